"""``CompileArtifacts`` (``compile/_cache.py``): what one process compiles, a later process with empty torch caches
finds (inductor's FX graph cache hits instead of misses); the file is named by everything that decides the compiled
code, and a broken file or torch's caches switched off cost nothing but the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_paged.compile import _cache as compile_cache
from hf_paged.compile._cache import CompileArtifacts, artifact_key

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
import torch
from torch._dynamo.utils import counters
from hf_paged.compile._cache import CompileArtifacts
artifacts = CompileArtifacts("probe", Path(sys.argv[1]))
loaded = artifacts.load()
torch.compile(lambda x: torch.sin(x) * 3 + 1)(torch.ones(8))
saved = artifacts.save()
print(json.dumps({"loaded": loaded, "saved": saved, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def _process(tmp_path: Path, torch_cache: str, **env) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "artifacts")], capture_output=True, text=True,
                         cwd=ROOT, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                     "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / torch_cache), **env})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_with_empty_torch_caches_finds_what_the_first_compiled(tmp_path):
    first = _process(tmp_path, "torch_a")
    assert first == {"loaded": False, "saved": True, "hit": 0, "miss": 1}
    second = _process(tmp_path, "torch_b")  # a fresh torch cache: only hf_paged's file holds the graph
    assert second == {"loaded": True, "saved": False, "hit": 1, "miss": 0}  # nothing new to save either
    off = _process(tmp_path, "torch_c", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    assert off == {"loaded": False, "saved": False, "hit": 0, "miss": 0}


def _tiny(**overrides) -> LlamaForCausalLM:
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    config = LlamaConfig(**{**shape, **overrides})
    return LlamaForCausalLM(config)


def test_the_key_names_the_model_the_dtype_the_settings_and_the_versions(monkeypatch):
    model = _tiny()
    key = artifact_key(model, {"pass": "a"})
    assert key == artifact_key(_tiny(), {"pass": "a"})  # the same model and settings: the same file
    assert key != artifact_key(_tiny(num_hidden_layers=2), {"pass": "a"})
    assert key != artifact_key(model.to(torch.bfloat16), {"pass": "a"})
    assert key != artifact_key(_tiny(), {"pass": "b"})
    monkeypatch.setattr(compile_cache, "__version__", "0.0.0-other")
    assert key != artifact_key(_tiny(), {"pass": "a"})


def test_a_broken_file_is_skipped_and_an_unchanged_bundle_not_rewritten(tmp_path, monkeypatch):
    artifacts = CompileArtifacts("k", tmp_path)
    artifacts.path.write_bytes(b"not a bundle")
    assert artifacts.load() is False and not artifacts.loaded
    info = lambda *keys: SimpleNamespace(artifacts={"inductor": list(keys)})  # noqa: E731
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"bundle", info("a")))
    assert artifacts.save() is True and artifacts.path.read_bytes() == b"bundle"
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"other bytes", info("a")))
    assert artifacts.save() is False  # the same artifacts: no write
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"more", info("a", "b")))
    assert artifacts.save() is True and artifacts.path.read_bytes() == b"more"
    assert [p.name for p in tmp_path.iterdir()] == ["k.bin"]  # no temporary file left behind
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)  # nothing compiled
    assert CompileArtifacts("other", tmp_path).save() is False
