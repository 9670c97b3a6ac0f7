"""``Lockstep``: the ranks of a tensor-parallel engine take the same steps, or all stop with the same error.

Every process of a tensor-parallel model runs its own engine on the same calls (SPMD: the same prompts, settings
and order on every rank), and every forward's collectives must meet their peers'. The engine's bookkeeping is
deterministic, so equal inputs give equal steps on every rank, except where a rank could decide alone:

- **sampled tokens**: logits agree only up to float rounding, and unseeded requests draw their seeds from each
  process's own generator; the leader's (first rank's) tokens and logprobs are broadcast over the model's group
  on the device after each sample, so every rank feeds the same ids to its next step.
- **pool size**: free memory differs per device; the ranks take the smallest pool (``agree_min``).
- **everything else host-side** (requests added or aborted from other threads, prompts that differ per rank, a
  rank that fails): before each step the ranks exchange ``[status, step, fingerprint of the scheduled batch]``
  over a gloo group of their own (host memory, so it never waits for the device). A rank whose step failed sends
  its error instead; on any difference every rank raises the same ``RuntimeError`` before the forward, and the
  engine refuses later steps with it.

A rank that fails inside the model's forward may leave the others waiting in one of the model's collectives: on
GPUs their hosts run ahead (NCCL is asynchronous) and meet the failure at the next check; on the CPU (gloo) they
block, and the failed rank gives up after ``HF_PAGED_TP_TIMEOUT_S`` seconds (default 600) with a message saying
so; ending the process then ends the others (torchrun stops every worker when one fails).
"""

from __future__ import annotations

import logging
import zlib
from array import array
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from hf_paged import envs

from hf_paged.compile import _layers as compiled_layers
from hf_paged.parallel import _linears as tp_linears
from hf_paged.parallel._tensor_parallel import TensorParallel, tensor_parallel

logger = logging.getLogger("hf_paged")

_OK, _FAILED = 0, 1
KEPT_ERROR_TYPES = (NotImplementedError, ValueError, TypeError, RuntimeError)  # raised on every rank as they are
_check_groups: dict[tuple[int, float], object] = {}  # one gloo group per (model's group, timeout)


