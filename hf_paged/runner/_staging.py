"""``StagingBuffer``: flat int32 host layouts sent to the device in one non-blocking copy each.

A copy from pageable memory may wait for the device's queue (it would stall an asynchronous step behind the one
before it), and pinning a fresh tensor every step costs more than the copy. So the host fills one of two persistent
pinned buffers, used in turn; each is refilled only after its previous copy has run (an event per buffer), so the
host lays out step N+1 while the device may still be reading step N's inputs.
"""

from __future__ import annotations

import torch


class StagingBuffer:
    """Pinned host buffers and one device buffer of int32, ``size`` values each (grown on demand).

    Fill the array :meth:`host_array` returns, then :meth:`send` it: the device view is valid until the next send.
    """

    def __init__(self, size: int, device: torch.device):
        self.device = torch.device(device)
        self._turn = 0
        self._done = [torch.cuda.Event(), torch.cuda.Event()]
        self._allocate(size)

    def _allocate(self, size: int) -> None:
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._host = [torch.empty(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]  # (filled before sent)
        self._host_arrays = [h.numpy() for h in self._host]  # the same memory, for numpy's cheaper small ops

    def host_array(self, n: int):
        """``[n]`` int32 pinned memory to fill, as a numpy array (numpy's small ops cost a fraction of torch's on
        the host), free to overwrite: its previous copy has run."""
        if n > self.device_buffer.numel():
            for event in self._done:
                event.synchronize()
            self._allocate(max(n, 2 * self.device_buffer.numel()))
        self._done[self._turn].synchronize()
        return self._host_arrays[self._turn][:n]

    def send(self, n: int) -> torch.Tensor:
        """Copy the first ``n`` values of the last :meth:`host_array` buffer to the device; returns the ``[n]``
        view."""
        on_device = self.device_buffer[:n]
        on_device.copy_(self._host[self._turn][:n], non_blocking=True)
        self._done[self._turn].record()
        self._turn ^= 1
        return on_device
