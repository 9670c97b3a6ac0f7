"""Systems of the end-to-end benchmark and the timed calls: one ``generate_batch`` per (system, workload).

Each system is a function ``generate(prompts, generation_config, **generate_batch_kwargs) -> {request_id:
GenerationOutput}`` with the model and the scheduling budget bound in; every call gets its own deep copy of the
generation config (transformers' ``generate_batch`` writes ``eos_token_id=-1`` into the one it is given).
"""

from __future__ import annotations

import copy
import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers import GenerationConfig

from benchmarks.e2e.workloads import Workload
import hf_paged

Generate = Callable[..., dict]


@dataclass(frozen=True)
class Budget:
    """What every system may schedule per step: tokens (prefill chunks and decodes together) and sequences; None:
    the system's own default (``--defaults``: no settings at all)."""

    max_batch_tokens: int | None
    max_requests: int | None

    @property
    def is_default(self) -> bool:
        return self.max_batch_tokens is None and self.max_requests is None


def hf_paged_system(model: torch.nn.Module, budget: Budget, engine_kwargs: dict) -> Generate:
    """``hf_paged.generate_batch``; it reads its options by name from the continuous-batching config, so
    ``engine_kwargs`` (``block_size`` and options the engine may grow) travel as attributes of that config. With a
    default budget and no engine kwargs it passes no config at all."""
    options = {**({} if budget.is_default else {"block_size": 16}), **engine_kwargs}
    if budget.max_batch_tokens is not None:
        options["max_batch_tokens"] = budget.max_batch_tokens
    if budget.max_requests is not None:
        options["max_requests_per_batch"] = budget.max_requests
    config = SimpleNamespace(**options) if options else None
    return lambda prompts, gc, **kwargs: hf_paged.generate_batch(model, prompts, copy.deepcopy(gc),
                                                                 continuous_batching_config=config, **kwargs)


