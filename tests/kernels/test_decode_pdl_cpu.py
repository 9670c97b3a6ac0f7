"""Decode with programmatic dependent launch, without a GPU: from compute capability 9.0 on, the benchmark's
``ours-bs16`` row is the default (PDL) launch and ``ours-nopdl-bs16`` the same decode with ``pdl=False``; the op
takes the choice as an argument, on by default. The kernels are tested on a GPU by
tests/gpu/kernels/test_decode_pdl_gpu.py."""

from __future__ import annotations

import pytest
import torch

from hf_paged import kernels
from hf_paged.bench import _kernels as decode_bench


def one_set() -> dict:
    caches = ("query", "k16", "v16", "k256", "v256", "t256", "k16_fp8", "v16_fp8", "k_scale", "v_scale")
    return {name: None for name in caches} | {"seq_lens": torch.ones(1, dtype=torch.int32),
                                              "t16": torch.zeros(1, 1, dtype=torch.int32)}


@pytest.mark.parametrize(("capability", "present"), [((9, 0), True), ((10, 0), True), ((8, 9), False)])
def test_bench_times_the_launch_without_pdl_from_hopper_on(monkeypatch, capability, present: bool):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(decode_bench, "build_metadata", lambda **_: None)  # the torch row's metadata needs a GPU
    rows = decode_bench.contenders([one_set()], 8192, 128)
    assert ("ours-nopdl-bs16" in rows) == present
    assert "ours-pdl-bs16" not in rows  # PDL is the default launch: ours-bs16


def test_the_nopdl_row_passes_pdl_false_and_the_default_row_passes_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(decode_bench, "build_metadata", lambda **_: None)
    seen = []
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: seen.append(k.get("pdl", "default")))
    rows = decode_bench.contenders([one_set()], 8192, 128)
    rows["ours-nopdl-bs16"][0]()
    rows["ours-bs16"][0]()
    assert seen == [False, "default"]


def test_the_op_takes_pdl_as_an_argument_on_by_default():
    """The schema the C++ op registers (csrc/ops.cpp): ``pdl`` last, a bool defaulting to true, and the Python
    wrapper passes its own ``pdl`` (default True) through."""
    import inspect

    from hf_paged.kernels import _build as build

    text = (build.CSRC / "ops.cpp").read_text()
    schema = text.split('m.def("paged_decode(', 1)[1].split(");", 1)[0]
    assert "Tensor? v_scale=None, bool pdl=True) " in schema.replace('"\n        "', "")
    assert inspect.signature(kernels.paged_decode).parameters["pdl"].default is True
