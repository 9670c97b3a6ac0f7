"""``hf-paged serve`` sets what exists once its engine is up aside from the garbage collector for good
(``gc.freeze()``), before it serves: the model, its compiled layers and the libraries are never walked by a full
collection while requests wait."""

from __future__ import annotations

import gc
import socket
from types import SimpleNamespace

import pytest

from hf_paged.cli import _serve, build_parser

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_serve_freezes_after_the_engine_is_up_and_before_it_serves(monkeypatch):
    assert gc.get_freeze_count() == 0
    seen = {}
    engine_made = [object()]  # a list, which the collector tracks: what the engine's start left behind
    app = SimpleNamespace(state=SimpleNamespace(engine_loop=SimpleNamespace(
        engine=SimpleNamespace(config=SimpleNamespace(num_blocks=8, block_size=16),
                               stats=lambda: {"sizing": {"num_blocks": "given"}}), death=None)))

    def app_of(args):
        seen["frozen at start"] = gc.get_freeze_count()
        return app

    class Server:
        def run(self, sockets):
            seen["frozen when serving"] = gc.get_freeze_count()
            seen["engine's objects set aside"] = not any(o is engine_made for o in gc.get_objects())

    monkeypatch.setattr(_serve, "_app", app_of)
    monkeypatch.setattr(_serve, "_server", lambda args, app: Server())
    monkeypatch.setattr(_serve, "bind", lambda host, port: socket.create_server((host, 0)))  # any free port
    args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", "8000"])
    try:
        assert _serve.run(args) == 0
    finally:
        gc.unfreeze()
    assert seen["frozen at start"] == 0
    assert seen["frozen when serving"] > 1000 and seen["engine's objects set aside"]
