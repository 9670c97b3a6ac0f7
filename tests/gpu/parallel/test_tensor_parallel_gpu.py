"""Tensor parallel on two GPUs (NCCL): a small float32 Llama (head_dim 64, so the CUDA kernels serve it) loaded with
``tp_plan="auto"`` under ``torchrun --nproc-per-node 2``, against the same weights on one GPU.

Each test launches ``torchrun`` on this file (``__main__`` below is the worker) and reads what each rank wrote.
Skipped without two CUDA devices.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers"))  # tiny_models, when run as torchrun's script
from tiny_models import _COMMON, EOS, PAD, VOCAB, left_padded_batch  # noqa: E402

WORLD_SIZE = 2
# Each launch (two launches stay within 10 minutes); HF_PAGED_TEST_LAUNCH_TIMEOUT_S overrides it.
LAUNCH_TIMEOUT_S = float(os.environ.get("HF_PAGED_TEST_LAUNCH_TIMEOUT_S", "270"))
STUCK_EXIT = 17
GREEDY = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=512)


def _prompts(seed: int, n: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def _configs():
    from transformers import GenerationConfig

    return {"greedy": GenerationConfig(**GREEDY),
            "seeded": GenerationConfig(max_new_tokens=8, do_sample=True, top_k=20, seed=5, pad_token_id=PAD,
                                       eos_token_id=EOS)}


def _engine(model, **settings):
    """Small steps (chunked prefills) and a pool the prompts preempt each other in; eager layers on one GPU too
    (compiled ones round differently)."""
    import hf_paged

    return hf_paged.Engine(model, num_blocks=40, block_size=16, max_batch_tokens=64, max_num_seqs=8,
                           compile_layers=False, **settings)


def _batch_settings():
    import hf_paged

    return hf_paged.EngineConfig(num_blocks=None, compile_layers=False)


def _outcome(call):
    try:
        return "ok", call()
    except Exception as exc:
        return "error", type(exc).__name__, str(exc)


def _raise():
    raise RuntimeError("injected failure")


# ----- the worker (one per rank, under torchrun) -----------------------------------------------------------------
def worker(path: str, out_dir: str, part: str) -> None:
    import hf_paged
    from hf_paged.parallel import _all_reduce as tp_all_reduce
    from hf_paged.parallel import _linears as tp_linears
    from hf_paged.hf.compat import with_cache
    from hf_paged.integrations.accelerate import paged_cache_for
    from transformers import AutoModelForCausalLM

    rank = int(os.environ["RANK"])
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="hf_paged",
                                                 dtype=torch.float32).eval()
    prompts, configs = _prompts(0), _configs()
    record: dict = {}
    if part == "eager":  # decode without CUDA graphs
        engine = _engine(model, cuda_graphs=False)
        record["graphs"] = engine.stats()["cuda_graphs"]
        record["greedy"] = _outcome(lambda: [o.token_ids for o in engine.generate(prompts, configs["greedy"])])
        _write(out_dir, f"eager{rank}", record)
        torch.distributed.destroy_process_group()
        return
    if part == "compiled":  # the engine's defaults: compiled layers (local products, all-reduce ops)
        engine = hf_paged.Engine(model, num_blocks=40, block_size=16, max_batch_tokens=64, max_num_seqs=8)
        record["greedy"] = _outcome(lambda: [o.token_ids for o in engine.generate(prompts, configs["greedy"])])
        record["graphs"] = engine.stats()["cuda_graphs"]
        record["compiled"] = (engine.runner.compiled is not None and engine.runner.compiled.enabled, tp_linears.installed(model))
        record["one_shot"] = tp_all_reduce.one_shot_calls + tp_all_reduce.fused_calls > 0  # (fused: peer_sum too)
        record["peer_sum"] = bool(tp_all_reduce._peers)  # hf_paged's kernel set up (not torch's one-shot)
        record["fused"] = tp_all_reduce.fused_calls > 0  # the add and norm in its kernel
        record["sharded_logits"] = engine.runner.vocab_shards is not None
        _write(out_dir, f"compiled{rank}", record)
        engine.close()  # its graphs hold NCCL collectives: destroy_process_group would wait for them forever
        torch.distributed.destroy_process_group()
        return
    engine = _engine(model)
    k_cache = engine.runner.pool.kv_caches[0][0]
    record["pool"] = (k_cache.shape[2], str(k_cache.device), engine.runner.pool.num_blocks)
    for name, config in configs.items():
        record[name] = _outcome(lambda: [o.token_ids for o in _engine(model).generate(prompts, config)])
    graphed = _engine(model)
    record["graphed"] = _outcome(lambda: [o.token_ids for o in graphed.generate(prompts, configs["greedy"])])
    record["graphs"] = graphed.stats()["cuda_graphs"]
    torch.manual_seed(100 + rank)
    unseeded = configs["seeded"]
    unseeded.seed = None
    record["unseeded"] = _outcome(lambda: [o.token_ids for o in _engine(model).generate(prompts, unseeded)])
    record["generate_batch"] = _outcome(lambda: [list(o.generated_tokens) for o in hf_paged.generate_batch(
        model, prompts, configs["greedy"], _batch_settings()).values()])
    batch = {k: v.cuda() for k, v in left_padded_batch([5, 17, 30], torch.Generator().manual_seed(2)).items()}
    record["generate"] = _outcome(lambda: model.generate(**with_cache(
        model, paged_cache_for(model, memory_budget=0.05, block_size=16), **batch), **GREEDY).cpu().tolist())
    engine = _engine(model)
    if rank == 1:  # fails after the step's collectives
        send, calls = engine._receiver.send, []
        engine._receiver.send = lambda *a: (calls.append(1), send(*a))[1] if len(calls) < 3 else _raise()
    record["failed_step"] = _outcome(lambda: engine.generate(prompts, configs["greedy"]))
    _write(out_dir, f"rank{rank}", record)
    # Last: rank 1 fails inside its forward, before the first all-reduce. NCCL runs asynchronously, so rank 0's
    # host goes on to the next step's check and learns of it there (its GPU waits in the all-reduce for good).
    engine = _engine(model)
    if rank == 1:
        model.model.embed_tokens.forward = lambda *a, **k: _raise()
    faulthandler.dump_traceback_later(45)  # a rank still here after 45 s prints where it waits (the check's limit: 60)
    _write(out_dir, f"stuck{rank}", _outcome(lambda: engine.generate(prompts[:2], configs["greedy"])))
    faulthandler.cancel_dump_traceback_later()
    os._exit(STUCK_EXIT if rank == 1 else 0)


def _write(out_dir: str, name: str, record) -> None:
    with open(os.path.join(out_dir, f"{name}.pkl"), "wb") as f:
        pickle.dump(record, f)


# ----- the tests (one process, launching torchrun) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tp_gpu_model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**_COMMON, **SHAPE)).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def single(saved):
    import hf_paged  # noqa: F401
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(saved, attn_implementation="hf_paged",
                                                dtype=torch.float32).cuda().eval()


def _launch(saved: str, out_dir: Path, part: str, **env) -> str:
    """torchrun on this file; its output. A launch that hangs is ended with its workers after LAUNCH_TIMEOUT_S, with
    each worker's Python stacks in the output (faulthandler on SIGABRT) to show where it waited."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD_SIZE}",
           __file__, saved, str(out_dir), part]
    root = str(Path(__file__).resolve().parents[3])
    full_env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "HF_PAGED_TP_TIMEOUT_S": "60", "PYTHONFAULTHANDLER": "1", **env}
    proc = subprocess.Popen(cmd, env=full_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        return proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGABRT)  # the workers print their stacks
        try:
            out = proc.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
        return out + f"\n(ended after {LAUNCH_TIMEOUT_S:g} s)"


