"""``EngineConfig``: the engine's settings in one frozen record, validated in one place.

``Engine(model, num_blocks=..., ...)`` builds one from its keywords; ``Engine(model, config=EngineConfig(...))``
and ``generate_batch`` pass one. The defaults here are the defaults everywhere (``Engine``'s signature shows them).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence as SequenceType
from dataclasses import dataclass, fields

from hf_paged.attention._dispatch import available_backends
from hf_paged.cache._kv_quant import KV_CACHE_DTYPES, kv_storage_dtype

GRAPH_CAPTURE = ("start", "on_demand")  # when the decode CUDA graphs are captured (Engine's docstring)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of an :class:`~hf_paged.Engine` (its docstring says what each does).

    ``backend`` is kept as a tuple of names (a comma-separated string is split) and ``cuda_graphs`` as True, False
    or a tuple of batch sizes, so two configs that mean the same compare equal.
    """

    num_blocks: int | None = 512
    block_size: int = 16
    max_batch_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    backend: str | tuple[str, ...] | None = None
    memory_budget: float = 0.8
    cuda_graphs: bool | tuple[int, ...] = True
    async_scheduling: bool | None = None
    compile_layers: bool | None = None
    skinny_linear: bool | None = None
    kv_cache_dtype: str | None = None
    cuda_graph_capture: str = "start"

    def __post_init__(self) -> None:
        if self.num_blocks is not None:
            _positive_int("num_blocks", self.num_blocks, "or None (size the pool from free device memory)")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        for name in ("async_scheduling", "compile_layers", "skinny_linear"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True, False or None (automatic), got {getattr(self, name)!r}")
        budget = self.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not (0 < budget <= 1):
            raise ValueError(f"memory_budget must be a fraction in (0, 1] of free device memory, got {budget!r}")
        object.__setattr__(self, "memory_budget", float(budget))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            kv_storage_dtype(self.kv_cache_dtype, None)  # raises, listing the accepted values
        object.__setattr__(self, "backend", _backend_names(self.backend))
        object.__setattr__(self, "cuda_graphs", _graph_sizes(self.cuda_graphs))
        if self.cuda_graph_capture not in GRAPH_CAPTURE:
            raise ValueError(f"cuda_graph_capture must be one of {', '.join(map(repr, GRAPH_CAPTURE))}, got "
                             f"{self.cuda_graph_capture!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def resolve(cls, config: EngineConfig | None, **settings) -> EngineConfig:
        """``config``, or one built from keyword ``settings``; both (a keyword off its default) is refused."""
        if config is None:
            return cls(**settings)
        if not isinstance(config, EngineConfig):
            hint = ": pass EngineConfig(**settings)" if isinstance(config, dict) else ""
            raise ValueError(f"config must be an hf_paged.EngineConfig, got {type(config).__name__}{hint}")
        changed = [k for k, v in settings.items() if v != getattr(cls, k)]
        if changed:
            raise ValueError(f"give the engine settings either as config=EngineConfig(...) or as keywords, not both "
                             f"(got config and {', '.join(changed)})")
        return config


def _positive_int(name: str, value, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' ' + alternative if alternative else ''}, got {value!r}")


def _backend_names(backend) -> tuple[str, ...] | None:
    if backend is None:
        return None
    if isinstance(backend, str):
        names = tuple(n.strip() for n in backend.split(","))
    elif isinstance(backend, SequenceType) and all(isinstance(n, str) for n in backend):
        names = tuple(backend)
    else:
        raise ValueError(f"backend must be a name, a list of names or a comma-separated string, got {backend!r}")
    known = available_backends()
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"unknown attention backend(s) {unknown or list(names)}; choose from {known}")
    return names


def _graph_sizes(sizes) -> bool | tuple[int, ...]:
    if isinstance(sizes, bool):
        return sizes
    ok = isinstance(sizes, SequenceType) and not isinstance(sizes, str) and sizes and all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 1 for s in sizes)
    if not ok:
        raise ValueError(f"cuda_graphs must be True, False or a list of positive batch sizes, got {sizes!r}")
    return tuple(sorted({int(s) for s in sizes}))
