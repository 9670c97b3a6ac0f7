"""The checkpoint folder both servers of ``benchmarks/serving/compare.py`` load: the anchor workload's random-init Llama
(the e2e benchmark's weights, seed 0) saved with ``save_pretrained``, no EOS anywhere, and a word-level tokenizer.

The tokenizer has one word per token id (``t<id>``, split on whitespace, no special tokens, nothing added around a
prompt), so the text ``prompt_text(ids)`` reads back as exactly ``ids`` on any server: the anchor's token-id prompts
become text prompts of the intended lengths, which ``transformers serve`` needs (its completions take strings
only). Its chat template joins the messages' contents, so a chat message holding such a text is those tokens too.
With no EOS in the config, the generation config or the tokenizer, every request runs to its ``max_tokens``.

    python -m benchmarks.serving.model --out DIR            # Llama-3.2-1B's shape, bf16 on a GPU (about 2.5 GB)
    python -m benchmarks.serving.model --out DIR --smoke    # the tiny shape the CPU tests use
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from benchmarks.e2e.workloads import LLAMA_1B, SMOKE_SHAPE, load_model

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
STAMP = "serve_model.json"  # what the folder was built from; a folder whose stamp matches is reused


def word(token_id: int) -> str:
    return f"t{token_id}"


def prompt_text(ids: list[int]) -> str:
    """The text that the folder's tokenizer reads back as ``ids``."""
    return " ".join(word(i) for i in ids)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """One whitespace-separated word per id in ``[0, vocab_size)``; an unknown word reads as id 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({word(i): i for i in range(vocab_size)}, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def is_built(out: Path, smoke: bool = False) -> bool:
    """Whether ``out`` holds this shape's checkpoint already (in whichever dtype it was built)."""
    try:
        stamp = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("shape") == (SMOKE_SHAPE if smoke else LLAMA_1B) and stamp.get("seed") == 0


def build(out: Path, smoke: bool = False, device: str | None = None) -> Path:
    """Save the model and tokenizer to ``out`` unless it holds them already."""
    if is_built(out, smoke):
        return out
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = SMOKE_SHAPE if smoke else LLAMA_1B
    model = load_model(shape, device, attn="sdpa")  # bf16 on a GPU, float32 on the CPU
    # transformers' continuous batching falls back from the generation config's EOS to the model config's
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    word_tokenizer(shape["vocab_size"]).save_pretrained(out)
    stamp = {"shape": shape, "seed": 0, "dtype": str(model.dtype).removeprefix("torch.")}
    (out / STAMP).write_text(json.dumps(stamp) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the folder to write")
    p.add_argument("--smoke", action="store_true", help="the tiny shape (vocab 2000) for the CPU")
    p.add_argument("--device", help="where to initialise the weights (default: cuda when available)")
    args = p.parse_args(argv)
    print(build(args.out, args.smoke, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
