"""lm-evaluation-harness's ``hf`` model on ``attn_implementation="hf_paged"`` (docs/guides/evaluation.md).

A tiny random-init Llama saved with its tokenizer and two local tasks (multiple-choice log-likelihoods and greedy
``generate_until``) run once with eager attention and once with hf_paged: the same per-sample log-likelihoods
(within 1e-3) and generations, with every log-likelihood forward paged on a transient KV and every ``generate`` on a
PagedAttentionCache, no layer falling back to dense attention. The command line run gets the implementation from
``hf_paged_autoload``'s startup file alone (no ``import hf_paged`` anywhere in the command).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["hfp_choice", "hfp_greedy"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

pytestmark = pytest.mark.slow

CHOICE = """\
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GREEDY = """\
output_type: generate_until
doc_to_target: "{{choices[0]}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 7
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _task(name: str, data: Path, rest: str) -> str:
    """A task over the local JSON-lines file ``data``: its name, dataset and prompt, then ``rest``."""
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            'test_split: test\ndoc_to_text: "Q: {{question}}"\n' + rest)


def _autoload():
    spec = importlib.util.spec_from_file_location("hf_paged_autoload", ROOT / "hf_paged_autoload.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The saved model, the tasks' folder, and lm-eval's offline settings for this module's process."""
    from hf_paged.cli.default_model import load_model

    root = tmp_path_factory.mktemp("lm_eval")
    model, tokenizer = load_model("tiny", "cpu", torch.float32, seed=4)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    gen = torch.Generator().manual_seed(4)
    with open(root / "data.jsonl", "w") as f:
        for i in range(5):
            a, b = torch.randint(2, 90, (2,), generator=gen).tolist()
            choices = [f" {a + b}", f" {a * b}", f" {a}", " none of these"]
            f.write(json.dumps({"question": f"{a} plus {b} is", "choices": choices, "label": i % 4}) + "\n")
    (root / "tasks").mkdir()
    (root / "tasks" / "choice.yaml").write_text(_task("hfp_choice", root / "data.jsonl", CHOICE))
    (root / "tasks" / "greedy.yaml").write_text(_task("hfp_greedy", root / "data.jsonl", GREEDY))
    old = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    yield root
    for k, v in old.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _evaluate(root: Path, attn_implementation: str) -> dict:
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={root / 'model'},attn_implementation={attn_implementation},dtype=float32",
        tasks=TASKS, task_manager=TaskManager(include_path=str(root / "tasks")), log_samples=True, batch_size=3,
        device="cpu")
    return {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in TASKS}


@pytest.fixture(scope="module")
def eager(workspace):
    return _evaluate(workspace, "eager")


def _assert_same(got: dict, want: dict) -> None:
    choice, greedy = got["hfp_choice"], want["hfp_choice"]
    assert len(choice) == len(greedy) == 5
    for a, b in zip(choice, greedy):
        scores = [float(r[0][0]) for r in a["resps"]], [float(r[0][0]) for r in b["resps"]]  # (a file has text)
        assert scores[0] == pytest.approx(scores[1], abs=1e-3)
    texts = [s["resps"] for s in got["hfp_greedy"]], [s["resps"] for s in want["hfp_greedy"]]
    assert texts[0] == texts[1] and all(r[0][0] for r in texts[0])  # non-empty greedy continuations


def test_lm_eval_scores_and_generations_equal_eager_and_page(workspace, eager, monkeypatch):
    from hf_paged.generate import _default_cache
    from hf_paged.hf import _attention
    from hf_paged.hf._transient import TransientKV

    seen = {"transient": 0, "dense": 0, "caches": []}
    attend, dense, default = _attention.attend, _attention._dense_fallback, _default_cache.paged_default

    def counting_attend(step, *args):
        seen["transient"] += isinstance(step.pool, TransientKV)
        return attend(step, *args)

    def counting_dense(*args, **kwargs):
        seen["dense"] += 1
        return dense(*args, **kwargs)

    def recording_default(*args):
        seen["caches"].append(default(*args))
        return seen["caches"][-1]

    monkeypatch.setattr(_attention, "attend", counting_attend)
    monkeypatch.setattr(_attention, "_dense_fallback", counting_dense)
    monkeypatch.setattr(_default_cache, "paged_default", recording_default)
    _assert_same(_evaluate(workspace, "hf_paged"), eager)
    assert seen["dense"] == 0 and seen["transient"] > 0
    assert seen["caches"] and all(c.stats()["backends"].get("decode") for c in seen["caches"])


def test_the_lm_eval_command_line_gets_hf_paged_from_the_startup_file(workspace, eager, tmp_path):
    """The startup file that ``python -m hf_paged_autoload enable`` writes, in a site folder of its own here, is all
    that tells ``lm_eval --model hf ... attn_implementation=hf_paged`` about hf_paged."""
    autoload = _autoload()
    site = tmp_path / "site"
    site.mkdir()
    autoload._pth_path = lambda: str(site / autoload.PTH_NAME)
    assert autoload.main(["enable"]) == 0
    argv = ["lm_eval", "--model", "hf", "--model_args",
            f"pretrained={workspace / 'model'},attn_implementation=hf_paged,dtype=float32", "--tasks", ",".join(TASKS),
            "--include_path", str(workspace / "tasks"), "--device", "cpu", "--batch_size", "3", "--log_samples",
            "--output_path", str(tmp_path / "out")]
    code = ("import site, sys; site.addsitedir(sys.argv[1]); from lm_eval.__main__ import cli_evaluate; "
            "sys.argv = sys.argv[2:]; cli_evaluate()")
    env = {**os.environ, **OFFLINE, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code, str(site), *argv], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = {}
    for task in TASKS:
        (path,) = glob.glob(str(tmp_path / "out" / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        got[task] = sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])
    _assert_same(got, eager)
