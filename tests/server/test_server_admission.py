"""What one request may cost the others, in process through the ASGI app: a json_schema request with 128 copies
holds up no short request; a request whose copies hold too much context, or whose whole answer would be too large, is
refused at the door with a 400 naming the flag; a whole answer is built off the event loop; a streaming client that
reads nothing is given up and its request aborted in the engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from transformers import GenerationConfig  # noqa: E402

from hf_paged import Engine  # noqa: E402
from hf_paged.cli.default_model import load_model  # noqa: E402
from hf_paged.server import _engine_loop, _limits, create_app  # noqa: E402
from hf_paged.server import _responses  # noqa: E402
from hf_paged.server._responses import Reply  # noqa: E402
from server_process import metric  # noqa: E402
from structured_engine import LARGE_SCHEMA, tiny_engine  # noqa: E402

MODEL = "tiny"
@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@contextlib.asynccontextmanager
async def serving(engine, **options):
    """The app on ``engine`` with its engine loop running, and a client that calls it in this event loop."""
    app = create_app(engine, MODEL, max_queued_requests=8, **options)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60) as client:
            yield app, client


def completion(prompt="Hello", **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, **fields}


def test_a_json_schema_with_128_copies_does_not_hold_up_a_2_token_request(engine):
    engine.structured.compiled.cache_clear()  # (compiled afresh, as a new schema is)
    big = completion("Fill in the form:", n=128, max_tokens=2, temperature=1.0,
                     response_format={"type": "json_schema", "json_schema": {"name": "form", "schema": LARGE_SCHEMA}})

    async def run():
        async with serving(engine) as (_, client):
            large = asyncio.create_task(client.post("/v1/completions", json=big))
            while not engine.has_unfinished():  # the schema compiles, then the request is queued
                await asyncio.sleep(0.005)
            # the process's CPU time (the engine loop's thread included), not the wall clock: a loaded machine (CI
            # runs three jobs on two cores) stretches the latter by waits that are not this server's work
            start = time.process_time()
            small = await client.post("/v1/completions", json=completion(max_tokens=2))
            return small, time.process_time() - start, await large

    small, waited, large = asyncio.run(run())
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
    assert large.status_code == 200 and len(large.json()["choices"]) == 128
    assert waited < 1.0, f"the 2-token request took {waited:.2f} CPU s beside a json_schema request with n=128"


def test_costs_past_the_limits_are_400s_naming_the_flag_and_the_limit_is_exact(engine):
    prompt = engine.tokenizer.encode("Count the ships")  # token ids: the lengths are known here
    n, new = 3, 5
    context = n * (len(prompt) + new)
    size = n * (len(prompt) + new) * (_limits.TOKEN_BYTES + 3 * _limits.LOGPROB_BYTES[False])  # echo, logprobs=2

    async def run():
        answers = {}
        async with serving(engine, max_request_tokens=context, max_response_bytes=size) as (_, client):
            for name, fields in (("fits", {}), ("more context", {"max_tokens": new + 1, "stream": True}),
                                 ("larger answer", {"logprobs": 3}), ("streamed", {"logprobs": 3, "stream": True})):
                body = completion(prompt, n=n, max_tokens=new, temperature=1.0, echo=True, logprobs=2)
                answers[name] = await client.post("/v1/completions", json={**body, **fields})
        return answers

    answers = asyncio.run(run())
    assert answers["fits"].status_code == 200 and answers["streamed"].status_code == 200
    context_error, size_error = answers["more context"].json()["error"], answers["larger answer"].json()["error"]
    assert answers["more context"].status_code == 400 and context_error["code"] == "request_too_large"
    assert f"{context + n} tokens" in context_error["message"] and "--max-request-tokens" in context_error["message"]
    assert answers["larger answer"].status_code == 400 and size_error["code"] == "response_too_large"
    assert f"at most {size} (--max-response-bytes)" in size_error["message"] and size_error["param"] == "max_tokens"


def test_a_whole_answer_is_built_off_the_event_loop(engine, monkeypatch):
    threads = []
    build = Reply.completion

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return build(self, *args, **kwargs)

    monkeypatch.setattr(Reply, "completion", recording)

    async def run():
        async with serving(engine) as (_, client):
            return await client.post("/v1/completions", json=completion(max_tokens=3))

    answer = asyncio.run(run())  # (the event loop runs on this thread)
    expected = engine.generate(["Hello"], GenerationConfig(max_new_tokens=3, do_sample=False))[0].text
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
    assert threads and threading.current_thread() not in threads


def test_n_copies_with_no_sampling_field_follow_the_models_default_decoding():
    """No sampling field set: a model whose generation config samples gives ``n`` sampled copies (as
    ``temperature: 1`` with the same seed does); one that decodes greedily gives a 400 naming ``n``."""
    model, tokenizer = load_model("tiny", "cpu", None, 0)
    sampling = Engine(model, num_blocks=16, block_size=16, max_num_seqs=8, tokenizer=tokenizer,
                      generation_config=GenerationConfig(do_sample=True))
    greedy = Engine(model, num_blocks=16, block_size=16, max_num_seqs=8, tokenizer=tokenizer)
    body = {"model": MODEL, "prompt": "Hello", "n": 3, "max_tokens": 4, "seed": 5}

    async def run(engine, **fields):
        async with serving(engine) as (_, client):
            return await client.post("/v1/completions", json={**body, **fields})

    unset, sampled = asyncio.run(run(sampling)), asyncio.run(run(sampling, temperature=1.0))
    assert unset.status_code == sampled.status_code == 200
    assert [c["text"] for c in unset.json()["choices"]] == [c["text"] for c in sampled.json()["choices"]]
    refused = asyncio.run(run(greedy))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    assert "temperature" in refused.json()["error"]["message"]


def test_a_whole_answer_is_encoded_one_choice_at_a_time_into_what_json_response_writes(engine, monkeypatch):
    """One ``json.dumps`` call holds the GIL until it returns: a whole answer is encoded choice by choice, so the event
    loop runs between them; the bytes are those of ``JSONResponse`` (the oracle)."""
    from fastapi.responses import JSONResponse

    body = {"id": "cmpl-1", "object": "text_completion", "model": 'odd "choices":[] name \u00e9', "created": 1,
            "choices": [{"index": i, "text": f"caf\u00e9 {i} \u2603 \"q\"", "logprobs": None, "finish_reason": "length"}
                        for i in range(3)], "usage": {"prompt_tokens": 1}}
    assert _responses.json_bytes(body) == JSONResponse(body).body
    assert _responses.json_bytes({**body, "choices": []}) == JSONResponse({**body, "choices": []}).body

    encoded, encode = [], _responses._json
    monkeypatch.setattr(_responses, "_json", lambda value: encoded.append(value) or encode(value))

    async def run():
        async with serving(engine) as (_, client):
            return await client.post("/v1/completions", json=completion(max_tokens=3, n=4, temperature=1.0, seed=0,
                                                                       echo=True, logprobs=2))

    answer = asyncio.run(run())
    assert answer.status_code == 200
    choices = answer.json()["choices"]
    assert len(choices) == 4 and all(c["logprobs"]["top_logprobs"] for c in choices)
    assert sorted(v["index"] for v in encoded if "index" in v) == [0, 1, 2, 3]  # each choice alone
    assert all(v.get("choices", []) == [] for v in encoded)  # never the whole list


async def unread_stream(app, body: dict, sent: list) -> None:
    """Call ``app`` with a streaming request whose client takes its response's start and then never reads."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1234), "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}
    requests = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays connected

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # and reads nothing

    await app(scope, receive, send)


