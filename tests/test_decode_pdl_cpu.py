"""Decode with programmatic dependent launch, without a GPU: from compute capability 9.0 on, the benchmark's
``ours-bs16`` row is the default (PDL) launch and ``ours-nopdl-bs16`` the same decode with ``HF_PAGED_DECODE_PDL=0``
set just for its own calls. The kernels are tested on a GPU by tests/gpu/test_decode_pdl_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from hf_paged import kernels
from hf_paged.bench import _kernels as decode_bench


def one_set() -> dict:
    return {"query": None, "k16": None, "v16": None, "seq_lens": torch.ones(1, dtype=torch.int32),
            "t16": torch.zeros(1, 1, dtype=torch.int32)}


@pytest.mark.parametrize(("capability", "present"), [((9, 0), True), ((10, 0), True), ((8, 9), False)])
def test_bench_times_the_launch_without_pdl_from_hopper_on(monkeypatch, capability, present: bool):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(decode_bench, "build_metadata", lambda **_: None)  # the torch row's metadata needs a GPU
    rows = decode_bench.contenders([one_set()], 8192, 128)
    assert ("ours-nopdl-bs16" in rows) == present
    assert ("ours-cluster-bs16" in rows) == present  # thread-block clusters: Hopper on too
    assert "ours-pdl-bs16" not in rows  # PDL is the default launch: ours-bs16


def test_the_nopdl_row_turns_pdl_off_only_around_its_call(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(decode_bench, "build_metadata", lambda **_: None)
    seen = []
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: seen.append(os.environ.get(decode_bench.PDL_ENV)))
    monkeypatch.delenv(decode_bench.PDL_ENV, raising=False)
    rows = decode_bench.contenders([one_set()], 8192, 128)
    rows["ours-nopdl-bs16"][0]()
    rows["ours-bs16"][0]()
    assert seen == ["0", None] and decode_bench.PDL_ENV not in os.environ


def test_with_env_restores_the_switch_when_the_call_fails(monkeypatch):
    monkeypatch.setenv(decode_bench.PDL_ENV, "1")

    def fails():
        raise RuntimeError("launch failed")

    with pytest.raises(RuntimeError):
        decode_bench.with_env(decode_bench.PDL_ENV, "0", fails)()
    assert os.environ[decode_bench.PDL_ENV] == "1"
