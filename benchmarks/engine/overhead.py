"""The engine's own cost per step: scheduling + planning + sampling + bookkeeping, with a model that costs nothing.

256 running requests with ~1k tokens of context each decode one token per step; the stub model returns fixed
logits, so the time per ``engine.step()`` is the engine's overhead alone. Goal: at most 1 ms per step, also with
a 128k vocabulary.

On the CPU (default) the sampler's argmax over ``[256, vocab]`` logits runs on the host too, and with a large
vocabulary it dominates (milliseconds at 128k): that cost belongs to the device of a real run. ``--device cuda``
puts the stub's logits (and the KV pool) on the GPU, so the argmax runs there and the time measured is the host's
overhead plus microseconds of device work: each timed step is bracketed by ``torch.cuda.synchronize()``. The
mean over the same steps without the per-step synchronization is printed too (with asynchronous scheduling the
host then runs ahead of the device, as in a real run).

``--model tiny`` replaces the stub by a real one-layer Llama (hidden 64, one head, the same vocabulary) whose
device work is microseconds: its decode steps take the engine's production path (on a GPU: CUDA graphs), which
the stub cannot (a graph needs an attention call to capture), so the time is the engine's overhead as a real
decode step pays it. ``--profile N`` prints the N functions of most host time (cProfile) over the timed steps.

``--min-new-tokens N`` gives every request an EOS id and ``min_new_tokens=N``: the sampler then masks each row's EOS
column every step (on the CPU with a 128k vocabulary: what that costs beside the argmax).

    python -m benchmarks.engine.overhead [--vocab 1024] [--steps 200] [--device cpu|cuda] [--threads 1]
        [--min-new-tokens N]
        [--model stub|tiny] [--profile 25] [--engine-kwargs '{"async_scheduling": false}']
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
from transformers import GenerationConfig, LlamaConfig

from benchmarks.engine.decode_steps import phase_ms_between, step_until_decoding
import hf_paged


class StubModel(torch.nn.Module):
    """Quacks like a causal LM for the engine; ``forward`` returns rows of one fixed logits buffer.

    ``logits_to_keep``: a LongTensor of the rows to keep, or an int as in transformers (0 = every row, k = the last
    k); only the number of rows matters here.
    """

    def __init__(self, vocab: int, max_rows: int, device: str = "cpu"):
        super().__init__()
        # head_dim 64: a size every attention backend takes, though the stub never calls attention
        self.config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, max_position_embeddings=4096)
        self.config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
        self.generation_config = GenerationConfig(eos_token_id=None)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # what the real model's logits would be
        self.register_buffer("logits", torch.randn(1, max_rows, vocab, device=device).to(dtype))
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.logits.device

    @property
    def dtype(self) -> torch.dtype:
        return self.logits.dtype

    def forward(self, input_ids, position_ids=None, use_cache=True, logits_to_keep=0, past_key_values=None,
                cache=None, **kwargs):
        # input_ids: [1, T]; returns logits [1, rows, vocab]
        if isinstance(logits_to_keep, torch.Tensor):
            rows = logits_to_keep.numel()
        else:
            rows = int(logits_to_keep) or input_ids.shape[-1]
        return SimpleNamespace(logits=self.logits[:, :rows])


def tiny_model(vocab: int, device: str) -> torch.nn.Module:
    """A real one-layer Llama (hidden 64, one head of 64) with ``vocab`` tokens: microseconds of device work."""
    from transformers import LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=4096)
    config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config = GenerationConfig(eos_token_id=None)
    return model


def build_engine(args: argparse.Namespace) -> hf_paged.Engine:
    """An engine with every request prefilled: ``args.requests`` prompts of ``args.context`` +- 50 tokens."""
    block_size, max_batch_tokens = 16, 2048
    prefill_steps = args.requests * (args.context + 50) // max_batch_tokens + 2  # early requests decode meanwhile
    runs = 3 if getattr(args, "profile", 0) else 2  # timed steps: synchronized, unsynchronized (and profiled)
    blocks = args.requests * -(-(args.context + 50 + prefill_steps + runs * args.steps + 8) // block_size)
    if args.model == "tiny":
        model, defaults = tiny_model(args.vocab, args.device), {"compile_layers": False}  # (no layer to speak of)
    else:
        model, defaults = StubModel(args.vocab, max_batch_tokens, args.device), {}
        if args.min_new_tokens:  # the EOS (the last id) is every row's top token: held back only by the mask
            model.logits[..., -1] = model.logits.max() + 1
    engine = hf_paged.Engine(model, **{"num_blocks": blocks, "block_size": block_size,
                                       "max_batch_tokens": max_batch_tokens, "max_num_seqs": args.requests,
                                       "enable_prefix_caching": True, **defaults, **args.engine_kwargs})
    # --min-new-tokens: every request holds its EOS (the vocabulary's last id) back for that many tokens, so each
    # step's sampler masks the EOS column of every row (the greedy path with min_new_tokens)
    eos = {"eos_token_id": args.vocab - 1, "min_new_tokens": args.min_new_tokens} if args.min_new_tokens else {}
    config = GenerationConfig(max_new_tokens=10**6, do_sample=False, **eos)
    g = torch.Generator().manual_seed(0)
    for _ in range(args.requests):
        n = args.context + int(torch.randint(-50, 50, (), generator=g))
        engine.add_request(torch.randint(0, args.vocab, (n,), generator=g).tolist(), config)
    step_until_decoding(engine)
    for _ in range(3):
        engine.step()
    return engine


def time_steps(engine: hf_paged.Engine, steps: int, sync,
               profile: int = 0) -> tuple[list[float], list[float], dict, float]:
    """Per-step seconds (each step bracketed by ``sync``), the calling thread's CPU seconds in each ``step()`` (time
    the host spent elsewhere, descheduled on a busy machine, is not in them), mean ms per phase over the steps, and
    the mean seconds per step of as many steps again with one ``sync`` at the end. ``profile``: print the functions
    of most host time over an extra ``steps`` steps (cProfile; its own overhead inflates the total)."""
    if profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            engine.step()
        sync()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    before, times, cpu = engine.stats(), [], []
    for _ in range(steps):
        sync()
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - c)
        sync()
        times.append(time.perf_counter() - t)
    phases = phase_ms_between(before, engine.stats())
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    return times, cpu, phases, (time.perf_counter() - start) / steps


def add_workload_arguments(parser: argparse.ArgumentParser, model: str = "stub") -> None:
    """The options that shape the engine and its requests (``build_engine`` reads them); ``model``: the default."""
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--min-new-tokens", type=int, default=0,
                        help="each request's min_new_tokens, with an EOS id (0: no EOS, no minimum)")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("stub", "tiny"), default=model,
                        help="stub: fixed logits, eager steps; tiny: a one-layer Llama, production decode path")
    parser.add_argument("--engine-kwargs", type=json.loads, default={}, help="JSON dict passed to hf_paged.Engine")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest functions")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; run without it to measure on the CPU")
    torch.set_num_threads(args.threads)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    engine = build_engine(args)
    times, cpu, phases, unsynced = time_steps(engine, args.steps, sync, args.profile)
    stats = engine.stats()
    if stats["running"] != args.requests or stats["preemptions"]:
        raise RuntimeError(f"expected {args.requests} running requests and no preemption, got {stats}")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    graphs = (stats.get("cuda_graphs") or {}).get("replays", 0)
    print(f"{args.requests} running requests, ~{args.context} tokens of context, vocab {args.vocab}, {args.model} "
          f"model on {where} (decode steps served by CUDA graphs: {graphs}), {args.threads} CPU thread(s), torch "
          f"{torch.__version__}, engine kwargs {args.engine_kwargs}, min_new_tokens {args.min_new_tokens}")
    ms = [t * 1e3 for t in times]
    unsynced = f"; without per-step sync: mean {unsynced * 1e3:.3f} ms" if args.device == "cuda" else ""
    print(f"engine overhead per decode step: median {statistics.median(ms):.3f} ms, mean {statistics.mean(ms):.3f} "
          f"ms, min {min(ms):.3f} ms (goal <= 1 ms){unsynced}")
    print(f"CPU time of the stepping thread per step: median {statistics.median(cpu) * 1e3:.3f} ms, min "
          f"{min(cpu) * 1e3:.3f} ms (without the time it waited for a core)")
    print("mean per phase:", ", ".join(f"{k} {v:.3f} ms" for k, v in phases.items()))


if __name__ == "__main__":
    main()