def _read(out_dir: Path, name: str):
    path = out_dir / f"{name}.pkl"
    return pickle.loads(path.read_bytes()) if path.exists() else None


@pytest.fixture(scope="module")
def ranks(saved, tmp_path_factory) -> tuple[list[dict], list, str]:
    out_dir = tmp_path_factory.mktemp("tp_gpu_ranks")
    output = _launch(saved, out_dir, "main")
    records = [_read(out_dir, f"rank{r}") for r in range(WORLD_SIZE)]
    assert all(records), f"a rank wrote nothing; torchrun said:\n{output[-4000:]}"
    return records, [_read(out_dir, f"stuck{r}") for r in range(WORLD_SIZE)], output


def test_each_gpu_pools_its_own_kv_heads(ranks):
    records, _, _ = ranks
    assert [r["pool"][:2] for r in records] == [(1, "cuda:0"), (1, "cuda:1")]
    assert records[0]["pool"][2] == records[1]["pool"][2] == 40


@pytest.mark.parametrize("name", ["greedy", "seeded"])
def test_the_engine_on_two_gpus_gives_the_tokens_of_one(ranks, single, name):
    expected = [o.token_ids for o in _engine(single).generate(_prompts(0), _configs()[name])]
    for record in ranks[0]:
        assert record[name] == ("ok", expected)


