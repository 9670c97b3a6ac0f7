"""``import hf_paged`` imports neither torch nor transformers, and ``attn_implementation="hf_paged"`` still works
right after it: registered once transformers' model code is imported (``hf_paged/hf/_autoregister.py``), or at once
where it already is. Each case runs in a fresh interpreter (this one has long imported both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged.cli.default_model import tiny_llama

ROOT = Path(__file__).resolve().parents[2]

# The child loads the saved model twice (eager: the oracle; hf_paged), compares logits, then generates greedily on
# the hf_paged one with no cache given: generate's own cache must be the paged one, with eager's tokens.
CHECK = """
import torch
from transformers import AutoModelForCausalLM
paged = AutoModelForCausalLM.from_pretrained(DIR, attn_implementation="hf_paged").eval()
eager = AutoModelForCausalLM.from_pretrained(DIR, attn_implementation="eager").eval()
assert paged.config._attn_implementation == "hf_paged"
ids = torch.randint(3, 259, (2, 13), generator=torch.Generator().manual_seed(7))
with torch.no_grad():
    err = (paged(ids).logits - eager(ids).logits).abs().max().item()
assert err < 1e-4, err
out = paged.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
want = eager.generate(ids, max_new_tokens=6, do_sample=False)
assert type(out.past_key_values).__name__ == "PagedAttentionCache", type(out.past_key_values)
assert torch.equal(out.sequences, want), (out.sequences, want)
print("ok")
"""


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=3, attn_implementation="eager").save_pretrained(folder)
    return folder


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_import_hf_paged_is_light_and_a_model_then_loads_with_it(saved_model):
    run = _python(f"DIR = {str(saved_model)!r}\n"
                  "import sys\nimport hf_paged\n"
                  "assert not {'torch', 'transformers'} & set(sys.modules), sorted({'torch', 'transformers'} & "
                  "set(sys.modules))\n" + CHECK)
    assert run.returncode == 0 and run.stdout.split() == ["ok"], run.stderr[-3000:]
    assert "RuntimeWarning" not in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("first", [
    "import transformers.modeling_utils\nimport hf_paged",  # transformers' model code first: registered at once
    "import hf_paged\nhf_paged.Engine",  # hf_paged's own modules import transformers, mid-way through their import
    "from hf_paged.cli.default_model import tiny_llama",
    # transformers' model code first imported while a model is built on the meta device (a checkpoint conversion)
    "import hf_paged, torch\nwith torch.device('meta'):\n    import transformers.modeling_utils",
])
def test_every_import_order_registers(saved_model, first):
    run = _python(f"DIR = {str(saved_model)!r}\n{first}\n" + CHECK)
    assert run.returncode == 0 and run.stdout.split() == ["ok"], run.stderr[-3000:]
    assert "RuntimeWarning" not in run.stderr, run.stderr[-3000:]
