"""The engine's compiled layers in a second process: with torch's own caches empty, the compile artifacts the first
process saved (``compile/_cache.py``, wired in ``compile/_layers.py``) are loaded before anything compiles, so
inductor compiles nothing afresh (every FX graph a cache hit) and the tokens are the first process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import json
import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
import hf_paged
from hf_paged.compile._layers import compiled_layers

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
engine = hf_paged.Engine(model, compile_layers=True, max_batch_tokens=64, max_num_seqs=4)
outputs = engine.generate([[5, 9, 13, 2, 7], [3, 1, 4]], GenerationConfig(max_new_tokens=4, do_sample=False))
print(json.dumps({"loaded": compiled_layers(model).artifacts.loaded, "compiled": engine.stats()["compiled_layers"],
                  "hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "tokens": [o.token_ids for o in outputs]}))
"""


def _process(tmp_path: Path, torch_cache: str) -> dict:
    """One engine run in a fresh process: torch's caches in ``torch_cache`` (a folder of its own), hf_paged's
    compile artifacts in the folder every process shares."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / torch_cache / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / torch_cache / "triton")}
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two processes, the first compiling with inductor: tens of seconds on a 2-core CPU
def test_a_second_process_loads_the_compiled_layers_instead_of_compiling(tmp_path):
    first = _process(tmp_path, "torch_a")
    assert first["compiled"] and not first["loaded"]
    assert first["miss"] > 0 and first["hit"] == 0  # it compiled every graph
    assert list((tmp_path / "xdg" / "hf_paged" / "compile").glob("*.bin"))  # and saved them for the next process
    second = _process(tmp_path, "torch_b")  # torch's caches empty: only hf_paged's artifacts hold the graphs
    assert second["compiled"] and second["loaded"]
    assert second["miss"] == 0 and second["hit"] == first["miss"]  # no fresh compile: each graph loaded instead
    assert second["tokens"] == first["tokens"]
