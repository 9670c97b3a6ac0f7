"""Nothing a request carries can break the server: a seeded generator of bad requests (random JSON, random Unicode
with unpaired surrogates and NULs, wrong types, huge numbers, huge and deeply nested bodies, bytes that are not
UTF-8 or not JSON, unknown routes and methods) against the live server. Each is answered (200, or an error in
OpenAI's shape whose ``param`` names a field as the client wrote it), and after each a normal request still gets
its exact greedy answer; at the end no sequence or KV block is left behind."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest

httpx = pytest.importorskip("httpx")

from transformers import GenerationConfig  # noqa: E402

from server_process import MODEL, TIMEOUT, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow  # a server subprocess

SEED, ROUNDS = 20261128, 250
PROBE = {"model": MODEL, "prompt": "The paged cache holds", "max_tokens": 3, "temperature": 0}
ANSWERED = {200, 400, 404, 405, 413}
PARAM = re.compile(r"^[A-Za-z_]\w*(\.\w+)*$")
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
          "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
          "top_logprobs", "echo", "best_of", "suffix", "top_k", "min_p", "repetition_penalty", "ignore_eos",
          "response_format", "tools", "unknown_field"]
NUMBERS = [0, -1, 1, 2, 7, 2**31, 2**63, 2**64, 10**30, -10**30, 0.5, -0.0, 1e308, -1e308, 3.0, 1e-300]


def text(rng: random.Random, longest: int = 40) -> str:
    """Random Unicode: ASCII, NULs, controls, unpaired surrogates, astral characters, combining marks."""
    pools = [(0x20, 0x7E), (0, 0x1F), (0xD800, 0xDFFF), (0x80, 0x2FF), (0x300, 0x36F), (0x1F300, 0x1FAFF),
             (0x10000, 0x10FFFF), (0x4E00, 0x9FFF)]
    return "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(rng.randint(0, longest)))


def value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return text(rng)
    if kind == 1:
        return rng.choice(NUMBERS)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return [rng.randrange(-5, 300) for _ in range(rng.randint(0, 8))]
    if kind == 4:
        return text(rng, 3000)
    if kind == 5:
        return rng.choice(["", "hi", "text", "json_object", "json_schema", "user", "system"])
    if kind == 6:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 7:
        return {text(rng, 8): value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return {"role": rng.choice(["user", "assistant", "wizard", 3]), "content": value(rng, depth + 1)}


def bad_request(rng: random.Random) -> tuple[str, str, bytes]:
    """``(method, path, body)`` of one bad (or odd) request."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    chat = path.endswith("chat/completions")
    base = {"model": MODEL, "max_tokens": 3, "temperature": 0,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    kind = rng.randrange(10)
    if kind <= 3:  # one field replaced by a random value
        body = dict(base, **{rng.choice(FIELDS): value(rng)})
    elif kind == 4:  # a random JSON document
        body = value(rng)
    elif kind == 5:  # text with unpaired surrogates and NULs where text belongs
        body = dict(base, **({"messages": [{"role": "user", "content": text(rng)}]} if chat else {"prompt": text(rng)}))
    elif kind == 6:  # bytes that are not UTF-8, not JSON, or JSON Python reads but should not
        raw = rng.choice([bytes(rng.randrange(256) for _ in range(rng.randint(1, 200))),
                          json.dumps(base).encode()[: rng.randint(0, 30)],
                          b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}',
                          b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "temperature": NaN}',
                          b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
                          b"[" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b"", b"null", b"[]"])
        return "POST", path, raw
    elif kind == 7:  # unknown routes and methods
        return rng.choice(["GET", "PUT", "DELETE", "PATCH"]), rng.choice([path, "/v1/nope", "/", "/v1/models/x",
                                                                          "/v1/embeddings", "/%ff"]), b""
    elif kind == 8:  # messages of every wrong shape
        body = dict(base, messages=value(rng)) if chat else dict(base, prompt=[value(rng), value(rng)])
    else:  # odd but maybe valid sampling
        body = dict(base, temperature=rng.choice([0, 0.5, 2]), top_p=rng.choice([1e-9, 1]), seed=rng.randrange(99),
                    stop=[text(rng, 3) or "x"], stream=rng.random() < 0.5)
    return "POST", path, json.dumps(body).encode()  # (unpaired surrogates travel as \\ud800 escapes)


def check_answer(r: httpx.Response) -> None:
    assert r.status_code in ANSWERED, (r.status_code, r.text[:300])
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        else:
            assert r.json()["choices"]
        return
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] is None or PARAM.match(error["param"]), error["param"]
    assert "function-after" not in error["message"] and "list[" not in error["message"], error["message"]


def test_no_request_breaks_the_server(live_server, tiny_engine):
    expected = tiny_engine.generate([PROBE["prompt"]], GenerationConfig(max_new_tokens=3, do_sample=False))[0].text
    rng = random.Random(SEED)
    with httpx.Client(base_url=live_server, timeout=TIMEOUT) as client:
        def probe() -> None:
            r = client.post("/v1/completions", json=PROBE)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text[:300]

        for i in range(ROUNDS):
            method, path, body = bad_request(rng)
            check_answer(client.request(method, path, content=body, headers={"content-type": "application/json"}))
            probe()
        # a huge body, and the same bad requests from many clients at once
        check_answer(client.post("/v1/completions", content=b"x" * (17 * 2**20)))
        bodies = [bad_request(rng) for _ in range(24)]
        answers: list = []
        threads = [threading.Thread(target=lambda m=m, p=p, b=b: answers.append(httpx.request(
            m, live_server + p, content=b, headers={"content-type": "application/json"}, timeout=TIMEOUT)))
                   for m, p, b in bodies]
        for t in threads:
            t.start()
        probe()
        for t in threads:
            t.join(60)
        assert len(answers) == len(bodies)
        for r in answers:
            check_answer(r)
        probe()
    assert httpx.get(f"{live_server}/health", timeout=5).json() == {"status": "ok"}
    wait_idle(live_server)
