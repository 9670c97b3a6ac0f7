"""``hf_paged.compile_config()``'s backend: inductor's code replayed from one CUDA graph per compiled graph.

On the CPU the capture is replaced by a stand-in with a graph's semantics: capturing records the call and the
tensors it was given; a replay runs it again on those same tensors and writes the results into the outputs made at
capture. A replay that read an input from anywhere but the buffer filled for it, or a static input copied instead
of used in place, gives wrong results here as it would on a GPU. The compiler is dynamo's graph as it is (no
inductor), so the oracle, eager hf_paged's ``generate``, does the same arithmetic.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from tiny_models import PAD, left_padded_batch, make_models

import hf_paged
from hf_paged.hf.compat import with_cache
from hf_paged.hf.graphed_compile import GraphedCall, GraphedInductor, compile_config


class FakeCapture:
    """Graph semantics on the CPU: capturing runs nothing (its writes are undone); ``replay`` reruns the captured
    call on the captured tensors and writes the outputs made at capture."""

    def __init__(self, fail: bool = False):
        self.fail, self.captures, self.replays = fail, 0, 0

    def __call__(self, run, inputs, device):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        saved = [(t, t.clone()) for t in inputs if isinstance(t, torch.Tensor)]
        outputs = run(inputs)  # for the outputs' tensors; a capture runs nothing, so its writes are undone
        for t, before in saved:
            t.copy_(before)

        def replay():
            self.replays += 1
            for out, new in zip(_flat(outputs), _flat(run(inputs))):
                out.copy_(new)

        return replay, outputs


def _flat(outputs) -> list[torch.Tensor]:
    return [t for t in (outputs if isinstance(outputs, (list, tuple)) else [outputs]) if isinstance(t, torch.Tensor)]


def step(args):
    """A compiled step's shape: dynamic ids times a static weight, plus a static buffer it also writes."""
    ids, weight, pool = args[0], args[1], args[2]
    out = ids.float() @ weight + pool.sum()
    pool.add_(1.0)  # an in-place write to a static input: it must land in the caller's tensor
    return (out,)


def make_call(capture):
    weight = torch.nn.Parameter(torch.randn(3, 2), requires_grad=False)
    pool = torch.zeros(4)
    torch._dynamo.mark_static_address(pool)
    ids = torch.tensor([[1, 2, 0]])
    return GraphedCall(step, [ids, weight, pool], torch.device("cpu"), capture), weight, pool


def test_warms_up_then_captures_once_and_replays_with_each_calls_inputs():
    capture = FakeCapture()
    call, weight, pool = make_call(capture)
    assert call.copied_index == [0] and call.static_index == [1, 2]
    for n in range(5):
        ids = torch.randint(0, 5, (1, 3))  # a new tensor at a new address every step
        before = pool.sum().item()
        (got,) = call(ids, weight, pool)
        torch.testing.assert_close(got, ids.float() @ weight + before)
        assert pool.sum().item() == before + 4, f"call {n}: the step's write reached the caller's pool"
    assert capture.captures == 1 and capture.replays == 4, "the first call runs uncaptured, then one capture"


def test_outputs_are_copies_a_later_replay_does_not_change():
    call, weight, pool = make_call(FakeCapture())
    call(torch.ones(1, 3, dtype=torch.long), weight, pool)
    (first,) = call(torch.ones(1, 3, dtype=torch.long), weight, pool)
    kept = first.clone()
    call(torch.full((1, 3), 4), weight, pool)
    assert torch.equal(first, kept)


def test_a_moved_static_input_or_a_new_shape_captures_again():
    capture = FakeCapture()
    call, weight, pool = make_call(capture)
    ids = torch.ones(1, 3, dtype=torch.long)
    call(ids, weight, pool), call(ids, weight, pool)
    other = torch.nn.Parameter(torch.randn(3, 2), requires_grad=False)  # the same shape at another address
    (got,) = call(ids, other, pool)
    torch.testing.assert_close(got, ids.float() @ other + pool.sum() - 4)
    assert capture.captures == 2
    wide = torch.ones(2, 3, dtype=torch.long)
    (got,) = call(wide, other, pool)
    assert got.shape == (2, 2) and capture.captures == 3


def test_a_failed_capture_warns_once_and_runs_uncaptured(caplog):
    call, weight, pool = make_call(FakeCapture(fail=True))
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        for _ in range(4):
            ids = torch.randint(0, 5, (1, 3))
            before = pool.sum().item()
            torch.testing.assert_close(call(ids, weight, pool)[0], ids.float() @ weight + before)
    assert "capture failed" in call.failure
    assert sum("without its CUDA graph" in r.message for r in caplog.records) == 1


def test_inputs_that_move_every_step_stop_being_captured():
    capture = FakeCapture()
    call, weight, pool = make_call(capture)
    ids = torch.ones(1, 3, dtype=torch.long)
    for _ in range(12):
        weight = torch.nn.Parameter(torch.randn(3, 2), requires_grad=False)
        before = pool.sum().item()
        torch.testing.assert_close(call(ids, weight, pool)[0], ids.float() @ weight + before)
    assert capture.captures == 8 and "moved" in call.failure


def test_compile_config_keeps_one_backend_through_generates_deep_copy():
    config = compile_config()
    assert config.mode is None and config.dynamic is False
    assert copy.deepcopy(config) == config and copy.deepcopy(config).backend is config.backend
    with pytest.raises(ValueError, match="captures CUDA graphs itself"):
        compile_config(inductor_options={"triton.cudagraphs": True})


@pytest.mark.parametrize("rows", [1, 3])
def test_generate_through_the_backend_gives_eager_tokens_across_calls_and_caches(rows: int):
    """Two calls on one cache (one capture serves both), then a new cache of the same shape (the pool moved:
    captured again), each giving eager hf_paged's tokens. A replay reading stale ids or positions, or writing the
    KV into a copy of the pool, changes the tokens."""
    torch._dynamo.reset()
    _, paged = make_models("llama_gqa", seed=5)
    gen = torch.Generator().manual_seed(5)
    batch = left_padded_batch(torch.randint(3, 20, (rows,), generator=gen).tolist(), gen)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    want = paged.generate(**with_cache(paged, hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4),
                                       **batch), **kwargs)
    capture = FakeCapture()
    backend = GraphedInductor(compiler=lambda gm, inputs: gm.forward, capture=capture, graph_devices=("cpu",))
    config = compile_config()
    config.backend, config._compile_all_devices = backend, True
    caches = [hf_paged.PagedAttentionCache(paged.config, num_blocks=64, block_size=4, max_new_tokens=10,
                                           compileable=True) for _ in range(2)]
    try:
        for cache in (caches[0], caches[0], caches[1]):
            got = paged.generate(**with_cache(paged, cache, **batch), compile_config=config, **kwargs)
            assert torch.equal(got, want)
    finally:
        torch._dynamo.reset()
    (graph,) = backend.graphs
    assert graph.failure is None and graph.captures == 2, "one capture per cache"
    assert capture.replays >= 3 * (kwargs["max_new_tokens"] - 1) - 1, "decode steps replayed"
    assert graph.copied_index and len(graph.static_index) > len(graph.copied_index)
