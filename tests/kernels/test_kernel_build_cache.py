"""The kernels' build cache: a build folder whose library was built and loaded once is loaded directly by a later
process (no ninja run); a folder without the mark, or whose library fails to load, goes through the build."""

from __future__ import annotations

import pytest
import torch
from torch.utils import cpp_extension

from hf_paged.kernels import _build


@pytest.fixture
def calls(monkeypatch):
    seen = {"load_library": [], "build": []}
    monkeypatch.setattr(_build, "missing_requirement", lambda: None)  # nvcc and ninja "there"

    def load_library(path):
        seen["load_library"].append(path)
        if seen.get("fail_load"):
            raise OSError("invalid ELF header")

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen["build"].append(kw["build_directory"]))
    return seen


def test_a_marked_build_is_loaded_without_building(tmp_path, calls, monkeypatch):
    monkeypatch.setattr(_build, "missing_requirement", lambda: pytest.fail("probed the build tools"))
    (tmp_path / "hf_paged_kernels.so").write_bytes(b"\x7fELF")
    (tmp_path / _build.BUILT_MARKER).write_text("x")
    _build._load_or_build(tmp_path, "90a", False)
    assert calls["load_library"] == [str(tmp_path / "hf_paged_kernels.so")] and calls["build"] == []


def test_an_unmarked_folder_is_built_and_then_marked(tmp_path, calls):
    (tmp_path / "hf_paged_kernels.so").write_bytes(b"\x7fELF")  # a library from before the mark, or a cut build
    _build._load_or_build(tmp_path, "90a", False)
    assert calls["build"] == [str(tmp_path)] and calls["load_library"] == []
    assert (tmp_path / _build.BUILT_MARKER).is_file()
    _build._load_or_build(tmp_path, "90a", False)  # the next process loads it directly
    assert calls["build"] == [str(tmp_path)] and len(calls["load_library"]) == 1


def test_a_marked_library_that_fails_to_load_is_built_again(tmp_path, calls):
    (tmp_path / "hf_paged_kernels.so").write_bytes(b"damaged")
    (tmp_path / _build.BUILT_MARKER).write_text("x")
    calls["fail_load"] = True
    _build._load_or_build(tmp_path, "90a", False)
    assert len(calls["load_library"]) == 1  # tried first
    assert calls["build"] == [str(tmp_path)] and (tmp_path / _build.BUILT_MARKER).is_file()


def test_a_failed_build_leaves_no_mark(tmp_path, monkeypatch, calls):
    def fail(**kw):
        raise RuntimeError("nvcc: error")

    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(_build, "_failure", None)
    with pytest.raises(_build.KernelsUnavailable, match="nvcc: error"):
        _build._load_or_build(tmp_path, "90a", False)
    assert not (tmp_path / _build.BUILT_MARKER).exists()


def test_load_takes_a_marked_build_without_the_build_tools(tmp_path, monkeypatch, calls):
    """``load`` itself: a GPU and a marked build folder are all it needs (no nvcc/ninja probe, no build)."""
    monkeypatch.setattr(_build, "missing_device", lambda: None)
    monkeypatch.setattr(_build, "missing_requirement", lambda: pytest.fail("probed the build tools"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    monkeypatch.setattr(_build, "build_dir", lambda arch: tmp_path)
    for name, fresh in (("_failure", None), ("_warned", False), ("_folder", None)):
        monkeypatch.setattr(_build, name, fresh)  # (put back after the test)
    (tmp_path / "hf_paged_kernels.so").write_bytes(b"\x7fELF")
    (tmp_path / _build.BUILT_MARKER).write_text("x")
    assert _build.load() == tmp_path and _build.is_loaded()
    assert calls["load_library"] == [str(tmp_path / "hf_paged_kernels.so")] and calls["build"] == []
