"""The OpenAI API features clients and evaluators use, through the real ``openai`` client and raw HTTP against the
live server: logprobs with alternatives (completions and chat, streamed and not) equal to the engine's, ``echo``
with prompt logprobs equal to the model's own log-softmax (float32 forward), ``response_format`` answers that match
their schema, and ``--api-key``."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from hf_paged import envs  # noqa: E402
from hf_paged.cli.default_model import tiny_llama  # noqa: E402
from hf_paged.server._prompts import SIMPLE_CHAT_TEMPLATE  # noqa: E402
from server_process import MODEL, TIMEOUT, running_server  # noqa: E402

pytestmark = pytest.mark.slow  # a server subprocess


@pytest.fixture
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", timeout=60, max_retries=0)


def engine_out(engine, prompt, n: int, k: int):
    return engine.generate([prompt], GenerationConfig(max_new_tokens=n, do_sample=False, output_logprobs=True,
                                                      top_logprobs=k))[0]


def text_of(engine, token: int) -> str:
    return engine.tokenizer.decode([token])


def test_completion_logprobs_with_alternatives_equal_the_engines_streamed_or_not(client, tiny_engine):
    prompt = "Alternatives of each token"
    out = engine_out(tiny_engine, prompt, 6, 3)
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = answer.choices[0].logprobs
    assert lp.tokens == [text_of(tiny_engine, t) for t in out.token_ids]
    assert lp.token_logprobs == pytest.approx(out.logprobs, abs=1e-4)
    for got, want in zip(lp.top_logprobs, out.top_logprobs, strict=True):
        expected: dict[str, float] = {}
        for token, value in want:
            expected.setdefault(text_of(tiny_engine, token), value)
        assert got.keys() == expected.keys() and list(got.values()) == pytest.approx(list(expected.values()),
                                                                                       abs=1e-4)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = [c for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                                   logprobs=3, stream=True) if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs,
                                                                                             abs=1e-5)
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_chat_top_logprobs_equal_the_engines_streamed_or_not(client, tiny_engine):
    messages = [{"role": "user", "content": "Rank the next tokens"}]
    text = tiny_engine.tokenizer.apply_chat_template(messages, chat_template=SIMPLE_CHAT_TEMPLATE, tokenize=False,
                                                     add_generation_prompt=True)
    out = engine_out(tiny_engine, tiny_engine.tokenizer.encode(text, add_special_tokens=False), 5, 20)
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=20)
    content = answer.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(out.logprobs, abs=1e-4)
    for got, want in zip(content, out.top_logprobs, strict=True):
        assert [a.token for a in got.top_logprobs] == [text_of(tiny_engine, t) for t, _ in want]
        assert [a.logprob for a in got.top_logprobs] == pytest.approx([v for _, v in want], abs=1e-4)
        assert got.bytes == list(got.token.encode())
    streamed = [c.choices[0].logprobs.content for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=20, stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [t.logprob for part in streamed for t in part] == pytest.approx(out.logprobs, abs=1e-4)
    assert sum(len(t.top_logprobs) for part in streamed for t in part) == 20 * len(out.token_ids)


def eager_log_softmax(ids: list[int]) -> torch.Tensor:
    """The embedded model (seed 0) with eager attention, float32, over ``ids``: ``[len(ids), V]``."""
    model = tiny_llama(0)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_returns_the_prompts_logprobs_as_the_model_computes_them(live_server, tiny_engine):
    prompts = [tiny_engine.tokenizer.encode("Question: which block? Answer: the first"),
               tiny_engine.tokenizer.encode("Question: which block? Answer: the last one")]
    # lm-evaluation-harness's local-completions request for log-likelihoods
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = httpx.post(f"{live_server}/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices, strict=True):
        ref = eager_log_softmax(ids)
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt and the one new token
        want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
        for p in range(1, len(ids)):  # the one alternative is the likeliest token
            (value,) = lp["top_logprobs"][p].values()
            assert value == pytest.approx(ref[p - 1].max().item(), abs=1e-4)
        assert choice["text"].startswith(tiny_engine.tokenizer.decode(ids))
    only = dict(body, prompt=prompts[0], max_tokens=0)  # the prompt alone
    answer = httpx.post(f"{live_server}/v1/completions", json=only, timeout=TIMEOUT).json()
    assert len(answer["choices"][0]["logprobs"]["token_logprobs"]) == len(prompts[0])
    assert answer["choices"][0]["text"] == tiny_engine.tokenizer.decode(prompts[0])
    assert answer["usage"]["completion_tokens"] == 0


SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "size": {"type": "integer",
                                                                                         "minimum": 1, "maximum": 9}},
          "required": ["colour", "size"], "additionalProperties": False}


def test_response_format_answers_match_their_schema(client):
    for seed in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "A block as JSON"}], max_tokens=40, temperature=1,
            seed=seed, response_format={"type": "json_schema", "json_schema": {"name": "block", "schema": SCHEMA}})
        value = json.loads(answer.choices[0].message.content)
        assert set(value) == {"colour", "size"} and value["colour"] in ("red", "green") and 1 <= value["size"] <= 9
        assert answer.choices[0].finish_reason == "stop"
    answer = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=30, temperature=0,
                                       extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(answer.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}})
    assert err.value.body["param"] == "response_format" and "wat" in err.value.body["message"]
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices


def test_api_key_guards_every_route_but_health_and_metrics(monkeypatch):
    monkeypatch.setenv(envs.API_KEY, "from-the-environment")
    envs.refresh()
    assert envs.api_key() == "from-the-environment"
    with running_server("--num-blocks", "32", "--api-key", "s3cret", env={envs.API_KEY: "other"}) as (url, _):
        with pytest.raises(openai.AuthenticationError) as err:
            openai.OpenAI(base_url=f"{url}/v1", api_key="other", max_retries=0).models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                          timeout=TIMEOUT).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="with the key", max_tokens=2).choices
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # probes need no key
        for path in ("/docs", "/redoc", "/openapi.json"):  # the API's description follows the key too
            error = httpx.get(f"{url}{path}", timeout=TIMEOUT).json()["error"]
            assert error["code"] == "invalid_api_key", (path, error)
            r = httpx.get(f"{url}{path}", headers={"Authorization": "Bearer s3cret"}, timeout=TIMEOUT)
            assert r.status_code == 200 and (path != "/openapi.json" or "/v1/completions" in r.json()["paths"])
        # with a key, any Host is served (a rebinding page cannot know the key)
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer s3cret", "Host": "evil.example"},
                      timeout=TIMEOUT)
        assert r.status_code == 200
    with running_server("--num-blocks", "32", env={envs.API_KEY: "from-env"}) as (url, _):
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer from-env"}, timeout=5).status_code == 200
