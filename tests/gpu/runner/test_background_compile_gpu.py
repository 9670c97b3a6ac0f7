"""On the GPU: ``compile_layers="background"`` (``runner/_background_compile.py``). A long-lived engine captures its
decode graphs with the eager layers while the helper process compiles a slim copy of the model on the same device;
once the helper is done the engine switches between two steps to the compiled layers, its graphs captured anew,
every graph of the full model found in torch's caches; a ``generate_batch`` call started after the helper compiles
at its start. float32, so the compiled and the eager layers give the same greedy tokens. The CPU side:
``tests/runner/test_background_compile.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged import envs

pytestmark = pytest.mark.usefixtures("hf_paged_kernels")

ROOT = Path(__file__).resolve().parents[3]

FLOW = """
import json, torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
import hf_paged
from hf_paged.runner import _background_compile as bc

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2)).to("cuda").eval()
prompts = [[int(t) for t in torch.randint(0, 512, (n,))] for n in (5, 33, 70, 1)]
config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
settings = dict(max_batch_tokens=256, max_num_seqs=8)
reference = [o.token_ids for o in hf_paged.Engine(model, compile_layers=False, **settings).generate(prompts, config)]
engine = hf_paged.Engine(model, compile_layers="background", **settings)
out = {"eager": engine.runner.compiled is None, "eager_graphs": engine.stats()["cuda_graphs"] is not None}
tokens = [[o.token_ids for o in engine.generate(prompts, config)]]
out["helper"] = bc.helper(model).wait(600)
out["helper_log"] = bc.helper(model).log_tail(8)
tokens.append([o.token_ids for o in engine.generate(prompts, config)])
stats = engine.stats()
out["switched"] = engine.runner.compiled is not None and stats["compiled_layers"]
out["graphs_anew"] = stats["cuda_graphs"] is not None and stats["cuda_graphs"]["replays"] > 0
batch = hf_paged.generate_batch(model, prompts, config, hf_paged.EngineConfig(compile_layers="background", **settings))
tokens.append([list(batch[f"req_{i}"].generated_tokens) for i in range(len(prompts))])
out["misses"] = counters["inductor"]["fxgraph_cache_miss"]
out["hits"] = counters["inductor"]["fxgraph_cache_hit"]
out["same"] = [t == reference for t in tokens]
print(json.dumps(out))
"""


def test_a_long_lived_engine_switches_to_the_helpers_compile(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HF_PAGED_CACHE": str(envs.kernel_cache_dir())}
    run = subprocess.run([sys.executable, "-c", FLOW], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["eager"] and out["eager_graphs"]
    assert out["helper"] == "done", out["helper_log"]
    assert out["switched"] and out["graphs_anew"]
    assert out["hits"] > 0 and out["misses"] == 0, out
    assert out["same"] == [True, True, True], out
