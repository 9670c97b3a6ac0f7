"""Start ``hf-paged serve`` in a subprocess on a free loopback port (on the tiny model unless the flags name another
with ``--model``), and always stop it."""

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

START_TIMEOUT_S = 90
MODEL = "hf-paged-tiny"
NUM_BLOCKS, MAX_SEQS, MAX_QUEUED = 96, 32, 8  # a 1536-token cache, below the model's 2048 positions
#: The flags of the suite's shared server (``live_server`` in conftest.py).
FLAGS = ("--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", str(MAX_SEQS), "--max-queued-requests", str(MAX_QUEUED))
TIMEOUT = httpx.Timeout(60.0, connect=5.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*flags: str, env: dict | None = None, command: tuple[str, ...] = ("-m", "hf_paged")):
    """Yields ``(base_url, process)``; the process is killed on the way out whatever happened. The process's
    output goes to ``process.log`` (a file); ``command``: what runs before ``serve`` (a script may patch first)."""
    if "--model" not in flags:
        flags = ("--model", "tiny", *flags)
    port = free_port()
    log = tempfile.TemporaryFile()
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.Popen([sys.executable, *command, "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--device", "cpu", *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = log
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


def output(proc: subprocess.Popen) -> str:
    """What a ``running_server`` process has printed so far."""
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")


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
    log.seek(0)
    raise RuntimeError(f"the server did not answer /health within {START_TIMEOUT_S} s; its output: "
                       f"{log.read().decode(errors='replace')[-2000:]}")


def wait_idle(server: str, timeout: float = 20.0) -> str:
    """The /metrics page once no sequence is running or waiting and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        page = httpx.get(f"{server}/metrics", timeout=5).text
        busy = [metric(page, f"hf_paged_{n}") for n in ("requests_running", "requests_waiting", "kv_blocks_used")]
        if not any(busy) or time.monotonic() > deadline:
            assert not any(busy), f"still busy after {timeout} s: running, waiting, blocks = {busy}"
            return page
        time.sleep(0.1)


def metric(text: str, name: str) -> float:
    """The value of the sample ``name`` (with its labels, if any) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)
