"""A mixed step through the cuda backend: the decode rows in front of the prefill chunks (``single_token_prefix``)
go to the decode kernel, the rest to the prefill kernel, into one output. Judged against the float64 torch oracle
on fresh random data, and against the same step served by the prefill kernel alone; a prefix that is the whole step
(only the decode kernel runs) and one that stops before a later one-token row (which the prefill kernel keeps).
float32 is served by the prefill path alone, split or not."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from kernel_steps import check, params_for, prefill_step, reference

from hf_paged import available_backends
from hf_paged.attention import AttentionInputs, Phase
from hf_paged.attention.backends.base import backend_named

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")
available_backends()  # registers every backend module (the cuda one among them)

# (cached prefix lengths, new-token counts, single_token_prefix): decode rows first, then chunks; a one-token row
# after the first chunk stays with the prefill kernel; contexts that cross key tiles and blocks.
STEPS = {
    "decode-then-chunks": ([40, 300, 1000, 0, 5, 77], [1, 1, 1, 300, 1, 129], 3),
    "one-decode-row": ([700, 0], [1, 64], 1),
    "prefix-not-taken": ([17, 0, 33], [1, 200, 1], 0),
    "all-one-token": ([0, 0, 0], [1, 1, 1], 3),
}


def seeded(label: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(label.encode()))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("step", list(STEPS))
def test_decode_rows_in_front_go_to_the_decode_kernel(step: str, dtype: torch.dtype, head_dim: int):
    """float32 takes no split (its prefill runs each row as a decode and writes every row): the split step must
    still equal the oracle, which the split once broke (the prefill pass overwrote the decode rows)."""
    prefix, new, ones = STEPS[step]
    meta, query, key, value, k_cache, v_cache, params = prefill_step(prefix, new, 16, 32, 8, head_dim, dtype,
                                                                     seeded(f"{step}-{dtype}-{head_dim}"))
    assert meta.phase is not Phase.DECODE
    backend = backend_named("cuda")
    split_meta = dataclasses.replace(meta, single_token_prefix=ones)
    split = backend.forward(AttentionInputs(query, key, value, k_cache, v_cache, split_meta, params),
                            backend.plan(split_meta))
    expected = reference(query, k_cache, v_cache, meta, params)
    check(split, expected, dtype, f"{step} split at {ones}")
    whole = backend.forward(AttentionInputs(query, key, value, k_cache, v_cache, meta, params),
                            backend.plan(meta))  # the prefill kernel alone
    check(whole, expected, dtype, f"{step} prefill kernel only")
    if ones:  # the two kernels differ on the decode rows only
        assert torch.equal(split[ones:], whole[ones:])
    else:
        assert torch.equal(split, whole)


@pytest.mark.parametrize("window,softcap", [(100, 0.0), (0, 5.0)])
def test_a_split_step_keeps_the_window_and_the_softcap(window: int, softcap: float):
    meta, query, key, value, k_cache, v_cache, _ = prefill_step([500, 90, 0], [1, 1, 260], 16, 32, 8, 128,
                                                                torch.bfloat16, seeded(f"options-{window}-{softcap}"))
    params = params_for(128, window, softcap)
    query = query * 3.0  # scores large enough for a softcap of 5 to matter
    backend, split_meta = backend_named("cuda"), dataclasses.replace(meta, single_token_prefix=2)
    out = backend.forward(AttentionInputs(query, key, value, k_cache, v_cache, split_meta, params),
                          backend.plan(split_meta))
    check(out, reference(query, k_cache, v_cache, meta, params), torch.bfloat16, f"window {window} softcap {softcap}")
