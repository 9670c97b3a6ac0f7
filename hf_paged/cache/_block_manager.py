"""``BlockManager``: per-sequence block tables over the pool's allocator, with a prefix cache.

Prefix cache: once a block is full its content is fixed, so it is keyed by ``block_key``, SHA-256 of the key of the
block before it and the block's token ids: the key names the whole prefix. The digest must resist collisions, since
a prompt built to collide with another's key would be served that prompt's KV (``hash()`` is easy to collide on
purpose for int tuples, and differs between processes for strings and ``None``). A hit also compares the block's
own tokens and its parent's key with the stored ones: two cheap ``bytes`` comparisons that catch a colliding block,
though not a colliding earlier prefix.

A new sequence walks its full blocks and reuses every leading block whose key is known, prefilling only the rest. A
block keeps its key after it is freed: it sits on the allocator's free list (so it counts as free) and can still be
found; a hit on such a block takes it back with ``allocator.take``. The allocator hands out the block freed longest
ago, so unreferenced cached blocks are evicted least recently used first; the stale key is dropped then.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Protocol

from hf_paged.cache._block_allocator import BlockAllocator
from hf_paged.cache._block_table import BlockTableBuffer


class Sequence(Protocol):
    """What the block manager reads and writes of a sequence (the engine's ``Sequence`` is one)."""

    token_ids: list[int]
    block_table: list[int]
    row: int
    num_computed_tokens: int
    num_hashed_blocks: int
    last_block_hash: bytes | None

    @property
    def num_tokens(self) -> int: ...


def block_key(parent: bytes | None, token_bytes: bytes) -> bytes:
    """Prefix-cache key of a full block: SHA-256 of its parent's key (None for a first block) and its token ids.

    ``token_bytes``: the block's ``block_size`` token ids as little-endian int64. Every key is 32 bytes, so a first
    block's message (tokens only) never has the length of a later block's (key + tokens).
    """
    return hashlib.sha256(token_bytes if parent is None else parent + token_bytes).digest()


class BlockManager:
    """Hands blocks to sequences; ``copy_blocks(src, dst)`` copies KV for copy-on-write (``KVPool.copy_blocks``)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, tables: BlockTableBuffer,
                 copy_blocks: Callable[[list[int], list[int]], None], enable_prefix_caching: bool = True):
        self.allocator, self.block_size, self.tables, self.copy_blocks = allocator, block_size, tables, copy_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._pack = struct.Struct(f"<{block_size}q").pack
        self._key_to_block: dict[bytes, int] = {}
        self._block_key: dict[int, tuple[bytes, bytes | None, bytes]] = {}  # block -> (key, parent key, token bytes)
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_to_block)

    # ----- prefix cache ----------------------------------------------------------------------------------------
    def find_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the leading full blocks of ``seq`` (at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = self._token_bytes(seq.token_ids, i)
            key = block_key(parent, tokens)
            block = self._key_to_block.get(key)
            if block is None or self._block_key[block][1:] != (parent, tokens):
                break
            hits.append(block)
            parent = key
        return hits

    def _token_bytes(self, token_ids: list[int], i: int) -> bytes:
        """The token ids of block ``i`` as ``block_key`` hashes them."""
        return self._pack(*token_ids[i * self.block_size : (i + 1) * self.block_size])

    def register_full_blocks(self, seq: Sequence) -> None:
        """Make ``seq``'s computed full blocks not registered yet findable in the prefix cache."""
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // self.block_size):
            parent, tokens = seq.last_block_hash, self._token_bytes(seq.token_ids, i)
            key, block = block_key(parent, tokens), seq.block_table[i]
            if key not in self._key_to_block and block not in self._block_key:
                self._key_to_block[key] = block
                self._block_key[block] = (key, parent, tokens)
            seq.last_block_hash, seq.num_hashed_blocks = key, i + 1

    def reset_prefix_cache(self) -> int:
        """Make no block findable any more (the KV in the pool was computed with weights that have changed since);
        returns how many were. Sequences holding blocks must be freed first: their later blocks would register under
        keys chained to the forgotten ones."""
        findable = len(self._key_to_block)
        self._key_to_block.clear()
        self._block_key.clear()
        return findable

    def _allocate(self, n: int) -> list[int]:
        blocks = self.allocator.allocate(n)
        for b in blocks:  # these blocks get new content: their old prefix-cache keys are stale
            key = self._block_key.pop(b, None)
            if key is not None and self._key_to_block.get(key[0]) == b:
                del self._key_to_block[key[0]]
        return blocks

    # ----- sizing ----------------------------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> int:
        """Free blocks that giving ``seq`` room for ``num_new_tokens`` more tokens takes from the free list.

        ``hits`` (a waiting sequence's prefix hits): hits on free blocks take a free block each.
        """
        if hits is not None:
            computed, table_len = len(hits) * self.block_size, len(hits)
            taken = sum(1 for b in hits if self.allocator.is_free(b))
        else:
            computed, table_len, taken = seq.num_computed_tokens, len(seq.block_table), 0
        grow = max(0, -(-(computed + num_new_tokens) // self.block_size) - table_len)
        return taken + grow + (1 if hits is None and self._needs_copy(seq) else 0)

    def max_tokens_fitting(self, seq: Sequence, num_tokens: int, hits: list[int] | None = None) -> int:
        """The most of ``num_tokens`` new tokens (0 to ``num_tokens``) the free blocks can hold for ``seq``."""
        free = self.allocator.num_free
        if self.blocks_needed(seq, num_tokens, hits) <= free:
            return num_tokens
        fixed = self.blocks_needed(seq, 0, hits)
        if fixed > free:
            return 0
        # the room left in the blocks already held (none in a waiting sequence's hits: they are full)
        room = 0 if hits is not None else len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return min(num_tokens, room + (free - fixed) * self.block_size)

    def _needs_copy(self, seq: Sequence) -> bool:
        """Whether the next write lands in a block another sequence also holds (a forked copy's shared tail)."""
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_table) and self.allocator.ref_count(seq.block_table[i]) > 1

    # ----- changes ---------------------------------------------------------------------------------------------
    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Give a waiting ``seq`` its prefix hits and a block-table row."""
        assert not seq.block_table and seq.row < 0
        for b in hits:
            if self.allocator.is_free(b):
                self.allocator.take(b)
            else:
                self.allocator.share([b])
        seq.block_table = list(hits)
        seq.num_hashed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.last_block_hash = self._block_key[hits[-1]][0] if hits else None
        self.prefix_hit_tokens += seq.num_computed_tokens
        seq.row = self.tables.acquire()
        if hits:
            self.tables.write(seq.row, 0, hits)

    def reserve_up_to(self, seq: Sequence, num_new_tokens: int) -> int:
        """Reserve room for as many of ``num_new_tokens`` more tokens as the free blocks allow; returns how many."""
        computed, table, bs = seq.num_computed_tokens, seq.block_table, self.block_size
        # Fast path (most decode steps): the tokens fit the last block, which only this sequence holds.
        if computed + num_new_tokens <= len(table) * bs and self.allocator.ref_count(table[computed // bs]) == 1:
            return num_new_tokens
        n = self.max_tokens_fitting(seq, num_new_tokens)
        if n:
            self.reserve(seq, n)
        return n

    def reserve(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` more tokens: copy a shared tail block, append blocks."""
        if self._needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            old, (new,) = seq.block_table[i], self._allocate(1)
            self.copy_blocks([old], [new])
            self.allocator.free([old])
            seq.block_table[i] = new
            self.tables.write(seq.row, i, [new])
        grow = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if grow > 0:
            start = len(seq.block_table)
            seq.block_table.extend(self._allocate(grow))
            self.tables.write(seq.row, start, seq.block_table[start:])

    def commit(self, seqs: list[Sequence], num_computed: list[int]) -> None:
        """Record that ``num_computed[i]`` more tokens of ``seqs[i]`` have their KV written."""
        for seq, n in zip(seqs, num_computed):
            seq.num_computed_tokens += n
            if self.enable_prefix_caching and seq.num_computed_tokens // self.block_size > seq.num_hashed_blocks:
                self.register_full_blocks(seq)

    def fork(self, parent: Sequence, child: Sequence, num_computed: int) -> None:
        """Let ``child`` share ``parent``'s blocks holding its first ``num_computed`` tokens."""
        nb = -(-num_computed // self.block_size)
        child.block_table = parent.block_table[:nb]
        self.allocator.share(child.block_table)
        child.num_computed_tokens = num_computed
        # A child that stops short of the parent's registered blocks registers its own anew at its next commit (they
        # are found registered already, so the keys are only computed again).
        inherit = num_computed // self.block_size >= parent.num_hashed_blocks
        child.num_hashed_blocks, child.last_block_hash = (
            (parent.num_hashed_blocks, parent.last_block_hash) if inherit else (0, None))
        child.row = self.tables.acquire()
        self.tables.write(child.row, 0, child.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s blocks (tail first, so a prefix outlives its tail in the cache) and its row."""
        self.allocator.free(reversed(seq.block_table))
        if seq.row >= 0:
            self.tables.release(seq.row)
        seq.block_table, seq.row = [], -1
        seq.num_computed_tokens = seq.num_hashed_blocks = 0
        seq.last_block_hash = None

    def blocks_to_reserve(self, seqs: list[Sequence], num_new_tokens: list[int]) -> int:
        """Free blocks that :meth:`reserve` of ``num_new_tokens[i]`` tokens for each ``seqs[i]`` in turn (those with
        a nonzero count) takes: each row's growth, and a copy for each writer of a shared block but its last holder."""
        bs, grow, writers = self.block_size, 0, {}
        for seq, n in zip(seqs, num_new_tokens):
            if n:
                grow += max(0, -(-(seq.num_computed_tokens + n) // bs) - len(seq.block_table))
                if self._needs_copy(seq):
                    block = seq.block_table[seq.num_computed_tokens // bs]
                    writers[block] = writers.get(block, 0) + 1
        return grow + sum(min(w, self.allocator.ref_count(b) - 1) for b, w in writers.items())

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of ``seq`` (of a manager without prefix caching) and drop the blocks
        past them, tail first; their table entries become 0."""
        assert not self.enable_prefix_caching, "truncating would leave cached blocks keyed by tokens dropped"
        nb = -(-num_tokens // self.block_size)
        dropped = seq.block_table[nb:]
        self.allocator.free(reversed(dropped))
        del seq.block_table[nb:]
        if dropped and seq.row >= 0:
            self.tables.write(seq.row, nb, [0] * len(dropped))
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def check_invariants(self, live: list[Sequence]) -> None:
        """Reference counts equal the number of live tables holding each block; cache keys point at real blocks."""
        self.allocator.check_invariants()
        counts = [0] * self.allocator.num_blocks
        for seq in live:
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens, seq
            for b in seq.block_table:
                counts[b] += 1
        for b, c in enumerate(counts):
            assert self.allocator.ref_count(b) == c, f"block {b}: ref {self.allocator.ref_count(b)}, held {c}"
        for key, b in self._key_to_block.items():
            assert self._block_key[b][0] == key
