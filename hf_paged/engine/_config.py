"""``EngineConfig``: the engine's settings in one frozen record, validated in one place.

``Engine(model, num_blocks=..., ...)`` builds one from its keywords; ``Engine(model, config=EngineConfig(...))``
and ``generate_batch`` pass one. The defaults here are the defaults everywhere (``Engine``'s signature shows them).
The KV pool's settings (``num_blocks``, ``block_size``, ``memory_budget``, ``kv_cache_dtype``, ``backend``) are a
:class:`~hf_paged.CacheConfig`'s (``cache_config``), with its defaults and its checks; ``hf-paged``'s engine flags are
made from the fields' metadata. This module imports no torch: the command line builds those flags before torch is
loaded.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence as SequenceType
from dataclasses import dataclass, field, fields

# (_flag: the flags of both configs read alike)
from hf_paged.cache._config import MAX_SLOTS, CacheConfig, _flag, config_or_keywords

GRAPH_CAPTURE = ("start", "on_demand", "first_use")  # when the decode CUDA graphs are captured (Engine's docstring)
#: What logprobs are of (``logprobs_mode``, named as vLLM names it): the model's raw logits, or the distribution each
#: token was drawn from: after the repetition penalty, EOS suppression, grammar masks, temperature, top-k, top-p and
#: min-p, renormalized (a greedy token's after what applies to it: no temperature).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
_CACHE = {f.name: f for f in fields(CacheConfig)}
#: The settings that take one of a few values, and those values (None: automatic).
_CHOICES = {"enable_prefix_caching": (True, False), "async_scheduling": (True, False, None),
            "skinny_linear": (True, False, None), "layer_kernels": (True, False, None),
            "compile_layers": (True, False, None),
            "cuda_graph_capture": (*GRAPH_CAPTURE, None), "logprobs_mode": LOGPROBS_MODES}


def _cache_field(name: str):
    """A field of ``CacheConfig`` as an ``EngineConfig`` field: the same default and flag."""
    return field(default=_CACHE[name].default, metadata=_CACHE[name].metadata)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of an :class:`~hf_paged.Engine` (its docstring says what each does).

    ``backend`` is kept as a tuple of names (a comma-separated string is split) and ``cuda_graphs`` as True, False
    or a tuple of batch sizes, so two configs that mean the same compare equal. None in ``num_blocks``,
    ``max_batch_tokens``, ``max_num_seqs`` and ``cuda_graph_capture`` means automatic: the engine picks them
    (``hf_paged/engine/_sizing.py``), and its ``config`` holds what it picked. Fields with flag metadata are the
    options of ``hf-paged generate`` and ``hf-paged serve``.
    """

    num_blocks: int | None = _cache_field("num_blocks")
    block_size: int = _cache_field("block_size")
    max_batch_tokens: int | None = field(default=None, metadata=_flag(
        "tokens one step may run (prefill chunks and decodes together; default: automatic, from the device and its "
        "free memory)", "N"))
    max_num_seqs: int | None = field(default=None, metadata=_flag(
        "sequences running at once (default: automatic, from the device and its free memory)", "N"))
    enable_prefix_caching: bool = True
    backend: str | tuple[str, ...] | None = _cache_field("backend")
    memory_budget: float = _cache_field("memory_budget")
    cuda_graphs: bool | tuple[int, ...] = True
    async_scheduling: bool | None = None
    compile_layers: bool | None = field(default=None, metadata=_flag(
        "compile the layers' work outside attention with torch.compile: auto (default: off where the layer kernels "
        "serve the model, else on for CUDA models where triton is installed), on or off", metavar="{auto,on,off}"))
    skinny_linear: bool | None = None
    kv_cache_dtype: str | None = _cache_field("kv_cache_dtype")
    cuda_graph_capture: str | None = None
    logprobs_mode: str = LOGPROBS_MODES[0]
    layer_kernels: bool | None = field(default=None, metadata=_flag(
        "run eager layers' norms, SiLU MLPs, q/k/v and rotary embedding on hf_paged's layer kernels: auto (default: "
        "on a model on one CUDA device whose norms, MLPs and rotary embedding compute what Llama's do), on, off",
        metavar="{auto,on,off}"))

    def __post_init__(self) -> None:
        cache = self.cache_config  # the pool's checks
        object.__setattr__(self, "memory_budget", cache.memory_budget)
        object.__setattr__(self, "backend", cache.backend)
        for name in ("max_batch_tokens", "max_num_seqs"):  # (token offsets and sequence rows are int32)
            if (value := getattr(self, name)) is not None and (
                    isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= MAX_SLOTS):
                raise ValueError(f"{name} must be an integer in [1, 2**31 - 1] or None (automatic), got {value!r}")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if not any(value is c or isinstance(c, str) and value == c for c in choices):  # (1 is not True)
                named = ["None (automatic)" if c is None else repr(c) for c in choices]
                raise ValueError(f"{name} must be {', '.join(named[:-1])} or {named[-1]}, got {value!r}")
        if not isinstance(graphs := self.cuda_graphs, bool):  # batch sizes: kept sorted, each once
            if not (isinstance(graphs, SequenceType) and not isinstance(graphs, str) and graphs and all(
                    isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 1 for s in graphs)):
                raise ValueError(f"cuda_graphs must be True, False or a list of positive batch sizes, got {graphs!r}")
            object.__setattr__(self, "cuda_graphs", tuple(sorted({int(s) for s in graphs})))

    @property
    def cache_config(self) -> CacheConfig:
        """The KV pool's settings."""
        return CacheConfig(**{name: getattr(self, name) for name in _CACHE})

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def resolve(cls, config: EngineConfig | None, **settings) -> EngineConfig:
        """``config``, or one built from keyword ``settings``; both (a keyword off its default) is refused."""
        return config_or_keywords(cls, config, "config", "the engine settings", **settings)
