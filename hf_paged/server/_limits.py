"""``Limits``: what one client may make the server do, the bounds (``hf-paged serve``'s flags of the same names) on
what a request may ask of the engine and of the response, and on what the server reads of its body (those are
:mod:`hf_paged.server._access`'s to apply).

A request whose copies would hold more tokens of context than ``max_request_tokens``, or whose answer, built whole,
would be larger than ``max_response_bytes`` (estimated from :data:`TOKEN_BYTES` and :data:`LOGPROB_BYTES`), is refused
with a 400 once its prompts are tokenized, before anything is queued. A streamed answer is sent as it comes instead:
its client must take each chunk within ``stream_timeout`` seconds (the engine thread also gives it up when its chunks
pile up: ``_engine_loop``).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.server._errors import bad_request

#: The bytes a response's estimated size counts for each token it shows (its text, as JSON writes a typical subword
#: token) and, when log-probabilities are asked, for each one shown with it (the token's own and each alternative's),
#: in the completions API's shape and in the chat API's (which adds each token's bytes).
TOKEN_BYTES = 8
LOGPROB_BYTES = {False: 40, True: 80}


@dataclass(frozen=True)
class Limits:
    """What one client may make the server do: each field is an argument of :func:`hf_paged.server.create_app` and a
    flag of ``hf-paged serve`` (``--max-body-bytes``...), whose defaults these are."""

    max_body_bytes: int = 16 * 2**20
    read_timeout: float = 30.0
    body_timeout: float = 300.0
    max_request_tokens: int = 2**20
    max_response_bytes: int = 64 * 2**20
    stream_timeout: float = 60.0

    def check(self, job, prompt_lengths: list[int], new_tokens: list[int]) -> None:
        """A 400 if ``job`` (a ``_sampling.Job`` whose prompts have ``prompt_lengths`` tokens and may take
        ``new_tokens`` new ones each) asks for more than these limits allow."""
        choices, param = len(prompt_lengths) * job.n, "max_completion_tokens" if job.chat else "max_tokens"
        if (context := job.n * (sum(prompt_lengths) + sum(new_tokens))) > self.max_request_tokens:
            raise bad_request(f"the request's {choices} choices would hold {context} tokens of context (prompt and "
                              f"new tokens, each copy of n counted); this server takes at most "
                              f"{self.max_request_tokens} per request (--max-request-tokens): ask for fewer copies "
                              f"(n), prompts or {param}", "n", "request_too_large")
        shown = job.n * ((sum(prompt_lengths) if job.echo else 0) + (0 if job.max_tokens == 0 else sum(new_tokens)))
        per_token = TOKEN_BYTES + ((1 + job.top_logprobs) * LOGPROB_BYTES[job.chat] if job.logprobs else 0)
        if not job.stream and shown * per_token > self.max_response_bytes:  # (a stream is never built whole)
            with_logprobs = " with their log-probabilities" if job.logprobs else ""
            raise bad_request(f"the answer could take about {shown * per_token} bytes ({shown} tokens{with_logprobs} "
                              f"in {choices} choices); this server builds at most {self.max_response_bytes} "
                              f"(--max-response-bytes): ask for fewer copies (n) or {param}, or stream it "
                              "(stream: true)", param, "response_too_large")
