"""``RequestIntake``: how requests enter an ``Engine``, checked whole at the door and queued all or nothing.

A request is validated completely (``validation``, ``SamplingParams``) before anything is queued; several requests
of one call are all validated first, and their shared generation config is resolved once. Queueing gives each its
id and arrival under the engine's lock, or fails it at once (with its error in the output) if it can never run.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceType

import torch
from transformers import GenerationConfig

from hf_paged.engine import _validation as validation
from hf_paged.engine._sampling_params import SamplingParams
from hf_paged.engine._sequence import Sequence

Prompt = SequenceType[int] | str


class RequestIntake:
    """The request-intake half of :class:`~hf_paged.Engine` (a mixin: it reads the engine's ``vocab_size``,
    ``tokenizer``, ``generation_config``, ``model``, ``pool``, ``max_model_len``, ``requests``, ``scheduler``,
    ``counters``, ``_lock`` and ``_refuse_if_closed``)."""

    def add_request(
        self, prompt: Prompt, generation_config: GenerationConfig | None = None, request_id: str | int | None = None
    ) -> str:
        """Queue a prompt (token ids, or a string with a tokenizer); returns its request id.

        Raises ``ValueError`` (one line, nothing queued) for anything the engine cannot serve: an empty prompt,
        token ids that are not integers of the vocabulary, invalid or unserved sampling settings, a duplicate live
        ``request_id``. A prompt that can never run (longer than the whole cache, or leaving no room within the
        model's position limit) finishes with ``finish_reason="error"`` and a message instead.
        """
        seq = self._new_sequence(prompt, generation_config, request_id)
        return self._enqueue([seq])[0]

    def add_requests(
        self, prompts: list[Prompt], generation_config: GenerationConfig | list[GenerationConfig] | None = None,
        request_ids: list[str | int] | None = None,
    ) -> list[str]:
        """Queue several prompts (one config for all, or one each); returns their request ids, in order.

        Every prompt is checked before any is queued: a ``ValueError`` (as :meth:`add_request` raises it) queues
        nothing. A config shared by the prompts is resolved once, which makes this cheaper than a loop of
        ``add_request`` for many prompts.
        """
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError(f"got {len(request_ids)} request ids for {len(prompts)} prompts; give one each or none")
        return self._enqueue(self._new_sequences(prompts, generation_config, "add_requests", request_ids))

    def _new_sequence(self, prompt: Prompt, config: GenerationConfig | None, request_id,
                      resolved: dict[int, GenerationConfig] | None = None) -> Sequence:
        """Validate a request and build its sequence (id and arrival are given when it is queued); changes
        nothing in the engine. ``resolved`` memoizes resolved configs by identity for the prompts of one call."""
        ids = validation.prompt_token_ids(prompt, self.vocab_size, self.tokenizer)
        config = validation.generation_config(config) or self.generation_config
        gc = None if resolved is None else resolved.get(id(config))
        if gc is None:
            gc = SamplingParams.resolve(config, getattr(self.model, "generation_config", None))
            if resolved is not None:
                resolved[id(config)] = gc
        params = SamplingParams.from_resolved(gc, len(ids))
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: create the Engine with tokenizer=...")
        seed = params.seed if params.seed is not None else int(torch.randint(2**31 - 1, ()).item())
        return Sequence(validation.request_id(request_id), ids, params, (0, 0), seed, params.num_return_sequences - 1)

    def _enqueue(self, seqs: list[Sequence]) -> list[str]:
        """Give each sequence its id and arrival, and queue it (or fail it at once if it can never run)."""
        with self._lock:
            self._refuse_if_closed()
            return self._enqueue_locked(seqs)

    def _enqueue_locked(self, seqs: list[Sequence]) -> list[str]:
        given = [s.request_id for s in seqs if s.request_id is not None]
        clash = next((rid for rid in given if rid in self.requests.open), None)
        if clash is None and len(set(given)) < len(given):
            clash = next(rid for rid in given if given.count(rid) > 1)
        if clash is not None:  # before any is queued
            raise ValueError(f"request id {clash!r} is already live or given twice; pick another")
        for seq in seqs:
            seq.request_id, arrival = self.requests.new_id(seq.request_id)
            seq.arrival = (arrival, 0)
            self.requests.track(seq)
            self.counters.prompt_tokens += seq.num_tokens
            error = self._never_runs(seq)
            if error is not None:
                seq.finish("error", error)
                self.scheduler.failed.append(seq)
            else:
                self.scheduler.add(seq)
        return [seq.request_id for seq in seqs]

    def _never_runs(self, seq: Sequence) -> str | None:
        bs, num_blocks = self.pool.block_size, self.pool.num_blocks
        if seq.num_tokens >= self.max_model_len:
            return validation.past_position_limit(seq.num_tokens, self.max_model_len)
        if -(-seq.num_tokens // bs) > num_blocks:
            return (f"the prompt ({seq.num_tokens} tokens) is longer than the whole KV cache ({num_blocks} blocks "
                    f"of {bs}); create the Engine with more num_blocks")
        return None

    def _new_sequences(self, prompts, config, what: str, request_ids: list | None = None) -> list[Sequence]:
        """Validate every prompt (and its config) before any is queued; a config shared by several prompts is
        resolved once (the configs do not change during the call)."""
        prompts = validation.prompt_list(prompts, what)
        configs = validation.generation_configs(config, len(prompts))
        resolved: dict[int, GenerationConfig] = {}
        return [self._new_sequence(p, c, rid, resolved)
                for p, c, rid in zip(prompts, configs, request_ids or [None] * len(prompts))]
