"""Every package under hf_paged/ is listed in pyproject.toml, so a non-editable install ships it."""

from __future__ import annotations

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "hf_paged").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {found - listed}"
    assert "hf_paged.integrations" in listed and (ROOT / "integrations" / "__init__.py").exists()
