"""Multi-GPU runs with accelerate: models split by ``device_map``, and data parallel under ``accelerate launch``.

A model loaded with ``device_map="auto"`` (or any map) records where each module went in ``model.hf_device_map``.
``paged_cache_for`` reads it and builds a :class:`hf_paged.PagedAttentionCache` whose per-layer K/V tensors sit next
to their layer's weights; the step metadata then reaches each device once per step (``PagedMetadata.on``). For a
model loaded with ``tp_plan="auto"`` it holds the process's own KV heads, and the processes agree on one pool size.

``distributed_generate_batch`` runs one engine per process (``accelerate launch`` or ``torchrun``): each process
generates for a share of the prompts balanced by tokens, and every process gets all the results.

Both are also ``hf_paged.paged_cache_for`` and ``hf_paged.distributed_generate_batch``; this module keeps the import
path they had.
"""

from hf_paged.engine._data_parallel import distributed_generate_batch
from hf_paged.parallel._data_parallel import balanced_shares
from hf_paged.generate._paged_cache import paged_cache_for
from hf_paged.hf._placement import layer_devices

__all__ = ["balanced_shares", "distributed_generate_batch", "layer_devices", "paged_cache_for"]
