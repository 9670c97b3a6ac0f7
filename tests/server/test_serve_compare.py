"""``benchmarks/serving/compare.py`` on the CPU: ``hf-paged serve`` and ``transformers serve`` (continuous batching) on
the tiny checkpoint of ``benchmarks/serving/model.py``; both read every text prompt back as its intended token ids and
run every request to exactly ``--max-tokens``, and a system out of time is stopped and reported, never waited for."""

from __future__ import annotations

import json
import time

import pytest

for module in ("httpx", "fastapi", "uvicorn", "openai", "typer"):  # openai and typer: transformers serve's
    pytest.importorskip(module)

from benchmarks.e2e.workloads import WORKLOADS  # noqa: E402
from benchmarks.serving import compare as serve_compare  # noqa: E402
from benchmarks.serving.model import build, prompt_text, word_tokenizer  # noqa: E402

REQUESTS, CLIENTS, MAX_TOKENS = 4, 2, 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build(tmp_path_factory.mktemp("serve_compare") / "model", smoke=True, device="cpu"))


def test_word_tokenizer_reads_prompt_text_back_as_its_ids():
    tokenizer = word_tokenizer(2000)
    for ids in WORKLOADS["anchor"].smoke().prompts(2000) + [[0, 1, 2, 1999]]:
        assert tokenizer(prompt_text(ids))["input_ids"] == ids
        assert tokenizer.decode(ids) == prompt_text(ids)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text([5, 6])}], tokenize=False,
                                         add_generation_prompt=True)
    assert tokenizer(chat)["input_ids"] == [5, 6]


@pytest.mark.slow
def test_serve_compare_both_servers_do_the_same_exact_work(tmp_path, model_dir):
    out = tmp_path / "compare.json"
    argv = ["--smoke", "--requests", str(REQUESTS), "--clients", str(CLIENTS), "--max-tokens", str(MAX_TOKENS),
            "--warmup-tokens", "2", "--model-dir", model_dir, "--json", str(out),
            "--system-timeout", "120"]
    assert serve_compare.main(argv) == 0
    result = json.loads(out.read_text())
    _, _, lengths = serve_compare.prompts(serve_compare.parse_args(argv))
    assert result["prompt_tokens"] == sum(lengths) > 0
    rows = {r["system"]: r for r in result["rows"]}
    assert set(rows) == {"hf_paged", "transformers"}
    for row in rows.values():
        assert row["status"] == "ok" and row["exact"], row
        assert row["errors"] == row["short"] == 0 and row["requests"] == REQUESTS
        assert row["prompt_tokens"] == sum(lengths)  # the servers' own usage counts
        assert row["output_tokens"] == REQUESTS * MAX_TOKENS
        assert row["output_tok_per_s"] == pytest.approx(row["output_tokens"] / row["seconds"])
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 < row["tpot_p50_ms"] <= row["tpot_p99_ms"]
        assert (tmp_path / row["log"]).is_file()


@pytest.mark.slow
def test_serve_compare_stops_a_system_out_of_time(tmp_path, model_dir):
    out = tmp_path / "compare.json"
    start = time.monotonic()
    argv = ["--smoke", "--systems", "hf_paged", "--requests", "2", "--clients", "1", "--system-timeout", "1",
            "--model-dir", model_dir, "--json", str(out)]
    assert serve_compare.main(argv) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"].startswith("timeout during starting")
    assert time.monotonic() - start < 30  # one second of server, then its stop
