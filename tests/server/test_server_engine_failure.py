"""A request that fails inside the engine answers 500 with the engine's reason, its neighbours are served, and the
server keeps serving. In process (the fault is injected into the model), through the ASGI app."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from hf_paged import Engine  # noqa: E402
from hf_paged.cli.default_model import load_model  # noqa: E402
from hf_paged.server import create_app  # noqa: E402

POISON = "\x07"  # the byte tokenizer's id for it is 3 + 7


def poisoned_engine() -> Engine:
    model, tokenizer = load_model("tiny", "cpu", None, 0)
    forward = model.forward
    poison = tokenizer.encode(POISON)[0]

    def faulty_forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and bool((ids == poison).any()):
            raise RuntimeError("injected fault")
        return forward(*args, **kwargs)

    model.forward = faulty_forward
    return Engine(model, num_blocks=64, tokenizer=tokenizer)


def test_engine_failure_is_a_500_and_the_server_keeps_serving():
    engine = poisoned_engine()
    expected = engine.generate(["healthy"], GenerationConfig(max_new_tokens=4, do_sample=False))[0].text
    with TestClient(create_app(engine, "tiny")) as client:
        bad = client.post("/v1/completions", json={"model": "tiny", "prompt": f"bad {POISON}", "max_tokens": 4})
        assert bad.status_code == 500
        error = bad.json()["error"]
        assert error["code"] == "engine_error" and "injected fault" in error["message"]
        stream = client.post("/v1/completions", json={"model": "tiny", "prompt": f"bad {POISON}", "max_tokens": 4,
                                                      "stream": True})
        assert stream.status_code == 200 and "injected fault" in stream.text and "[DONE]" in stream.text
        good = client.post("/v1/completions", json={"model": "tiny", "prompt": "healthy", "max_tokens": 4,
                                                    "temperature": 0})
        assert good.status_code == 200 and good.json()["choices"][0]["text"] == expected
        assert client.get("/health").status_code == 200
