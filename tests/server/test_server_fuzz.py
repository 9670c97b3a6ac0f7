"""Nothing a request carries can break the server: hypothesis draws bad requests (random JSON, random Unicode with
unpaired surrogates and NULs, wrong types, huge numbers, huge and deeply nested bodies, bytes that are not UTF-8 or
not JSON, unknown routes and methods) against the live server, derandomized so every run sends the same ones. Each
is answered (200, or an error in OpenAI's shape whose ``param`` names a field as the client wrote it), and after each
a normal request still gets its exact greedy answer; at the end, after a burst of them from many clients at once, no
sequence or KV block is left behind."""

from __future__ import annotations

import json
import re
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from server_process import MODEL, TIMEOUT, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow  # a server subprocess

EXAMPLES = 250
PROBE = {"model": MODEL, "prompt": "The paged cache holds", "max_tokens": 3, "temperature": 0}
ANSWERED = {200, 400, 404, 405, 413}
PARAM = re.compile(r"^[A-Za-z_]\w*(\.\w+)*$")
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
          "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs",
          "top_logprobs", "echo", "best_of", "suffix", "top_k", "min_p", "repetition_penalty", "ignore_eos",
          "response_format", "tools", "unknown_field"]
ROUTES = ["/v1/completions", "/v1/chat/completions"]

# every code point, unpaired surrogates and NULs included
texts = st.text(alphabet=st.characters(exclude_categories=()), max_size=40)
numbers = st.one_of(st.integers(-10**40, 10**40), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0, -1, 1, 2, 2**31, 2**63, 2**64, -0.0, 1e308, 3.0]))
json_values = st.recursive(st.none() | st.booleans() | numbers | texts | st.text(max_size=3000),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                           max_leaves=16)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "wizard"]) | json_values,
                                           "content": texts | json_values}), max_size=3)


def base(path: str) -> dict:
    chat = path.endswith("chat/completions")
    return {"model": MODEL, "max_tokens": 3, "temperature": 0,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}


def as_json(body) -> bytes:
    return json.dumps(body).encode()  # ASCII escapes: an unpaired surrogate travels as \\ud800, as JavaScript sends it


raw_bodies = st.sampled_from([
    b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe"}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "temperature": NaN}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "temperature": Infinity}',
    b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
    b"[" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000, b"", b"null", b"[]", b'{"model": ',
]) | st.binary(max_size=200)
requests = st.one_of(
    # one field replaced by a random value
    st.builds(lambda path, name, v: ("POST", path, as_json(dict(base(path), **{name: v}))),
              st.sampled_from(ROUTES), st.sampled_from(FIELDS), json_values),
    # a random JSON document
    st.builds(lambda path, doc: ("POST", path, as_json(doc)), st.sampled_from(ROUTES), json_values),
    # random text where text belongs
    st.builds(lambda t: ("POST", ROUTES[0], as_json(dict(base(ROUTES[0]), prompt=t))), texts),
    st.builds(lambda m: ("POST", ROUTES[1], as_json(dict(base(ROUTES[1]), messages=m))), messages),
    # bytes that are not UTF-8, not JSON, or JSON Python reads but should not
    st.builds(lambda path, raw: ("POST", path, raw), st.sampled_from(ROUTES), raw_bodies),
    # unknown routes and methods
    st.builds(lambda method, path: (method, path, b""), st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
              st.sampled_from(ROUTES + ["/v1/nope", "/", "/v1/models/x", "/v1/embeddings", "/%ff"])),
    # odd but possibly valid sampling
    st.builds(lambda path, t, p, seed, stop, stream: ("POST", path, as_json(dict(
        base(path), temperature=t, top_p=p, seed=seed, stop=stop, stream=stream))),
        st.sampled_from(ROUTES), st.sampled_from([0, 0.5, 2]), st.sampled_from([1e-9, 1]), st.integers(0, 99),
        st.lists(texts, max_size=3), st.booleans()),
)


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


@pytest.fixture(scope="module")
def expected(tiny_engine) -> str:
    return tiny_engine.generate([PROBE["prompt"]], GenerationConfig(max_new_tokens=3, do_sample=False))[0].text


def ask(url: str, method: str, path: str, body: bytes) -> httpx.Response:
    return httpx.request(method, url + path, content=body, headers={"content-type": "application/json"},
                         timeout=TIMEOUT)


def probe(url: str, expected: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json=PROBE, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text[:300]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(request=requests)
def test_no_request_breaks_the_server(live_server, expected, request):
    check_answer(ask(live_server, *request))
    probe(live_server, expected)


def test_a_burst_of_bad_requests_from_many_clients_leaves_nothing_behind(live_server, expected):
    check_answer(httpx.post(f"{live_server}/v1/completions", content=b"x" * (17 * 2**20), timeout=TIMEOUT))
    bodies = 4 * [("POST", ROUTES[0], as_json(dict(base(ROUTES[0]), prompt="abc \ud800 def"))),
                  ("POST", ROUTES[1], as_json(dict(base(ROUTES[1]), messages=[{"role": "user", "content": 5}]))),
                  ("POST", ROUTES[0], b"[" * 100_000), ("POST", ROUTES[0], b'{"prompt": "\xff"}'),
                  ("POST", ROUTES[0], as_json(dict(base(ROUTES[0]), max_tokens=True))), ("DELETE", "/v1/x", b"")]
    answers: list = []
    threads = [threading.Thread(target=lambda b=b: answers.append(ask(live_server, *b))) for b in bodies]
    for t in threads:
        t.start()
    probe(live_server, expected)
    for t in threads:
        t.join(60)
    assert len(answers) == len(bodies)
    for r in answers:
        check_answer(r)
    probe(live_server, expected)
    assert httpx.get(f"{live_server}/health", timeout=5).json() == {"status": "ok"}
    wait_idle(live_server)
