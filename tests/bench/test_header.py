"""``hf_paged.bench.run_header``: the commit is that of the checkout holding hf_paged's source, read by git there
(not in the current folder), ``+dirty`` when its files differ, None outside a checkout; the other fields are the
running versions."""

from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

import hf_paged
from hf_paged.bench import run_header, source_commit

pytestmark = pytest.mark.skipif(
    subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="needs git")


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True, text=True).stdout.strip()


def _repository(root: Path, text: str = "x = 1\n") -> Path:
    """A repository with a committed package folder ``pkg`` (its ``__init__.py`` holds ``text``); that folder."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(text)
    _git(root, "init", "-q")
    _git(root, "add", "pkg")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return root / "pkg"


def test_the_commit_is_that_of_the_checkout_holding_the_source(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_PAGED_COMMIT", raising=False)
    pkg = _repository(tmp_path / "project")
    other = _repository(tmp_path / "elsewhere", "y = 1\n")  # the current folder: another repository, another commit
    monkeypatch.chdir(other)
    assert source_commit(pkg) == _git(pkg, "rev-parse", "--short", "HEAD") != _git(other, "rev-parse", "--short",
                                                                                    "HEAD")
    (pkg / "__init__.py").write_text("x = 2\n")
    assert source_commit(pkg) == _git(pkg, "rev-parse", "--short", "HEAD") + "+dirty"


def test_a_source_that_git_does_not_track_has_no_commit(tmp_path, monkeypatch):
    """An installed copy inside some other repository (a venv in a checkout) is not that repository's code."""
    monkeypatch.delenv("HF_PAGED_COMMIT", raising=False)
    _repository(tmp_path / "project")
    installed = tmp_path / "project" / "venv" / "site-packages" / "hf_paged"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    assert source_commit(installed) is None
    outside = tmp_path / "plain" / "hf_paged"
    outside.mkdir(parents=True)
    (outside / "__init__.py").write_text("")
    assert source_commit(outside) is None


def test_hf_paged_commit_names_a_copied_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_COMMIT", "abc1234")
    assert source_commit(tmp_path) == "abc1234" == run_header("cpu")["hf_paged_commit"]


def test_the_header_names_what_runs(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_PAGED_COMMIT", raising=False)
    monkeypatch.chdir(tmp_path)
    header = run_header("cpu")
    assert header == {
        "card": f"CPU ({platform.machine()})", "host_cpu": header["host_cpu"], "torch": torch.__version__, "transformers": transformers.__version__,
        "hf_paged": hf_paged.__version__, "hf_paged_commit": source_commit(Path(hf_paged.__file__).parent),
        "flash_attn": header["flash_attn"], "python": platform.python_version(),
        "date": datetime.date.today().isoformat()}


def test_the_header_names_the_host_cpu_as_the_system_reports_it():
    with open("/proc/cpuinfo") as f:
        names = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
    assert run_header("cpu")["host_cpu"] in names
