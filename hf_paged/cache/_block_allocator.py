"""Fixed-size block allocator: a free list plus per-block reference counts.

Blocks are identified by integers in ``[0, num_blocks)``. A block is *free* when its reference count is 0 and it
sits on the free list; allocating pops from the free list (O(1)); sharing a block (prefix reuse, beam search,
``num_return_sequences``) increments its count; freeing decrements it and returns the block to the free list when
the count reaches 0. The allocator is pure bookkeeping: it never touches KV tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free.

    Attributes:
        needed: blocks the request asked for.
        free: blocks that were free at the time.
        total: blocks the pool holds.
    """

    def __init__(self, needed: int, free: int, total: int, hint: str = ""):
        self.needed, self.free, self.total = needed, free, total
        msg = (
            f"out of KV-cache blocks: {needed} needed, {free} free of {total}. "
            "Create the cache with more blocks (num_blocks=..., or a larger memory budget), "
            "a smaller batch, or fewer max_new_tokens.")
        super().__init__(msg + (f" {hint}" if hint else ""))


class BlockAllocator:
    """Free list of ``num_blocks`` blocks with reference counts.

    Invariants (checked by :meth:`check_invariants`): no block is handed out twice, and a block is on the free list
    iff its reference count is 0 (so ``num_free + num_used == num_blocks``).
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Insertion-ordered: allocation takes the block freed longest ago, so a prefix cache that keeps freed
        # blocks' contents findable evicts least recently used first; `take` reclaims one such block early.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref: list[int] = [0] * num_blocks

    @property
    def ref_counts(self) -> list[int]:
        """Each block's reference count (read only): for hot loops that check many blocks."""
        return self._ref

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        """Hand out ``n`` fresh blocks, each with reference count 1. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free), self.num_blocks)
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def is_free(self, block: int) -> bool:
        return self._ref[block] == 0

    def take(self, block: int) -> None:
        """Allocate one specific free block (a prefix-cache hit on a block no one holds)."""
        if self._ref[block] != 0:
            raise ValueError(f"block {block} is not free")
        del self._free[block]
        self._ref[block] = 1

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each of ``blocks`` (all must be in use)."""
        blocks = list(blocks)
        for b in blocks:
            if self._ref[b] <= 0:
                raise ValueError(f"cannot share block {b}: it is not allocated")
        for b in blocks:
            self._ref[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each of ``blocks``; a block whose count reaches 0 returns to the free list."""
        blocks = list(blocks)
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._ref[b] <= 0:
                raise ValueError(f"double free or invalid block id {b}")
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def check_invariants(self) -> None:
        for b, r in enumerate(self._ref):
            assert r >= 0, f"block {b} has negative reference count {r}"
            assert (r == 0) == (b in self._free), f"block {b}: ref {r} but on free list: {b in self._free}"
