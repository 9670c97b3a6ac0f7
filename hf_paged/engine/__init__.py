"""Continuous batching on a paged KV pool: requests join and leave the running batch every step.

The names below are imported on first use (``hf_paged/_lazy.py``): ``EngineConfig``'s module imports no torch, so the
command line builds its engine flags from it before torch is loaded.
"""

from hf_paged._lazy import lazy_exports

_LAZY = {
    "Engine": "hf_paged.engine._engine",
    "EngineConfig": "hf_paged.engine._config",
    "RequestOutput": "hf_paged.engine._request_output",
    "SamplingParams": "hf_paged.engine._sampling_params",
    "TokenDelta": "hf_paged.engine._request_output",
    "Workload": "hf_paged.engine._sizing",
    "distributed_generate_batch": "hf_paged.engine._data_parallel",
    "generate_batch": "hf_paged.engine._generate_batch",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
