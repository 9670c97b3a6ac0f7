"""Block tables of the rows of a ``generate`` batch, with sharing and copy-on-write.

``generate`` sees a cache as a ``[batch, columns]`` grid: each forward appends ``q_len`` columns; in a left-padded
batch some columns of a row are padding. Here each row keeps only its real tokens: a block table (list of block
ids) and a token count. Rows may share blocks (beam search, ``num_return_sequences``); a shared block that must be
written is copied first, so sharing never changes what another row reads.
"""

from __future__ import annotations

import torch

from hf_paged.cache.block_allocator import OutOfBlocksError
from hf_paged.cache.kv_pool import KVPool


class BatchTables:
    """Per-row block tables over a :class:`KVPool`, plus the padding history needed to ``crop`` columns."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.tables: list[list[int]] = []
        self.num_tokens: list[int] = []
        self.num_columns = 0
        self._valid = torch.zeros(0, 0, dtype=torch.bool)  # [rows, capacity]: which columns hold real tokens

    @property
    def num_rows(self) -> int:
        return len(self.tables)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def reset(self) -> None:
        for table in self.tables:
            self.pool.allocator.free(table)
        self.tables, self.num_tokens, self.num_columns = [], [], 0
        self._valid = torch.zeros(0, 0, dtype=torch.bool)

    def start(self, num_rows: int) -> None:
        self.reset()
        self.tables = [[] for _ in range(num_rows)]
        self.num_tokens = [0] * num_rows
        self._valid = torch.zeros(num_rows, 0, dtype=torch.bool)

    def append(self, valid: torch.Tensor) -> torch.Tensor:
        """Add one forward's columns. ``valid``: [rows, q_len] bool (host), True where the token is real.

        Reserves blocks for all rows at once (nothing changes if they do not fit), copies shared blocks that will
        be written, and returns the ``[T]`` int64 slot of each real token in row-major order.
        """
        rows, q_len = valid.shape
        n_new = valid.sum(1).tolist()
        bs = self.pool.block_size
        alloc = self.pool.allocator
        cow = self._rows_to_copy(n_new)
        grow = [self._blocks_for(self.num_tokens[r] + n_new[r]) - len(self.tables[r]) for r in range(rows)]
        needed = len(cow) + sum(grow)
        if needed > alloc.num_free:
            raise OutOfBlocksError(
                needed, alloc.num_free, alloc.num_blocks,
                hint=f"(this step adds {sum(n_new)} tokens to {rows} rows of {bs}-token blocks)",
            )
        if cow:
            fresh = alloc.allocate(len(cow))
            self.pool.copy_blocks([self.tables[r][-1] for r in cow], fresh)
            for r, b in zip(cow, fresh):
                alloc.free([self.tables[r][-1]])
                self.tables[r][-1] = b
        for r in range(rows):
            if grow[r]:
                self.tables[r].extend(alloc.allocate(grow[r]))

        start = torch.tensor(self.num_tokens, dtype=torch.int64)
        pos = start[:, None] + valid.long().cumsum(1) - 1  # [rows, q_len] position of each real token
        table = self.block_table_tensor()
        row_idx = torch.arange(rows)[:, None].expand(rows, q_len)
        slots = table[row_idx, pos.clamp(min=0) // bs].long() * bs + pos.clamp(min=0) % bs
        for r in range(rows):
            self.num_tokens[r] += n_new[r]
        self._append_valid(valid)
        return slots[valid]

    def _rows_to_copy(self, n_new: list[int]) -> list[int]:
        """Rows that must copy their shared last (partial) block before writing into it.

        Of ``w`` writers sharing a block held ``c`` times, ``w`` copy if someone else still holds it, else ``w - 1``:
        the last writer keeps the original.
        """
        writers: dict[int, list[int]] = {}
        for r, n in enumerate(n_new):
            if n and self.num_tokens[r] % self.pool.block_size:
                writers.setdefault(self.tables[r][-1], []).append(r)
        rows = []
        for block, ws in writers.items():
            holders = self.pool.allocator.ref_count(block)
            rows += ws if len(ws) < holders else ws[:-1]
        return rows

    def block_table_tensor(self) -> torch.Tensor:
        """``[rows, max_blocks]`` int32, padded with 0."""
        width = max((len(t) for t in self.tables), default=0)
        out = torch.zeros(self.num_rows, max(width, 1), dtype=torch.int32)
        for r, t in enumerate(self.tables):
            out[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out

    def _append_valid(self, valid: torch.Tensor) -> None:
        rows, q_len = valid.shape
        need = self.num_columns + q_len
        if need > self._valid.shape[1]:
            grown = torch.zeros(rows, max(need, 2 * self._valid.shape[1]), dtype=torch.bool)
            grown[:, : self.num_columns] = self._valid[:, : self.num_columns]
            self._valid = grown
        self._valid[:, self.num_columns : need] = valid
        self.num_columns = need

    def select_rows(self, rows: list[int]) -> None:
        """Rebuild the batch from ``rows`` (indices into the current rows, repeats allowed), sharing blocks."""
        new_tables = [list(self.tables[r]) for r in rows]
        for t in new_tables:
            self.pool.allocator.share(t)
        for t in self.tables:
            self.pool.allocator.free(t)
        self.tables = new_tables
        self.num_tokens = [self.num_tokens[r] for r in rows]
        self._valid = self._valid[torch.tensor(rows, dtype=torch.long)] if rows else self._valid[:0]

    def crop(self, max_columns: int) -> None:
        """Keep the first ``max_columns`` columns of every row and free the blocks past them."""
        if max_columns >= self.num_columns:
            return
        keep = self._valid[:, :max_columns].sum(1).tolist()
        for r, n in enumerate(keep):
            nb = self._blocks_for(n)
            self.pool.allocator.free(self.tables[r][nb:])
            del self.tables[r][nb:]
            self.num_tokens[r] = n
        self._valid[:, max_columns:] = False
        self.num_columns = max_columns

    def stats(self) -> dict:
        bs = self.pool.block_size
        fill: dict[int, int] = {}
        for table, n in zip(self.tables, self.num_tokens):
            for i, b in enumerate(table):
                fill[b] = max(fill.get(b, 0), min(bs, n - i * bs))
        alloc = self.pool.allocator
        slots = alloc.num_used * bs
        return {
            "num_blocks": alloc.num_blocks,
            "block_size": bs,
            "blocks_used": alloc.num_used,
            "blocks_free": alloc.num_free,
            "tokens_stored": sum(self.num_tokens),
            "internal_fragmentation": 0.0 if slots == 0 else 1.0 - sum(fill.values()) / slots,
        }
