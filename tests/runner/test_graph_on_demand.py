"""On-demand CUDA-graph capture without a GPU: the policy (``OnDemandSizes``: which size a decode step counts toward,
when a size is due) and what ``DecodeGraphs`` serves a step with around a capture, the capture itself replaced by a
recorder."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from hf_paged.runner import _cuda_graphs as cuda_graphs
from hf_paged.runner import _graph_sizes as graph_sizes
from hf_paged.runner._decode_graphs import DecodeGraphs
from hf_paged.runner._graph_sizes import OnDemandSizes


def test_a_size_is_due_after_enough_steps_padded_past_it():
    k = graph_sizes.ON_DEMAND_STEPS
    sizes = OnDemandSizes([1, 2, 4, 8])
    assert [sizes.due(3, 16) for _ in range(k - 1)] == [None] * (k - 1)  # counted toward 4, served by 16
    assert sizes.due(4, 16) == 4 and sizes.waiting == [1, 2, 8]  # the k-th step: 4 is due, no longer waiting
    assert sizes.due(3, 4) is None  # served by its own size now: counts toward nothing
    assert sizes.due(16, 16) is None and sizes.due(17, 16) is None
    assert [sizes.due(2, 4) for _ in range(3)] == [None] * 3  # the smallest fitting size counts: 2, not 8
    assert [sizes.due(5, 16) for _ in range(k - 1)] == [None] * (k - 1)
    assert sizes.due(8, 16) == 8 and sizes.waiting == [1, 2]
    sizes.restart(8)
    assert sizes.waiting == [1, 2, 8] and all(sizes.due(8, 16) is None for _ in range(k - 1))
    sizes.stop()
    assert sizes.waiting == [] and sizes.due(1, 16) is None


class _Captured:
    """Stands in for a DecodeGraphs' CudaGraphs on the CPU: records what is captured (failing for the sizes in
    ``fail``), and its pool's bytes."""

    def __init__(self, sizes, fail, captured):
        self.sizes, self.fail, self.captured = dict.fromkeys(sizes), fail, captured

    def __len__(self):
        return len(self.sizes)

    def keys(self):
        return list(self.sizes)

    def drop(self, key):
        self.sizes.pop(key, None)

    def capture(self, steps, prepare=None, check=None):
        for key, _, warm in steps:
            assert warm  # each size is warmed up first, whatever the compiler has seen
            if check is not None and check() is not None:
                return check()
            if key in self.fail:
                raise RuntimeError("capture failed")
            self.captured.append(key)
            self.sizes[key] = None

    def held_bytes(self):
        return cuda_graphs.pool_bytes(torch.device("cuda", 0), (0, 3))


def _graphs(sizes: list[int], monkeypatch, fail: set[int] = frozenset(),
            capture: str = "on_demand") -> tuple[DecodeGraphs, list[int]]:
    graphs = object.__new__(DecodeGraphs)  # the capture needs a GPU: build only what serving a step reads
    wanted = sorted(sizes)
    start = graph_sizes.start_sizes(wanted, capture)
    captured = []
    graphs.sizes, graphs.graphs = start, _Captured(start, fail, captured)
    graphs._first = None if start else wanted[-1]  # as DecodeGraphs.__init__ sets them
    graphs._waiting = OnDemandSizes([s for s in wanted[:-1] if s not in start], first_use=capture == "first_use")
    graphs.width, graphs.pool, graphs.on_demand_seconds = 8, SimpleNamespace(block_size=16), 0.0
    graphs.device, graphs._memory_bytes, graphs._live_bytes = torch.device("cuda", 0), 0, 0
    graphs.compiled, graphs.dispatcher = None, SimpleNamespace(graph_unsupported_reason=lambda: None)
    # the pool's segments: 1 MiB per captured size (another pool's segment is not the graphs')
    monkeypatch.setattr(cuda_graphs.torch.cuda, "memory_snapshot", lambda: [
        {"device": 0, "total_size": len(captured) << 20, "segment_pool_id": (0, 3)},
        {"device": 0, "total_size": 64 << 20, "segment_pool_id": (0, 0)}])
    monkeypatch.setattr(cuda_graphs.torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda *a: None)
    return graphs, captured


def _step(graphs: DecodeGraphs, n: int) -> int | None:
    seqs = [SimpleNamespace(num_computed_tokens=10 + i) for i in range(n)]
    return graphs.size_for(seqs, [1] * n)


def test_the_step_that_makes_a_size_due_captures_it_and_runs_in_it(monkeypatch):
    graphs, captured = _graphs([1, 2, 4, 8, 16], monkeypatch)
    k = graph_sizes.ON_DEMAND_STEPS
    assert graphs.sizes == [] and graphs.memory_bytes == 0  # "on_demand": nothing at start
    assert _step(graphs, 17) is None and captured == []  # more than the largest: eager, nothing captured
    assert graphs.size_for([SimpleNamespace(num_computed_tokens=0)] * 2, [5, 1]) is None and captured == []  # prompts
    assert [_step(graphs, 16) for _ in range(k + 1)] == [16] * (k + 1) and captured == [16]  # its first step
    assert graphs.memory_bytes == 1 << 20 and graphs.on_demand_seconds > 0
    assert [_step(graphs, 3) for _ in range(k - 1)] == [16] * (k - 1)  # padded up to 16 meanwhile
    assert _step(graphs, 4) == 4 and captured == [16, 4] and graphs.sizes == [4, 16]
    assert graphs.memory_bytes == 2 << 20, "the pool's memory after the on-demand capture"
    assert [_step(graphs, 3) for _ in range(k + 1)] == [4] * (k + 1) and captured == [16, 4]
    assert _step(graphs, 17) is None  # more than the largest: eager, nothing counted
    assert graphs._waiting.waiting == [1, 2, 8]


