"""Every ``HF_PAGED_*`` environment variable hf_paged reads: each is read here, once (at its first use in the
process), checked, and documented below. Nothing else in the package reads the environment; the C++ kernels take
these choices as arguments.

=============================  ==========================================  =============================================
variable                       values (default first)                      what it does
=============================  ==========================================  =============================================
``HF_PAGED_API_KEY``           unset, or a key (not blank)                 the API key ``hf-paged serve`` requires on
                                                                            every route but ``/health`` and
                                                                            ``/metrics`` when ``--api-key`` is not
                                                                            given
``HF_PAGED_BACKEND``           unset, or a comma list of ``flash``,         the attention backends tried, in this order,
                               ``cuda``, ``torch``                          where the caller names none
``HF_PAGED_CACHE``             ``$XDG_CACHE_HOME/hf_paged/kernels``         where the JIT-built CUDA kernels are kept
                               (``~/.cache/hf_paged/kernels`` without it)
``HF_PAGED_COMMIT``            unset, or a commit                          benchmarks: the project commit a result file
                                                                            records, where the source is no git checkout
``HF_PAGED_KERNEL_TRACE``      unset, ``1``                                 diagnostics: build the kernels (in a build
                                                                            folder of their own) with decode trace
                                                                            points, read by ``python -m
                                                                            hf_paged.bench._decode_trace``
``HF_PAGED_TP_ALL_REDUCE``     ``hf_paged``, ``nccl``                       how tensor-parallel compiled layers sum a
                                                                            decode step's rowwise outputs: hf_paged's
                                                                            one-shot kernel over peer-mapped memory
                                                                            (NCCL where the GPUs cannot map each
                                                                            other's memory), or NCCL (compare on GPUs
                                                                            linked by PCIe only)
``HF_PAGED_TP_TIMEOUT_S``      ``600``                                      seconds a tensor-parallel rank waits for the
                                                                            others at a step check
=============================  ==========================================  =============================================

A test or benchmark that changes one of them inside a process calls :func:`refresh` for the new value to be read.
Beside the kernels, hf_paged keeps torch's compile artifacts of each model under
``$XDG_CACHE_HOME/hf_paged/compile`` (``~/.cache/hf_paged/compile`` without it; :func:`compile_cache_dir`), off with
torch's own caches (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

API_KEY = "HF_PAGED_API_KEY"
BACKEND = "HF_PAGED_BACKEND"
CACHE = "HF_PAGED_CACHE"
COMMIT = "HF_PAGED_COMMIT"
KERNEL_TRACE = "HF_PAGED_KERNEL_TRACE"
TP_ALL_REDUCE = "HF_PAGED_TP_ALL_REDUCE"
TP_TIMEOUT_S = "HF_PAGED_TP_TIMEOUT_S"

#: Every variable read here (the docs and the tests check the table above against it).
VARIABLES = (API_KEY, BACKEND, CACHE, COMMIT, KERNEL_TRACE, TP_ALL_REDUCE, TP_TIMEOUT_S)


def _value(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or value.strip() == "" else value.strip()


@functools.cache
def api_key() -> str | None:
    """``HF_PAGED_API_KEY``: the key ``hf-paged serve`` requires when ``--api-key`` is not given, or None (unset).
    ``ValueError`` when it is set but blank, which would otherwise serve with no key at all."""
    value = os.environ.get(API_KEY)
    if value is not None and not value.strip():
        raise ValueError(f"{API_KEY} is empty, which would serve with no key; set a non-empty key, or unset it to "
                         "serve without one")
    return _value(API_KEY)


@functools.cache
def backend() -> str | None:
    """``HF_PAGED_BACKEND``, a comma list of backend names (split and checked where it is used:
    ``hf_paged.cache._config.backend_names``), or None."""
    return _value(BACKEND)


@functools.cache
def commit() -> str | None:
    """``HF_PAGED_COMMIT``: the project commit a benchmark's result file records instead of git's answer, or None."""
    return _value(COMMIT)


@functools.cache
def kernel_cache_dir() -> Path:
    """``HF_PAGED_CACHE``, else ``$XDG_CACHE_HOME/hf_paged/kernels`` (``~/.cache/hf_paged/kernels``)."""
    value = _value(CACHE)
    return Path(value).expanduser() if value is not None else _cache_home() / "kernels"


@functools.cache
def model_cache_dir() -> Path:
    """Where the models hf_paged converts for itself are kept (the command line's default model):
    ``$XDG_CACHE_HOME/hf_paged/models`` (``~/.cache/hf_paged/models``)."""
    return _cache_home() / "models"


def _cache_home() -> Path:
    base = _value("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "hf_paged"


@functools.cache
def compile_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/hf_paged/compile`` (``~/.cache/hf_paged/compile``): torch's compile artifacts of each model
    and engine setting (``hf_paged/compile/_cache.py``)."""
    return _cache_home() / "compile"


@functools.cache
def kernel_trace() -> bool:
    """``HF_PAGED_KERNEL_TRACE=1``: the diagnostic build of the kernels, with decode trace points."""
    return _choice(KERNEL_TRACE, ("0", "1"), "0") == "1"


@functools.cache
def tp_all_reduce() -> str:
    """``HF_PAGED_TP_ALL_REDUCE``: ``hf_paged`` (the default) or ``nccl``."""
    return _choice(TP_ALL_REDUCE, ("hf_paged", "nccl"), "hf_paged")


def tp_all_reduce_asked() -> bool:
    """Whether ``HF_PAGED_TP_ALL_REDUCE`` is set (a fallback from a path asked for by name is a warning, not a note)."""
    return _value(TP_ALL_REDUCE) is not None


@functools.cache
def tp_timeout_s() -> float:
    """``HF_PAGED_TP_TIMEOUT_S``: seconds, default 600."""
    value = _value(TP_TIMEOUT_S) or "600"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TP_TIMEOUT_S}={value!r}: give a positive number of seconds (default 600)")
    return seconds


def _choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = _value(name) or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: use one of {', '.join(choices)} (default {default})")
    return value


def refresh() -> None:
    """Forget the values read so far: the next use of each reads the environment again."""
    for read in [value for value in globals().values() if hasattr(value, "cache_clear")]:  # the cached readers
        read.cache_clear()
