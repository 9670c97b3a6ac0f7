"""``hf-paged serve`` starting and stopping: a bad or taken port is one line and exit status 2 before anything says
it is serving; SIGTERM answers requests still running past ``--shutdown-timeout`` with a 503 in OpenAI's shape and
logs no traceback; an engine thread that dies answers its clients at once and the process exits with status 1 (for
a supervisor to restart it) instead of hanging them."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_process import MODEL, TIMEOUT, output, running_server  # noqa: E402

pytestmark = pytest.mark.slow  # server subprocesses


def serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_paged", "serve", "--device", "cpu", *flags],
                          capture_output=True, text=True, timeout=120)


def test_a_bad_or_taken_port_is_one_line_before_anything_serves():
    bad = serve("--port", "99999")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "--port" in bad.stderr and "65535" in bad.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        start = time.monotonic()
        busy = serve("--port", str(taken.getsockname()[1]))
        assert busy.returncode == 2 and "serving" not in busy.stdout + busy.stderr
        assert busy.stderr.count("\n") == 1 and "Address already in use" in busy.stderr
        assert time.monotonic() - start < 60  # refused before the model would load
    host = serve("--host", "no-such-host.invalid")
    assert host.returncode == 2 and host.stderr.count("\n") == 1 and "--host" in host.stderr


def test_sigterm_answers_requests_past_the_timeout_with_a_503_and_no_traceback():
    with running_server("--num-blocks", "160", "--shutdown-timeout", "1") as (url, proc):
        long = {"model": MODEL, "prompt": "endless", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
        answers: list = []
        streamed: list[str] = []

        def ask():
            answers.append(httpx.post(f"{url}/v1/completions", json=long, timeout=TIMEOUT))

        def stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=dict(long, stream=True), timeout=TIMEOUT) as r:
                streamed.extend(line for line in r.iter_lines() if line)

        threads = [threading.Thread(target=ask), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(streamed) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
        for t in threads:
            t.join(30)
        (answer,) = answers
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "shutting_down"
        assert any("shutting_down" in line for line in streamed) and streamed[-1] == "data: [DONE]"
        log = output(proc)
        assert "Traceback" not in log and "Exception" not in log, log


KILLER = textwrap.dedent("""
    import sys

    from hf_paged.cli import main
    from hf_paged.cli.default_model import byte_tokenizer
    from hf_paged.engine import Engine

    POISON = byte_tokenizer().encode("die!")
    armed = []
    add_requests, has_unfinished = Engine.add_requests, Engine.has_unfinished

    def add(self, prompts, *args, **kwargs):
        if any(list(prompt) == POISON for prompt in prompts):
            armed.append(True)
        return add_requests(self, prompts, *args, **kwargs)

    def unfinished(self):  # a bug in the loop itself, outside any one request
        if armed:
            raise RuntimeError("injected loop fault")
        return has_unfinished(self)

    Engine.add_requests, Engine.has_unfinished = add, unfinished
    sys.exit(main(sys.argv[1:], prog="hf-paged"))
""")


def test_an_engine_loop_that_dies_answers_its_clients_and_the_process_exits_1(tmp_path):
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    with running_server("--num-blocks", "32", command=(str(script),)) as (url, proc):
        ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 2},
                        timeout=TIMEOUT)
        assert ok.status_code == 200
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "die!", "max_tokens": 50},
                       timeout=TIMEOUT)
        assert r.status_code in (500, 503) and r.json()["error"]["code"] == "engine_dead"
        assert "injected loop fault" in r.json()["error"]["message"]
        assert proc.wait(30) == 1
        assert time.monotonic() - start < 30
        log = output(proc)
        assert "error: the engine loop died (RuntimeError: injected loop fault)" in log, log
