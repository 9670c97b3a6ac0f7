"""``hf-paged serve`` end to end: the real server on the embedded model in a subprocess, driven by the real
``openai`` client and by raw HTTP; every answer is compared with the engine run in this process on the same
model, prompts and seeds."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from transformers import GenerationConfig  # noqa: E402

from hf_paged import Engine  # noqa: E402
from hf_paged.server._prompts import SIMPLE_CHAT_TEMPLATE  # noqa: E402
from server_process import MAX_QUEUED, MAX_SEQS, MODEL, NUM_BLOCKS, TIMEOUT, metric, running_server, wait_idle  # noqa: E402,E501

pytestmark = pytest.mark.slow  # a server subprocess


@pytest.fixture
def server(live_server):
    return live_server


@pytest.fixture
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=60, max_retries=0)


def greedy(n: int = 12, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, **{"do_sample": False, **kw})


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, chat_template=SIMPLE_CHAT_TEMPLATE, tokenize=False,
                                                add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def streamed_text(engine: Engine, prompt, config: GenerationConfig) -> str:
    return "".join(d.text or "" for d in engine.stream([prompt], config))


def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health", timeout=5).json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_concurrent_completions_equal_engine_generate(server, engine):
    prompts = [f"Request {i}: the paged cache holds" + " block" * (i % 5) for i in range(24)]
    sampled = dict(temperature=0.8, top_p=0.9, seed=1234)

    async def ask_all():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=60, max_retries=0) as c:
            greedy_calls = [c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0) for p in prompts]
            sample_call = c.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, **sampled)
            return await asyncio.gather(*greedy_calls, sample_call)

    answers = asyncio.run(ask_all())
    expected = engine.generate(prompts, greedy()) + engine.generate(
        [prompts[0]], greedy(do_sample=True, temperature=0.8, top_p=0.9, seed=1234))
    for answer, out in zip(answers, expected, strict=True):
        assert answer.choices[0].text == out.text
        assert answer.choices[0].finish_reason == out.finish_reason
        assert answer.usage.completion_tokens == len(out.token_ids)
        assert answer.usage.prompt_tokens == len(out.prompt_token_ids)
    assert answers[-1].choices[0].text != answers[0].choices[0].text  # the seeded request really sampled


def test_n_copies_and_logprobs_equal_engine(client, engine):
    answer = client.completions.create(model=MODEL, prompt="Copies of one prompt", max_tokens=6, n=3,
                                       temperature=1.0, seed=7, logprobs=0)
    outs = engine.generate(["Copies of one prompt"], GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0,
                                                                       seed=7, num_return_sequences=3,
                                                                       output_logprobs=True))
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice, out in zip(answer.choices, outs, strict=True):
        assert choice.text == out.text
        assert choice.logprobs.token_logprobs == pytest.approx(out.logprobs, abs=1e-4)
        assert len(choice.logprobs.tokens) == len(out.token_ids)
    assert answer.usage.completion_tokens == sum(len(o.token_ids) for o in outs)


def test_chat_equals_engine_on_the_templated_prompt(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a block size."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            logprobs=True)
    ids = chat_ids(engine, messages)
    out = engine.generate([ids], greedy(10, output_logprobs=True))[0]
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == out.text
    assert [t.logprob for t in answer.choices[0].logprobs.content] == pytest.approx(out.logprobs, abs=1e-4)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), len(out.token_ids))


def test_streaming_completion_and_chat_equal_engine_stream(client, engine):
    stream = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == streamed_text(engine, "Stream me", greedy(10))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10

    messages = [{"role": "user", "content": "Stream a chat"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == streamed_text(engine, chat_ids(engine, messages), greedy(8))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": MODEL, "prompt": "raw", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_client_disconnect_aborts_and_frees_blocks(server):
    wait_idle(server)
    body = {"model": MODEL, "prompt": "a long story " * 4, "max_tokens": 1400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(20)]
        assert any(line.startswith("data: {") for line in got)
        assert metric(httpx.get(f"{server}/metrics", timeout=5).text, "hf_paged_kv_blocks_used") > 0
    page = wait_idle(server)  # the abort freed its blocks
    assert metric(page, 'hf_paged_request_success_total{finish_reason="abort"}') >= 1


def test_full_server_answers_429(server, client):
    wait_idle(server)
    body = {"model": MODEL, "prompt": "hold", "max_tokens": 100, "temperature": 1, "stream": True, "ignore_eos": True,
            "n": MAX_SEQS + MAX_QUEUED - 2}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the response, which the server takes as a disconnect
        next(lines)
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="one more", max_tokens=2, n=3, temperature=1)
        assert err.value.status_code == 429 and "full" in err.value.body["message"]
        fits = client.completions.create(model=MODEL, prompt="fits", max_tokens=2, n=2, temperature=1)
        assert fits.choices  # room for two
    wait_idle(server)


LONG_PROMPT = "x" * (NUM_BLOCKS * 16 + 10)
BAD_INPUTS = {
    "malformed json": ("/v1/completions", b'{"model": "hf-paged-tiny", "prompt": ', None),
    "unknown model": ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, "model"),
    "max_tokens 0": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": -3}, "max_tokens"),
    "max_tokens past the limit": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000},
                                  "max_tokens"),
    "temperature negative": ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    "temperature not a number": ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"},
                                 "temperature"),
    "top_p 0": ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    "top_p above 1": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                               "top_p": 1.5}, "top_p"),
    "n 0": ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    "n 2 greedy": ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "temperature": 0}, "n"),
    "n 2 under the model's greedy default": ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, "n"),
    "seed negative": ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -1}, "seed"),
    "empty prompt": ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    "token id out of vocab": ("/v1/completions", {"model": MODEL, "prompt": [5, 99999]}, "prompt"),
    "prompt too long for the cache": ("/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1},
                                      "prompt"),
    "chat too long for the cache": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1,
                                                             "messages": [{"role": "user", "content": LONG_PROMPT}]},
                                    "messages"),
    "no messages": ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    "bad role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
                 "messages.0.role"),
    "top_logprobs 21": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"model": MODEL, "top_logprobs": 2,
                                                               "messages": [{"role": "user", "content": "hi"}]},
                                      "top_logprobs"),
    "completion logprobs 6": ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 6}, "logprobs"),
    "frequency_penalty": ("/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 0.5},
                          "frequency_penalty"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_400_with_openai_error_json(server, case):
    path, body, param = BAD_INPUTS[case]
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", timeout=TIMEOUT, **kw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_openai_client_sees_bad_request_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="not-this-one", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices[0].finish_reason


def test_metrics_parse_as_prometheus_text(server, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4, temperature=0)
    page = wait_idle(server)
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(page)}
    for name in ("hf_paged_requests_running", "hf_paged_requests_waiting", "hf_paged_kv_blocks_used",
                 "hf_paged_generation_tokens_per_second"):
        assert families[name].type == "gauge"
    for name in ("hf_paged_generation_tokens", "hf_paged_preemptions", "hf_paged_prefix_cache_hit_tokens"):
        assert families[name].type == "counter"
    for name in ("hf_paged_time_to_first_token_seconds", "hf_paged_time_per_output_token_seconds"):
        assert families[name].type == "histogram"
        count = next(s.value for s in families[name].samples if s.name == f"{name}_count")
        assert count >= 1
    assert metric(page, "hf_paged_generation_tokens_total") >= 4
    assert metric(page, "hf_paged_kv_blocks_total") == NUM_BLOCKS


def test_sigterm_ends_in_flight_requests_and_exits_cleanly():
    # A request far longer than the 1 s of grace (2,000 tokens: the embedded model's position limit is 2,048)
    with running_server("--num-blocks", "160", "--shutdown-timeout", "1") as (url, proc):
        body = {"model": MODEL, "prompt": "endless", "max_tokens": 2000, "temperature": 0, "stream": True}
        seen: list[str] = []

        def read():
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                    seen.extend(line for line in r.iter_lines() if line)
            except httpx.HTTPError as exc:  # the server may cut the stream
                seen.append(f"cut: {exc}")

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 20
        while len(seen) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal it caught once its shutdown is done, so the status is -SIGTERM (or 0)
        assert proc.wait(20) in (0, -signal.SIGTERM)
        assert time.monotonic() - start < 10
        reader.join(20)
        assert not reader.is_alive() and seen
        assert any("shutting_down" in line for line in seen)  # cut short with a 503 event, not run to the end


def test_serve_bench_smoke(server, tmp_path):
    import json

    from benchmarks.serving import load as serve_bench

    out = tmp_path / "bench.json"
    argv = ["--url", server, "--smoke", "--vocab-size", "259", "--clients", "4", "--ignore-eos", "--max-tokens", "8",
            "--json", str(out)]
    assert serve_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == 0 and result["output_tokens"] == result["requests"] * 8
    assert result["ttft_p50_ms"] > 0 and result["tpot_p99_ms"] >= result["tpot_p50_ms"] > 0
