"""The helper process of ``compile_layers="background"`` (``runner/_background_compile.py``): an engine of the given
settings on a random-weight model of the given slim config runs a few short prompts (a prefill, then decode steps),
which compiles the layers into torch's on-disk caches; then the process exits.

    python -m hf_paged.engine._background_helper SPEC.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hf_paged.runner._background_compile import HELPER_BLOCKS
from hf_paged.engine._config import EngineConfig
from hf_paged.engine._generate_batch import generate_batch


def run(spec: dict) -> None:
    fields = dict(spec["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec["dtype"]),
                                             attn_implementation="hf_paged")
    model = model.to(spec["device"]).eval()
    vocab = config.get_text_config(decoder=True).vocab_size
    prompts = [[(3 + i) % vocab] * n for i, n in enumerate((5, 9, 17))]
    # (EngineConfig reads the JSON lists of graph sizes and backends as tuples)
    generate_batch(model, prompts, GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1),
                   EngineConfig(**spec["engine"], num_blocks=HELPER_BLOCKS, compile_layers=True))


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
