"""The tokens a step sampled, on their way from the device to the host.

The step's only device -> host transfer: the ``[N]`` sampled ids (and logprobs when asked) are copied without
blocking into pinned memory, and an event marks when they have landed. With asynchronous scheduling the host
launches the next step before it waits on that event, so the device never waits for the host's bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.engine._sequence import Sequence


@dataclass
class InFlightStep:
    """``seqs[i]`` sampled ``tokens[i]`` (host buffers, valid once ``event`` has completed); ``logprobs``: the
    sampler's (``[N]``, or ``[N, 1 + 2K]`` rows with alternatives)."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    logprobs: torch.Tensor | None
    event: torch.cuda.Event | None

    def wait(self) -> tuple[list[int], list[float | None]]:
        """Block until the tokens are on the host; returns them (and the logprobs, or Nones) as lists."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.tokens.tolist()
        logprobs = self.logprobs.tolist() if self.logprobs is not None else [None] * len(tokens)
        return tokens, logprobs


class TokenReceiver:
    """Two pinned buffer pairs used in turn: a step's copy never overwrites tokens the host has not read yet (the
    host reads step ``k``'s tokens before it launches step ``k + 2``)."""

    def __init__(self, max_rows: int, device: torch.device):
        self._cuda = torch.device(device).type == "cuda"
        self._buffers = [(torch.zeros(max_rows, dtype=torch.int64, pin_memory=True),
                          torch.zeros(max_rows, dtype=torch.float32, pin_memory=True), torch.cuda.Event())
                         for _ in range(2 if self._cuda else 0)]  # (none off CUDA: the tokens stay where they are)
        self._turn = 0

    def send(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor | None) -> InFlightStep:
        if not self._cuda:  # the sampler ran on the host: nothing to wait for
            return InFlightStep(seqs, tokens, logprobs, None)
        token_buf, logprob_buf, event = self._buffers[self._turn]
        self._turn ^= 1
        n = len(seqs)
        token_buf[:n].copy_(tokens, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            # rows with alternatives ([N, 1 + 2K], asked for rarely) get a pinned buffer of their own
            host_logprobs = (logprob_buf[:n] if logprobs.dim() == 1
                             else torch.empty(logprobs.shape, dtype=torch.float32, pin_memory=True))
            host_logprobs.copy_(logprobs, non_blocking=True)
        event.record(torch.cuda.current_stream(tokens.device))  # the logits' device: the last one of a split model
        return InFlightStep(seqs, token_buf[:n], host_logprobs, event)
