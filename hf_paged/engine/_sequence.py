"""``Sequence``: one stream of tokens the engine generates (a request, or one of its ``num_return_sequences`` copies).

Its KV lives in the blocks of ``block_table``; the first ``num_computed_tokens`` of ``token_ids`` have their KV
written there. A step computes the next tokens; when every token is computed, the logits of the last one are sampled
and the new token is appended (its KV is written by the following step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hf_paged.engine._sampling_params import SamplingParams


#: Stands in ``token_ids`` for a token sampled by a step still running on the device (asynchronous scheduling);
#: the next step reads its value on the device, the host writes it in when the step's tokens arrive.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TextState:
    """One sequence's text so far, as the ``Detokenizer`` (``engine/_detokenizer.py``) reads it: ``text`` is the text
    of its first ``read_offset`` generated tokens, ``ends[i]`` the length of ``text`` through token ``i``; ``sent``
    characters were streamed; ``stop_at`` is where the first stop string begins (None: none found)."""

    __slots__ = ("prefix_offset", "read_offset", "text", "ends", "sent", "stop_at")

    def __init__(self) -> None:
        self.prefix_offset = self.read_offset = self.sent = 0
        self.text = ""
        self.ends: list[int] = []
        self.stop_at: int | None = None


@dataclass(eq=False, repr=False, slots=True)
class Sequence:
    """Request state the scheduler, block manager and sampler share. Plain mutable object, owned by the engine: made
    from its first six fields (``token_ids``: the prompt's, copied), the others start as below."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival: tuple[int, int]  # (request counter, copy index): FIFO order, copies right after their parent
    seed: int
    pending_children: int = 0  # copies forked once the prompt is computed
    num_prompt_tokens: int = field(init=False)
    stop_at: int = field(init=False)  # length at which it has all its tokens
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    row: int = -1  # row of the block-table buffer while the sequence holds blocks
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0  # leading full blocks registered with the prefix cache
    last_block_hash: bytes | None = None  # prefix-cache key (SHA-256) of block num_hashed_blocks - 1
    num_streamed: int = 0  # generated tokens already handed to a stream reader
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # each new token's alternatives
    # (logprob, alternatives) of prompt tokens 1, 2, ... as far as computed (params.prompt_logprobs)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    grammar: object = None  # the structured-output matcher of params.json_schema (engine/_structured_output.py)
    finish_reason: str | None = None
    error: str | None = None
    # >= 0 while the last token is a PLACEHOLDER: the row of this sequence in the in-flight step's tokens.
    pending_row: int = -1
    text_state: TextState = field(default_factory=TextState)  # its text, when a Detokenizer reads it

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.stop_at = self.num_prompt_tokens + self.params.max_new_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens known on the host (an in-flight placeholder is left out)."""
        return self.token_ids[self.num_prompt_tokens : len(self.token_ids) - (self.pending_row >= 0)]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asks for prompt logprobs not all computed yet (its prompt must be computed, not found in the cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
