"""Tensor parallel: a Llama-3.1-8B-shaped model on one GPU and split over N GPUs with ``tp_plan="auto"``.

A random-init bf16 Llama of the 8B shape (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336, vocab
128256) is saved once to a temporary folder, then loaded by ``torchrun`` once per GPU count (one GPU: the whole
model on it; N: ``tp_plan="auto"``, each GPU holding its shard and its own KV heads). Each launch measures, per
system (``hf_paged.generate_batch``, and transformers' ``model.generate_batch`` as the baseline):

- decode at batch 64: 64 prompts of 512 random tokens, 256 new tokens, greedy, no EOS. Decode time is the wall of
  the call for 256 new tokens minus the wall of the call for 2 (prefill, setup and the first decode step cancel
  out), over 254 steps; reported as output tokens per second.
- batch-1 latency: one 512-token prompt, ms per output token, the same way.
- hf_paged only, steady decode at batch 64 (``steady`` in the JSON, the table's last columns): the batch-64 requests
  added to one ``hf_paged.Engine`` (the options ``generate_batch`` gets), stepped past every prefill and 3 more
  steps, then 32 decode steps timed. No setup in it: ``generate_batch`` builds an engine per call and captures its
  decode graphs on demand, and under tensor parallel the two calls of the subtraction above took 1.1 to 3.5 s of
  setup and prefill that did not cancel out (2x H200, 2026-11-27), so the steady figure is the one to compare
  between hf_paged variants.

    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --json tp.json  # torchrun per count, then the table
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --tp-eager          # also hf_paged with eager decode on TP
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --tp-layers-eager   # also hf_paged with eager layers on TP
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --tp-nccl           # also hf_paged with NCCL all-reduces
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --tp-peer-sum  # also hf_paged, peer_sum named (default)
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --steady-only  # hf_paged without the batch-64 calls
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --steady-only --no-latency  # the steady step only (faster)
    python -m benchmarks.parallel.tensor_parallel --gpus 2 --variants-only --tp-nccl --keep-model DIR  # no plain runs
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --cublaslt  # also hf_paged with products on cuBLASLt
    python -m benchmarks.parallel.tensor_parallel --gpus 1,2 --split  # also hf_paged on the model split by layers
    python -m benchmarks.parallel.tensor_parallel --gpus 2 --keep-model DIR  # save the model once, reuse it later
    python -m benchmarks.parallel.tensor_parallel --tiny                         # a tiny model on CPU processes (gloo)

Without as many GPUs as the largest count it stops at once. A launch that fails is reported and the others still
run; the JSON is rewritten after each.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks import child_env, module_command

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LAUNCH_TIMEOUT_S = 420  # a launch that hangs (a rank stuck in a collective) is ended, with its workers


# flag -> (variant suffix, environment, what it runs): launches on the tensor-parallel counts only, then ones on every
# count (each count against the same variant on one GPU), in launch order; parse_args makes a --flag of each
TP_VARIANTS = {
    "tp_eager": (" (eager)", {"HF_PAGED_BENCH_GRAPHS": "0"},
                 "cuda_graphs=False: eager decode; graphs are the default"),
    "tp_layers_eager": (" (layers eager)", {"HF_PAGED_BENCH_COMPILE": "0"},
                        "compile_layers=False: eager layers under decode graphs; compiled layers are the default"),
    "tp_peer_sum": (" (peer_sum)", {"HF_PAGED_TP_ALL_REDUCE": "hf_paged"},
                    "small all-reduces on hf_paged's one-shot kernel, csrc/peer_sum.cu, named: the default, so this "
                    "repeats the plain run"),
    "tp_nccl": (" (NCCL)", {"HF_PAGED_TP_ALL_REDUCE": "nccl"}, "the layers' all-reduces through NCCL"),
}
EVERY_COUNT_VARIANTS = {
    "cublaslt": (" (cublaslt)", {"TORCH_BLAS_PREFER_CUBLASLT": "1"}, "torch's matrix products through cuBLASLt"),
}
# The benchmark's own settings (HF_PAGED_BENCH_*), passed to its torchrun workers: engine options, not hf_paged
# switches.
BENCH_SETTINGS = {"HF_PAGED_BENCH_GRAPHS": "cuda_graphs", "HF_PAGED_BENCH_COMPILE": "compile_layers"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,2", help="comma list of GPU counts (1 = the whole model on one GPU)")
    parser.add_argument("--systems", default="hf_paged,transformers", help="hf_paged and/or transformers")
    every = "every count, each against the same variant on one GPU,"
    for variants, counts in ((TP_VARIANTS, "the tensor-parallel counts"), (EVERY_COUNT_VARIANTS, every)):
        for flag, (_, env, what) in variants.items():
            setting = " ".join(f"{k}={v}" for k, v in env.items())
            parser.add_argument("--" + flag.replace("_", "-"), action="store_true",
                                help=f"also run hf_paged on {counts} with {setting} ({what})")
    parser.add_argument("--tp-graphs", action="store_true",
                        help="deprecated: decode CUDA graphs are the default under tensor parallel (ignored)")
    parser.add_argument("--split", action="store_true",
                        help="also run hf_paged in one process on the model split by layers over the largest GPU count "
                             "(device_map; pipeline style, for the record)")
    parser.add_argument("--steady-only", action="store_true",
                        help="hf_paged: skip the batch-64 pair of calls (the subtraction that misleads under tensor "
                             "parallel); the steady decode and batch-1 latency still run")
    parser.add_argument("--no-latency", action="store_true",
                        help="skip the batch-1 latency calls (each two-GPU launch is ~40%% shorter; the table's "
                             "batch-1 columns stay empty)")
    parser.add_argument("--variants-only", action="store_true",
                        help="skip the plain runs of each count: only the variants the flags ask for (with "
                             "--keep-model, against plain runs of an earlier call on the same machine)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--keep-model", type=Path,
                        help="save the model in this folder and keep it; a later run given the same folder loads it "
                             "instead of saving again (the same weights across calls; the 8B save takes ~30-45 s)")
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model on CPU processes (gloo)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _workloads(tiny: bool):
    """(batch-64 decode, batch-1 latency), scaled down for --tiny."""
    from benchmarks.e2e.workloads import Workload

    if tiny:
        return (Workload("decode_b64", 4, 8, prompt_len=32), Workload("latency", 1, 8, prompt_len=32))
    return Workload("decode_b64", 64, 256, prompt_len=512), Workload("latency", 1, 256, prompt_len=512)


def _shape(tiny: bool) -> dict:
    from benchmarks.e2e.workloads import SMOKE_SHAPE

    return {**SMOKE_SHAPE, "tie_word_embeddings": False} if tiny else LLAMA_8B


def save(args: argparse.Namespace) -> None:
    """Initialise the model (the same weights for every launch) and save it to ``args.model_dir``."""
    import hf_paged
    from benchmarks.e2e.workloads import load_model

    shape = _shape(args.tiny)
    model = load_model(shape, "cpu" if args.tiny else "cuda", hf_paged.ATTN_IMPLEMENTATION)
    model.save_pretrained(args.model_dir)
    (args.model_dir / "shape.json").write_text(json.dumps(shape))


def worker(args: argparse.Namespace) -> None:
    """One process of a launch: load (sharded when there are several), time each system; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_paged
    from benchmarks.e2e.systems import Budget, hf_paged_system, timed_latency, transformers_system
    from hf_paged.bench import run_header

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    began = time.perf_counter()
    if args.tiny:
        torch.set_num_threads(1)
    load = dict(attn_implementation=hf_paged.ATTN_IMPLEMENTATION, dtype=torch.float32 if args.tiny else torch.bfloat16)
    shape = json.loads((args.model_dir / "shape.json").read_text())
    split = int(os.environ.get("HF_PAGED_BENCH_SPLIT", "0"))  # > 1: one process, the layers over that many GPUs
    if world > 1:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, tp_plan="auto", **load)
    elif split > 1:
        device_map = split_map(shape["num_hidden_layers"], ["cpu"] * split if args.tiny else list(range(split)))
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, device_map=device_map, **load)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, device_map="cpu" if args.tiny else "cuda:0",
                                                     **load)
    model.eval().generation_config.eos_token_id = None
    loaded_s = time.perf_counter() - began
    vocab = shape["vocab_size"]
    budget = Budget(max_batch_tokens=256 if args.tiny else 2048, max_requests=64)
    batch64, batch1 = _workloads(args.tiny)
    meta = {**run_header("cpu" if args.tiny else None), "tiny": args.tiny}
    rows = []
    for system in args.systems.split(","):
        if system == "hf_paged":
            layers = {option: False for name, option in BENCH_SETTINGS.items() if os.environ.get(name) == "0"}
            generate = hf_paged_system(model, budget, layers)
        else:  # transformers' continuous batching takes its own attention ("sdpa", run as "paged|sdpa")
            model.set_attn_implementation("sdpa")
            generate = transformers_system(model, budget, num_blocks=16 if args.tiny else None)
        row = {"system": system + args.variant, "gpus": split if split > 1 else world}
        phases = row["phase_s"] = {"load": round(loaded_s, 1)}  # where a launch's time goes (wall, this rank)
        try:
            mark = time.perf_counter()
            if not (args.steady_only and system == "hf_paged"):
                row["decode"] = timed_latency(model, generate, batch64, vocab, reps=1 if args.tiny else 2)
                row["decode_tok_per_s"] = batch64.num_requests * 1e3 / row["decode"]["ms_per_token"]
                phases["decode"], mark = round(time.perf_counter() - mark, 1), time.perf_counter()
            if not args.no_latency:
                row["latency"] = timed_latency(model, generate, batch1, vocab, reps=1 if args.tiny else 3)
                row["ms_per_token"] = row["latency"]["ms_per_token"]
                phases["latency"], mark = round(time.perf_counter() - mark, 1), time.perf_counter()
            if system == "hf_paged":
                row["steady"] = steady_decode(model, batch64, budget, layers, vocab, steps=4 if args.tiny else 32)
                phases["steady"] = round(time.perf_counter() - mark, 1)
            row["status"] = "ok"
        except Exception as exc:  # the same on every rank (the calls are), so the ranks stay in step
            row.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append({**row, **meta})
        if rank == 0:  # after each system: a later one that hangs leaves the rows before it
            args.out.write_text(json.dumps(rows))
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def steady_decode(model, workload, budget, engine_kwargs: dict, vocab: int, steps: int) -> dict:
    """Milliseconds per decode step of one ``hf_paged.Engine`` at the workload's batch, past every prefill (the
    module doc's "steady decode"). Every rank runs it (the engine keeps the ranks in step)."""
    import copy
    import time

    from benchmarks.engine.decode_steps import step_until_decoding
    from benchmarks.e2e.systems import sync

    import hf_paged

    if steps + 4 > workload.new_tokens:  # the prefill's token and 3 warm-up steps come first
        raise ValueError(f"{steps} timed steps need at least {steps + 4} new tokens per request")
    prompts, gc = workload.prompts(vocab), workload.generation_config()
    block_size = 16
    num_blocks = sum(-(-(len(p) + workload.new_tokens) // block_size) for p in prompts)
    with hf_paged.Engine(model, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget.max_batch_tokens,
                         max_num_seqs=budget.max_requests, **engine_kwargs) as engine:
        for prompt in prompts:
            engine.add_request(prompt, copy.deepcopy(gc))
        step_until_decoding(engine)
        for _ in range(3):
            engine.step()
        before = engine.stats()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        seconds = time.perf_counter() - start
        after = engine.stats()
    decoded = after["generated_tokens"] - before["generated_tokens"]
    if decoded != steps * before["running"]:
        raise RuntimeError(f"steady decode: {decoded} tokens in {steps} steps of {before['running']} sequences (a "
                           "sequence finished or was preempted inside the timed steps)")
    return {"batch": before["running"], "steps": steps, "seconds": seconds, "ms_per_step": 1e3 * seconds / steps,
            "tok_per_s": decoded / seconds}


def split_map(num_layers: int, devices: list) -> dict:
    """A ``device_map`` that gives each device an equal run of decoder layers (the embedding with the first, the
    final norm and the output head with the last)."""
    per = -(-num_layers // len(devices))
    layers = {f"model.layers.{i}": devices[i // per] for i in range(num_layers)}
    return {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0], **layers, "model.norm": devices[-1],
            "lm_head": devices[-1]}


def launch(count: int, args: argparse.Namespace, model_dir: Path, variant: str = "", **env) -> list[dict]:
    out = Path(tempfile.mkdtemp()) / "rows.json"
    cmd = module_command("torch.distributed.run", "--standalone", f"--nproc-per-node={count}", "--module",
                         __spec__.name, "--worker", "--model-dir", str(model_dir), "--out", str(out),
                         "--systems", "hf_paged" if variant else args.systems, "--variant", variant)
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--steady-only"] if args.steady_only else []
    cmd += ["--no-latency"] if args.no_latency else []
    full_env = {"HF_PAGED_TP_TIMEOUT_S": "120", **child_env(), **env}
    if args.tiny:
        full_env["OMP_NUM_THREADS"] = "1"
    returncode, output = run_group(cmd, full_env, LAUNCH_TIMEOUT_S)
    rows = json.loads(out.read_text()) if out.exists() else []
    if returncode != 0:  # the systems the launch did not report
        tail = " | ".join(output.strip().splitlines()[-4:])[-500:]
        systems = ["hf_paged"] if variant else args.systems.split(",")
        gpus = int(env.get("HF_PAGED_BENCH_SPLIT", count))
        rows += [{"system": s + variant, "gpus": gpus, "status": "failed", "error": tail}
                 for s in systems[len(rows):]]
    return rows


def run_group(cmd: list[str], env: dict, timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` in a session of its own; past ``timeout_s`` end the whole session (torchrun and its workers)."""
    proc = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -9, output + f"\nthe launch ran past {timeout_s:g} s and was ended"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.save:
        return save(args)
    if args.worker:
        return worker(args)
    counts = [int(c) for c in args.gpus.split(",")]
    if not args.tiny:
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < max(counts):
            raise SystemExit(f"benchmarks/parallel/tensor_parallel.py needs {max(counts)} CUDA devices for --gpus "
                             f"{args.gpus}, found {found}; --tiny runs a tiny model on CPU processes instead")
    begin = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - begin:7.1f} s] {msg}", flush=True)  # noqa: E731
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir = args.keep_model or Path(folder) / "model"
        if (model_dir / "shape.json").exists():
            saved = json.loads((model_dir / "shape.json").read_text())
            if saved != json.loads(json.dumps(_shape(args.tiny))):
                raise SystemExit(f"{model_dir} holds a model of another shape ({'not ' if args.tiny else ''}the "
                                 "tiny one); give --keep-model a folder of its own per shape")
            say(f"reusing the model saved in {model_dir}")
        elif args.tiny:
            say("saving a random-init tiny model ...")
            save(argparse.Namespace(tiny=True, model_dir=model_dir))
        else:  # in a process of its own, so that this one holds no GPU memory
            say("saving a random-init Llama-3.1-8B-shaped bf16 model ...")
            subprocess.run(module_command(__spec__.name, "--save", "--model-dir", str(model_dir)), env=child_env(),
                           check=True)
        runs = planned_runs(args, counts)
        for count, variant, env in runs:
            gpus = int(env.get("HF_PAGED_BENCH_SPLIT", count))
            say(f"{gpus} GPU(s){variant}: {args.systems if not variant else 'hf_paged'} ...")
            for row in launch(count, args, model_dir, variant, **env):
                rows.append(row)
                say(f"  {row['system']} on {gpus}: " + (_summary(row) if row["status"] == "ok" else
                                                          f"FAILED: {row['error']}"))
            if args.json:
                args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print_table(rows)


def _summary(row: dict) -> str:
    parts = [f"decode {row['decode_tok_per_s']:,.0f} tok/s at batch 64"] if "decode_tok_per_s" in row else []
    if "steady" in row:
        parts.append(f"steady decode {row['steady']['ms_per_step']:.2f} ms/step ({row['steady']['tok_per_s']:,.0f} "
                     f"tok/s) at batch {row['steady']['batch']}")
    parts += [f"{row['ms_per_token']:.2f} ms/token at batch 1"] if "ms_per_token" in row else []
    phases = " + ".join(f"{k} {v:g}" for k, v in row.get("phase_s", {}).items())
    return ", ".join(parts) + (f" [s: {phases}]" if phases else "")


def planned_runs(args: argparse.Namespace, counts: list[int]) -> list[tuple[int, str, dict]]:
    """(process count, variant suffix, environment) of every launch the flags ask for, in launch order."""
    runs = [] if args.variants_only else [(c, "", {}) for c in counts]
    if args.tp_graphs:
        warnings.warn("--tp-graphs is deprecated: decode CUDA graphs are the default under tensor parallel "
                      "(--tp-eager adds the eager runs)", FutureWarning, stacklevel=1)
    for flag, (suffix, env, _) in TP_VARIANTS.items():
        if getattr(args, flag):
            runs += [(c, suffix, dict(env)) for c in counts if c > 1]
    if args.split and max(counts) > 1:  # one process (torchrun of 1) holding every GPU
        runs.append((1, " (split)", {"HF_PAGED_BENCH_SPLIT": str(max(counts))}))
    for flag, (suffix, env, _) in EVERY_COUNT_VARIANTS.items():
        if getattr(args, flag):
            runs += [(c, suffix, dict(env)) for c in counts]
    return runs


def print_table(rows: list[dict]) -> None:
    card = next((r["card"] for r in rows if "card" in r), "?")
    what = ("a tiny float32 Llama, 4 x 32-token prompts / 1 x 32, 8 new" if any(r.get("tiny") for r in rows)
            else "Llama-3.1-8B shape (random bf16), 64 x 512-token prompts / 1 x 512, 256 new")
    print(f"\nTensor parallel, {what}; {card}")
    width = max([22] + [len(r["system"]) + 2 for r in rows])
    print(f"{'system':<{width}}{'GPUs':>5}{'decode tok/s (b64)':>20}{'vs 1 GPU':>10}{'steady ms/step (b64)':>22}"
          f"{'steady tok/s':>14}{'vs 1 GPU':>10}{'ms/token (b1)':>15}{'vs 1 GPU':>10}")
    for r in rows:
        # against the same variant on one GPU where it ran there (--cublaslt), else the plain system's one-GPU run
        ones = {b["system"]: b for b in rows if b["gpus"] == 1 and b["status"] == "ok"}
        base = ones.get(r["system"]) or ones.get(r["system"].split(" ")[0])
        if r["status"] != "ok":
            print(f"{r['system']:<{width}}{r['gpus']:>5}  failed: {r['error'][:80]}")
            continue
        both = lambda key: base is not None and key in r and key in base  # noqa: E731
        decode = f"{r['decode_tok_per_s']:,.0f}" if "decode_tok_per_s" in r else "-"
        decode_x = f"{r['decode_tok_per_s'] / base['decode_tok_per_s']:.2f}x" if both("decode_tok_per_s") else ""
        steady = f"{r['steady']['ms_per_step']:.2f}" if "steady" in r else "-"
        steady_rate = f"{r['steady']['tok_per_s']:,.0f}" if "steady" in r else "-"
        steady_x = f"{base['steady']['ms_per_step'] / r['steady']['ms_per_step']:.2f}x" if both("steady") else ""
        latency_x = f"{base['ms_per_token'] / r['ms_per_token']:.2f}x" if both("ms_per_token") else ""
        latency = f"{r['ms_per_token']:.2f}" if "ms_per_token" in r else "-"
        print(f"{r['system']:<{width}}{r['gpus']:>5}{decode:>20}{decode_x:>10}{steady:>22}{steady_rate:>14}"
              f"{steady_x:>10}{latency:>15}{latency_x:>10}")


if __name__ == "__main__":
    main()
