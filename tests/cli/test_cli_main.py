"""The ``hf-paged`` entry point: ``--version``, ``python -m hf_paged``, defaults in ``--help`` (the engine's own)."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import hf_paged
from hf_paged.cache._kv_pool import CPU_MEMORY_SHARE, DEFAULT_MEMORY_BUDGET
from hf_paged.cli import build_parser, main
from hf_paged.cli._generate import engine_settings

ROOT = pathlib.Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def python_m_hf_paged(*argv: str, python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, *python_flags, "-m", "hf_paged", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_version_is_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"hf-paged {VERSION}\n"
    assert hf_paged.__version__ == VERSION == importlib.metadata.version("hf-paged")


def test_python_m_hf_paged_shows_help_with_defaults():
    run = python_m_hf_paged("generate", "--help")
    assert run.returncode == 0 and run.stderr == ""
    help_text = " ".join(run.stdout.split())
    assert help_text.startswith("usage: python -m hf_paged generate ")
    engine_defaults = inspect.signature(hf_paged.Engine).parameters
    for flag, default in [("--num-blocks", 0), ("--block-size", engine_defaults["block_size"].default),
                          ("--max-new-tokens", 32), ("--top-p", 1.0), ("--temperature", 0.0)]:
        assert re.search(rf"{flag} \w+ [^-]*\(default: {default}\)", help_text), flag
    # automatic, which the flags' help says
    assert engine_defaults["max_batch_tokens"].default is None and engine_defaults["memory_budget"].default is None
    assert re.search(r"--max-batch-tokens N [^(]*\(prefill chunks and decodes together; default: automatic", help_text)
    assert re.search(rf"--memory-budget F [^(]*\(default: {DEFAULT_MEMORY_BUDGET} of free memory, and on a CPU at "
                     rf"most {CPU_MEMORY_SHARE} of all its RAM\)", help_text)
    assert "exit status:" in help_text and "--verbose adds the traceback" in help_text


def test_python_m_hf_paged_reports_bad_input_in_one_line():
    run = python_m_hf_paged("generate", "--model", "/no/such/checkpoint")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == ("python -m hf_paged generate: error: argument --model: no such directory "
                          "'/no/such/checkpoint'; give a local checkpoint directory "
                          "(see 'python -m hf_paged generate --help')\n")


@pytest.mark.slow
def test_output_closed_early_ends_quietly():
    """``hf-paged generate ... | head -1``: it reported an "unexpected BrokenPipeError" (status 1)."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    argv = ["generate", "--model", "tiny", "--num-prompts", "1500", "--max-new-tokens", "1", "--show", "1500",
            "--no-progress", "--device", "cpu"]  # (more output than a pipe buffers)
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=env)
    assert proc.stdout.readline() == b"> What is the capital of France?\n"
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and err == b""


@pytest.mark.parametrize("name", ["num_blocks", "block_size", "max_batch_tokens", "memory_budget", "backend",
                                  "kv_cache_dtype", "compile_layers"])
def test_engine_sizes_default_to_the_engines_own(name):
    """Every engine flag's default is the Engine's, and so is what the command line passes on (``--num-blocks 0``
    is the flag's spelling of None: sized from free memory)."""
    args = build_parser().parse_args(["generate"])
    engine_default = inspect.signature(hf_paged.Engine).parameters[name].default
    assert engine_settings(args)[name] == engine_default
    assert getattr(args, name) == (0 if name == "num_blocks" else engine_default)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_compile_layers_flag_spells_the_engines_values(command, capsys):
    parser = build_parser()
    for text, value in (("auto", None), ("on", True), ("off", False)):
        assert engine_settings(parser.parse_args([command, "--compile-layers", text]))["compile_layers"] == value
    for removed in ("yes", "background"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--compile-layers", removed])
        assert f"expected auto, on or off, got '{removed}'" in capsys.readouterr().err


def test_every_command_help_exits_0(capsys):
    for argv in (["--help"], ["generate", "--help"], ["build-kernels", "--help"], ["bench", "kernels", "--help"]):
        assert main(argv) == 0
        assert capsys.readouterr().out.startswith("usage: hf-paged")


def modules_imported(*argv: str) -> set[str]:
    """The modules ``python -m hf_paged ARGV`` imports, read from ``-X importtime``."""
    run = python_m_hf_paged(*argv, python_flags=("-X", "importtime"))
    assert run.returncode in (0, 2), run.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("argv", [("--help",), ("generate", "--help"), ("serve", "--help"), ("generate", "--bogus"),
                                  ("generate", "--max-new-tokens", "0"), ("serve", "--backend", "cuda,nope"),
                                  ("generate", "--device", "cpu", "--top-p", "2")])
def test_help_and_argument_errors_come_before_torch_is_imported(argv):
    """Issue 60: ``--help`` and every argparse error answer at once (torch and transformers take seconds)."""
    imported = modules_imported(*argv)
    assert "argparse" in imported  # (the reader sees the imports)
    assert "torch" not in imported and "transformers" not in imported
