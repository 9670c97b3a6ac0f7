"""Prompt logprobs: the log-probability the model gives each prompt token after the first (what an evaluator scores
a choice by), computed in the steps that compute the prompt.

A step that prefills a chunk of such a prompt keeps the logits of the chunk's tokens as well as the sampled rows'
(``plan_step(extra_rows=...)``); the logits at position ``p`` score prompt token ``p + 1``. Positions already
scored (a sequence recomputed after a preemption) are not scored again, and such a prompt is computed rather than
found in the prefix cache (``Sequence.needs_prompt_logprobs``).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from hf_paged.engine._sampler import logprob_rows, split_logprob_row
from hf_paged.engine._sequence import Sequence

_ASKED = operator.attrgetter("params.prompt_logprobs")


class PromptRows(NamedTuple):
    """The extra logits rows of a step: ``rows[i]`` (a position in the packed step) scores ``targets[i]``;
    ``owners`` gives the rows' sequences in order, with how many rows each has."""

    rows: list[int]
    targets: list[int]
    owners: list[tuple[Sequence, int]]


def prompt_rows(seqs: list[Sequence], num_tokens: list[int]) -> PromptRows | None:
    """The rows of a step that computes ``num_tokens[i]`` tokens of ``seqs[i]``; None if it scores none."""
    if set(map(_ASKED, seqs)) == {None}:  # (the usual case, checked at C speed)
        return None
    out, offset = PromptRows([], [], []), 0
    for seq, n in zip(seqs, num_tokens):
        if seq.needs_prompt_logprobs:
            c = seq.num_computed_tokens
            start, stop = max(c, len(seq.prompt_logprobs)), min(c + n, seq.num_prompt_tokens - 1)
            if start < stop:
                out.rows.extend(range(offset + start - c, offset + stop - c))
                out.targets.extend(seq.token_ids[start + 1 : stop + 1])
                out.owners.append((seq, stop - start))
        offset += n
    return out if out.rows else None


def score(logits: torch.Tensor, rows: PromptRows) -> list[list[tuple[float, list[tuple[int, float]]]]]:
    """logits: ``[R, V]`` of ``rows``. Returns, per owner, ``(logprob of the target, its k likeliest (id,
    logprob))`` for each of its rows (host lists: the step waits for the device here)."""
    targets = torch.tensor(rows.targets, device=logits.device)
    scored = logprob_rows(logits, targets, max(s.params.prompt_logprobs for s, _ in rows.owners)).tolist()
    out, at = [], 0
    for seq, count in rows.owners:
        out.append([split_logprob_row(row, seq.params.prompt_logprobs) for row in scored[at : at + count]])
        at += count
    return out
