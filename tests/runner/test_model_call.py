"""The engine's own model calls skip transformers' mask building: position_ids are not probed for packed sequences
(a host sync in every step, a wait for the device that asynchronous scheduling avoids), and the tokens stay those of
``model.generate`` with eager attention."""

from __future__ import annotations

import pytest
import transformers.masking_utils as masking_utils
from engine_helpers import greedy_config, hf_greedy, models, random_prompts
from tiny_models import ARCHS

import hf_paged


def _refused(position_ids):
    raise AssertionError("an engine step probed position_ids for packed sequences (a host sync)")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_engine_steps_build_no_mask_and_give_the_eager_tokens(arch, monkeypatch):
    prompts = random_prompts(5, 3, 30, seed=sorted(ARCHS).index(arch))
    expected = hf_greedy(arch, prompts, 6)  # (the oracle builds its masks: before the probe is refused)
    _, paged = models(arch)
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", _refused)
    # chunked prefills next to decodes: steps that pack several sequences, where the probe would find packing
    engine = hf_paged.Engine(paged, num_blocks=64, block_size=4, max_batch_tokens=24, max_num_seqs=4)
    outputs = engine.generate(prompts, greedy_config(6))
    assert "error" not in [o.finish_reason for o in outputs]  # (a step that raised would fail its sequences)
    assert [o.token_ids for o in outputs] == expected