def test_unseeded_sampling_gives_both_gpus_the_leaders_tokens(ranks):
    records, _, _ = ranks
    assert records[0]["unseeded"][0] == "ok" and records[1]["unseeded"] == records[0]["unseeded"]


def test_generate_batch_and_generate_on_two_gpus_give_the_tokens_of_one(ranks, single):
    import hf_paged

    results = hf_paged.generate_batch(single, _prompts(0), _configs()["greedy"], _batch_settings())
    want = [list(o.generated_tokens) for o in results.values()]
    batch = {k: v.cuda() for k, v in left_padded_batch([5, 17, 30], torch.Generator().manual_seed(2)).items()}
    generated = single.generate(**batch, **GREEDY).cpu().tolist()  # transformers' own cache
    for record in ranks[0]:
        assert record["generate_batch"] == ("ok", want)
        assert record["generate"] == ("ok", generated)


def test_a_failure_on_one_gpu_is_raised_on_both(ranks):
    records, stuck, output = ranks
    assert records[0]["failed_step"][:2] == ("error", "RuntimeError")
    assert "failed on rank 1 of 2: RuntimeError: injected failure" in records[0]["failed_step"][2]
    assert records[1]["failed_step"] == records[0]["failed_step"]
    # inside the forward: the other rank's host is not blocked by NCCL, so it raises the same error
    assert stuck[1] is not None and "injected failure" in stuck[1][2], output[-6000:]
    assert stuck[0] == stuck[1], output[-6000:]


def test_decode_graphs_under_tensor_parallel_by_default(ranks, single):
    """Decode CUDA graphs are on under tensor parallel (the layers' NCCL all-reduces captured inside): they serve
    the decode steps and give the tokens of one GPU (every engine of the tests above ran with them too)."""
    expected = [o.token_ids for o in _engine(single).generate(_prompts(0), _configs()["greedy"])]
    for record in ranks[0]:
        assert record["graphs"] and record["graphs"]["batch_sizes"], "no decode graph was captured"
        assert record["graphs"]["replays"] > 10, "the graphs served no decode step"
        assert record["graphed"] == ("ok", expected)


def test_eager_decode_under_tensor_parallel_when_asked(saved, single, tmp_path):
    """``Engine(cuda_graphs=False)``: no graph captured, the tokens of one GPU."""
    output = _launch(saved, tmp_path, "eager")
    records = [_read(tmp_path, f"eager{r}") for r in range(WORLD_SIZE)]
    assert all(records), f"a rank wrote nothing; torchrun said:\n{output[-4000:]}"
    expected = [o.token_ids for o in _engine(single).generate(_prompts(0), _configs()["greedy"])]
    for record in records:
        assert record["graphs"] is None
        assert record["greedy"] == ("ok", expected)


if __name__ == "__main__":
    worker(*sys.argv[1:4])


@pytest.mark.parametrize("all_reduce", ["nccl", "hf_paged"])
def test_compiled_layers_under_tensor_parallel(saved, single, tmp_path, all_reduce):
    """The engine's defaults on two GPUs: compiled layers (each sharded linear a local product, rowwise ones summed
    by the all-reduce op inside the compiled code) under decode CUDA graphs, the greedy tokens of one GPU; with
    peer_sum's one-shot all-reduces over symmetric memory (HF_PAGED_TP_ALL_REDUCE=hf_paged, csrc/peer_sum.cu, the
    default) and with NCCL's."""
    output = _launch(saved, tmp_path, "compiled", HF_PAGED_TP_ALL_REDUCE=all_reduce)
    records = [_read(tmp_path, f"compiled{r}") for r in range(WORLD_SIZE)]
    assert all(records), f"a rank wrote nothing; torchrun said:\n{output[-4000:]}"
    expected = [o.token_ids for o in _engine(single).generate(_prompts(0), _configs()["greedy"])]
    for record in records:
        assert record["compiled"] == (True, 7 * SHAPE["num_hidden_layers"])
        assert record["one_shot"] == (all_reduce != "nccl"), "the one-shot all-reduce did not serve as asked"
        assert record["peer_sum"] == (all_reduce == "hf_paged")
        assert record["fused"] is (all_reduce == "hf_paged")  # the add and norm in peer_sum's kernel
        # the logits left split over the vocabulary; on the tensor-parallel group: hf_paged/parallel/_logits.py's
        # (value, id) exchange rides whichever all-reduce serves
        assert record["sharded_logits"] is True
        assert record["graphs"] and record["graphs"]["replays"] > 10, "the graphs served no decode step"
        assert record["greedy"] == ("ok", expected)
