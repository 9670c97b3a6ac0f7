"""The package's ``HF_PAGED_*`` switches are read in one place, ``hf_paged/envs.py``, and documented there and in
``docs/guides/configuration.md``: no other module reads the environment for one, the C++ kernels read no environment
at all (a choice they need comes as an argument of the op), and ``envs.VARIABLES``, envs.py's docstring table and the
guide's table (generated from that docstring by ``docs/tables.py``) list the same variables. The scans are checked on planted violations too, so that a scan that finds nothing cannot pass."""

from __future__ import annotations

import re
from pathlib import Path

from hf_paged import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_paged"
ENVS = PACKAGE / "envs.py"
CSRC = PACKAGE / "csrc"

# os.environ / os.getenv / os.putenv in any spelling a module might use (``from os import environ`` included)
PYTHON_ENVIRON = re.compile(r"\bos\s*\.\s*(?:environ|getenv|putenv|unsetenv)\b|\bfrom\s+os\s+import\b[^\n]*"
                            r"\b(?:environ|getenv)\b")
SWITCH_NAME = re.compile(r"HF_PAGED_\w*")
CPP_GETENV = re.compile(r"\b\w*getenv\b")  # getenv, std::getenv, secure_getenv, ...
CPP_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")


def python_readers(package: Path, allowed: Path) -> list[str]:
    """The Python files under ``package`` other than ``allowed`` that touch the environment and name an
    ``HF_PAGED_`` variable (a constant defined in the file and read through ``os.environ`` counts)."""
    return sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                  if path != allowed and PYTHON_ENVIRON.search(text := path.read_text()) and SWITCH_NAME.search(text))


def cpp_readers(csrc: Path) -> list[str]:
    """The C++ / CUDA sources under ``csrc`` that mention getenv."""
    return sorted(str(path.relative_to(csrc)) for path in csrc.rglob("*")
                  if path.suffix in CPP_SUFFIXES and CPP_GETENV.search(path.read_text()))


def docstring_variables() -> list[str]:
    """The variables of envs.py's docstring table, in order."""
    return re.findall(r"^``(HF_PAGED_[A-Z0-9_]+)``", envs.__doc__, flags=re.MULTILINE)


def guide_variables() -> list[str]:
    """The variables of the configuration guide's "Environment switches" table, in order."""
    text = (ROOT / "docs" / "guides" / "configuration.md").read_text()
    text = text.split("## Environment switches", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(HF_PAGED_[A-Z0-9_]+)` \|", text, flags=re.MULTILINE)


def test_only_envs_reads_the_environment_for_a_switch():
    assert python_readers(PACKAGE, ENVS) == [], "read a switch in hf_paged/envs.py instead"


def test_the_kernels_read_no_environment():
    assert any(CSRC.glob("*.cu")) and any(CSRC.glob("*.cpp"))  # the scan looks where the sources are
    assert cpp_readers(CSRC) == [], "pass the choice to the op as an argument instead"


def test_envs_reads_exactly_the_variables_its_docstring_and_the_guide_list():
    assert len(set(envs.VARIABLES)) == len(envs.VARIABLES)
    assert docstring_variables() == list(envs.VARIABLES)
    assert guide_variables() == list(envs.VARIABLES)
    # and envs.py names no HF_PAGED_ variable outside that list (a read without a VARIABLES entry)
    named = set(re.findall(r"""["'](HF_PAGED_[A-Z0-9_]+)["']""", ENVS.read_text()))
    assert named == set(envs.VARIABLES)


def test_the_scans_find_planted_reads(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    allowed = package / "envs.py"
    allowed.write_text('import os\nNAME = "HF_PAGED_X"\nos.environ.get(NAME)\n')
    (package / "quiet.py").write_text('import os\nos.environ.get("WORLD_SIZE")  # not a switch\n')
    (package / "docs_only.py").write_text('"""``HF_PAGED_X=1`` is read by envs."""\n')
    assert python_readers(package, allowed) == []
    for name, text in {"direct.py": 'import os\nos.environ.get("HF_PAGED_X")\n',
                       "sub/constant.py": 'import os\nSWITCH = "HF_PAGED_Y"\n\nvalue = os.environ[SWITCH]\n',
                       "getenv.py": 'import os\nos.getenv("HF_PAGED_Z", "1")\n',
                       "imported.py": 'from os import environ\nenviron.get("HF_PAGED_W")\n'}.items():
        (package / name).write_text(text)
    assert python_readers(package, allowed) == ["direct.py", "getenv.py", "imported.py", "sub/constant.py"]

    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "plain.cu").write_text("// reads nothing\n__global__ void k() {}\n")
    assert cpp_readers(csrc) == []
    (csrc / "launch.cpp").write_text('#include <cstdlib>\nbool on() { return std::getenv("ANYTHING"); }\n')
    (csrc / "kernel.cuh").write_text('const char* v = getenv("HF_PAGED_X");\n')
    assert cpp_readers(csrc) == ["kernel.cuh", "launch.cpp"]
