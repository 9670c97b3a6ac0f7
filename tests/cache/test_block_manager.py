"""Property tests of the block manager: random admissions, growth, forks and frees keep every invariant, and every
computed token reads back its own KV (prefix-cache hits and copy-on-write included). Prefix-cache keys: distinct for
prefixes that ``hash()`` confuses, the same in every process, and a colliding key never serves another prefix's KV."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

import torch
from fake_kv import check_table_rows, make_block_manager
from hf_paged.cache import _block_manager as block_manager
from hf_paged.runner._device_block_table import DeviceBlockTable
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._sequence import Sequence

PARAMS = SamplingParams(max_new_tokens=4)


def constant_key(parent: bytes | None, token_bytes: bytes) -> bytes:
    """Every block collides."""
    return bytes(32)


def parent_blind_key(parent: bytes | None, token_bytes: bytes) -> bytes:
    """Blocks with the same tokens collide, whatever came before them."""
    return hashlib.sha256(token_bytes).digest()


@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(2, 24),
    block_size=st.sampled_from([1, 2, 3, 4]),
    ops=st.lists(st.tuples(st.sampled_from(["add", "grow", "fork", "free"]), st.integers(0, 10**6)), max_size=60),
    all_keys_collide=st.booleans(),
)
def test_random_operations_keep_invariants(num_blocks, block_size, ops, all_keys_collide):
    with pytest.MonkeyPatch.context() as mp:
        if all_keys_collide:  # only the token and parent checks on a hit keep prefixes apart
            mp.setattr(block_manager, "block_key", constant_key)
        _random_operations(num_blocks, block_size, ops)


def _random_operations(num_blocks, block_size, ops):
    bm, kv = make_block_manager(num_blocks, block_size, max_rows=64)
    # A device copy of the tables' first 3 columns (the host's grow past them), synced after some of the steps
    device_tables = DeviceBlockTable(bm.tables, 3, torch.device("cpu"))
    live: list[Sequence] = []
    for n, (op, r) in enumerate(ops):
        if op == "add":  # small vocabulary and shared starts so prefixes repeat
            prompt = [r % 3] * (r % 5) + [(r >> 3) % 4 for _ in range(1 + r % 13)]
            seq = Sequence(str(n), prompt, PARAMS, (n, 0), seed=0)
            hits = bm.find_prefix(seq)
            todo = min(seq.num_tokens - len(hits) * block_size, 1 + r % 7)
            if bm.blocks_needed(seq, todo, hits) <= bm.num_free_blocks:
                bm.admit(seq, hits)
                live.append(seq)
                _compute(bm, kv, seq, todo)
        elif op == "grow" and live:
            seq = live[r % len(live)]
            if seq.num_uncomputed == 0:
                seq.token_ids.append(r % 4)
            todo = bm.max_tokens_fitting(seq, min(seq.num_uncomputed, 1 + r % 5))
            if todo:
                _compute(bm, kv, seq, todo)
        elif op == "fork" and live:
            parent = live[r % len(live)]
            if parent.num_computed_tokens:
                child = Sequence(f"{n}c", parent.token_ids[: parent.num_computed_tokens + 1], PARAMS, (n, 1), 0)
                bm.fork(parent, child, parent.num_computed_tokens)
                live.append(child)
        elif op == "free" and live:
            bm.free(live.pop(r % len(live)))
        bm.check_invariants(live)
        check_table_rows(bm, live)
        for seq in live:
            kv.check(seq)
        if r % 3 == 0:  # several steps' writes (rows freed and taken again among them) reach the copy at once
            device_tables.sync()
            check_device_rows(device_tables, live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks


def check_device_rows(device_tables: DeviceBlockTable, seqs: list[Sequence]) -> None:
    """The device copy holds every live sequence's blocks in the columns it keeps; its padding row stays 0."""
    for seq in seqs:
        kept = min(len(seq.block_table), device_tables.width)
        assert device_tables.table[seq.row, :kept].tolist() == seq.block_table[:kept], seq
    assert not device_tables.table[device_tables.pad_row].any()


def _compute(bm, kv, seq, n):
    bm.reserve(seq, n)
    kv.write(seq, n)
    bm.commit([seq], [n])