def wait_aborted(app, timeout: float = 10.0) -> str:
    """The app's /metrics page once its engine has nothing left to run."""
    deadline = time.monotonic() + timeout
    engine_loop = app.state.engine_loop
    while (engine_loop.engine.has_unfinished() or engine_loop._live) and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine_loop.metrics.render()


def test_a_stream_whose_client_reads_nothing_is_given_up_after_the_stream_timeout(engine, caplog):
    body = completion(max_tokens=1000, ignore_eos=True, stream=True)
    before = engine.stats()["generated_tokens"]  # (the module's engine served the tests before)

    async def run():
        sent = []
        async with serving(engine, stream_timeout=0.5) as (app, _):
            start = time.perf_counter()
            await asyncio.wait_for(unread_stream(app, body, sent), 10)
            returned = time.perf_counter() - start
            return await asyncio.to_thread(wait_aborted, app), returned, sent

    page, returned, sent = asyncio.run(run())
    assert sent[0]["status"] == 200 and len(sent) == 2  # the start, and a first chunk that never went
    assert 0.5 <= returned < 5.0
    assert "took no part of its stream for 0.5 s (--stream-timeout)" in caplog.text
    assert metric(page, 'hf_paged_request_success_total{finish_reason="abort"}') == 1
    assert metric(page, "hf_paged_generation_tokens_total") - before < 1000  # it stopped generating


def test_a_stream_whose_unread_chunks_pile_up_is_aborted_before_the_timeout(engine, monkeypatch):
    monkeypatch.setattr(_engine_loop, "STREAM_BACKLOG_PER_CHOICE", 4)
    body = completion(max_tokens=1000, ignore_eos=True, stream=True)
    before = engine.stats()["generated_tokens"]

    async def run():
        sent = []
        async with serving(engine, stream_timeout=60) as (app, _):
            call = asyncio.create_task(unread_stream(app, body, sent))
            while not sent:  # until the request is queued and its response started
                await asyncio.sleep(0.01)
            page = await asyncio.to_thread(wait_aborted, app)
            still_waiting = not call.done()
            call.cancel()
            return page, still_waiting

    page, still_waiting = asyncio.run(run())
    assert still_waiting  # the send was still blocked: the engine thread gave the request up on its own
    assert metric(page, 'hf_paged_request_success_total{finish_reason="abort"}') == 1
    assert metric(page, "hf_paged_generation_tokens_total") - before < 100  # it stopped generating