def test_the_first_step_a_graph_can_serve_captures_the_largest_size_and_a_failure_leaves_decode_eager(
        monkeypatch, caplog):
    """``"on_demand"`` captures the largest size at the first step a graph can serve, whatever its batch; where
    that capture fails, every decode step runs eager and nothing more is captured."""
    graphs, captured = _graphs([1, 2, 4, 8], monkeypatch)
    assert _step(graphs, 3) == 8 and captured == [8] and graphs.sizes == [8]
    graphs, captured = _graphs([1, 2, 4, 8], monkeypatch, fail={8})
    assert [_step(graphs, n) for n in (8, 4, 1, 8)] == [None] * 4 and captured == []
    assert graphs.sizes == [] and graphs._waiting.waiting == [] and graphs._first is None
    assert any("without CUDA graphs: batch size 8: capturing it failed" in r.message and r.levelname == "WARNING"
               for r in caplog.records)
    caplog.clear()
    graphs, captured = _graphs([1, 2, 4, 8], monkeypatch)  # a decode backend that cannot be captured
    graphs.dispatcher = SimpleNamespace(graph_unsupported_reason=lambda: "torch is not capture-safe")
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        assert [_step(graphs, n) for n in (8, 1)] == [None, None] and captured == [] and graphs._waiting.waiting == []
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "hf_paged: decode runs without CUDA graphs: batch size 8: torch is not capture-safe")]


def test_first_use_captures_the_smallest_and_largest_at_start_and_each_other_size_at_its_first_step(monkeypatch):
    """``cuda_graph_capture="first_use"`` (an engine that serves many calls): no step pads past a size it would use
    more than once; a size never used is never captured."""
    assert graph_sizes.start_sizes([1, 2, 4, 8, 16], "first_use") == [1, 16]
    assert graph_sizes.start_sizes([1, 2, 4, 8, 16], "on_demand") == []
    assert graph_sizes.start_sizes([1, 2, 4, 8, 16], "start") == [1, 2, 4, 8, 16]
    assert graph_sizes.start_sizes([8], "first_use") == [8]
    graphs, captured = _graphs([1, 2, 4, 8, 16], monkeypatch, capture="first_use")
    assert graphs.sizes == [1, 16] and _step(graphs, 1) == 1 and captured == []
    assert _step(graphs, 3) == 4 and captured == [4]  # its first step captures it and runs in it
    assert [_step(graphs, n) for n in (3, 4, 16, 1)] == [4, 4, 16, 1] and captured == [4]
    assert _step(graphs, 2) == 2 and captured == [4, 2] and graphs._waiting.waiting == [8]
    sizes = OnDemandSizes([2, 4], first_use=True)
    assert sizes.due(3, 8) == 4 and sizes.due(3, 8) is None and sizes.waiting == [2]


def test_a_failed_capture_ends_on_demand_capture_and_the_captured_graphs_serve(monkeypatch, caplog):
    graphs, captured = _graphs([1, 2, 8], monkeypatch, fail={2})
    k = graph_sizes.ON_DEMAND_STEPS
    assert [_step(graphs, 2) for _ in range(k + 5)] == [8] * (k + 5)
    assert [_step(graphs, 1) for _ in range(k + 5)] == [8] * (k + 5)  # 1 is not tried either
    assert captured == [8] and graphs._waiting.waiting == [] and graphs.sizes == [8]
    assert any("batch size 2" in r.message and "failed" in r.message and "no more" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("sizes", [[1], [5]])
def test_one_size_waits_for_nothing(sizes, monkeypatch):
    graphs, captured = _graphs(sizes, monkeypatch)
    assert [_step(graphs, 1) for _ in range(3)] == sizes * 3 and captured == sizes  # captured once, at its first step


def test_graph_memory_counts_the_pools_segments_only(monkeypatch):
    """The graphs' memory is their pool's segments on their device (intermediates included), not the difference of
    live bytes (which the warm-up's frees could make negative); without pool ids in the snapshot: None."""
    pool = (0, 7)
    segments = [
        {"device": 0, "total_size": 2 << 20, "segment_pool_id": (0, 7)},
        {"device": 0, "total_size": 6 << 20, "segment_pool_id": [0, 7]},  # ids may come back as a list
        {"device": 0, "total_size": 100 << 20, "segment_pool_id": (0, 0)},  # the default pool
        {"device": 1, "total_size": 50 << 20, "segment_pool_id": (0, 7)},  # another device
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert cuda_graphs.pool_bytes(torch.device("cuda", 0), pool) == 8 << 20
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [{"device": 0, "total_size": 1}])
    assert cuda_graphs.pool_bytes(torch.device("cuda", 0), pool) is None
