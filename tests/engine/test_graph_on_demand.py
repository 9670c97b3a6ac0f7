"""On-demand CUDA-graph capture, the policy alone (no GPU: the capture is replaced by a recorder): which size a
decode step counts toward, when a size is captured, and what the step is served with meanwhile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_paged.engine import cuda_graphs
from hf_paged.engine.cuda_graphs import DecodeGraphs


def _graphs(sizes: list[int], monkeypatch, fail: set[int] = frozenset()) -> tuple[DecodeGraphs, list[int]]:
    graphs = object.__new__(DecodeGraphs)  # the capture needs a GPU: build only what the policy reads
    wanted = sorted(sizes)
    graphs.sizes, graphs._waiting = wanted[-1:], dict.fromkeys(wanted[:-1], 0)
    graphs._graphs = {wanted[-1]: None}
    graphs.width, graphs.cache, graphs.on_demand_seconds, graphs.device = 8, SimpleNamespace(block_size=16), 0.0, "cpu"
    captured = []

    def capture(batch_sizes, warm=False):
        assert len(batch_sizes) == 1 and warm
        if batch_sizes[0] in fail:
            raise RuntimeError("capture failed")
        captured.append(batch_sizes[0])
        graphs._graphs[batch_sizes[0]] = None

    graphs._capture_sizes = capture
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda *a: None)
    return graphs, captured


def _step(graphs: DecodeGraphs, n: int) -> int | None:
    seqs = [SimpleNamespace(num_computed_tokens=10 + i) for i in range(n)]
    return graphs.size_for(seqs, [1] * n)


def test_a_size_is_captured_once_enough_steps_padded_past_it(monkeypatch):
    graphs, captured = _graphs([1, 2, 4, 8, 16], monkeypatch)
    k = cuda_graphs.ON_DEMAND_STEPS
    assert [_step(graphs, 16) for _ in range(k + 1)] == [16] * (k + 1) and captured == []  # the largest serves
    assert [_step(graphs, 3) for _ in range(k - 1)] == [16] * (k - 1)  # counted toward 4, padded up to 16
    assert _step(graphs, 4) == 4 and captured == [4]  # the k-th step captures 4 and runs in it
    assert graphs.sizes == [4, 16] and sorted(graphs._waiting) == [1, 2, 8]
    assert [_step(graphs, 6) for _ in range(k - 1)] == [16] * (k - 1)  # 8 counts on, 4 does not fit
    assert _step(graphs, 5) == 8 and captured == [4, 8]
    assert _step(graphs, 2) == 4 and graphs._waiting[2] == 1  # the smallest fitting waiting size counts
    assert _step(graphs, 17) is None  # more than the largest: eager, nothing counted
    assert graphs._waiting == {1: 0, 2: 1}


def test_a_failed_capture_ends_on_demand_capture_and_the_captured_graphs_serve(monkeypatch, caplog):
    graphs, captured = _graphs([1, 2, 8], monkeypatch, fail={2})
    k = cuda_graphs.ON_DEMAND_STEPS
    assert [_step(graphs, 2) for _ in range(k + 5)] == [8] * (k + 5)
    assert [_step(graphs, 1) for _ in range(k + 5)] == [8] * (k + 5)  # 1 is not tried either
    assert captured == [] and graphs._waiting == {} and graphs.sizes == [8]
    assert any("batch size 2 failed" in r.message and "no more" in r.message for r in caplog.records)


@pytest.mark.parametrize("sizes", [[1], [5]])
def test_one_size_waits_for_nothing(sizes, monkeypatch):
    graphs, captured = _graphs(sizes, monkeypatch)
    assert [_step(graphs, 1) for _ in range(3)] == sizes * 3 and captured == []
