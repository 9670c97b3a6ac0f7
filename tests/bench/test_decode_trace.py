"""The decode trace without a GPU: the reader's arithmetic on hand-made traces, and the build switch that adds the
trace points (the normal build must not carry them). tests/gpu/kernels/test_decode_trace_gpu.py runs the real thing."""

from __future__ import annotations

import pytest

from hf_paged import envs

from hf_paged.bench import _decode_trace as dt
from hf_paged.kernels import _build as build


def cta(start: int, work: int, first: int, loop: int, ticket: int, end: int, sm: int, flags: int = 0,
        ns_per_cycle: float = 0.5) -> list[int]:
    """One CTA's words: globaltimer at each point, clock64 = (ns - start) / ns_per_cycle + 1000."""
    ns = [start, work, first, loop, ticket, end]
    words = ns + [sm, flags] + [int((t - start) / ns_per_cycle) + 1000 for t in ns] + [0, 0]
    assert len(words) == dt.WORDS
    return words


def test_summary_of_two_launches():
    first = [cta(0, 500, 1500, 9500, 10500, 10500, sm=0), cta(200, 700, 1700, 10700, 11500, 13000, sm=1, flags=1),
             cta(100, 0, 0, 0, 0, 0, sm=2, flags=dt.NO_SPLIT)]  # past its sequence's splits: left out
    second = [cta(14000, 14600, 15600, 23600, 24600, 24600, sm=0),
              cta(14300, 14900, 16000, 24000, 25000, 26500, sm=1, flags=1)]
    s = dt.summarize([first, second])
    one, two = s["launches"]
    assert one["ctas"] == 2 and one["sms"] == 2 and one["gap_ns"] is None
    assert one["span_ns"] == 13000 and one["start_spread_ns"] == 200 and one["tail_ns"] == 13000 - 10700
    assert two["gap_ns"] == 14000 - 13000 and two["span_ns"] == 26500 - 14000 and two["tail_ns"] == 26500 - 24000
    assert one["ns_per_cycle"] == pytest.approx(0.5, rel=1e-3)
    # phases from clock64 converted back to ns: (work - start), (first - work), (loop - first), (ticket - loop)
    assert two["prologue"]["median_ns"] == pytest.approx((600 + 600) / 2, abs=2)
    assert two["loop"]["max_ns"] == pytest.approx(8000, abs=2)
    assert two["epilogue"]["max_ns"] == pytest.approx(1000, abs=2)
    assert two["combine"] == {"median_ns": pytest.approx(1500, abs=2), "max_ns": pytest.approx(1500, abs=2),
                              "ctas": 1}
    m = s["medians"]  # over launches 2..n: the second launch alone here
    assert m["gap_ns"] == 1000 and m["span_ns"] == 12500 and m["combine median_ns"] == pytest.approx(1500, abs=2)


def test_a_launch_without_traced_ctas_is_an_error():
    with pytest.raises(ValueError, match="trace buffer"):
        dt.summarize([[cta(0, 0, 0, 0, 0, 0, sm=0, flags=dt.NO_SPLIT)]])


def test_the_trace_points_exist_only_in_the_diagnostic_build(monkeypatch):
    monkeypatch.delenv(envs.KERNEL_TRACE, raising=False)
    plain_cuda, plain_host, plain_hash = build._cuda_flags("90a"), build._host_flags(), build.source_hash("90a")
    assert "-DHF_PAGED_DECODE_TRACE" not in plain_cuda + plain_host
    monkeypatch.setenv(envs.KERNEL_TRACE, "1")
    envs.refresh()
    assert "-DHF_PAGED_DECODE_TRACE" in build._cuda_flags("90a") and "-DHF_PAGED_DECODE_TRACE" in build._host_flags()
    assert build.source_hash("90a") != plain_hash  # a build folder of its own


def test_the_reader_refuses_the_normal_build(monkeypatch):
    monkeypatch.delenv(envs.KERNEL_TRACE, raising=False)
    with pytest.raises(SystemExit, match="HF_PAGED_KERNEL_TRACE=1"):
        dt.run(1, 1024, 128, 2)
