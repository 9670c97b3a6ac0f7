"""Which model configs the paged path serves (anything else is refused at once with the feature named), and the KV
pool and backend dispatcher built for a served one."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_paged.attention._dispatch import Dispatcher, basic_calls
from hf_paged.cache._kv_pool import SUPPORTED_DTYPES, KVLayout, KVPool
from hf_paged.cache._kv_quant import kv_storage_dtype

SERVED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Architectures whose attention adds an ALiBi bias inside their own modules (not through the attention interface).
ALIBI_MODEL_TYPES = {"bloom", "mpt", "jais"}


def check_model_supported(config) -> None:
    """Raise ``NotImplementedError`` naming the feature if the paged path cannot serve ``config`` exactly."""
    text = config.get_text_config(decoder=True)
    name = getattr(text, "model_type", type(text).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{name}: encoder-decoder models are not served by hf_paged (decoder-only only)")
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        raise NotImplementedError(f"{name}: non-causal (bidirectional) attention is not served by hf_paged")
    if name in ALIBI_MODEL_TYPES or getattr(text, "alibi", False):
        raise NotImplementedError(
            f"{name}: ALiBi position bias is applied inside this architecture's own attention code, which "
            "hf_paged cannot serve; load it with attn_implementation='eager' or 'sdpa'")
    if unserved := sorted(set(getattr(text, "layer_types", None) or []) - SERVED_LAYER_TYPES):
        raise NotImplementedError(
            f"{name}: layer types {unserved} (e.g. linear, chunked or compressed attention) are not served by "
            f"hf_paged; it serves {sorted(SERVED_LAYER_TYPES)}")
    if getattr(text, "num_kv_shared_layers", 0):
        raise NotImplementedError(f"{name}: KV sharing across layers is not served by hf_paged")
    if getattr(text, "attention_chunk_size", None):
        raise NotImplementedError(f"{name}: chunked attention is not served by hf_paged")


def position_limit(model_config) -> int:
    """Most tokens (prompt + generated) one sequence of the model may hold: ``max_position_embeddings`` or
    ``n_positions``; 4096 when the config names neither."""
    text = model_config.get_text_config(decoder=True)
    return int(getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 4096)


def paged_kv(config, layout: KVLayout, devices: Sequence[torch.device], dtype: torch.dtype, block_size: int,
             num_blocks: int, kv_cache_dtype: str | None = None,
             backend: str | Sequence[str] | None = None) -> tuple[KVPool, Dispatcher]:
    """The KV pool of ``num_blocks`` blocks (``devices``: one per layer) for a model of ``config`` computing in
    ``dtype``, and the dispatcher of its attention backends: refuses (at once, with the reason) a model hf_paged does
    not serve, a dtype the pool cannot hold, and backends restricted to ones that cannot serve the model."""
    check_model_supported(config)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported for the KV cache; use one of {SUPPORTED_DTYPES}")
    kv_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
    pool = KVPool(layout, num_blocks, block_size, kv_dtype, devices)
    dispatcher = Dispatcher(backend)
    dispatcher.check_restriction(basic_calls(config, layout, list(devices), dtype, block_size, kv_dtype))
    return pool, dispatcher
