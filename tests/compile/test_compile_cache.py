"""``CompileArtifacts`` (``compile/_cache.py``): the file is named by everything that decides the compiled code, and a
broken file or torch's caches switched off cost nothing but the cache. That a later process with empty torch caches
loads what the first compiled is tested on the engine: ``tests/compile/test_compiled_layers_second_process.py``."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_paged.compile import _cache as compile_cache
from hf_paged.compile._cache import CompileArtifacts, artifact_key


def test_with_torchs_caches_switched_off_nothing_is_loaded_or_saved(tmp_path, monkeypatch):
    """``TORCHINDUCTOR_FORCE_DISABLE_CACHES`` (read through ``_compat.compile_caches_disabled``): a saved bundle is not
    handed to torch, and nothing is written. (A second process that loads what the first saved, instead of compiling:
    ``tests/compile/test_compiled_layers_second_process.py``.)"""
    artifacts = CompileArtifacts("k", tmp_path)
    artifacts.path.write_bytes(b"a bundle")
    loaded = []

    def load(data: bytes) -> SimpleNamespace:
        loaded.append(data)
        return SimpleNamespace(artifacts={"inductor": ["b"]})

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts",
                        lambda: (b"new", SimpleNamespace(artifacts={"inductor": ["a"]})))
    monkeypatch.setattr(compile_cache._compat, "compile_caches_disabled", lambda: True)
    assert artifacts.load() is False and not artifacts.loaded and loaded == []
    assert artifacts.save() is False and artifacts.path.read_bytes() == b"a bundle"
    monkeypatch.setattr(compile_cache._compat, "compile_caches_disabled", lambda: False)  # switched on: both act
    assert artifacts.load() is True and loaded == [b"a bundle"]
    assert artifacts.save() is True and artifacts.path.read_bytes() == b"new"


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