def test_freed_blocks_stay_findable_until_reallocated_least_recently_used_first():
    bm, kv = make_block_manager(num_blocks=4, block_size=2, max_rows=8)
    a = Sequence("a", [1, 2, 3, 4, 5], PARAMS, (0, 0), 0)
    bm.admit(a, [])
    _compute(bm, kv, a, 5)
    a_full_blocks = a.block_table[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    again = Sequence("b", [1, 2, 3, 4, 9], PARAMS, (1, 0), 0)
    hits = bm.find_prefix(again)
    assert hits == a_full_blocks
    bm.admit(again, hits)  # takes the two free cached blocks back
    assert again.num_computed_tokens == 4 and bm.num_free_blocks == 2
    _compute(bm, kv, again, 1)
    kv.check(again)
    bm.free(again)
    other = Sequence("c", [7] * 8, PARAMS, (2, 0), 0)
    bm.admit(other, [])
    _compute(bm, kv, other, 8)  # needs all 4 blocks: evicts every cached prefix
    assert bm.find_prefix(Sequence("d", [1, 2, 3, 4, 5], PARAMS, (3, 0), 0)) == []
    bm.check_invariants([other])


def _run(bm, kv, name, prompt):
    """Admit a sequence with its prefix hits and compute its whole prompt."""
    seq = Sequence(name, prompt, PARAMS, (0, 0), 0)
    bm.admit(seq, bm.find_prefix(seq))
    _compute(bm, kv, seq, seq.num_uncomputed)
    kv.check(seq)
    return seq


def test_prefixes_that_collide_under_hash_get_their_own_keys_and_blocks():
    # ints hash modulo 2**61 - 1: under hash() the second block shadowed the first one's key
    a, b = [3, 7], [3, 7 + 2**61 - 1]
    assert hash((None, tuple(a))) == hash((None, tuple(b)))
    bm, kv = make_block_manager(num_blocks=8, block_size=2, max_rows=8)
    first, second = _run(bm, kv, "a", a + [5]), _run(bm, kv, "b", b + [5])
    assert first.num_computed_tokens == second.num_computed_tokens == 3  # no hit on the other's block
    assert first.last_block_hash != second.last_block_hash and bm.num_cached_blocks == 2
    for prompt, owner in ((a, first), (b, second)):
        assert bm.find_prefix(Sequence("probe", prompt + [9], PARAMS, (1, 0), 0)) == owner.block_table[:1]
    bm.check_invariants([first, second])


@pytest.mark.parametrize("weak_key, want", [
    # only [1, 2] is cached: every later block found the key taken
    (constant_key, {(1, 2, 3, 4, 6): ("a", 1), (7, 8, 3, 4, 5): ("b", 0), (9, 9, 3, 4, 5): ("a", 0)}),
    # [3, 4] is cached after [1, 2], and [7, 8] is cached, but [7, 8, 3, 4] is not
    (parent_blind_key, {(1, 2, 3, 4, 6): ("a", 2), (7, 8, 3, 4, 5): ("b", 1), (9, 9, 3, 4, 5): ("a", 0)}),
], ids=["constant", "parent-blind"])
def test_a_colliding_key_never_serves_another_prefixs_kv(monkeypatch, weak_key, want):
    monkeypatch.setattr(block_manager, "block_key", weak_key)
    bm, kv = make_block_manager(num_blocks=16, block_size=2, max_rows=8)
    live = {"a": _run(bm, kv, "a", [1, 2, 3, 4, 5]), "b": _run(bm, kv, "b", [7, 8, 0])}
    for prompt, (owner, num_hits) in want.items():
        assert bm.find_prefix(Sequence("probe", list(prompt), PARAMS, (1, 0), 0)) == \
            live[owner].block_table[:num_hits], prompt
        live[prompt] = _run(bm, kv, str(prompt), list(prompt))  # kv.check: each token reads back its own prefix
    bm.check_invariants(list(live.values()))


def registered_keys(prompt: list[int], block_size: int) -> list[str]:
    """The prefix-cache keys (hex) a block manager gives the full blocks of ``prompt``, one block computed at a time."""
    bm, kv = make_block_manager(num_blocks=len(prompt), block_size=block_size, max_rows=1)
    seq = Sequence("a", prompt, PARAMS, (0, 0), 0)
    bm.admit(seq, [])
    keys = []
    for _ in range(len(prompt) // block_size):
        _compute(bm, kv, seq, block_size)
        keys.append(seq.last_block_hash.hex())
    return keys


@pytest.mark.slow
def test_keys_are_sha256_of_the_chain_and_the_same_in_every_process():
    prompt, bs = list(range(1000, 1013)) + [0, 2**40], 4  # 15 tokens: 3 full blocks
    keys = registered_keys(prompt, bs)
    want, parent = [], b""
    for i in range(3):
        parent = hashlib.sha256(parent + struct.pack("<4q", *prompt[i * bs : (i + 1) * bs])).digest()
        want.append(parent.hex())
    assert keys == want
    here = os.path.dirname(os.path.abspath(__file__))
    helpers = os.path.join(os.path.dirname(here), "helpers")
    code = (f"import sys; sys.path[:0] = {[here, helpers]!r}; "
            f"from test_block_manager import registered_keys; print(registered_keys({prompt!r}, {bs}))")
    seed = "1" if os.environ.get("PYTHONHASHSEED") == "0" else "0"  # another seed than this process's
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == repr(keys), out.stderr
