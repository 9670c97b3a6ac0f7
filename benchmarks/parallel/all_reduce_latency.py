"""Latency of the small all-reduces of a tensor-parallel decode step: NCCL, torch's one-shot, hf_paged's peer_sum.

Run under ``torchrun`` on the GPUs of one host::

    torchrun --standalone --nproc-per-node 2 -m benchmarks.parallel.all_reduce_latency --json ar.json
    torchrun --standalone --nproc-per-node 2 -m benchmarks.parallel.all_reduce_latency --check   # correctness only

Every method sums the same bf16 inputs (rank-specific random values) over all ranks, at each size (default 8 KiB,
one decode row of hidden 4096, up to 1 MiB, 128 rows):

- ``nccl``: ``dist.all_reduce`` in place on a copy, as ``hf_paged::tp_all_reduce`` does by default;
- ``torch-one-shot``: ``torch.ops.symm_mem.one_shot_all_reduce_copy``;
- ``hf_paged``: ``torch.ops.hf_paged.peer_sum`` (``HF_PAGED_TP_ALL_REDUCE=hf_paged``, ``csrc/peer_sum.cu``);
- ``hf_paged+add`` and ``hf_paged+add+norm``: its fused forms, the sum plus a residual and then that row's RMSNorm,
  at rows of 4096.

Checks (every method, before timing): the sum against float32 sums of the gathered inputs in rank order (hf_paged's
must be bit-identical; the others are reported as a max difference), on eager calls whose inputs change between
calls (so both data halves serve), after a delay on one rank only (the others must wait, not read stale data), and
from a CUDA graph replay. The fused forms: the residual add bit-identical to the unfused rounding (the sum rounded
to the dtype, then added), the norm within two units of the dtype's last place of a float64 norm of that sum, at
widths from 2048 to 16384 and 1 to 128 rows.
Timing (``hf_paged.bench.time_calls``): ``--calls`` back-to-back calls captured in one CUDA graph, replayed
``--replays`` times between CUDA events, the ranks at a barrier before each; the median replay over the calls is the
time per call, which is what a decode graph pays. Rank 0 prints progress, a table, and writes ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from hf_paged.bench import run_header, time_calls
from hf_paged.parallel import _all_reduce as tp_all_reduce

METHODS = ("nccl", "torch-one-shot", "hf_paged")
FUSED = ("hf_paged+add", "hf_paged+add+norm")  # peer_sum_add, peer_sum_add_rms_norm
HIDDEN = 4096  # the row width of the fused forms' timings


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64,256,512,1024", help="comma list of KiB")
    parser.add_argument("--calls", type=int, default=64, help="calls per captured graph (a decode step of 32 layers "
                                                              "makes 64)")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--check", action="store_true", help="correctness checks only, no timing")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


class Methods:
    """The three all-reduces over the world group, their buffers set up once (collective)."""

    def __init__(self, device: torch.device):
        self.group = dist.group.WORLD
        self.name = self.group.group_name
        self.rank = dist.get_rank()
        max_bytes = tp_all_reduce.ONE_SHOT_MAX_BYTES
        self.staged, _ = tp_all_reduce._symmetric(self.group, torch.zeros(max_bytes // 2, dtype=torch.bfloat16,
                                                                          device=device))
        os.environ["HF_PAGED_TP_ALL_REDUCE"] = "hf_paged"
        tp_all_reduce._prepare_peer_sum(self.group, device)
        self.peers = tp_all_reduce._peers[self.name]  # (addresses, rank, buffer bytes, timeout)

    def __call__(self, method: str, x: torch.Tensor) -> torch.Tensor:
        if method == "nccl":
            out = x.clone()
            dist.all_reduce(out, group=self.group)
            return out
        if method == "torch-one-shot":
            staged = self.staged[: x.numel()].view(x.shape)
            return torch.ops.symm_mem.one_shot_all_reduce_copy(staged, x, "sum", self.name)
        return torch.ops.hf_paged.peer_sum(x, *self.peers)

    def fused(self, method: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        if method == "hf_paged+add":
            return torch.ops.hf_paged.peer_sum_add(x, residual, *self.peers)
        return torch.ops.hf_paged.peer_sum_add_rms_norm(x, residual, weight, eps, *self.peers)[1]


def _inputs(numel: int, dtype: torch.dtype, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input and the reference sum: every rank's input summed in float32 in rank order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device="cpu").manual_seed(seed * 100 + rank)
    x = (torch.randn(numel, generator=gen) * (rank + 1)).to(dtype).to(device)
    everyone = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(everyone, x)
    acc = torch.zeros(numel, dtype=torch.float32, device=device)
    for part in everyone:
        acc += part.float()
    return x, acc.to(dtype)


def _diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max())


def check(methods: Methods, sizes_kib: list[int], device) -> list[dict]:
    """Each method against the reference: eager calls with changing inputs, a delayed rank, a graph replay."""
    rows = []
    cases = [(k * 1024 // 2, torch.bfloat16) for k in sizes_kib] + [(4096, torch.float16), (2048, torch.float32),
                                                                    (8, torch.bfloat16)]
    for numel, dtype in cases:
        for method in METHODS:
            if method == "torch-one-shot" and dtype != torch.bfloat16:
                continue  # its buffer is bf16 here
            worst, exact = 0.0, True
            for call in range(5):  # consecutive calls: the data halves alternate, the epochs advance
                x, ref = _inputs(numel, dtype, seed=call + 7 * numel, device=device)
                if call == 3 and methods.rank == 1:
                    torch.cuda._sleep(50_000_000)  # rank 1 arrives ~25 ms late: rank 0 must wait for its data
                out = methods(method, x)
                worst, exact = max(worst, _diff(out, ref)), exact and torch.equal(out, ref)
            x, ref = _inputs(numel, dtype, seed=99 + numel, device=device)
            graph, out = _capture(lambda: methods(method, x), calls=3)
            graph.replay()
            x.copy_(_inputs(numel, dtype, seed=98 + numel, device=device)[0])
            ref = _inputs(numel, dtype, seed=98 + numel, device=device)[1]
            graph.replay()  # the replay reads the new input
            torch.cuda.synchronize()
            worst, exact = max(worst, _diff(out, ref)), exact and torch.equal(out, ref)
            rows.append({"method": method, "bytes": numel * dtype.itemsize, "dtype": str(dtype).split(".")[-1],
                         "max_diff": worst, "bit_identical": exact})
            if methods.rank == 0:
                print(f"[check] {method:15s} {numel * dtype.itemsize:>8d} B {rows[-1]['dtype']:9s} max diff "
                      f"{worst:.3g} {'bit-identical' if exact else ''}", flush=True)
    return rows


def _fused_inputs(rows: int, hidden: int, dtype: torch.dtype, seed: int, device):
    """This rank's input, the residual and norm weight (the same on every rank), and the references: the sum plus
    the residual as the unfused layer rounds it, and a float64 RMSNorm of that (rounded to the dtype before the
    weight, as Llama's norm does)."""
    x, summed = _inputs(rows * hidden, dtype, seed, device)
    gen = torch.Generator(device="cpu").manual_seed(seed + 12345)  # not rank-dependent
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    h = (residual.float() + summed.view(rows, hidden).float()).to(dtype)
    h64 = h.double()
    y = (h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    return x.view(rows, hidden), residual, weight, h, weight.double() * y.double()


def _within_two_ulps(out: torch.Tensor, ref: torch.Tensor) -> bool:
    # two units in the last place: the float32 norm may round to the neighbour of float64's, then the weight rounds
    eps = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -18}[out.dtype]
    return bool(((out.double() - ref).abs() <= ref.abs() * eps + 1e-30).all())


def check_fused(methods: Methods, device) -> list[dict]:
    """peer_sum_add and peer_sum_add_rms_norm against their references: eager calls with changing inputs (one with
    a late rank), then a graph replay reading a new input."""
    rows = []
    for n, hidden, dtype in ((64, 4096, torch.bfloat16), (1, 4096, torch.bfloat16), (128, 4096, torch.bfloat16),
                             (3, 8192, torch.float16), (5, 2048, torch.float32), (2, 16384, torch.bfloat16)):
        sums_ok, norms_ok, worst = True, True, 0.0
        for call in range(5):
            x, residual, weight, h_ref, y_ref = _fused_inputs(n, hidden, dtype, call + 11 * n + hidden, device)
            if call == 3 and methods.rank == 1:
                torch.cuda._sleep(50_000_000)
            if call % 2:
                h, y = torch.ops.hf_paged.peer_sum_add_rms_norm(x, residual, weight, 1e-5, *methods.peers)
                norms_ok = norms_ok and _within_two_ulps(y, y_ref)
                worst = max(worst, float((y.double() - y_ref).abs().max()))
            else:
                h = torch.ops.hf_paged.peer_sum_add(x, residual, *methods.peers)
            sums_ok = sums_ok and torch.equal(h, h_ref)
        x, residual, weight, _, _ = _fused_inputs(n, hidden, dtype, 500 + n, device)
        graph, (h, y) = _capture(lambda: torch.ops.hf_paged.peer_sum_add_rms_norm(x, residual, weight, 1e-5,
                                                                                  *methods.peers), calls=3)
        new = _fused_inputs(n, hidden, dtype, 600 + n, device)
        for buffer, value in zip((x, residual, weight), new[:3]):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        sums_ok, norms_ok = sums_ok and torch.equal(h, new[3]), norms_ok and _within_two_ulps(y, new[4])
        rows.append({"method": "hf_paged fused", "rows": n, "hidden": hidden, "dtype": str(dtype).split(".")[-1],
                     "sum_bit_identical": sums_ok, "norm_within_two_ulps": norms_ok, "norm_max_diff": worst})
        if methods.rank == 0:
            print(f"[check] fused {n:4d} x {hidden:5d} {rows[-1]['dtype']:9s} sum+residual "
                  f"{'bit-identical' if sums_ok else 'DIFFERS'}, norm {'within two ulps' if norms_ok else 'DIFFERS'} "
                  f"(max diff {worst:.3g})", flush=True)
        del graph
    return rows


def _capture(run, calls: int):
    """``run`` ``calls`` times in one CUDA graph (after a warm-up outside it): ``(graph, last output)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = run()
    torch.cuda.synchronize()
    dist.barrier()
    return graph, out


def time_methods(methods: Methods, sizes_kib: list[int], calls: int, replays: int, device) -> list[dict]:
    rows = []
    for kib in sizes_kib:
        x, _ = _inputs(kib * 512, torch.bfloat16, seed=kib, device=device)
        runs = {method: functools.partial(methods, method, x) for method in METHODS}
        if kib * 512 % HIDDEN == 0:  # the fused forms on rows of HIDDEN, with a residual and a norm weight
            residual = torch.randn(kib * 512 // HIDDEN, HIDDEN, device=device).to(torch.bfloat16)
            weight = torch.ones(HIDDEN, device=device, dtype=torch.bfloat16)
            runs.update({method: functools.partial(methods.fused, method, x.view(-1, HIDDEN), residual, weight, 1e-5)
                         for method in FUSED})
        for method, run in runs.items():
            # the ranks start each replay together (host-side), as decode steps do
            us = 1e6 * time_calls([run], min_calls=calls, reps=replays, before_rep=dist.barrier).median_s
            rows.append({"method": method, "kib": kib, "us_per_call": us, "calls": calls, "replays": replays})
            if methods.rank == 0:
                print(f"[time] {method:17s} {kib:>5d} KiB {us:7.2f} us per call", flush=True)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("nccl")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = Methods(device)
    checks = check(methods, sizes, device)
    fused = check_fused(methods, device)
    timings = [] if args.check else time_methods(methods, sizes, args.calls, args.replays, device)
    if dist.get_rank() == 0:
        card = torch.cuda.get_device_name(device)
        nccl = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        if timings:
            print(f"{card} x {dist.get_world_size()}, bf16, {args.calls} calls per graph, median of "
                  f"{args.replays} replays; us per call{' (' + str(nccl) + ')' if nccl else ''}")
            print("  KiB | " + " | ".join(f"{m:>17s}" for m in METHODS + FUSED))
            for kib in sizes:
                cells = [next((r["us_per_call"] for r in timings if r["kib"] == kib and r["method"] == m), None)
                         for m in METHODS + FUSED]
                print(f"{kib:5d} | " + " | ".join(f"{c:17.2f}" if c is not None else f"{'-':>17s}" for c in cells))
        ours = [r for r in checks if r["method"] == "hf_paged"]
        bad = [r for r in ours if not r["bit_identical"]]
        print(f"checks: hf_paged bit-identical in {len(ours) - len(bad)} of {len(ours)} cases", flush=True)
        bad_fused = [r for r in fused if not (r["sum_bit_identical"] and r["norm_within_two_ulps"])]
        print(f"checks: fused forms right in {len(fused) - len(bad_fused)} of {len(fused)} cases", flush=True)
        if args.json:
            args.json.write_text(json.dumps({**run_header(device), "world_size": dist.get_world_size(),
                                             "nccl_env": nccl, "checks": checks, "fused_checks": fused,
                                             "timings": timings},
                                            indent=1))
        if bad:
            raise SystemExit(f"hf_paged peer_sum differs from the rank-order float32 sum: {bad}")
        if bad_fused:
            raise SystemExit(f"hf_paged's fused peer_sum differs from its reference: {bad_fused}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
