"""Paged attention: per-step metadata and backend dispatch."""

from hf_paged.attention.backends.base import (AttentionBackend, AttentionCall, AttentionInputs, AttentionParams,
                                              register_backend)
from hf_paged.attention._dispatch import Dispatcher, available_backends
from hf_paged.attention._metadata import PagedMetadata, Phase

__all__ = ["AttentionBackend", "AttentionCall", "AttentionInputs", "AttentionParams", "Dispatcher", "PagedMetadata",
           "Phase", "available_backends", "register_backend"]
