"""Decode with programmatic dependent launch, without a GPU: the benchmark's ``ours-pdl-bs16`` row exists on
compute capability 9.0 and newer only, and sets ``HF_PAGED_DECODE_PDL`` just for its own calls. The kernels are
tested on a GPU by tests/gpu/test_decode_pdl_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from hf_paged.bench import kernels as decode_bench


@pytest.mark.parametrize(("capability", "present"), [((9, 0), True), ((10, 0), True), ((8, 9), False)])
def test_bench_times_the_pdl_row_from_hopper_on(monkeypatch, capability, present: bool):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(decode_bench, "build_metadata", lambda **_: None)  # the torch row's metadata needs a GPU
    one_set = {"seq_lens": torch.ones(1, dtype=torch.int32), "t16": torch.zeros(1, 1, dtype=torch.int32)}
    rows = decode_bench.contenders([one_set], 8192, 128)
    assert ("ours-pdl-bs16" in rows) == present
    assert ("ours-cluster-bs16" in rows) == present  # thread-block clusters: Hopper on too


def test_the_pdl_row_sets_the_switch_only_around_its_call(monkeypatch):
    monkeypatch.delenv(decode_bench.PDL_ENV, raising=False)
    seen = []
    call = decode_bench.with_env(decode_bench.PDL_ENV, "1", lambda: seen.append(os.environ.get(decode_bench.PDL_ENV)))
    call()
    assert seen == ["1"] and decode_bench.PDL_ENV not in os.environ
    monkeypatch.setenv(decode_bench.PDL_ENV, "0")

    def fails():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError):
        decode_bench.with_env(decode_bench.PDL_ENV, "1", fails)()
    assert os.environ[decode_bench.PDL_ENV] == "0"