class Lockstep:
    """Keeps the engines of the ranks of ``tp`` in step (see the module docstring)."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self.timeout_s = envs.tp_timeout_s()
        self.failure: tuple[type[Exception], str] | None = None  # set on every rank at once: the engine stops
        self._step = 0
        key = (id(tp.group), self.timeout_s)
        if key not in _check_groups:
            _check_groups[key] = dist.new_group(list(tp.ranks), timeout=timedelta(seconds=self.timeout_s),
                                                backend="gloo", use_local_synchronization=True)
        self._checks = _check_groups[key]

    # ----- agreement -------------------------------------------------------------------------------------------
    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of the ranks (each rank's pool fits its own free memory)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._checks)
        return int(t.item())

    def check(self, seqs: list, num_tokens: list[int]) -> None:
        """Before a step's forward (``seqs[i]`` computes ``num_tokens[i]`` tokens): raise the same ``RuntimeError``
        on every rank if a rank failed or scheduled another batch."""
        if self.failure is not None:
            kind, message = self.failure
            raise kind(f"this engine stopped after an earlier error: {message}")
        self._step += 1
        mine = torch.tensor([_OK, self._step, _fingerprint(seqs, num_tokens), len(seqs), sum(num_tokens)],
                            dtype=torch.int64)
        everyone = self._gather(mine, None)
        if any(int(row[0]) != _OK for row in everyone):
            self._raise_failure(None)
        if any(not torch.equal(row, everyone[0]) for row in everyone):
            detail = "; ".join(f"rank {self.tp.ranks[i]}: step {int(r[1])}, {int(r[3])} sequences, {int(r[4])} "
                               f"tokens, fingerprint {int(r[2]):08x}" for i, r in enumerate(everyone))
            self._stop(RuntimeError, f"hf_paged: the tensor-parallel ranks scheduled different steps ({detail}). "
                       "Every rank must make the same calls with the same prompts and settings, in the same order "
                       "(adding or aborting requests from other threads is not served under tensor parallel)")

    def fail(self, exc: BaseException) -> NoReturn:
        """This rank's step failed: tell the others at their next check, and raise the same error they raise."""
        if self.failure is not None:
            raise RuntimeError(self.failure[1]) from exc
        mine = torch.tensor([_FAILED, self._step, 0, 0, 0], dtype=torch.int64)
        self._gather(mine, exc)
        self._raise_failure(exc)

    # ----- tokens ----------------------------------------------------------------------------------------------
    def share(self, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> None:
        """Overwrite the sampled ``tokens`` (and ``logprobs``) with the leader's, in place, over the model's group
        (on the device, without a host sync)."""
        dist.broadcast(tokens, src=self.tp.leader, group=self.tp.group)
        if logprobs is not None:
            dist.broadcast(logprobs, src=self.tp.leader, group=self.tp.group)

    # ----- internals -------------------------------------------------------------------------------------------
    def _gather(self, mine: torch.Tensor, exc: BaseException | None) -> list[torch.Tensor]:
        everyone = [torch.empty_like(mine) for _ in self.tp.ranks]
        try:
            dist.all_gather(everyone, mine, group=self._checks)
        except Exception as err:  # a rank did not come: it is stuck in the model's collectives, or gone
            what = f"this rank's step failed ({type(exc).__name__}: {exc}), and " if exc is not None else ""
            self._stop(RuntimeError, (
                f"hf_paged: tensor-parallel rank {self.tp.ranks[self.tp.rank]} of {self.tp.world_size}: {what}the "
                f"other ranks did not reach step {self._step}'s check within {self.timeout_s:g} s "
                f"(HF_PAGED_TP_TIMEOUT_S); they may wait in the model's collectives. The run cannot go on: end "
                f"every process (torchrun ends the others when one exits with an error). ({type(err).__name__})"),
                cause=exc)
        return everyone

    def _raise_failure(self, exc: BaseException | None) -> NoReturn:
        """Some rank failed: every rank learns the first failed rank's error and raises it."""
        mine = None if exc is None else portable_error(exc)
        errors: list = [None] * self.tp.world_size
        dist.all_gather_object(errors, mine, group=self._checks)
        index = next(i for i, e in enumerate(errors) if e is not None)
        kind, message = errors[index]
        self._stop(kind, f"hf_paged: a tensor-parallel step failed on rank {self.tp.ranks[index]} of "
                         f"{self.tp.world_size}: {message}; every rank stops this engine", cause=exc)

    def _stop(self, kind: type[Exception], message: str, cause: BaseException | None = None) -> NoReturn:
        self.failure = (kind, message)
        logger.error("%s", message)
        raise kind(message) from cause


def portable_error(exc: BaseException) -> tuple[type[Exception], str]:
    """``exc`` as every process can raise it again: its class where it is one of :data:`KEPT_ERROR_TYPES` (else
    ``RuntimeError``) and a message naming its own class."""
    return next((k for k in KEPT_ERROR_TYPES if isinstance(exc, k)), RuntimeError), f"{type(exc).__name__}: {exc}"


def _fingerprint(seqs: list, num_tokens: list[int]) -> int:
    """A checksum of the step's choice: each sequence's arrival, computed tokens and new tokens, and the prompt ids
    of the prompt chunks (so prompts that differ between ranks are caught before their first forward)."""
    words = array("q")
    crc = 0
    for seq, n in zip(seqs, num_tokens):
        start = seq.num_computed_tokens
        words.extend((seq.arrival[0], seq.arrival[1], start, n))
        if start < seq.num_prompt_tokens:
            crc = zlib.crc32(array("q", seq.token_ids[start : min(start + n, seq.num_prompt_tokens)]), crc)
    return zlib.crc32(words, crc)


def agreed_min(model: torch.nn.Module, value: int) -> int:
    """``value`` for a model that is not tensor-parallel; for one that is, the smallest of its ranks' values (a pool
    size each rank read from its own free memory), so that every rank takes the same decisions from it."""
    tp = tensor_parallel(model)
    return value if tp is None else Lockstep(tp).agree_min(value)


def for_model(model: torch.nn.Module, compile_layers: bool | None) -> tuple[Lockstep | None, dict]:
    """A ``Lockstep`` for a tensor-parallel ``model`` (None for any other) and the engine settings it changes:
    every decode graph size captured at start (an on-demand capture mid-run would have to happen on every rank at
    the same step), and compiled layers as asked, their sharded linears run as local products with an opaque
    all-reduce (``hf_paged.parallel._linears``; where the model's sharding is not one it compiles, the layers run
    eagerly, and ``compile_layers=True`` is refused)."""
    tp = tensor_parallel(model)
    if tp is None:
        return None, {}
    if compile_layers or (compile_layers is None and compiled_layers.compile_unsupported_reason(model) is None):
        if (reason := tp_linears.install(model, tp.group)) is not None:
            if compile_layers:
                raise ValueError(f"compile_layers=True cannot be served for this tensor-parallel model: {reason}; "
                                 "pass compile_layers=False or None")
            logger.info("hf_paged: the engine runs the tensor-parallel model's layers eagerly: %s", reason)
            compile_layers = False
    return Lockstep(tp), dict(compile_layers=compile_layers, cuda_graph_capture="start")
