"""Continuous batching on a paged KV pool: requests join and leave the running batch every step."""

from hf_paged.engine._config import EngineConfig
from hf_paged.engine._data_parallel import distributed_generate_batch
from hf_paged.engine._engine import Engine
from hf_paged.engine._generate_batch import generate_batch, workload_blocks
from hf_paged.engine._request_output import RequestOutput, TokenDelta
from hf_paged.engine._sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta", "distributed_generate_batch",
           "generate_batch", "workload_blocks"]
