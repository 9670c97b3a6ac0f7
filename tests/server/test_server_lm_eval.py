"""lm-evaluation-harness scores a multiple-choice task through ``hf-paged serve`` as it does on the model itself.

Its ``local-completions`` model asks ``/v1/completions`` for each choice with ``echo``, ``logprobs: 1`` and
``max_tokens: 1`` (token-id prompts) and sums the prompt logprobs of the continuation. The first test makes exactly
those requests and compares the sums with the same log-likelihoods computed by transformers (float32 forward); the
second (where ``lm-eval[api]`` is installed: the ``eval`` extra) runs lm-evaluation-harness itself, once with
``local-completions`` against the server and once with its own ``hf`` model on the same weights, on a local JSON task
(no download), and compares every choice's log-likelihood.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

from hf_paged.cli.default_model import byte_tokenizer, tiny_llama  # noqa: E402
from server_process import MODEL, TIMEOUT  # noqa: E402

pytestmark = pytest.mark.slow  # a server subprocess; lm-evaluation-harness

TOLERANCE = 1e-3
DOCS = [
    {"question": "Which block holds the first token?", "choices": ["the first", "the last", "none of them"],
     "answer": 0},
    {"question": "Paged attention splits the KV cache into", "choices": ["blocks", "pages of text", "files"],
     "answer": 0},
    {"question": "2 + 2 =", "choices": ["4", "22", "five"], "answer": 0},
    {"question": "A request that leaves frees its", "choices": ["blocks", "tokens", "nothing at all"], "answer": 0},
]


def context(doc: dict) -> str:
    return f"Question: {doc['question']}\nAnswer:"


def reference_loglikelihood(ctx: list[int], cont: list[int]) -> float:
    """The model's log-likelihood of ``cont`` after ``ctx``, as transformers computes it (float32, eager)."""
    model = tiny_llama(0)  # the embedded model the server runs (seed 0)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), -1)
    return sum(logprobs[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_local_completions_requests_score_choices_as_the_model_does(live_server):
    tokenizer = byte_tokenizer()
    pairs = [(tokenizer.encode(context(doc)), tokenizer.encode(" " + choice)) for doc in DOCS
             for choice in doc["choices"]]
    body = {"model": MODEL, "prompt": [ctx + cont for ctx, cont in pairs], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # lm-evaluation-harness's request, batched
    r = httpx.post(f"{live_server}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for (ctx, cont), choice in zip(pairs, choices, strict=True):
        scored = sum(choice["logprobs"]["token_logprobs"][len(ctx) : -1])  # local-completions' parse_logprobs
        assert scored == pytest.approx(reference_loglikelihood(ctx, cont), abs=TOLERANCE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The served model's weights and tokenizer as a checkpoint lm-evaluation-harness's ``hf`` model loads."""
    path = tmp_path_factory.mktemp("lm_eval") / "model"
    model = tiny_llama(0)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_task")
    (folder / "docs.jsonl").write_text("\n".join(json.dumps(doc) for doc in DOCS))
    (folder / "hf_paged_mc.yaml").write_text("\n".join([
        "task: hf_paged_mc", "dataset_path: json", "dataset_kwargs:", "  data_files:",
        f"    test: {folder / 'docs.jsonl'}", "test_split: test", "output_type: multiple_choice",
        'doc_to_text: "Question: {{question}}\\nAnswer:"', 'doc_to_choice: "{{choices}}"', "doc_to_target: answer",
        "metric_list:", "  - metric: acc", "    aggregation: mean", "    higher_is_better: true", ""]))
    return folder


def loglikelihoods(result: dict) -> dict[int, list[float]]:
    return {s["doc_id"]: [resp[0][0] for resp in s["resps"]] for s in result["samples"]["hf_paged_mc"]}


def test_lm_evaluation_harness_local_completions_equals_its_hf_model(live_server, checkpoint, task_dir):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval[api]
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_dir))
    own = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={checkpoint},dtype=float32",
                                  tasks=["hf_paged_mc"], task_manager=tasks, log_samples=True, batch_size=1,
                                  device="cpu")
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=["hf_paged_mc"], task_manager=tasks, log_samples=True, batch_size=1,
        model_args=f"model={MODEL},base_url={live_server}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={checkpoint},num_concurrent=1,max_retries=1,tokenized_requests=True")
    want, got = loglikelihoods(own), loglikelihoods(served)
    assert sorted(got) == sorted(want) == list(range(len(DOCS)))
    for doc_id, values in want.items():
        assert got[doc_id] == pytest.approx(values, abs=TOLERANCE)
    assert served["results"]["hf_paged_mc"]["acc,none"] == own["results"]["hf_paged_mc"]["acc,none"]
