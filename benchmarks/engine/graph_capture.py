"""Where a ``generate_batch`` call's wall time goes, by CUDA-graph capture policy, and what padding a decode step up
to a larger graph costs.

Part 1, ``timeline`` (the end-to-end benchmark's anchor: 256 requests, prompts of 128-1024 tokens, 256 new tokens,
no EOS, budget 8192 tokens / 256 sequences, after a warm-up call): each engine step's launch is timestamped, and a
call's wall splits into the engine's setup (``EngineCore.__init__``: pool, graph capture), the steps with a prefill
in them (eager), the decode steps at the full batch and the tail (fewer sequences, as they finish). Variants
(``--variants``, each run ``--reps`` times, alternating):

  on_demand  ``generate_batch``'s default: the call's sequence count captured at start, smaller powers of two once
             32 decode steps would have used them
  start      the same sizes, all captured at start (``cuda_graph_capture="start"``)
  largest    only the largest size (every smaller batch pads up to it)

Part 2, ``padding`` (CUDA only): an engine with graphs of sizes 1, 4, 16, 64, 128 and 256 holds 256 sequences of
800-token contexts; a step of ``n`` of them is replayed in each graph ``b >= n`` (``hf_paged.bench.time_calls``: CUDA
events, median of 30), so the cost of padding ``n`` rows up to ``b`` is the difference; the capture time of each size is
printed too.

    python -m benchmarks.engine.graph_capture [--parts timeline,padding] [--variants on_demand,start,largest] [--reps 2]
        [--json F] [--smoke]

``--smoke`` runs the timeline on a tiny model on the CPU (1/64 of the requests, 1/16 of the prompt lengths, 4 new
tokens; no graphs there, so the variants differ only in name) and skips the padding part; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig

from benchmarks.e2e.report import write_json
from benchmarks.e2e.systems import Budget, hf_paged_system
from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, WARM, WORKLOADS, load_model
import hf_paged
from hf_paged.bench import run_header, time_calls
from hf_paged.engine import _core as engine_core
from hf_paged.runner._step_plan import DecodeColumns

VARIANTS = {"on_demand": {}, "start": {"cuda_graph_capture": "start"}, "largest": "largest"}
PAD_SIZES = (1, 4, 16, 64, 128, 256)


class StepClock:
    """Timestamps of the engines' step launches and of their construction, while installed."""

    def __init__(self):
        self.launches: list[tuple[float, int, bool]] = []  # (time, sequences, one token each: a decode step)
        self.setup_seconds = 0.0
        self._launch, self._init = engine_core.EngineCore._launch, engine_core.EngineCore.__init__

    def __enter__(self) -> StepClock:
        clock, launch, init = self, self._launch, self._init

        def timed_launch(core, batch):  # (not through size_for: it counts steps toward on-demand captures)
            decode = sum(batch.num_tokens) == len(batch.seqs)
            clock.launches.append((time.perf_counter(), len(batch.seqs), decode))
            return launch(core, batch)

        def timed_init(core, *args, **kwargs):
            began = time.perf_counter()
            init(core, *args, **kwargs)
            clock.setup_seconds += time.perf_counter() - began

        engine_core.EngineCore._launch, engine_core.EngineCore.__init__ = timed_launch, timed_init
        return self

    def __exit__(self, *exc) -> None:
        engine_core.EngineCore._launch, engine_core.EngineCore.__init__ = self._launch, self._init


def split_call(launches: list[tuple[float, int, bool]], start: float, end: float, full: int) -> dict:
    """A call's steps by kind (with a prefill in them, decode at the full batch, decode below it): each step lasts
    until the next launch (the last until the call's end)."""
    ends = [t for t, _, _ in launches[1:]] + [end]
    parts = {"mixed": [0, 0.0], "full": [0, 0.0], "tail": [0, 0.0]}
    for (t, n, decode), until in zip(launches, ends):
        kind = "mixed" if not decode else "full" if n == full else "tail"
        parts[kind][0] += 1
        parts[kind][1] += until - t
    first = launches[0][0] - start if launches else end - start
    return {"before_first_step_s": first, **{f"{k}_steps": v[0] for k, v in parts.items()},
            **{f"{k}_s": v[1] for k, v in parts.items()}}


