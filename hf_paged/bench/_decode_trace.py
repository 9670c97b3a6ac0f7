"""Where a paged-decode launch spends its time, from per-CTA timestamps of the diagnostic kernel build.

The normal build's decode kernels hold no trace code. With ``HF_PAGED_KERNEL_TRACE=1`` set before the kernels first
load in a process, they are built (into a folder of their own) with it: a launch made while a trace buffer is set
(``torch.ops.hf_paged.decode_trace_buffer``) has each CTA's first thread store ``%globaltimer`` (ns, shared by all
SMs) and ``clock64`` (its SM's cycles) at the phases of ``csrc/decode_common.cuh``'s ``TracePoint``: start, work
(sequence length and block-table slice loaded), first tile (warp 0's first K/V tile arrived), loop done (warp 0's
K/V loop drained), ticket (partial stored and ticket taken, or the output written), end (the last store; after the
combine for the split that combines).

    HF_PAGED_KERNEL_TRACE=1 python -m hf_paged.bench._decode_trace [--batch 1] [--ctx 8192] [--head-dim 128]
        [--launches 8] [--no-pdl] [--json F] [--raw]

It captures one CUDA graph of ``--launches`` back-to-back decodes over rotating input sets (the kernel benchmark's
layout: bf16, 32 query / 8 KV heads, block size 16, the split length the kernel picks), each launch with a trace
buffer of its own (with programmatic dependent launch where the GPU allows it, unless ``--no-pdl``), replays it,
times it with CUDA events, and prints per launch and as medians over launches 2..n
(the first one follows the graph's start):

- ``span``: last CTA end - first CTA start, the launch as its CTAs see it; ``event``: graph time / launches;
- ``gap``: this launch's first CTA start - the previous launch's last CTA end (kernel boundary and CTA launch);
- ``start spread``: last CTA start - first CTA start;
- per CTA, median and max: ``prologue`` (work - start), ``first tile`` (first tile - work), ``loop`` (loop done -
  first tile), ``epilogue`` (ticket - loop done), ``combine`` (end - ticket, the combining CTAs only);
- ``tail``: last CTA end - latest loop done, what the launch spends after its slowest split has streamed its K/V.

Intra-CTA phases come from ``clock64`` differences converted to ns with the median ns-per-cycle of the CTAs' whole
runs (globaltimer's steps can be coarse); cross-CTA figures come from ``%globaltimer``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch

from hf_paged import envs, kernels
from hf_paged.bench import time_calls
from hf_paged.bench._kernels import DTYPE, NUM_HEADS, NUM_KV_HEADS, decode_set

WORDS = 16  # kTraceWords in csrc/launch.h
START, WORK, FIRST_TILE, LOOP_DONE, TICKET, END = range(6)  # TracePoint in csrc/decode_common.cuh
SM, FLAGS = 6, 7
COMBINED, NO_SPLIT = 1, 2  # the flags word
PHASES = (("prologue", START, WORK), ("first tile", WORK, FIRST_TILE), ("loop", FIRST_TILE, LOOP_DONE),
          ("epilogue", LOOP_DONE, TICKET))


def summarize(launches: list[list[list[int]]]) -> dict:
    """Figures of traced launches: ``launches[i][cta]`` is that CTA's ``WORDS`` words (as the kernel stored them,
    int64). CTAs flagged NO_SPLIT (past their sequence's last split) are left out."""
    per_launch = []
    prev_end = None
    for ctas in launches:
        live = [c for c in ctas if not c[FLAGS] & NO_SPLIT]
        if not live:
            raise ValueError("a traced launch recorded no CTA that ran a split; was the trace buffer set?")
        ns_per_cycle = statistics.median(
            (c[END] - c[START]) / (c[8 + END] - c[8 + START]) for c in live if c[8 + END] > c[8 + START])

        def phase(c, a, b):
            return (c[8 + b] - c[8 + a]) * ns_per_cycle

        first_start, last_end = min(c[START] for c in live), max(c[END] for c in live)
        row = {"ctas": len(live), "sms": len({c[SM] for c in live}), "span_ns": last_end - first_start,
               "start_spread_ns": max(c[START] for c in live) - first_start,
               "tail_ns": last_end - max(c[LOOP_DONE] for c in live), "ns_per_cycle": ns_per_cycle,
               "gap_ns": None if prev_end is None else first_start - prev_end}
        for name, a, b in PHASES:
            values = [phase(c, a, b) for c in live if c[8 + a] and c[8 + b]]
            row[name] = {"median_ns": statistics.median(values), "max_ns": max(values)} if values else None
        combined = [phase(c, TICKET, END) for c in live if c[FLAGS] & COMBINED]
        row["combine"] = ({"median_ns": statistics.median(combined), "max_ns": max(combined), "ctas": len(combined)}
                          if combined else None)
        per_launch.append(row)
        prev_end = last_end
    later = per_launch[1:] or per_launch

    def med(key, sub=None):
        values = [(r[key] if sub is None else (r[key] or {}).get(sub)) for r in later]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    medians = {k: med(k) for k in ("span_ns", "start_spread_ns", "tail_ns", "gap_ns")}
    medians.update({f"{name} {stat}": med(name, stat) for stat in ("median_ns", "max_ns") for name, *_ in PHASES})
    medians["combine median_ns"] = med("combine", "median_ns")
    return {"launches": per_launch, "medians": medians}


def run(batch: int, ctx: int, head_dim: int, launches: int, replays: int = 5, raw: bool = False,
        pdl: bool = True) -> dict:
    """Trace ``launches`` back-to-back decodes in one CUDA graph (see the module docstring); returns the summary with
    the event time per launch, the settings, whether the traced output equals an untraced launch's bit for bit, and
    with ``raw`` every CTA's words (``raw[launch][cta]``)."""
    if not envs.kernel_trace():
        raise SystemExit(f"set {envs.KERNEL_TRACE}=1 first: the trace points exist only in that build")
    if (reason := kernels.unavailable_reason()) is not None:
        raise SystemExit(f"the kernels are unavailable: {reason}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [decode_set(batch, ctx, head_dim, gen) for _ in range(min(launches, 4))]
    scale = head_dim**-0.5
    split = kernels.decode_split_len(sets[0]["query"], sets[0]["k16"], ctx)
    grid = batch * NUM_KV_HEADS * max(1, -(-ctx // split))  # CTAs of a launch: one head group per split at 32 / 8 heads
    buffers = [torch.zeros(grid * WORDS, dtype=torch.int64, device="cuda") for _ in range(launches)]
    outs = [torch.empty_like(s["query"]) for s in sets]
    workspace = torch.empty(max(1, kernels.decode_workspace_numel(batch, NUM_HEADS, head_dim, ctx, split)),
                            dtype=torch.float32, device="cuda")

    def decode(s: dict, **options) -> torch.Tensor:
        return kernels.paged_decode(s["query"], s["k16"], s["v16"], s["t16"], s["seq_lens"], scale, max_seq_len=ctx,
                                    split_len=split, **options)

    def launch(i: int) -> None:
        torch.ops.hf_paged.decode_trace_buffer(buffers[i])  # read at launch: the captured launch keeps it
        decode(sets[i % len(sets)], out=outs[i % len(sets)], workspace=workspace, pdl=pdl)

    try:  # one graph of the launches, each with its buffer; timed over replays that start from zeroed buffers
        timing = time_calls([functools.partial(launch, i) for i in range(launches)], min_calls=launches,
                            reps=replays, before_rep=lambda: [b.zero_() for b in buffers])
    finally:
        torch.ops.hf_paged.decode_trace_buffer(None)
    if timing.method != "graph":
        raise RuntimeError("the traced decodes could not be captured in a CUDA graph")
    traced = [b.view(-1, WORDS).tolist() for b in buffers]
    summary = summarize(traced)
    # the trace must not change the answer: the same decode untraced, bit for bit
    summary["matches_untraced"] = bool(torch.equal(decode(sets[0]), outs[0]))
    if raw:
        summary["raw"] = traced
    summary["medians"]["event_ns"] = timing.median_s * 1e9
    summary["settings"] = {"batch": batch, "ctx": ctx, "head_dim": head_dim, "launches": launches,
                           "split_len": split, "block_size": 16, "dtype": str(DTYPE), "heads": NUM_HEADS,
                           "kv_heads": NUM_KV_HEADS, "pdl": pdl, "device": torch.cuda.get_device_name()}
    return summary


def table(summary: dict) -> str:
    m = summary["medians"]

    def us(v):
        return "-" if v is None else f"{v / 1e3:.2f}"

    s = summary["settings"]
    lines = [f"decode trace, {s['device']}: B={s['batch']} ctx={s['ctx']} hd{s['head_dim']}, split "
             f"{s['split_len']}, {summary['launches'][-1]['ctas']} CTAs on {summary['launches'][-1]['sms']} SMs; "
             f"us, medians over launches 2..{s['launches']}"]
    lines.append(f"  event time per launch {us(m['event_ns'])} | span {us(m['span_ns'])} | gap {us(m['gap_ns'])} | "
                 f"start spread {us(m['start_spread_ns'])} | tail {us(m['tail_ns'])}")
    lines.append("  per CTA (median / max): " + " | ".join(
        f"{name} {us(m[f'{name} median_ns'])} / {us(m[f'{name} max_ns'])}" for name, *_ in PHASES)
        + f" | combine {us(m['combine median_ns'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--raw", action="store_true", help="also write every CTA's trace words to the JSON")
    args = parser.parse_args(argv)
    if args.launches < 2:
        parser.error("--launches must be at least 2 (the gaps are between launches)")
    summary = run(args.batch, args.ctx, args.head_dim, args.launches, raw=args.raw, pdl=not args.no_pdl)
    print(table(summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
