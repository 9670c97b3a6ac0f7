"""What ``import hf_paged`` and loading a model with ``attn_implementation="hf_paged"`` cost in imports: nothing
outside hf_paged's own modules beyond what transformers alone loads for the same model (the oracle: a fresh process
that loads it without hf_paged), and none of hf_paged's engine, runner, server or command line. The import and load
times follow from it (``benchmarks/e2e/cold_start_cpu.py`` measures them); this test holds without timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged.cli.default_model import tiny_llama

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys
WITH_HF_PAGED = {with_hf_paged}
if WITH_HF_PAGED:
    import hf_paged
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({folder!r}, attn_implementation="hf_paged" if WITH_HF_PAGED else "sdpa")
assert model.config._attn_implementation == ("hf_paged" if WITH_HF_PAGED else "sdpa")
print(json.dumps(sorted(sys.modules)))
"""

# hf_paged's parts that a model's load must leave alone: what the engine, a server or the command line needs
NOT_LOADED = ("hf_paged.engine", "hf_paged.runner", "hf_paged.server", "hf_paged.cli", "hf_paged.integrations",
              "hf_paged.bench", "fastapi", "uvicorn")


def _modules(folder: Path, with_hf_paged: bool) -> set[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = CHILD.format(with_hf_paged=with_hf_paged, folder=str(folder))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return set(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.mark.slow  # two fresh processes, each importing torch and transformers
def test_loading_a_model_with_hf_paged_imports_nothing_more_than_transformers_but_hf_paged(tmp_path):
    tiny_llama(seed=0, attn_implementation="eager").save_pretrained(tmp_path)
    theirs, ours = _modules(tmp_path, False), _modules(tmp_path, True)
    assert "hf_paged" not in theirs and "hf_paged.hf._register" in ours
    assert sorted(m for m in ours - theirs if m.split(".")[0] != "hf_paged") == []
    assert sorted(m for m in ours if m.startswith(NOT_LOADED)) == []
