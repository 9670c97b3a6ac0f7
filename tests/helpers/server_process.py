"""Start ``hf-paged serve`` (with the flags given: tests pass ``--model tiny``) in a subprocess on a free loopback port,
and always stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*flags: str):
    """Yields ``(base_url, process)``; the process is killed on the way out whatever happened."""
    port = free_port()
    log = tempfile.TemporaryFile()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "hf_paged", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        log.close()


def wait_healthy(url: str, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read().decode(errors='replace')}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S} s")


def metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels, if any) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)
