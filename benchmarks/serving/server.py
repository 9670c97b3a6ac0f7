"""A server under benchmark as a subprocess: started with its output in a log file, ready when ``/health`` answers
200, stopped with SIGTERM (then SIGKILL) whatever happened."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx

STOP_TIMEOUT_S = 15


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``cmd`` must listen on ``127.0.0.1:<port>``, the port being the argument after ``--port``."""

    def __init__(self, cmd: list[str], log: Path, cwd: Path, env: dict[str, str] | None = None):
        self.cmd, self.log, self.cwd = cmd, log, cwd
        self.url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        # Servers run this checkout's hf_paged, and never reach for the network
        path = os.pathsep.join(p for p in (str(cwd), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                    "HF_HUB_DISABLE_UPDATE_CHECK": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env,
                                         start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def wait_ready(self, poll_s: float = 0.5) -> None:
        """Wait until ``/health`` answers 200."""
        async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with status {self.proc.returncode}")
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(poll_s)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # its whole process group: a server may have started workers
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
