"""Cold start on a CPU: a fresh process's first token of ``hf-paged generate`` against transformers' ``generate``.

Systems (``--systems``), each in a fresh process per repetition, the order alternating between repetitions:
  cli_generate    ``hf-paged generate --device cpu --model DIR --no-progress --max-new-tokens N PROMPT``: the
                  command line as a user runs it (without a progress bar it prints the answer as it comes)
  transformers    ``AutoModelForCausalLM.from_pretrained(DIR)`` (sdpa) and ``model.generate`` of the same prompt,
                  greedy, with a streamer that prints each new token as it comes
  hf_paged_load   ``import hf_paged`` and ``from_pretrained(DIR, attn_implementation="hf_paged")`` alone: the
                  library's import and load, against transformers' own

The work: SmolLM2-135M-Instruct as the command line converts it (``smollm2_checkpoint()``, float32; converted
beforehand, untimed), one prompt sent as one user message through its chat template, ``--new-tokens`` (default 32,
the command line's default) new tokens at most, stopping at EOS. Every child runs one torch thread
(``OMP_NUM_THREADS=1``).

Columns, in seconds from the process's spawn: ``import`` (torch, transformers and, for hf_paged's systems, what the
command's run or ``import hf_paged`` loads), ``load`` (model and tokenizer loaded; the command line's includes
finding its converted checkpoint), ``first_token`` (the first generated text on the child's stdout, as the parent
reads it: both print each new token as it comes), ``done`` (the process exited). On a machine shared with other
work the wall times vary; the processor seconds the child itself spent vary less: ``cpu_load`` (up to the model
loaded) and ``cpu_total`` (the whole process). The summary gives each column's median over the repetitions.

    python -m benchmarks.e2e.cold_start_cpu [--repeats 5] [--new-tokens 32] [--prompt TEXT] [--json F]
        [--systems cli_generate,transformers,hf_paged_load]

The children's bytecode is compiled beforehand as ``benchmarks.e2e.cold_start`` does it (``--bytecode``), and one
untimed round of every system runs first, so that no timed child compiles the bytecode of a module the others
then find, or reads a file from the disk that the others find in memory: what an installed package's second
start gets, and a user's usual one.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import ROOT, comma_names, module_command
from benchmarks.e2e.cold_start import _env, compile_bytecode, package_folders, writes_no_bytecode

SYSTEMS = ("cli_generate", "transformers", "hf_paged_load")
COLUMNS = ("import", "load", "first_token", "done", "cpu_load", "cpu_total")
PROMPT = "What is the capital of France?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of " + ", ".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=5, help="fresh processes per system (default 5)")
    p.add_argument("--new-tokens", type=int, default=32, help="new tokens at most (default 32)")
    p.add_argument("--prompt", default=PROMPT, help="the prompt (default: %(default)r)")
    p.add_argument("--json", help="write the rows and the medians here")
    p.add_argument("--timeout", type=float, default=600, help="seconds one process may take")
    p.add_argument("--bytecode", choices=("auto", "compile", "as-is"), default="auto",
                   help="compile the packages' bytecode beforehand (see benchmarks.e2e.cold_start)")
    p.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.systems = comma_names(args.systems, SYSTEMS, "--systems", p.error)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    return parent(args)


# ===== the parent ===================================================================================================

def parent(args: argparse.Namespace) -> dict:
    from hf_paged.bench import run_header
    from hf_paged.cli._smollm2 import smollm2_checkpoint

    model_dir = smollm2_checkpoint()  # converted once here: every child finds it
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    meta = {**run_header("cpu"), "model": "SmolLM2-135M-Instruct (converted, float32)", "prompt": args.prompt,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "cpu_count": os.cpu_count(),
            "torch_threads": 1, "load_average_before": os.getloadavg()}
    if args.bytecode == "compile" or (args.bytecode == "auto" and writes_no_bytecode()):
        prefix = Path(tempfile.mkdtemp(prefix="cold_start_cpu_bytecode_"))
        compile_bytecode(package_folders([]), prefix)
        env["PYTHONPYCACHEPREFIX"] = str(prefix)
        meta["bytecode"] = "compiled beforehand into one cache folder for every child"
    else:
        meta["bytecode"] = "as installed" if not writes_no_bytecode() else "none: each process compiles its sources"
    for system in args.systems:  # untimed: the bytecode of what compileall left out written, the files cached
        run_child(system, args, model_dir, env)
    rows = []
    for repeat in range(args.repeats):
        for system in args.systems if repeat % 2 == 0 else reversed(args.systems):
            row = {"system": system, "repeat": repeat, **run_child(system, args, model_dir, env)}
            rows.append(row)
            print(f"{system} #{repeat}: " + ", ".join(f"{c} {row[c]:.2f}" for c in COLUMNS if row.get(c) is not None)
                  + ("" if row["status"] == "ok" else f" ({row['status']}: {row.get('error')})"), flush=True)
    medians = {s: {c: round(statistics.median(vals), 3) for c in COLUMNS
                   if (vals := [r[c] for r in rows if r["system"] == s and r.get(c) is not None])}
               for s in args.systems}
    meta["load_average_after"] = os.getloadavg()
    result = {"meta": meta, "medians": medians, "rows": rows}
    print(table(medians))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def run_child(system: str, args: argparse.Namespace, model_dir: Path, env: dict) -> dict:
    """Spawn one child, time the output it prints on stdout, and read the stamps it leaves in its result file."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = module_command(__spec__.name, "--child", system, "--model-dir", str(model_dir), "--result", str(result),
                             "--new-tokens", str(args.new_tokens), "--prompt", args.prompt)
        log = (Path(tmp) / "stderr").open("wb")
        spawned = time.time()
        with subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=log) as proc:
            out, first, deadline = b"", None, spawned + args.timeout
            while time.time() < deadline:
                ready, _, _ = select.select([proc.stdout], [], [], 0.5)
                chunk = os.read(proc.stdout.fileno(), 65536) if ready else None
                if chunk == b"":
                    break
                if chunk:
                    out += chunk
                    first = first or (time.time() if answer_started(system, out) else None)
            timed_out = time.time() >= deadline
            if timed_out:
                proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)  # (the child's own processor time with its exit)
            done, proc.returncode = time.time(), os.waitstatus_to_exitcode(status)
        log.close()
        if timed_out:
            return {"status": "failed", "error": "timed out"}
        if proc.returncode != 0 or not result.is_file():
            tail = " | ".join((Path(tmp) / "stderr").read_text(errors="replace").strip().splitlines()[-3:])
            return {"status": "failed", "error": f"exit {proc.returncode}: {tail[-400:]}"}
        stamps = json.loads(result.read_text())
    cpu_load = stamps.pop("cpu_load")
    row = {"status": "ok", **{k: round(v - spawned, 3) for k, v in stamps.items()},
           "first_token": None if first is None else round(first - spawned, 3), "done": round(done - spawned, 3),
           "cpu_load": round(cpu_load, 3), "cpu_total": round(usage.ru_utime + usage.ru_stime, 3)}
    return {**row, "answer": answer(system, out.decode(errors="replace"))} if system != "hf_paged_load" else row


