"""How ``generate_batch`` reads transformers' ``GenerationConfig`` and ``ContinuousBatchingConfig``: as transformers'
own ``model.generate_batch`` (5.17-5.24) reads them, field by field, so that one config means the same in both.

transformers' ``generate_batch`` reads the generation config it is given (the model's when given none) alone, with
no defaults merged in: an unset sampling field is off (``top_k=None`` is no top-k, not 50), ``do_sample=None`` is
greedy, ``eos_token_id=None`` (rewritten to ``-1``) and ``-1`` mean no EOS, ``max_new_tokens=None`` means no limit
(``max_length`` is not read). Every field of either config is in one of the tables below: read (with its meaning
here), refused (a ``ValueError`` naming it and why), or without effect on the tokens (a knob of transformers' own
runner); ``tests/engine/test_batch_configs.py`` checks that every field of the installed transformers is in them.
"""

from __future__ import annotations

import copy
import logging
import numbers

from transformers import GenerationConfig

from hf_paged.engine._config import EngineConfig
from hf_paged.engine._sampling_params import UNSERVED, eos_tuple

logger = logging.getLogger("hf_paged")

#: Generation settings transformers' ``generate_batch`` reads, and the value an unset (None) one means there.
GENERATION_READ = {
    "max_new_tokens": None,  # None: no limit (here: the model's position limit)
    "do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
    "eos_token_id": (),  # None and -1: no EOS; a list: any of them
    "num_return_sequences": 1,
}
#: Settings hf_paged applies as ``model.generate`` does, where transformers' ``generate_batch`` drops their logits
#: processor (with a warning: "isn't supported by CB"): a request asking for them gets them.
GENERATION_APPLIED_HERE = {"min_new_tokens": None, "min_length": None, "repetition_penalty": 1.0, "seed": None,
                           "output_logprobs": False, "output_scores": False}
#: Settings refused (the engine's own check, ``SamplingParams``): hf_paged does not apply them, and serving the
#: request without them would give other tokens. Their value that means off is accepted.
GENERATION_REFUSED = {**UNSERVED, "num_beams": 1, "stop_strings": None}
#: Settings that change nothing in ``generate_batch``'s tokens, there as here: what ``generate`` (not
#: ``generate_batch``) reads (output formats, caches, compile, assisted decoding, beam scoring), token ids used
#: only for padding and prompts, and bookkeeping.
GENERATION_NO_EFFECT = frozenset({
    "max_length", "_from_model_config", "_commit_hash", "transformers_version", "assistant_confidence_threshold",
    "assistant_early_exit", "assistant_ensemble_weight", "assistant_lookbehind", "target_lookbehind",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "is_assistant", "prompt_lookup_num_tokens",
    "max_matching_ngram_size", "speculation_type", "use_mtp", "bos_token_id", "pad_token_id",
    "decoder_start_token_id", "cache_config", "cache_implementation", "compile_config", "disable_compile",
    "max_cache_len", "prefill_chunk_size", "use_cache", "low_memory", "early_stopping", "length_penalty",
    "encoder_no_repeat_ngram_size", "encoder_repetition_penalty", "output_attentions", "output_hidden_states",
    "output_logits", "return_dict_in_generate", "remove_invalid_values", "renormalize_logits", "token_healing",
    "continuous_batching_config",
})

#: ContinuousBatchingConfig fields read, and the EngineConfig field (or generate_batch setting) each becomes.
BATCHING_READ = {
    "num_blocks": "num_blocks",  # blocks of page_size tokens: the same KV capacity in hf_paged's blocks
    "page_size": "block_size", "block_size": "block_size",  # 256 (transformers' default) reads as "not chosen"
    "max_batch_tokens": "max_batch_tokens", "max_requests_per_batch": "max_num_seqs",
    "max_memory_percent": "memory_budget", "allow_block_sharing": "enable_prefix_caching",
    "use_async_batching": "async_scheduling", "use_cuda_graph": "cuda_graphs",
    "return_logprobs": "return_logprobs", "seed": "seed",
}
#: ContinuousBatchingConfig fields that tune transformers' own runner (its compile, padding of its CUDA graphs,
#: attention switch, offloading, scheduler, logits processors, serving queue, tensor-parallel transport): they change
#: nothing in the tokens, and hf_paged's engine has its own ways (``EngineConfig``).
BATCHING_NO_EFFECT = frozenset({
    "max_blocks_per_request", "q_padding_interval_size", "kv_padding_interval_size", "varlen_compile_config",
    "decode_compile_config", "default_compile_level", "scheduler_type", "safety_margin", "auto_switch_to_flash",
    "cpu_offload_space", "cpu_offload_space_safety_threshold", "max_queue_size", "per_request_processors",
    "drop_unsupported_processors", "disable_nccl_graph_mixing", "cpu_group_timeout", "use_default_compile_configs",
    "max_cached_graphs",
})
#: hf_paged's own settings, read from the continuous-batching config under these names (an ``EngineConfig`` passed
#: as the config is taken as it is).
OWN_SETTINGS = ("cuda_graphs", "cuda_graph_capture", "compile_layers", "skinny_linear", "layer_kernels",
                "kv_cache_dtype", "logprobs_mode")
