"""Block allocator: O(1) allocate/free, reference counts, invariants under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.cache._block_allocator import BlockAllocator, OutOfBlocksError


def test_allocate_free_roundtrip():
    alloc = BlockAllocator(8)
    blocks = alloc.allocate(5)
    assert len(set(blocks)) == 5 and alloc.num_free == 3 and alloc.num_used == 5
    alloc.free(blocks)
    assert alloc.num_free == 8
    alloc.check_invariants()


def test_out_of_blocks_says_how_many_are_needed_and_changes_nothing():
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocksError, match="2 needed, 1 free of 4") as err:
        alloc.allocate(2)
    assert (err.value.needed, err.value.free, err.value.total) == (2, 1, 4)
    assert alloc.num_free == 1
    alloc.check_invariants()


def test_double_free_and_bad_ids_are_refused():
    alloc = BlockAllocator(4)
    (b,) = alloc.allocate(1)
    alloc.free([b])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([b])
    with pytest.raises(ValueError):
        alloc.free([99])
    with pytest.raises(ValueError):
        alloc.share([b])
    alloc.check_invariants()


def test_shared_block_returns_to_free_list_only_after_last_reference():
    alloc = BlockAllocator(2)
    (b,) = alloc.allocate(1)
    alloc.share([b])
    alloc.free([b])
    assert alloc.ref_count(b) == 1 and alloc.num_free == 1
    alloc.free([b])
    assert alloc.is_free(b) and alloc.num_free == 2


def test_lru_order_and_take():
    alloc = BlockAllocator(4)
    a, b, c, d = alloc.allocate(4)
    alloc.free([c])
    alloc.free([a])
    alloc.take(a)  # reclaim a specific free block
    assert alloc.allocate(1) == [c]
    with pytest.raises(ValueError):
        alloc.take(b)


@pytest.mark.parametrize("n", [0, -3, 2.5, None])
def test_invalid_pool_size(n):
    with pytest.raises(ValueError, match="positive integer"):
        BlockAllocator(n)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 6)), max_size=60))
def test_random_operations_keep_invariants(ops):
    alloc = BlockAllocator(10)
    held: list[int] = []  # one entry per reference we own
    for op, n in ops:
        if op == "alloc":
            if n > alloc.num_free:
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate(n)
            else:
                got = alloc.allocate(n)
                assert not set(got) & set(held), "a block was handed out twice"
                held += got
        elif op == "free" and held:
            b = held.pop(n % len(held))
            alloc.free([b])
        elif op == "share" and held:
            b = held[n % len(held)]
            alloc.share([b])
            held.append(b)
        alloc.check_invariants()
        assert alloc.num_used == len(set(held))
    alloc.free(held)
    assert alloc.num_free == alloc.num_blocks
