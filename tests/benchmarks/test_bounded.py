"""``benchmarks/serving/bounded.py --smoke`` (issue 59's bounds on the CPU): every part runs, reports its figures and
passes; the attention workspace it counts agrees with the torch backend's formula."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import ROOT
from benchmarks.serving import bounded

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")


@pytest.mark.slow
def test_bounded_smoke_reports_every_part_passing(tmp_path):
    path = tmp_path / "bounded.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.serving.bounded", "--smoke", "--json", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(path.read_text())
    assert doc["machine"] == "cpu" and doc["cores"] >= 1 and doc["smoke"] is True
    assert {"torch", "transformers", "hf_paged_commit", "date"} <= set(doc)
    assert list(doc["parts"]) == list(bounded.PARTS)
    assert doc["pass"] is True and all(part["pass"] is True for part in doc["parts"].values())

    server = doc["parts"]["server"]
    assert server["idle_rss_bytes"] > 0 and len(server["requests"]) == 3
    assert all(r["answered"] and r["health_polls"] >= 1 for r in server["requests"].values())
    grammar = doc["parts"]["grammar"]
    assert grammar["small_requests"] >= 1 and grammar["grammar_request"]["choices"] == bounded.SMOKE["grammar_n"]

    workspace = doc["parts"]["workspace"]
    sizes = bounded.SMOKE
    assert workspace["step"] == {"sequences": sizes["decoding"] + 1, "decode_rows": sizes["decoding"],
                                 "prompt_tokens": sizes["context"], "context_min": sizes["context"],
                                 "context_max": workspace["step"]["context_max"]}
    # the smoke step is one piece per layer, padded to the step's longest query and context: what was counted lies
    # between its float32 scores and their softmax (alive together) and the formula's bound for that piece
    assert workspace["pieces_per_layer"] == 1
    step = workspace["step"]
    for shape in ("tiny", "llama_1b_heads"):
        scores = step["sequences"] * workspace[shape]["heads"]["query"] * step["prompt_tokens"] * step["context_max"]
        measured, formula = workspace[shape]["measured_peak_bytes"], workspace[shape]["padded_one_piece_bytes"]
        assert 2 * 4 * scores <= measured <= formula

    signals = doc["parts"]["signals"]
    for name in ("abort", "stats"):
        assert signals[name]["returned"] == signals[name]["runs"] == sizes["signal_runs"], name
    assert signals["hand-over"]["lost"] == signals["hand-over"]["delivered twice"] == 0
    threads = doc["parts"]["threads"]
    assert threads["returned"] == 2 * sizes["thread_calls"] and threads["wrong"] == 0
