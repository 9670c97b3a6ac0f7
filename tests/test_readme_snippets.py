"""The README's Python snippets run as written (the checkpoint path pointed at a saved tiny model)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quick_start_and_engine_snippets_run(tmp_path):
    from hf_paged.cli.default_model import load_model

    model, tokenizer = load_model("tiny", "cpu", torch.float32, 0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    quick_start, engine = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[:2]
    assert '"path/to/a/local/checkpoint"' in quick_start
    scope: dict = {}
    exec(compile(quick_start.replace('"path/to/a/local/checkpoint"', repr(str(tmp_path))), "README", "exec"), scope)
    exec(compile(engine, "README", "exec"), scope)
    assert scope["cache"].stats()["tokens_stored"] > 0
    assert len(scope["outs"]) == 2 and all(len(o.token_ids) > 0 for o in scope["outs"])
    assert len(scope["res"]) == 2
