"""What the live server refuses at the door, and that refusing costs the other clients nothing: text that is not
valid Unicode (the issue's curl), bodies too large (refused before they are read, while other requests keep their
latency), prompts far too long (refused before they are tokenized), slow clients (408, a stalled body or one trickled past its deadline), foreign ``Host`` names
(DNS rebinding), and the shape of every error (OpenAI's, unknown routes and methods included)."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from transformers import GenerationConfig  # noqa: E402

from server_process import MODEL, TIMEOUT, running_server, wait_idle  # noqa: E402

pytestmark = pytest.mark.slow  # a server subprocess

PROBE = {"model": MODEL, "prompt": "Latency probe", "max_tokens": 2, "temperature": 0}


def post_json(url: str, body: dict) -> httpx.Response:
    """``body`` as JSON with ASCII escapes (an unpaired surrogate travels as ``\\ud800``, as JavaScript sends it)."""
    return httpx.post(url, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                      timeout=TIMEOUT)


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_the_issues_surrogate_curl_is_a_400_and_the_next_request_succeeds(live_server, tiny_engine):
    raw = b'{"model":"hf-paged-tiny","prompt":"abc \\ud800 def","max_tokens":2}'  # what the issue's curl sends
    error = openai_error(httpx.post(f"{live_server}/v1/completions", content=raw,
                                    headers={"content-type": "application/json"}, timeout=TIMEOUT), 400)
    assert error["param"] == "prompt" and error["code"] == "invalid_text" and "U+D800" in error["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}
    error = openai_error(post_json(f"{live_server}/v1/chat/completions", chat), 400)
    assert error["param"] == "messages.0.content"
    stop = {"model": MODEL, "prompt": "hi", "stop": ["ok", "\udfff"]}
    assert openai_error(post_json(f"{live_server}/v1/completions", stop), 400)["param"] == "stop.1"
    expected = tiny_engine.generate(["abc  def"], GenerationConfig(max_new_tokens=2, do_sample=False))[0].text
    r = httpx.post(f"{live_server}/v1/completions", json={"model": MODEL, "prompt": "abc  def", "max_tokens": 2,
                                                          "temperature": 0}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    pair = "abc \ud83d\ude00 def"  # a whole surrogate pair is the character it encodes
    r = post_json(f"{live_server}/v1/completions", {"model": MODEL, "prompt": pair, "max_tokens": 2,
                                                    "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(tiny_engine.tokenizer.encode("abc \U0001F600 def"))


DOOR_ERRORS = {
    "not UTF-8": (b'{"model": "hf-paged-tiny", "prompt": "\xff"}', None, "invalid_json"),
    "deep nesting": (b'{"model": "hf-paged-tiny", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None,
                     "invalid_json"),
    "nested objects": (b'{"user": ' + b'{"a": ' * 200 + b"1" + b"}" * 201, None, "invalid_json"),
    "NaN": (b'{"model": "hf-paged-tiny", "prompt": "hi", "temperature": NaN}', None, "invalid_json"),
    "max_tokens true": (b'{"model": "hf-paged-tiny", "prompt": "hi", "max_tokens": true}', "max_tokens", None),
    "n as a string": (b'{"model": "hf-paged-tiny", "prompt": "hi", "n": "2"}', "n", None),
    "prompt a number": (b'{"model": "hf-paged-tiny", "prompt": 12}', "prompt", None),
    "prompt ids with a bool": (b'{"model": "hf-paged-tiny", "prompt": [5, true]}', "prompt", None),
    "stop a number": (b'{"model": "hf-paged-tiny", "prompt": "hi", "stop": 5}', "stop", None),
    "huge max_tokens": (b'{"model": "hf-paged-tiny", "prompt": "hi", "max_tokens": ' + b"9" * 40 + b"}", "max_tokens",
                        None),
    "not an object": (b'[1, 2]', None, "invalid_json"),
    "empty body": (b"", None, "invalid_json"),
}


@pytest.mark.parametrize("case", list(DOOR_ERRORS))
def test_bad_bodies_are_400s_naming_the_field_as_the_client_wrote_it(live_server, case):
    body, param, code = DOOR_ERRORS[case]
    r = httpx.post(f"{live_server}/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    error = openai_error(r, 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if code:
        assert error["code"] == code
    assert "str" not in (error["param"] or "") and "function-after" not in error["message"]


def test_unknown_routes_and_methods_and_model_ids_answer_in_openais_shape(live_server):
    error = openai_error(httpx.get(f"{live_server}/v1/embeddings", timeout=TIMEOUT), 404)
    assert "/v1/embeddings" in error["message"] and error["type"] == "not_found_error"
    error = openai_error(httpx.delete(f"{live_server}/v1/completions", timeout=TIMEOUT), 405)
    assert "DELETE" in error["message"]
    client = openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert err.value.body["code"] == "model_not_found"


def latency(url: str) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json=PROBE, timeout=TIMEOUT)
    assert r.status_code == 200
    return time.perf_counter() - start


def send_headers_and_some_body(url: str, length: int | None, body: bytes) -> tuple[bytes, float]:
    """A raw request announcing ``length`` bytes (None: chunked) and sending ``body``; the first bytes of the answer
    and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  f"{framing}\r\n\r\n".encode())
        try:
            s.sendall(body)
        except OSError:  # the server answered and closed while we were still sending
            pass
        answer = read_answer(s)
    return answer, time.perf_counter() - start


