"""``RequestRegistry``: which requests the engine holds, under which ids, and which finished ones wait to be handed
over.

A request is *open* from ``add_request`` until its output (or its last stream delta) is handed over; its copies
for ``num_return_sequences`` (``"<id>__child#<k>"``) belong to the same family. Finished sequences wait in the
outbox, in the order they finished, until a reader takes them: ``step()`` takes every one, ``generate`` and
``stream(prompts)`` only their own, so requests added by someone else are never reported to the wrong reader.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from hf_paged.engine._sequence import Sequence
from hf_paged.engine._validation import CHILD_MARK


def family(request_id: str) -> str:
    """The id a request was added with (a copy's id without its ``__child#<k>`` suffix)."""
    return request_id.partition(CHILD_MARK)[0]


class RequestRegistry:
    """Open sequences by id, open sequences per family, the outbox and the arrival counter.

    Automatic ids are ``"0"``, ``"1"``, ... and never equal an id a user chose (ever, not only while it is open):
    a number a user took as an id is skipped when the counter reaches it.
    """

    def __init__(self) -> None:
        self.open: dict[str, Sequence] = {}
        self._family_size: Counter[str] = Counter()  # open sequences per family (none: no key)
        self.outbox: list[Sequence] = []
        self.next_arrival = 0
        self._next_auto = 0
        self._taken_numbers: set[int] = set()  # user ids that read as automatic ids the counter has not reached

    def new_id(self, user_id: str | None) -> tuple[str, int]:
        """``(request id, arrival number)`` of a new request, to be tracked next (the engine has checked that a user's
        id is not open)."""
        if user_id is None:
            while self._next_auto in self._taken_numbers:
                self._taken_numbers.discard(self._next_auto)
                self._next_auto += 1
            self._next_auto += 1
            return str(self._next_auto - 1), self.next_arrival
        if user_id.isascii() and user_id.isdigit() and str(int(user_id)) == user_id and int(user_id) >= self._next_auto:
            self._taken_numbers.add(int(user_id))
        return user_id, self.next_arrival

    def track(self, seq: Sequence) -> None:
        self.open[seq.request_id] = seq
        self.next_arrival = max(self.next_arrival, seq.arrival[0] + 1)
        self._family_size[family(seq.request_id)] += 1

    def untrack(self, seq: Sequence) -> None:
        if self.open.pop(seq.request_id, None) is None:
            return
        fam = family(seq.request_id)
        self._family_size[fam] -= 1
        if not self._family_size[fam]:
            del self._family_size[fam]

    def is_open(self, request_id: str) -> bool:
        """Whether a sequence of the family ``request_id`` is live or waits in the outbox."""
        return request_id in self._family_size

    def take(self, families: Collection[str] | None = None) -> list[Sequence]:
        """Remove and return the outbox's sequences of ``families`` (None: all); they are no longer open."""
        if families is None:
            taken, self.outbox = self.outbox, []
        else:
            taken = [s for s in self.outbox if family(s.request_id) in families]
            self.outbox = [s for s in self.outbox if family(s.request_id) not in families]
        for seq in taken:
            self.untrack(seq)
        return taken

    def put_back(self, seqs: list[Sequence]) -> None:
        """Undo :meth:`take` of ``seqs`` (their hand-over did not reach the reader): open again, first in the outbox."""
        for seq in seqs:
            self.track(seq)
        self.outbox[:0] = seqs

    def forget(self, families: Collection[str]) -> None:
        """Drop every open sequence of ``families`` (their reader is gone)."""
        self.take(families)
        for seq in [s for rid, s in self.open.items() if family(rid) in families]:
            self.untrack(seq)
