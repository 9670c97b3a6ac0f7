"""Packaging: every package under hf_paged/ is listed in pyproject.toml, so a non-editable install ships it, and
``hf_paged.integrations`` imports the same way from a bare checkout and from an installed package."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Run in a fresh interpreter with only the standard import machinery (no editable-install finder), so the import
# is served by sys.path alone; prints where the adapter came from.
IMPORT_CHECK = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("_frozen_importlib")]
import hf_paged
assert "hf_paged.integrations" not in sys.modules, "import hf_paged must not load its integrations"
from hf_paged.integrations.accelerate import distributed_generate_batch, paged_cache_for
import hf_paged.integrations.accelerate as adapter
print(adapter.__file__)
"""


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "hf_paged").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {found - listed}"
    assert "hf_paged.integrations" in listed
    assert not (ROOT / "integrations" / "__init__.py").exists(), "integrations/ must not become a top-level package"
    assert (ROOT / "integrations" / "README.md").exists()


def _import_from(path: pathlib.Path, cwd: pathlib.Path) -> pathlib.Path:
    env = {**os.environ, "PYTHONPATH": str(path)}
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return pathlib.Path(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_integrations_import_from_a_checkout(tmp_path):
    where = _import_from(ROOT, cwd=tmp_path)
    assert where == ROOT / "hf_paged" / "integrations" / "accelerate.py"


@pytest.mark.slow
def test_integrations_import_from_an_installed_package(tmp_path):
    source, site = tmp_path / "source", tmp_path / "site"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "hf_paged", source / "hf_paged", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
           "--target", str(site), str(source)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    top_level = {p.name for p in site.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin"}
    assert top_level == {"hf_paged"}, f"the install adds top-level names besides hf_paged: {top_level}"
    where = _import_from(site, cwd=tmp_path)
    assert where == site / "hf_paged" / "integrations" / "accelerate.py"
