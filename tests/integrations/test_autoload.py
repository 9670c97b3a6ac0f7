"""``hf_paged_autoload``: the startup file that registers ``"hf_paged"`` in programs that never import hf_paged.

Each case starts a fresh interpreter whose site folder (one of the test's own) holds the file ``enable`` writes:
Python's start imports hf_paged's light top but neither torch nor transformers; importing transformers' model code
registers the implementation; a broken hf_paged costs one warning, never the program; the file's line does nothing
once the module is gone.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _autoload():
    spec = importlib.util.spec_from_file_location("hf_paged_autoload", ROOT / "hf_paged_autoload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def site(tmp_path, capsys):
    """A site folder holding the startup file, written by ``enable`` (and removed by ``disable``)."""
    autoload = _autoload()
    folder = tmp_path / "site"
    folder.mkdir()
    autoload._pth_path = lambda: str(folder / autoload.PTH_NAME)
    assert autoload.main(["status"]) == 0 and capsys.readouterr().out.startswith("disabled")
    assert autoload.main(["enable"]) == 0 and (folder / autoload.PTH_NAME).exists()
    assert autoload.main(["status"]) == 0 and capsys.readouterr().out.splitlines()[-1].startswith("enabled")
    yield folder
    assert autoload.main(["disable"]) == 0 and not (folder / autoload.PTH_NAME).exists()


def _python(site: Path, code: str, *paths: Path) -> subprocess.CompletedProcess:
    start = f"import site, sys; site.addsitedir({str(site)!r}); "
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths)}
    return subprocess.run([sys.executable, "-c", start + code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=site)  # not the checkout: its hf_paged would come first on the path


@pytest.mark.slow
def test_start_is_light_and_transformers_model_code_registers_hf_paged(site):
    code = ("print('torch' in sys.modules, 'transformers' in sys.modules, 'hf_paged' in sys.modules); "
            "from transformers import AutoModelForCausalLM; "
            "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS; "
            "print('hf_paged' in ALL_ATTENTION_FUNCTIONS.valid_keys())")
    run = _python(site, code, ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "False", "True", "True"]


@pytest.mark.slow
def test_a_broken_hf_paged_costs_a_warning_not_the_program(site, tmp_path):
    broken = tmp_path / "broken"
    (broken / "hf_paged").mkdir(parents=True)
    (broken / "hf_paged" / "__init__.py").write_text("raise RuntimeError('deliberately broken')\n")
    code = ("import transformers.modeling_utils as m; "
            "print('hf_paged' in m.ALL_ATTENTION_FUNCTIONS.valid_keys())")
    run = _python(site, code, broken, ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"]
    assert "hf_paged_autoload: importing hf_paged failed (RuntimeError: deliberately broken)" in run.stderr


def test_the_startup_line_does_nothing_once_the_module_is_gone(site):
    """Without hf_paged_autoload on the path (uninstalled without ``disable``; ``-S``: not even this environment's
    site-packages), the file's line runs silently."""
    code = f"import site, sys; site.addsitedir({str(site)!r}); print('started', 'hf_paged_autoload' in sys.modules)"
    run = subprocess.run([sys.executable, "-S", "-c", code],
                         env={**os.environ, "PYTHONPATH": ""}, capture_output=True, text=True, timeout=120,
                         cwd=site)
    assert run.returncode == 0 and run.stdout.split() == ["started", "False"] and run.stderr == ""