def timeline(model, args, say) -> list[dict]:
    anchor = WORKLOADS["anchor"].smoke() if args.smoke else WORKLOADS["anchor"]
    warm = WARM.smoke() if args.smoke else WARM
    vocab = model.config.vocab_size
    budget = Budget(256, 16) if args.smoke else Budget(8192, 256)
    prompts, gc = anchor.prompts(vocab), anchor.generation_config()
    hf_paged_system(model, budget, {})(warm.prompts(vocab), warm.generation_config())
    full = min(len(prompts), budget.max_requests)
    rows = []
    for rep in range(args.reps):
        for name in args.variants:
            kwargs = VARIANTS[name] if VARIANTS[name] != "largest" else {"cuda_graphs": (full,)}
            generate = hf_paged_system(model, budget, kwargs)
            with StepClock() as clock:
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                out = generate(prompts, gc)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                end = time.perf_counter()
            tokens = sum(len(o.generated_tokens) for o in out.values())
            row = {"part": "timeline", "variant": name, "rep": rep, "wall_s": end - start, "tokens": tokens,
                   "expected_tokens": len(prompts) * anchor.new_tokens, "tok_per_s": tokens / (end - start),
                   "setup_s": clock.setup_seconds, **split_call(clock.launches, start, end, full)}
            rows.append(row)
            say(f"{name} #{rep}: {tokens:,} tokens in {row['wall_s']:.3f} s = {row['tok_per_s']:,.0f} tok/s "
                f"(setup {row['setup_s']:.3f} s, mixed {row['mixed_steps']} / {row['mixed_s']:.3f} s, full "
                f"{row['full_steps']} / {row['full_s']:.3f} s, tail {row['tail_steps']} / {row['tail_s']:.3f} s)")
    return rows


def padding(model, say) -> list[dict]:
    engine = hf_paged.Engine(model, num_blocks=16000, block_size=16, max_batch_tokens=8192, max_num_seqs=256,
                             cuda_graphs=PAD_SIZES)
    gen = torch.Generator().manual_seed(0)
    for _ in range(256):
        engine.add_request(torch.randint(3, model.config.vocab_size, (800,), generator=gen).tolist(),
                           GenerationConfig(max_new_tokens=100, do_sample=False, eos_token_id=None))
    while engine.scheduler.waiting or any(s.num_generated < 2 for s in engine.scheduler.running):
        engine.step()
    seqs = list(engine.scheduler.running)
    for seq in seqs:  # room for the token each replay writes (the same slot every time)
        engine.block_manager.reserve_up_to(seq, 1)
    rows = []
    for n in (1, 4, 16, 64, 128):
        for b in [s for s in PAD_SIZES if s >= n]:
            graphs = engine.runner.graphs
            timing = time_calls([lambda: (graphs.stage(DecodeColumns.of(seqs[:n]), b), graphs.replay(b))], graph=False,
                                reps=30)
            rows.append({"part": "padding", "rows": n, "graph": b, "ms": 1e3 * timing.median_s})
            say(f"{n} rows in the graph of {b}: {rows[-1]['ms']:.3f} ms")
    for b, seconds in sorted(engine.runner.graphs.size_seconds.items()):
        rows.append({"part": "capture", "graph": b, "seconds": seconds})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="timeline,padding")
    parser.add_argument("--variants", default="on_demand,start,largest")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU; the numbers mean nothing")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    began = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - began:7.1f} s] {msg}", flush=True)  # noqa: E731
    if args.smoke:
        torch.set_num_threads(1)
    model = load_model(SMOKE_SHAPE if args.smoke else LLAMA_1B, "cpu" if args.smoke else "cuda", "hf_paged")
    rows = timeline(model, args, say) if "timeline" in args.parts else []
    if "padding" in args.parts:
        if model.device.type == "cuda":
            rows += padding(model, say)
        else:
            say("padding: CUDA graphs only, skipped on the CPU")
    if args.json:
        write_json(args.json, rows, **run_header())
    print("\nvariant     wall s   tok/s  setup s  mixed (n, s)  full (n, s)  tail (n, s)")
    for r in (r for r in rows if r["part"] == "timeline"):
        print(f"{r['variant']:10} {r['wall_s']:7.3f} {r['tok_per_s']:7,.0f} {r['setup_s']:8.3f}  {r['mixed_steps']:4} "
              f"{r['mixed_s']:6.3f}  {r['full_steps']:4} {r['full_s']:6.3f}  {r['tail_steps']:4} {r['tail_s']:6.3f}")
    pads = [r for r in rows if r["part"] == "padding"]
    if pads:
        print("\nrows  graph  ms per step (median)")
        for r in pads:
            print(f"{r['rows']:4} {r['graph']:6} {r['ms']:8.3f}")


if __name__ == "__main__":
    main()
