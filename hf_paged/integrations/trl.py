"""TRL's online RL trainers (GRPO, RLOO) generating their rollouts with hf_paged, in one line.

::

    from hf_paged.integrations.trl import use_hf_paged
    trainer = GRPOTrainer(model=model, args=GRPOConfig(...), ...)
    use_hf_paged(trainer)            # or use_hf_paged(trainer, return_logprobs=True, compile_layers=True, ...)
    trainer.train()

``use_hf_paged`` turns on the trainer's continuous-batching path (``use_transformers_continuous_batching``), on
which TRL calls ``model.generate_batch(prompt_ids, generation_config=..., continuous_batching_config=...)`` before
each optimizer step and reads ``generated_tokens``; :func:`enable_generate_batch` makes that call, on this model,
:func:`hf_paged.generate_batch` with an engine kept for the whole run. Anything else that calls
``model.generate_batch`` gets the same by calling :func:`enable_generate_batch` itself.

Each call generates on the trainer's own weights, no copy and no sync: the kept engine (its KV pool, captured CUDA
graphs and compiled layers, reused from step to step) checks the weights before it schedules and computes again
whatever the last optimizer step made stale; the model generates in eval mode (dropout off) and goes back to the mode
it was in. ``return_logprobs=True`` fills each result's ``logprobs`` with the log-probabilities of its sampled tokens
(``logprobs_mode``: the raw logits' or the processed distribution's, the one the token was drawn from), and
``use_hf_paged`` hands them to the GRPO trainer as its sampling log-probabilities (what its off-policy sequence mask
reads; RLOO reads none). docs/guides/rl.md has the whole story.

Nothing here imports TRL: the trainer is reached through the attributes its continuous-batching path reads.
"""

from __future__ import annotations

import copy

import torch
from transformers import ContinuousBatchingConfig

from hf_paged.engine._batch_configs import BATCHING_READ, OWN_SETTINGS, engine_config
from hf_paged.engine._generate_batch import _KEPT, generate_batch

#: The model attribute holding the settings given to :func:`enable_generate_batch` (and the last call's logprobs).
_STATE = "_hf_paged_generate_batch"
#: What TRL sets when its continuous-batching path is on and the user set no memory share: the rest of the device
#: memory is the training's.
TRL_MEMORY_PERCENT = 0.5


def enable_generate_batch(model: torch.nn.Module, *, reset_prefix_cache: bool = False,
                          **settings) -> torch.nn.Module:
    """Make ``model.generate_batch(...)`` run :func:`hf_paged.generate_batch` on an engine kept between calls;
    returns ``model``. :func:`disable_generate_batch` undoes it.

    ``settings`` are continuous-batching settings, by transformers' ``ContinuousBatchingConfig`` names
    (``max_memory_percent``, ``num_blocks``, ``max_batch_tokens``, ``return_logprobs``, ``seed``, ...) or
    hf_paged's own (``logprobs_mode``, ``compile_layers``, ``cuda_graphs``, ``kv_cache_dtype``, ...): they win over the same fields of
    the ``continuous_batching_config`` each call passes. ``reset_prefix_cache=True`` forgets the cached prefixes at
    every call (the kept engine already forgets those that the weights' changes made stale).

    Each call keeps the engine on the model (``persistent_manager=True``) and returns what
    :func:`hf_paged.generate_batch` returns (which generates in eval mode and puts the modules' modes back). For a
    peft model the method goes on the model peft wraps (the LoRA layers sit in it), so that the wrapper finds it too.
    """
    unknown = sorted(set(settings) - set(BATCHING_READ) - set(OWN_SETTINGS))
    if unknown:
        raise TypeError(f"enable_generate_batch() got unknown setting(s) {', '.join(map(repr, unknown))}; accepted: "
                        f"reset_prefix_cache and {', '.join(sorted({*BATCHING_READ, *OWN_SETTINGS}))}")
    if not isinstance(reset_prefix_cache, bool):
        raise ValueError(f"reset_prefix_cache must be True or False, got {reset_prefix_cache!r}")
    engine_config(_overlaid(None, settings))  # (a bad value is refused here, naming its field, not at step 0)
    base = _base_model(model)

    def hf_paged_generate_batch(inputs, generation_config=None, continuous_batching_config=None, **kwargs):
        results = generate_batch(base, inputs, generation_config, _overlaid(continuous_batching_config, settings),
                                 persistent_manager=True, reset_prefix_cache=reset_prefix_cache, **kwargs)
        if settings.get("return_logprobs") or getattr(continuous_batching_config, "return_logprobs", False):
            base.__dict__[_STATE] = [out.logprobs for out in results.values()]
        return results

    base.generate_batch = hf_paged_generate_batch
    return model


def disable_generate_batch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_generate_batch`: ``model.generate_batch`` is transformers' again, and the kept engine (its
    KV pool and graphs) is let go. Returns ``model``."""
    base = _base_model(model)
    for name in ("generate_batch", _KEPT, _STATE):
        base.__dict__.pop(name, None)
    return model


def use_hf_paged(trainer, **settings):
    """Make a TRL ``GRPOTrainer`` or ``RLOOTrainer`` generate its rollouts with hf_paged; returns ``trainer``.

    Turns on the trainer's continuous-batching path (with TRL's own default memory share,
    ``max_memory_percent=0.5``, where the trainer has no continuous-batching config) and calls
    :func:`enable_generate_batch` on its model with ``settings``. With ``return_logprobs=True`` the GRPO trainer gets
    the sampled tokens' log-probabilities as its sampling log-probabilities (TRL's continuous-batching path alone
    passes none).
    """
    enable_generate_batch(trainer.accelerator.unwrap_model(trainer.model), **settings)
    trainer.use_transformers_continuous_batching = True
    if trainer.continuous_batching_config is None:
        trainer.continuous_batching_config = ContinuousBatchingConfig(max_memory_percent=TRL_MEMORY_PERCENT)
    single_turn = getattr(trainer, "_generate_single_turn", None)
    if single_turn is not None and hasattr(trainer, "get_off_policy_mask"):  # (GRPO's; RLOO reads no logprobs)
        base = _base_model(trainer.accelerator.unwrap_model(trainer.model))

        def generate_single_turn(*args, **kwargs):
            completion_ids, logprobs = single_turn(*args, **kwargs)
            handed = base.__dict__.pop(_STATE, None)
            return completion_ids, logprobs if logprobs is not None else handed

        trainer._generate_single_turn = generate_single_turn
    return trainer


def _overlaid(given, settings: dict):
    """A copy of the continuous-batching config ``given`` (transformers' own default where None) with ``settings``
    set over it."""
    config = copy.copy(given) if given is not None else ContinuousBatchingConfig()
    for name, value in settings.items():
        setattr(config, name, value)
    return config


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model of ``model``: the one a peft model wraps (its LoRA layers sit in it), else ``model``."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model
