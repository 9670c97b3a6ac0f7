"""What the server tests share: one live ``hf-paged serve`` (the embedded model, seed 0) for the whole session, and
the same model's engine in this process, the oracle of its answers."""

from __future__ import annotations

import pytest

from server_process import FLAGS, MAX_SEQS, NUM_BLOCKS, running_server


@pytest.fixture(scope="session")
def live_server():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with running_server(*FLAGS) as (url, _):
        yield url


@pytest.fixture(scope="session")
def tiny_engine():
    from hf_paged import Engine
    from hf_paged.cli.default_model import load_model

    model, tokenizer = load_model("tiny", "cpu", None, 0)  # the server's model: seed 0
    return Engine(model, num_blocks=NUM_BLOCKS, max_num_seqs=MAX_SEQS, tokenizer=tokenizer)
