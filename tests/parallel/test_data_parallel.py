"""Data parallel's process-group side (``hf_paged.parallel._data_parallel``) on a gloo group of one process: the share
runner gets its items and their indices, the results are merged, and a failure comes back as the same error naming
the rank and the call. ``distributed_generate_batch`` over two processes is tested in
tests/integrations/test_integrations_data_parallel.py."""

from __future__ import annotations

import pytest

from hf_paged.parallel import _data_parallel as data_parallel


def test_a_process_alone_without_a_launcher_is_a_group_of_one(monkeypatch):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is up in this process already")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert data_parallel.process_group() == (1, 0)
    assert not dist.is_initialized()


def test_the_share_runs_and_every_result_comes_back(single_process_group):
    calls = []

    def run(items, indices):
        calls.append((items, indices))
        return {f"req_{i}": item.upper() for item, i in zip(items, indices, strict=True)}

    results = data_parallel.run_shares(1, 0, lambda: (["a", "b", "c"], [3, 1, 2]), run, "the call")
    assert calls == [(["a", "b", "c"], [0, 1, 2])]
    assert results == {"req_0": "A", "req_1": "B", "req_2": "C"}


class _Unkept(Exception):
    pass


@pytest.mark.parametrize(("error", "kind"), [(ValueError("bad prompt"), ValueError), (_Unkept("odd"), RuntimeError)])
def test_a_failure_is_raised_as_a_kind_every_process_has_naming_the_rank(single_process_group, error, kind):
    def workload():
        raise error

    with pytest.raises(kind) as raised:
        data_parallel.run_shares(1, 0, workload, lambda items, indices: {}, "the call")
    assert type(raised.value) is kind
    assert str(raised.value) == f"the call failed on rank 0 of 1: {type(error).__name__}: {error}"
    assert raised.value.__cause__ is error