def transformers_system(model: torch.nn.Module, budget: Budget, num_blocks: int | None = None) -> Generate:
    """transformers' ``model.generate_batch`` with its default config but the budget (attention switch, CUDA graphs,
    async batching and compile level as transformers decides). ``num_blocks`` (of 256 tokens) caps the cache,
    which otherwise takes most of the free memory: for the CPU smoke run, where that is the host's RAM."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    def generate(prompts, gc, **kwargs):
        settings = dict(max_batch_tokens=budget.max_batch_tokens, max_requests_per_batch=budget.max_requests,
                        num_blocks=num_blocks)
        config = None if all(v is None for v in settings.values()) else ContinuousBatchingConfig(**settings)
        return model.generate_batch(prompts, generation_config=copy.deepcopy(gc), continuous_batching_config=config,
                                    progress_bar=False, **kwargs)

    return generate


def warm_up(model: torch.nn.Module, generate: Generate, prompts: list[list[int]], gc: GenerationConfig) -> str:
    """One untimed call; returns the attention implementation the model ran with inside it (transformers switches
    it for the call and restores the original one after)."""
    seen = []
    hook = getattr(model, "model", model).register_forward_pre_hook(
        lambda *_: seen.append(model.config._attn_implementation))
    try:
        generate(prompts, gc)
    finally:
        hook.remove()
    return seen[-1] if seen else "unknown"


def timed_throughput(model: torch.nn.Module, generate: Generate, workload: Workload, vocab: int,
                     warm: Workload | None, calls: int = 1) -> dict:
    """Wall clock of the first call on the workload, after a warm-up call on ``warm`` (None: none, the caller warmed
    the model up). With ``calls`` > 1 the same call runs again that many times in all: ``later_tok_per_s`` is the
    median rate of the later calls (the first big call of a process also pays the device memory it maps first)."""
    prompts = workload.prompts(vocab)
    attention = warm_up(model, generate, warm.prompts(vocab), warm.generation_config()) if warm else None
    timed, pauses = [], []
    for _ in range(calls):
        with FullCollections() as full:
            timed.append(_timed_call(generate, prompts, workload.generation_config()))
        pauses.append(full.seconds)
    seconds, out = timed[0]
    tokens = _num_generated(out)
    later = [s for s, _ in timed[1:]]
    return {"tokens": tokens, "expected_tokens": len(prompts) * workload.new_tokens, "seconds": seconds,
            "attention": attention, "full_collections_s": pauses,
            **({"later_calls_s": later, "later_tok_per_s": tokens / statistics.median(later)} if later else {})}


class FullCollections:
    """The seconds of each full (oldest-generation) collection of Python's garbage collector inside a ``with`` block:
    a pause of the host, 0.3-0.5 s after a compile, that a timed call should not hide (``full.seconds``)."""

    def __enter__(self) -> FullCollections:
        self.seconds: list[float] = []
        self._began = None
        gc.callbacks.append(self._record)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds.append(time.perf_counter() - self._began)
            self._began = None


#: New tokens of the shorter call of :func:`timed_latency`: two, so that it runs one decode step. A system may do
#: per-call setup at its first decode step (hf_paged's engine of one call captures its decode graph there), and the
#: shorter call must carry that setup too for it to cancel out.
SHORT_CALL_NEW_TOKENS = 2


def timed_latency(model: torch.nn.Module, generate: Generate, workload: Workload, vocab: int, reps: int = 3) -> dict:
    """Decode time per output token: (median wall of a call for ``new_tokens`` - median wall of a call for
    :data:`SHORT_CALL_NEW_TOKENS`) / the difference in steps, so prefill, setup (the first decode step's included)
    and per-call warm-up cancel out. Where the system records per-token timestamps (``record_timestamps``), their
    mean spacing is reported beside it."""
    prompts = workload.prompts(vocab)
    attention = warm_up(model, generate, prompts, workload.generation_config(new_tokens=4))
    short, full, spacing = [], [], []
    for _ in range(reps):
        short.append(_timed_call(generate, prompts, workload.generation_config(new_tokens=SHORT_CALL_NEW_TOKENS))[0])
        seconds, out = _timed_call(generate, prompts, workload.generation_config(), record_timestamps=True)
        full.append(seconds)
        stamps = getattr(next(iter(out.values())), "timestamps", None) if out else None
        if stamps and len(stamps) > 1:
            spacing.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    seconds = statistics.median(full) - statistics.median(short)
    decoded = workload.new_tokens - SHORT_CALL_NEW_TOKENS
    return {"tokens": _num_generated(out) - SHORT_CALL_NEW_TOKENS, "expected_tokens": decoded, "seconds": seconds,
            "ms_per_token": 1e3 * seconds / decoded, "short_call_new_tokens": SHORT_CALL_NEW_TOKENS,
            "short_call_s": statistics.median(short), "full_call_s": statistics.median(full), "short_calls_s": short,
            "full_calls_s": full,
            "attention": attention,
            "ms_per_token_timestamps": 1e3 * statistics.median(spacing) if spacing else None}


def _timed_call(generate: Generate, prompts: list[list[int]], config: GenerationConfig,
                **kwargs) -> tuple[float, dict]:
    """Wall seconds of one call, and its outputs."""
    sync()
    start = time.perf_counter()
    out = generate(prompts, config, **kwargs)
    sync()
    return time.perf_counter() - start, out


class EngineSizing(logging.Handler):
    """The start-up lines of the engines hf_paged builds meanwhile (logger ``hf_paged``, INFO): what each picked
    and why. ``with EngineSizing() as sizing: ...`` then ``sizing.last``."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.last: str | None = None
        self._logger, self._level = logging.getLogger("hf_paged"), None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "engine on " in message:
            self.last = message.removeprefix("hf_paged: ")

    def __enter__(self) -> EngineSizing:
        self._level = self._logger.level
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _num_generated(out: dict) -> int:
    return sum(len(o.generated_tokens) for o in out.values())