def answer_started(system: str, out: bytes) -> bool:
    """Whether ``out`` (the stdout so far) holds generated text: the command line prints ``> prompt`` first, then
    the answer; transformers' child prints the new tokens alone."""
    if system == "cli_generate":
        head, _, rest = out.partition(b"\n")
        return head.startswith(b"> ") and rest.strip() != b""
    return system == "transformers" and out.strip() != b""


def answer(system: str, out: str) -> str:
    return out.split("\n")[1] if system == "cli_generate" else out.strip()


def table(medians: dict) -> str:
    lines = ["| system | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for system, cols in medians.items():
        lines.append(f"| {system} | " + " | ".join("-" if cols.get(c) is None else f"{cols[c]:.2f}" for c in COLUMNS)
                     + " |")
    return "\n".join(lines)


# ===== a child ======================================================================================================

def child(args: argparse.Namespace) -> None:
    stamps = {}
    if args.child == "cli_generate":
        run_cli(args, stamps)
    else:
        import torch  # noqa: F401 - imported first in every child, as a user's script does
        import transformers

        if args.child == "hf_paged_load":
            import hf_paged  # noqa: F401 - registers attn_implementation="hf_paged"
        stamps["import"] = time.time()
        kind = "hf_paged" if args.child == "hf_paged_load" else "sdpa"
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation=kind).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
        stamps["load"], stamps["cpu_load"] = time.time(), time.process_time()
        if args.child == "transformers":
            transformers_generate(model, tokenizer, args)
    Path(args.result).write_text(json.dumps(stamps))


def run_cli(args: argparse.Namespace, stamps: dict) -> None:
    """``hf-paged generate`` in this process, its run's imports and its model load stamped on the way."""
    from hf_paged.cli import _generate_run, main

    stamps["import"] = time.time()
    load = _generate_run.load

    def stamped_load(*a):
        loaded = load(*a)
        stamps["load"], stamps["cpu_load"] = time.time(), time.process_time()
        return loaded

    _generate_run.load = stamped_load
    status = main(["generate", "--device", "cpu", "--model", args.model_dir, "--no-progress", "--max-new-tokens",
                   str(args.new_tokens), args.prompt])
    if status:
        raise SystemExit(status)


def transformers_generate(model, tokenizer, args: argparse.Namespace) -> None:
    """Greedy ``generate`` of the prompt as one user message through the chat template (as the command line sends
    it), each new token printed as it comes."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Printer(BaseStreamer):
        def __init__(self):
            self.prompt_seen = False

        def put(self, value):  # the prompt first, then each new token
            if self.prompt_seen:
                print(tokenizer.decode(value.reshape(-1), skip_special_tokens=True), end="", flush=True)
            self.prompt_seen = True

        def end(self):
            print(flush=True)

    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False,
                   streamer=Printer())


if __name__ == "__main__":
    main()
