"""Continuous batching on a paged KV pool: requests join and leave the running batch every step."""

from hf_paged.engine._config import EngineConfig
from hf_paged.engine._data_parallel import distributed_generate_batch
from hf_paged.engine._engine import Engine
from hf_paged.engine._generate_batch import generate_batch
from hf_paged.engine._request_output import RequestOutput, TokenDelta
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._sizing import Workload

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta", "Workload",
           "distributed_generate_batch", "generate_batch"]
