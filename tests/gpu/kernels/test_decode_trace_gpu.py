"""The diagnostic decode build (``HF_PAGED_KERNEL_TRACE=1``) and its reader, ``python -m hf_paged.bench._decode_trace``,
on a GPU. The build switch must be set before a process first loads the kernels, so each case runs the reader in a
process of its own (the first one builds the trace kernels into their own folder: about a minute).

- The traced launches give the untraced answer bit for bit (the trace points only store timestamps).
- Every CTA of every launch recorded its points in order (start <= work <= first tile <= loop done <= ticket <=
  end, on its SM's clock and on the global timer), one CTA per KV head combined, and the launches follow each other
  (each starts after the one before ended).
- The normal build refuses a trace buffer with the switch named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_paged import kernels
from hf_paged.bench import _decode_trace as dt

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

ROOT = Path(__file__).resolve().parents[3]


def _trace(tmp_path: Path, batch: int, ctx: int, launches: int = 3, pdl: bool = True) -> dict:
    out = tmp_path / "trace.json"
    path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "HF_PAGED_KERNEL_TRACE": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-m", "hf_paged.bench._decode_trace", "--batch", str(batch), "--ctx",
                           str(ctx), "--launches", str(launches), "--json", str(out), "--raw"]
                          + ([] if pdl else ["--no-pdl"]),
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "decode trace" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.parametrize(("batch", "ctx"), [(1, 8192), (3, 1000)])
def test_traced_launches_record_every_cta_in_order(tmp_path, batch: int, ctx: int):
    summary = _trace(tmp_path, batch, ctx, pdl=False)
    assert summary["matches_untraced"], "a traced launch changed the answer"
    splits = -(-ctx // summary["settings"]["split_len"])
    kv_heads = summary["settings"]["kv_heads"]
    previous_end = None
    for words_of in summary["raw"]:
        assert len(words_of) == batch * kv_heads * splits
        live = [w for w in words_of if not w[dt.FLAGS] & dt.NO_SPLIT]
        assert len(live) == len(words_of)  # every split of these lengths has keys
        for w in live:
            points = [w[dt.START], w[dt.WORK], w[dt.FIRST_TILE], w[dt.LOOP_DONE], w[dt.TICKET], w[dt.END]]
            cycles = [w[8 + i] for i in range(6)]
            assert all(p > 0 for p in points) and points == sorted(points), points
            assert cycles == sorted(cycles), cycles
        combined = [w for w in live if w[dt.FLAGS] & dt.COMBINED]
        assert len(combined) == (batch * kv_heads if splits > 1 else 0)
        start = min(w[dt.START] for w in live)
        if previous_end is not None:
            assert start >= previous_end, "a launch started before the one before it ended"
        previous_end = max(w[dt.END] for w in live)
    m = summary["medians"]
    assert 0 < m["span_ns"] <= m["event_ns"] * 1.5


def test_launches_overlap_under_programmatic_dependent_launch(tmp_path):
    """Compute capability 9.0 on, decode launches with PDL unless asked not to (pdl=False): back to back at B=1 x 8192,
    each launch's first CTAs start before the one before it has ended (its last CTAs still combine), and its CTAs
    still record their points in order."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 or newer")
    summary = _trace(tmp_path, 1, 8192, launches=5)
    assert summary["matches_untraced"]
    ends, starts = [], []
    for words_of in summary["raw"]:
        for w in words_of:
            points = [w[dt.START], w[dt.WORK], w[dt.FIRST_TILE], w[dt.LOOP_DONE], w[dt.TICKET], w[dt.END]]
            assert all(p > 0 for p in points) and points == sorted(points), points
        starts.append(min(w[dt.START] for w in words_of))
        ends.append(max(w[dt.END] for w in words_of))
    overlaps = [starts[i] < ends[i - 1] for i in range(1, len(starts))]
    assert all(overlaps), f"launches that waited for the one before to end: {overlaps}"


def test_the_normal_build_refuses_a_trace_buffer():
    if os.environ.get("HF_PAGED_KERNEL_TRACE") == "1":
        pytest.skip("this process loaded the diagnostic build")
    assert kernels.unavailable_reason() is None
    with pytest.raises(NotImplementedError, match="HF_PAGED_KERNEL_TRACE=1"):
        torch.ops.hf_paged.decode_trace_buffer(torch.zeros(16, dtype=torch.int64, device="cuda"))
    assert torch.ops.hf_paged.decode_trace_buffer(None) == dt.WORDS
