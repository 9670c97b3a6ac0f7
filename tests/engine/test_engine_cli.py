"""``hf-paged generate``: the no-argument default, prompts from a file and stdin, and a local checkpoint."""

from __future__ import annotations

import io

import torch

from hf_paged.cli import main
from hf_paged.cli.default_model import byte_tokenizer, tiny_llama

SUMMARY_ROWS = ["requests:", "generated tokens:", "tokens/s:", "peak blocks in use:", "preemptions:",
                "prefix-cache hits:", "attention backend:   prefill torch, decode torch"]


def test_generate_with_no_arguments_runs_the_embedded_default(capsys):
    assert main(["generate"]) == 0
    out = capsys.readouterr().out
    for row in SUMMARY_ROWS:
        assert row in out
    assert "requests:            32" in out and "generated tokens:    1024" in out


def test_prompts_from_arguments_file_and_stdin(tmp_path, capsys, monkeypatch):
    path = tmp_path / "prompts.txt"
    path.write_text("from a file\n\nsecond line\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    argv = ["generate", "an argument", "-", "--prompts-file", str(path), "--max-new-tokens", "3", "--no-progress",
            "--show", "4", "--num-blocks", "8", "--block-size", "4", "--max-batch-tokens", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for prompt in ["an argument", "from stdin", "from a file", "second line"]:
        assert repr(prompt) in out
    assert "requests:            4" in out


def test_a_local_checkpoint(tmp_path, capsys):
    model, tokenizer = tiny_llama(seed=3), byte_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = ["generate", "abc", "--model", str(tmp_path), "--max-new-tokens", "5", "--no-progress", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    ids = torch.tensor([tokenizer.encode("abc")])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert repr(tokenizer.decode(want[0, 3:], skip_special_tokens=True)) in out
