"""Which model configs the paged path serves; anything else is refused at once with the feature named."""

from __future__ import annotations

SERVED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Architectures whose attention adds an ALiBi bias inside their own modules (not through the attention interface).
ALIBI_MODEL_TYPES = {"bloom", "mpt", "jais"}


def check_model_supported(config) -> None:
    """Raise ``NotImplementedError`` naming the feature if the paged path cannot serve ``config`` exactly."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    name = getattr(text, "model_type", type(text).__name__)
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{name}: encoder-decoder models are not served by hf_paged (decoder-only only)")
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        raise NotImplementedError(f"{name}: non-causal (bidirectional) attention is not served by hf_paged")
    if name in ALIBI_MODEL_TYPES or getattr(text, "alibi", False):
        raise NotImplementedError(
            f"{name}: ALiBi position bias is applied inside this architecture's own attention code, which "
            "hf_paged cannot serve; load it with attn_implementation='eager' or 'sdpa'"
        )
    layer_types = getattr(text, "layer_types", None) or []
    unserved = sorted(set(layer_types) - SERVED_LAYER_TYPES)
    if unserved:
        raise NotImplementedError(
            f"{name}: layer types {unserved} (e.g. linear, chunked or compressed attention) are not served by "
            f"hf_paged; it serves {sorted(SERVED_LAYER_TYPES)}"
        )
    if getattr(text, "num_kv_shared_layers", 0):
        raise NotImplementedError(f"{name}: KV sharing across layers is not served by hf_paged")
    if getattr(text, "attention_chunk_size", None):
        raise NotImplementedError(f"{name}: chunked attention is not served by hf_paged")