def read_answer(s: socket.socket) -> bytes:
    """An error answer's head and JSON body, or what came before the server closed the connection."""
    answer = s.recv(300)
    while answer and not answer.endswith(b"}"):
        more = s.recv(300)
        if not more:
            break
        answer += more
    return answer


def test_a_50_mb_body_is_refused_at_once_while_other_requests_keep_their_latency(live_server):
    wait_idle(live_server)
    before = statistics.median(latency(live_server) for _ in range(5))
    during: list[float] = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            during.append(latency(live_server))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        answer, seconds = send_headers_and_some_body(live_server, 50 * 2**20, b"x" * 2**20)
        assert answer.startswith(b"HTTP/1.1 413") and seconds < 2, (answer, seconds)
        chunk = b"%x\r\n%s\r\n" % (2**20, b"[" * 2**20)
        answer, seconds = send_headers_and_some_body(live_server, None, chunk * 20)  # 20 MB, no length announced
        assert answer.startswith(b"HTTP/1.1 413") and seconds < 10, (answer, seconds)
        long_text = {"model": MODEL, "prompt": "y" * 10_000_000, "max_tokens": 1}  # under the size limit
        start = time.perf_counter()
        error = openai_error(httpx.post(f"{live_server}/v1/completions", json=long_text, timeout=TIMEOUT), 400)
        assert error["code"] == "context_length_exceeded" and time.perf_counter() - start < 5
        time.sleep(0.5)
    finally:
        stop.set()
        prober.join(30)
    assert during and max(during) < 3 * before + 1.0, (before, during)
    wait_idle(live_server)


def trickle_body(url: str, every: float, limit: float) -> tuple[bytes, float]:
    """A raw request announcing a 100-byte body and sending one byte of it every ``every`` seconds, for at most
    ``limit`` seconds; the first bytes of the answer and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n")
        s.settimeout(every)
        while time.perf_counter() - start < limit:
            try:
                s.sendall(b" ")  # (whitespace: valid JSON, were it ever complete)
                return read_answer(s), time.perf_counter() - start
            except TimeoutError:
                continue
            except OSError:  # the server answered and closed while we were still sending
                break
        s.settimeout(5)
        return read_answer(s), time.perf_counter() - start


def test_a_slow_client_gets_408_or_is_disconnected_and_a_foreign_host_403():
    with running_server("--num-blocks", "32", "--read-timeout", "1", "--body-timeout", "2") as (url, _):
        answer, seconds = send_headers_and_some_body(url, 100, b'{"model": ')
        assert answer.startswith(b"HTTP/1.1 408") and b"read_timeout" in answer and 0.9 < seconds < 5, answer
        answer, seconds = trickle_body(url, every=0.5, limit=10)  # each byte within --read-timeout, the body never
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer and 1.9 < seconds < 4, answer
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:  # headers that never end (slowloris)
            start = time.perf_counter()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            time.sleep(0.5)
            s.sendall(b"X-Slow: 1\r\n")
            assert s.recv(100) == b"" and 0.9 < time.perf_counter() - start < 5  # closed by the server
        error = openai_error(httpx.post(f"{url}/v1/completions", json=PROBE, headers={"Host": "evil.example:80"},
                                        timeout=TIMEOUT), 403)
        assert error["code"] == "host_not_allowed"
        assert httpx.post(f"{url}/v1/completions", json=PROBE, headers={"Host": "localhost:1234"},
                          timeout=TIMEOUT).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=PROBE, headers={"Host": "[::1]"},
                          timeout=TIMEOUT).status_code == 200