_SAMPLING = ("temperature", "top_k", "top_p", "min_p")
TRANSFORMERS_BLOCK = 256  # transformers' default page (block) size


def generation_config(given: GenerationConfig | None, model, max_new_tokens: int | None,
                      position_limit: int) -> GenerationConfig:
    """The config the engine runs for ``generate_batch``: ``given`` (else the model's) read as transformers'
    ``generate_batch`` reads it, every read field set (an unset one to what it means there), so that nothing of the
    model's generation config is merged in later. ``max_new_tokens``: the keyword of the call (it wins). No limit
    becomes ``max_length=position_limit`` (each request then ends at the model's position limit)."""
    gc = copy.deepcopy(given if given is not None else getattr(model, "generation_config", None) or GenerationConfig())
    if max_new_tokens is not None:
        gc.max_new_tokens = max_new_tokens
    # Every field the engine reads is set, so that the engine's resolution merges nothing of the model's generation
    # config into it (transformers' generate_batch reads the config alone); the sampling ones only when sampling
    # (greedy ignores them, and transformers' check warns of one set beside do_sample=False)
    for name, off in {**GENERATION_READ, **GENERATION_APPLIED_HERE, "num_beams": 1}.items():
        if getattr(gc, name, None) is None and off is not None and (gc.do_sample or name not in _SAMPLING):
            setattr(gc, name, off)
    if gc.min_new_tokens is None and not gc.min_length:
        gc.min_new_tokens = 0
    if getattr(gc, "stop_strings", None):
        raise ValueError("stop_strings: generate_batch has no tokenizer to match text with; use "
                         "hf_paged.Engine(model, tokenizer=...) for stop strings")
    gc.stop_strings = []
    # as transformers' generate_batch means it: None or -1 is no EOS (a negative entry, which no token matches, goes)
    gc.eos_token_id = [e for e in eos_tuple(gc.eos_token_id) if e >= 0]
    if gc.max_new_tokens is None:
        if gc.max_length is not None and gc.max_length != position_limit:
            logger.warning("hf_paged: generate_batch reads max_new_tokens, not max_length (as transformers' "
                           "generate_batch does): max_length=%s is ignored and requests run to EOS or the model's "
                           "position limit (%d tokens); set max_new_tokens", gc.max_length, position_limit)
        gc.max_length = position_limit
    return gc


def engine_config(given) -> EngineConfig:
    """The engine settings of ``given`` (transformers' ``ContinuousBatchingConfig``, or any object with some of its
    attributes and hf_paged's own, ``OWN_SETTINGS``); an ``EngineConfig`` is taken as it is. Unset ones stay
    automatic. ``ValueError`` (naming the field) for a value the engine refuses."""
    if isinstance(given, EngineConfig):
        return given
    if isinstance(given, dict):
        raise ValueError("continuous_batching_config must be transformers' ContinuousBatchingConfig (or an object "
                         "with its attributes), got a dict: pass ContinuousBatchingConfig(**settings)")
    fields = EngineConfig.field_names()
    settings = {ours: getattr(given, theirs) for theirs, ours in BATCHING_READ.items()  # (block_size over page_size)
                if ours in fields and getattr(given, theirs, None) is not None}
    if isinstance(settings.get("cuda_graphs"), tuple):  # use_cuda_graph as (varlen, decode): the decode one
        settings["cuda_graphs"] = bool(settings["cuda_graphs"][-1])
    settings.update({name: getattr(given, name) for name in OWN_SETTINGS if getattr(given, name, None) is not None})
    if (page := settings.pop("block_size", None)) is not None and page != TRANSFORMERS_BLOCK:
        settings["block_size"] = page
    num_blocks, tokens = settings.get("num_blocks"), TRANSFORMERS_BLOCK if page is None else page
    block_size = settings.get("block_size", EngineConfig.block_size)
    if all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0
           for v in (num_blocks, tokens, block_size)):
        settings["num_blocks"] = -(-num_blocks * tokens // block_size)  # the same tokens of KV, in hf_paged's blocks
    try:
        return EngineConfig(**settings)
    except ValueError as exc:
        raise ValueError(f"continuous_batching_config: {_transformers_names(str(exc))}") from None


def _transformers_names(message: str) -> str:
    """The engine names its fields; a ContinuousBatchingConfig user knows transformers' names."""
    for theirs, ours in BATCHING_READ.items():
        if ours not in BATCHING_READ and ours not in OWN_SETTINGS and message.startswith(ours):
            return f"{theirs} ({ours}){message[len(ours):]}"
    return message
