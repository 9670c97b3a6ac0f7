"""``Engine.close()`` and ``with Engine(...) as engine:``: release an engine's device resources at a known point.

An engine's decode CUDA graphs keep what they captured alive until they are freed, NCCL collectives included under
tensor parallel, where ``torch.distributed.destroy_process_group()`` then waits for them forever. Dropping the last
reference to the engine frees them too, but a script rarely knows when that happens; ``close()`` makes it explicit.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hf_paged")
CLOSED = "this engine is closed (Engine.close()); create a new Engine to generate again"


class EngineLifecycle:
    """The closing half of :class:`~hf_paged.Engine` (a mixin: it reads the engine's ``graphs``, ``device``,
    ``abort_all``, ``_stepping``, ``_steady`` and ``_inflight``)."""

    _closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Abort every unfinished request (their outputs are dropped), wait for the device's work, and free the
        decode CUDA graphs now. Later ``add_request``, ``step``, ``stream`` and ``generate`` calls raise
        ``RuntimeError``; ``stats()`` still answers. The KV pool is freed with the engine object. Call it from the
        thread that steps (or when no step runs); a second call does nothing. Under tensor parallel every rank
        closes its own engine (no collective runs)."""
        if self._closed:
            return
        self.abort_all()  # (takes the engine's lock itself)
        with self._stepping():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # an in-flight step may still replay a graph
            graphs, self.graphs = self.graphs, None
            if graphs is not None:
                graphs.release()
            self._steady = self._inflight = None
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # the block's own error goes on; a failure to close (a broken device, say) is only logged
            self.close()
        except Exception as err:
            logger.warning("hf_paged: closing the engine after %s failed too (%s: %s)", exc_type.__name__,
                           type(err).__name__, err)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError(CLOSED)
