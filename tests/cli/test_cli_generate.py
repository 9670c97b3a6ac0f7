"""``hf-paged generate``: the default run, prompts from a file and stdin (every answer shown), a local checkpoint against
HF ``generate`` in plain text and in ``--jsonl``, ``--ignore-eos``, a prompt that fails alone, what ``--verbose``
adds, and answers streamed while they are generated where no progress bar is drawn."""

from __future__ import annotations

import io
import json
import logging
import re

import torch

import hf_paged
from hf_paged.cache._kv_pool import KVLayout, pool_blocks
from hf_paged.cli import main
from hf_paged.cli._generate import DEFAULT_PROMPTS
from hf_paged.cli._generate_run import printable
from hf_paged.cli.default_model import byte_tokenizer, tiny_llama

SUMMARY_ROWS = ["requests:", "generated tokens:", "tokens/s:", "peak blocks in use:", "preemptions:",
                "prefix-cache hits:", "attention backend:   prefill torch, decode torch"]


def summary_value(out: str, row: str) -> str:
    return re.search(rf"^  {re.escape(row)}:\s+(.*)$", out, re.MULTILINE).group(1)


def workload_pool(prompts: list[str], max_new_tokens: int, block_size: int = 16) -> int:
    """The pool ``generate`` sizes without --num-blocks: every prompt of the tiny model at full length at once (it
    has no chat template: a prompt is its bytes), within 0.8 of free memory."""
    config = tiny_llama().config
    needed = sum(-(-(len(p.encode()) + max_new_tokens) // block_size) for p in prompts)
    layout = KVLayout.from_config(config)
    return pool_blocks(hf_paged.CacheConfig(), layout, torch.float32, [torch.device("cpu")] * layout.num_layers, needed)


def test_generate_with_no_other_arguments_runs_the_demo_prompts_on_the_tiny_model(capsys):
    assert main(["generate", "--model", "tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for row in SUMMARY_ROWS:
        assert row in out
    # The random model may emit EOS: every request ends by length (32 tokens) or by EOS (1 to 32 tokens).
    reasons = dict((r, int(n)) for n, r in re.findall(r"(\d+) (\w+)", summary_value(out, "requests").split("(")[1]))
    assert summary_value(out, "requests").startswith("32 (") and sum(reasons.values()) == 32
    assert set(reasons) <= {"length", "stop"}
    generated = int(summary_value(out, "generated tokens"))
    assert 32 * reasons.get("length", 0) + reasons.get("stop", 0) <= generated <= 1024
    demo = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(32)]
    assert summary_value(out, "peak blocks in use").endswith(f"of {workload_pool(demo, 32)} (block size 16)")
    assert re.findall(r"^> (.*)$", out, re.MULTILINE) == demo[:3]  # of the demo, --show's 3 answers


def test_show_caps_the_demo_only(capsys):
    argv = ["generate", "--model", "tiny", "--device", "cpu", "--no-progress", "--max-new-tokens", "2"]
    assert main(argv + ["--num-prompts", "6", "--show", "5"]) == 0
    assert len(re.findall(r"^> ", capsys.readouterr().out, re.MULTILINE)) == 5
    prompts = [f"prompt {i}" for i in range(5)]
    assert main(argv + prompts + ["--show", "1"]) == 0
    assert re.findall(r"^> (.*)$", capsys.readouterr().out, re.MULTILINE) == prompts


def test_prompts_from_arguments_file_and_stdin(tmp_path, capsys, monkeypatch):
    path = tmp_path / "prompts.txt"
    path.write_text("from a file\n\nsecond line\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    argv = ["generate", "an argument", "-", "--prompts-file", str(path), "--max-new-tokens", "3", "--no-progress",
            "--model", "tiny", "--num-blocks", "8", "--block-size", "4", "--max-batch-tokens", "8", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    shown = re.findall(r"^> (.*)$", out, re.MULTILINE)  # all four: --show caps the demo only
    assert shown == ["an argument", "from stdin", "from a file", "second line"]
    assert summary_value(out, "requests").startswith("4 (")


def save_checkpoint(path, eos_token_id: int | None = None):
    """A tiny checkpoint; with ``eos_token_id``, its generation config makes that token EOS."""
    model, tokenizer = tiny_llama(seed=3), byte_tokenizer()
    if eos_token_id is not None:
        model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer


def hf_greedy_ids(model, tokenizer, prompt: str, **kwargs) -> list[int]:
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()


def hf_greedy(model, tokenizer, prompt: str, **kwargs) -> str:
    return tokenizer.decode(hf_greedy_ids(model, tokenizer, prompt, **kwargs), skip_special_tokens=True)


def test_a_local_checkpoint(tmp_path, capsys):
    model, tokenizer = save_checkpoint(tmp_path)
    argv = ["generate", "abc", "--model", str(tmp_path), "--max-new-tokens", "5", "--no-progress", "--device", "cpu"]
    assert main(argv) == 0
    want = hf_greedy(model, tokenizer, "abc", max_new_tokens=5)
    out = capsys.readouterr().out
    assert out.startswith(f"> abc\n{printable(want)}\n"), out  # plain text, not a repr


def test_jsonl_prints_one_object_per_prompt_and_the_summary_on_stderr(tmp_path, capsys):
    model, tokenizer = save_checkpoint(tmp_path)
    prompts = ["abc", "a longer prompt", "x"]
    argv = ["generate", *prompts, "--model", str(tmp_path), "--max-new-tokens", "4", "--no-progress", "--device",
            "cpu", "--jsonl", "--show", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in records] == prompts
    for prompt, record in zip(prompts, records):
        want = hf_greedy_ids(model, tokenizer, prompt, max_new_tokens=4)
        assert record["text"] == tokenizer.decode(want, skip_special_tokens=True)
        assert record["prompt_tokens"] == len(tokenizer.encode(prompt))
        assert record["generated_tokens"] == len(want)
        assert record["finish_reason"] == ("stop" if len(want) < 4 else "length") and "error" not in record
    assert "summary:" in err and "summary:" not in out


def test_printable_escapes_control_characters_but_keeps_lines():
    assert printable("a\tb\nc") == "a\tb\nc"
    assert printable("\x1b[2Jred\r\x00\x85") == "\\x1b[2Jred\\r\\x00\\x85"
    assert printable("é 日本") == "é 日本"


def test_ignore_eos_generates_exactly_max_new_tokens(tmp_path, capsys):
    # A checkpoint whose EOS is the token it emits first: it stops at once unless EOS is ignored.
    model, tokenizer = save_checkpoint(tmp_path)
    [first] = hf_greedy_ids(model, tokenizer, "abc", max_new_tokens=1)
    model, tokenizer = save_checkpoint(tmp_path, eos_token_id=first)
    argv = ["generate", "abc", "--model", str(tmp_path), "--max-new-tokens", "6", "--no-progress", "--device", "cpu"]

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(cut at" not in out and summary_value(out, "generated tokens") == "1"

    assert main(argv + ["--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert summary_value(out, "generated tokens") == "6"
    want = hf_greedy(model, tokenizer, "abc", max_new_tokens=6, min_new_tokens=6)
    assert f"> abc\n{printable(want)}\n(cut at --max-new-tokens 6)\n" in out


def test_a_request_that_fails_in_the_run_fails_alone(capsys, monkeypatch):
    """A prompt too long to run is refused before anything runs (status 2, ``test_cli_arguments.py``); a request
    that fails while running (here the cache, of one block less than it needs) ends alone, named in the summary."""
    argv = ["generate", "short", "x" * 31, "--model", "tiny", "--num-blocks", "2", "--block-size", "16",
            "--max-new-tokens", "4", "--no-progress", "--device", "cpu", "--ignore-eos"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "> short\n" in out and out.count("(cut at --max-new-tokens 4)") == 1 and out.count("(failed: ") == 1
    assert summary_value(out, "requests") == "2 (1 error, 1 length)"
    assert "--num-blocks" in summary_value(out, "first error")


def test_verbose_names_the_backend_of_each_phase(capsys, caplog):
    argv = ["generate", "abc", "--model", "tiny", "--max-new-tokens", "3", "--no-progress", "--device", "cpu",
            "--verbose"]
    with caplog.at_level(logging.DEBUG, logger="hf_paged"):
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert summary_value(out, "attention backend") == "prefill torch, write torch, decode torch"
    assert summary_value(out, "steps") == "3"  # one prefill step, then one decode step per further token
    assert "forward" in summary_value(out, "host ms per step")
    logs = caplog.text
    assert "prefill attention served by the torch backend" in logs
    assert "decode attention served by the torch backend" in logs
    assert f"num_blocks={workload_pool(['abc'], 3)} (automatic" in logs  # (the engine's own line of its sizes)
    assert "1 prompts, up to 3 new tokens each, greedy" in logs and "model hf-paged-tiny (LlamaForCausalLM" in logs

    assert main(argv[:-1]) == 0
    assert "steps:" not in capsys.readouterr().out


def test_without_the_progress_bar_answers_stream_in_order_and_end_as_with_it(capsys, monkeypatch):
    """``--no-progress``: the first answer's text is on stdout while it is still being generated (the oracle: what
    stdout holds as each step starts), and the whole output is what the run with the progress bar prints at its end
    (a request that fails included)."""
    argv = ["generate", "short", "x" * 31, "a third", "--model", "tiny", "--num-blocks", "2", "--block-size", "16",
            "--max-new-tokens", "6", "--device", "cpu", "--ignore-eos"]
    assert main(argv) == 1
    whole = capsys.readouterr().out
    seen = []  # stdout as each step starts
    step_with_deltas = hf_paged.Engine.step_with_deltas

    def step_seen(engine):
        seen.append(stdout.getvalue())
        return step_with_deltas(engine)

    stdout = io.StringIO()
    monkeypatch.setattr(hf_paged.Engine, "step_with_deltas", step_seen)
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(argv + ["--no-progress"]) == 1
    streamed = stdout.getvalue()
    answers = streamed[: streamed.index("summary:")]
    assert answers == whole[: whole.index("summary:")] and answers.count("(failed: ") == 1
    head = "> short\n"
    # how much of the first answer's text was out as each step started, while it was not out whole
    partial = {len(s) - len(head) for s in seen if s.startswith(head) and "\n" not in s[len(head):]}
    assert len(partial - {0}) >= 2  # some of it before its last step, and more at a later one


def test_one_prompt_streams_without_a_progress_bar_by_default(capsys, monkeypatch):
    """The README's command (one prompt, no flags) prints its answer while it is generated: no bar over one request."""
    steps = []
    step_with_deltas = hf_paged.Engine.step_with_deltas
    monkeypatch.setattr(hf_paged.Engine, "step_with_deltas", lambda engine: steps.append(1) or step_with_deltas(engine))
    argv = ["generate", "short", "--model", "tiny", "--max-new-tokens", "4", "--device", "cpu", "--ignore-eos"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert len(steps) >= 4 and out.startswith("> short\n") and "summary:" in out and "request/s" not in err
