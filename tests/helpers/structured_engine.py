"""What the structured-output admission tests share (tests/engine/test_structured_output.py and
tests/server/test_server_admission.py): a schema that is slow to compile, and a warm engine on the tiny model with
room for a request of many copies."""

from __future__ import annotations

from transformers import GenerationConfig

from hf_paged import Engine
from hf_paged.cli.default_model import load_model

#: A schema whose matcher takes tens of milliseconds to compile for the tiny model's tokenizer (one per copy of 128
#: would stall a step for seconds).
LARGE_SCHEMA = {"type": "object", "required": [f"field_{i}" for i in range(200)],
                "properties": {f"field_{i}": {"type": "string", "pattern": "^[a-z]{3,8}-[0-9]{2,5}$"}
                               for i in range(200)}}


def tiny_engine() -> Engine:
    """The tiny model's engine (with its tokenizer) for 160 sequences, its first step run."""
    model, tokenizer = load_model("tiny", "cpu", None, 0)
    engine = Engine(model, num_blocks=160, block_size=16, max_num_seqs=160, tokenizer=tokenizer)
    engine.generate(["warm up"], GenerationConfig(max_new_tokens=2, do_sample=False))
    return engine
