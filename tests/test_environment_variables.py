"""Every ``HF_PAGED_*`` environment variable the package reads is in the README's table, and every variable of the
table is read somewhere: a new switch cannot land undocumented, nor a removed one stay documented."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON_READ = re.compile(r"""["'](HF_PAGED_[A-Z0-9_]+)["']""")
CPP_READ = re.compile(r"""getenv\("(HF_PAGED_[A-Z0-9_]+)"\)""")


def read_variables() -> set[str]:
    found = set()
    for path in (ROOT / "hf_paged").rglob("*.py"):
        found |= set(PYTHON_READ.findall(path.read_text()))
    for pattern in ("*.cpp", "*.cu", "*.cuh"):
        for path in (ROOT / "hf_paged" / "csrc").glob(pattern):
            found |= set(CPP_READ.findall(path.read_text()))
    return found


def documented_variables() -> set[str]:
    text = (ROOT / "README.md").read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(HF_PAGED_[A-Z0-9_]+)` \|", text, flags=re.MULTILINE))


def test_the_readme_lists_every_variable_the_package_reads():
    read, documented = read_variables(), documented_variables()
    assert "HF_PAGED_BACKEND" in read and "HF_PAGED_DECODE_PDL" in read  # the scan finds Python and C++ reads
    assert read - documented == set(), "read but not in the README's table"
    assert documented - read == set(), "in the README's table but read nowhere"
