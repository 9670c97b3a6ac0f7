"""A stand-in for the KV pool in scheduler tests: each slot remembers which tokens its KV was computed from.

A real token's KV depends on every token up to it (attention mixes them from the second layer on), so a slot records
the whole prefix ending at its token: a prefix-cache hit on a block whose own tokens match but whose earlier tokens
differ reads back the wrong record.
"""

from __future__ import annotations

from hf_paged.cache._block_allocator import BlockAllocator
from hf_paged.cache._block_manager import BlockManager
from hf_paged.cache._block_table import BlockTableBuffer
from hf_paged.engine._sequence import Sequence


class FakeKV:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.content: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        for s, d in zip(src, dst):
            self.content[d] = list(self.content[s])

    def write(self, seq: Sequence, n: int) -> None:
        """What a forward does: the KV of tokens ``[computed, computed + n)`` lands in their slots."""
        bs = self.block_size
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.content[seq.block_table[p // bs]][p % bs] = tuple(seq.token_ids[: p + 1])

    def check(self, seq: Sequence) -> None:
        """Every computed token of ``seq`` reads back its own KV through the block table (hits and copies too)."""
        bs = self.block_size
        for p in range(seq.num_computed_tokens):
            got = self.content[seq.block_table[p // bs]][p % bs]
            assert got == tuple(seq.token_ids[: p + 1]), (seq, p, got)


def make_block_manager(num_blocks: int, block_size: int, max_rows: int, prefix_caching: bool = True):
    kv = FakeKV(num_blocks, block_size)
    bm = BlockManager(BlockAllocator(num_blocks), block_size, BlockTableBuffer(max_rows, 2), kv.copy_blocks,
                      prefix_caching)
    return bm, kv


def check_table_rows(bm: BlockManager, seqs: list[Sequence]) -> None:
    """The block-table buffer mirrors every live sequence's block table."""
    for seq in seqs:
        if seq.row >= 0:
            row = bm.tables.table[seq.row, : len(seq.block_table)].tolist()
            assert row == seq.block_table, (row, seq.block_table)
