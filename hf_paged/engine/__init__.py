"""Continuous batching on the paged cache: requests join and leave the running batch every step."""

from hf_paged.engine._config import EngineConfig
from hf_paged.engine._engine import Engine
from hf_paged.engine._request_output import RequestOutput, TokenDelta
from hf_paged.engine._sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "TokenDelta"]
