"""Which batch sizes the decode CUDA graphs are captured for, and when (``DecodeGraphs``, ``Engine(cuda_graphs=...,
cuda_graph_capture=...)``).

A decode step of ``n`` sequences replays the graph of the smallest captured size ``b >= n`` (rows ``n..b`` are
padding). Each size costs a capture: about one traced forward of host time (~20-25 ms for a 1B model on an H100,
which the device waits out unless steps were queued before it), while a padded row costs its share of the matrix
products and a one-token context (on an H100, 4 sequences take 1.50 ms in their own graph of a 1B model, 1.79 ms
padded to 16, 2.39 ms to 256).
"""

from __future__ import annotations

# On-demand capture: a size is captured once this many decode steps have padded up to a larger graph instead; about
# where the padding paid equals one capture (ski rental), with the H100 figures above.
ON_DEMAND_STEPS = 32

# The smallest automatic graph: a decode step of one sequence replays a graph of two rows. The compiled layers
# specialise a one-token step into graphs of their own (torch.compile treats a size of 1 apart), so a graph of one
# row costs a compile of every layer's code; on an H200 (1B model, artifacts on disk) a server's engine started in
# 5.0-5.8 s with graphs of 2 and 256 rows against 6.4-7.7 s with 1 and 256, its batch-1 decode at 1.21-1.22 ms per
# token either way (the padding row is a one-token context and a row of each product).
SMALLEST_GRAPH = 2


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """2, 4, 8, 16, 32, then every multiple of 32 up to ``max_num_seqs`` (which is always included, and at least
    ``SMALLEST_GRAPH``): what an engine that serves many calls (``Engine``, a server) captures.

    Few sizes keep the capture short; a padded row costs little, since a decode step reads the weights once
    whatever the batch.
    """
    sizes = [s for s in (2, 4, 8, 16) if s < max_num_seqs] + list(range(32, max_num_seqs, 32))
    return sorted(set(sizes) | {max(max_num_seqs, SMALLEST_GRAPH)})


def sizes_for(sizes, max_num_seqs: int) -> list[int]:
    """The given graph ``sizes`` an engine of at most ``max_num_seqs`` sequences at once can use: those up to it
    and the smallest one above it, which its full batches pad up to."""
    wanted = sorted(set(sizes))
    above = [s for s in wanted if s >= max_num_seqs][:1]
    return [s for s in wanted if s < max_num_seqs] + above


def start_sizes(sizes: list[int], capture: str) -> list[int]:
    """Which of the (sorted) ``sizes`` an engine captures at start under ``cuda_graph_capture=capture``: all of them
    (``"start"``), none (``"on_demand"``: the largest at the first step a graph can serve, while the device runs the
    steps before it, which for a call's engine are its prompts'), or the smallest and the largest (``"first_use"``:
    a server's first requests run one at a time; the largest also compiles and warms the general shape)."""
    if capture == "on_demand":
        return []
    if capture == "first_use":
        return sorted({sizes[0], sizes[-1]})
    return list(sizes)


def one_call_graph_sizes(num_seqs: int) -> list[int]:
    """The sizes for an engine that serves one call of ``num_seqs`` sequences (``generate_batch``): the powers of two
    from ``SMALLEST_GRAPH`` below it, and itself (at least ``SMALLEST_GRAPH``).

    Such an engine pays its captures on every call, and its batches pass each size below the largest only for the
    steps in which its sequences finish; it captures these sizes on demand (:class:`OnDemandSizes`).
    """
    powers = (SMALLEST_GRAPH << i for i in range(num_seqs.bit_length()))
    return [s for s in powers if s < num_seqs] + [max(num_seqs, SMALLEST_GRAPH)]


class OnDemandSizes:
    """Sizes not captured yet, each with the number of decode steps that would have used it.

    A step of ``n`` sequences served by the captured size ``size`` counts toward the smallest waiting size that
    fits it and is smaller than ``size``; that size is due once it has ``ON_DEMAND_STEPS`` steps, or at its first
    step with ``first_use`` (an engine that serves many calls: each size will serve many steps).
    """

    def __init__(self, sizes=(), first_use: bool = False):
        self._steps = dict.fromkeys(sizes, 0)
        self.first_use = first_use

    @property
    def waiting(self) -> list[int]:
        return sorted(self._steps)

    def due(self, n: int, size: int) -> int | None:
        """Count a step of ``n`` sequences served by ``size``; the size to capture now (no longer waiting), or
        None."""
        if (want := min((s for s in self._steps if n <= s < size), default=None)) is None:
            return None
        self._steps[want] += 1
        if self._steps[want] < (1 if self.first_use else ON_DEMAND_STEPS):
            return None
        del self._steps[want]
        return want

    def restart(self, size: int) -> None:
        """Wait for ``size`` again, counting from zero."""
        self._steps[size] = 0

    def stop(self) -> None:
        """Capture nothing more on demand."""
        self._steps.clear()


def size_ranges(sizes: list[int]) -> str:
    """The sizes for a log line: all of them up to six, else the first five and the last."""
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}"
