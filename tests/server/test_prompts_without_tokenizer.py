"""A server whose engine has no tokenizer: token-id prompts are served as given, text and chat are refused with a 400
that says to send token ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_paged.server._errors import ServerError
from hf_paged.server._prompts import PromptBuilder


def test_token_ids_are_served_and_text_and_chat_are_refused_without_a_tokenizer():
    engine = SimpleNamespace(tokenizer=None, vocab_size=300, max_model_len=4096, max_prompt_tokens=4000,
                             generation_config=None, config=SimpleNamespace(num_blocks=512, block_size=16))
    prompts = PromptBuilder(engine)
    assert prompts.tokenizer is None and prompts.chat_template is not None
    ids = [7, 0, 299, 42]
    assert prompts.token_ids(ids, chat=False) == ids
    with pytest.raises(ServerError, match="send token ids") as text:
        prompts.token_ids("hello", chat=False)
    assert text.value.status == 400 and text.value.param == "prompt"
    with pytest.raises(ServerError, match="chat needs a tokenizer") as chat:
        prompts.token_ids([{"role": "user", "content": "hello"}], chat=True)
    assert chat.value.status == 400
    with pytest.raises(ServerError, match=r"in \[0, 300\), got 300"):
        prompts.token_ids([1, 300], chat=False)
