"""``Engine(compile_layers="background")`` (``runner/_background_compile.py``): an engine with nothing compiled yet runs
the layers eagerly while a helper process compiles a slim copy of the model into torch's caches; an engine started
after the helper compiles from them (cache hits, no misses) and gives the eager engine's tokens. A helper that fails
leaves the compile to this process (with a warning that says why), one still running at exit is stopped, and the
slim copy keeps one layer of each kind."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PretrainedConfig

import hf_paged
from hf_paged.runner import _background_compile as bc

ROOT = Path(__file__).resolve().parents[2]

# The whole flow in a process of its own, with torch's and hf_paged's caches empty (the helper inherits them).
FLOW = """
import json, torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
import hf_paged
from hf_paged.runner import _background_compile as bc

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
prompts = [[int(t) for t in torch.randint(0, 128, (n,))] for n in (5, 3, 11)]
config = GenerationConfig(max_new_tokens=6, do_sample=False)
settings = dict(max_batch_tokens=64, max_num_seqs=4)
reference = [o.token_ids for o in hf_paged.Engine(model, compile_layers=False, **settings).generate(prompts, config)]
# a long-lived engine: eager while the helper runs, compiled from its next step after the helper is done
first = hf_paged.Engine(model, compile_layers="background", **settings)
out = {"first_eager": first.runner.compiled is None and not first.stats()["compiled_layers"]}
tokens = [[o.token_ids for o in first.generate(prompts, config)]]
out["graphs_while_eager"] = counters["stats"]["unique_graphs"]
helper = bc.helper(model)
out["helper"] = helper.wait(600)
tokens.append([o.token_ids for o in first.generate(prompts, config)])
out["first_switched"] = first.runner.compiled is not None and first.stats()["compiled_layers"]
# an engine started after the helper: compiled from its start, one helper per model
second = hf_paged.Engine(model, compile_layers="background", **settings)
out["second_compiled"] = second.runner.compiled is not None and bc.helper(model) is helper
tokens.append([o.token_ids for o in second.generate(prompts, config)])
out["hits"], out["misses"] = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
out["same"] = [t == reference for t in tokens]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_eager_first_then_compiled_from_the_helpers_caches(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    run = subprocess.run([sys.executable, "-c", FLOW], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["first_eager"] and out["graphs_while_eager"] == 0  # nothing compiled here while the helper ran
    assert out["helper"] == "done"
    assert out["first_switched"] and out["second_compiled"]
    assert out["hits"] > 0 and out["misses"] == 0  # every graph of the 3-layer model came from the 1-layer copy's
    assert out["same"] == [True, True, True]


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1)).eval()


SETTINGS = {"block_size": 16, "max_batch_tokens": 64, "max_num_seqs": 4}


@pytest.mark.slow  # inductor's compile: several seconds on a 2-core CPU
def test_a_failed_helper_leaves_the_compile_to_this_process(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no compile artifacts of an earlier run
    monkeypatch.setattr(bc, "HELPER_MODULE", "hf_paged.no_such_helper")
    model = _tiny()
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        assert bc.layers_for_engine(model, "background", None, SETTINGS) is None  # eager while the helper runs
        assert bc.helper(model).wait(120) == "failed"
        layers = bc.layers_for_engine(model, "background", None, SETTINGS)
    assert layers is not None and layers.enabled  # compiled here, as compile_layers=True would
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "helper process compiling the layers failed" in warnings[0]
    assert "No module named" in warnings[0]  # the helper's own last lines say why
    assert bc.layers_for_engine(model, "background", None, SETTINGS) is layers
    layers.restore()


@pytest.mark.slow  # inductor's compile: several seconds on a 2-core CPU
def test_a_long_lived_engine_keeps_its_eager_layers_when_the_helper_fails(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(bc, "HELPER_MODULE", "hf_paged.no_such_helper")
    model = _tiny()
    prompts = [[3, 5, 7, 9], [2, 4]]
    config = GenerationConfig(max_new_tokens=5, do_sample=False)
    reference = [o.token_ids for o in hf_paged.Engine(model, compile_layers=False).generate(prompts, config)]
    engine = hf_paged.Engine(model, compile_layers="background")
    assert engine.runner.compiled is None and bc.helper(model).wait(120) == "failed"
    with caplog.at_level(logging.WARNING, logger="hf_paged"):
        assert [o.token_ids for o in engine.generate(prompts, config)] == reference
        assert [o.token_ids for o in engine.generate(prompts, config)] == reference
    assert engine.runner.compiled is None and not engine.stats()["compiled_layers"]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "keeps its layers eager" in warnings[0] and "No module named" in warnings[0]


def test_compiled_code_in_this_process_compiles_at_once_without_a_helper(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = _tiny()
    layers = hf_paged.compile._layers.compiled_layers(model)
    layers.warm_batch_sizes.add(4)  # as after an engine ran the compiled layers
    assert bc.layers_for_engine(model, "background", None, SETTINGS) is layers
    assert bc.helper(model) is None
    layers.restore()


def test_artifacts_of_an_earlier_process_compile_at_once_without_a_helper(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def found(self):  # as when an earlier process saved this model's artifacts and torch took them
        self.loaded = True
        return True

    monkeypatch.setattr(hf_paged.compile._cache.CompileArtifacts, "load", found)
    model = _tiny()
    layers = bc.layers_for_engine(model, "background", None, SETTINGS)
    assert layers is not None and layers.artifacts.loaded and bc.helper(model) is None
    layers.restore()


def test_the_other_settings_decide_as_before():
    model = _tiny()
    assert bc.layers_for_engine(model, False, None, SETTINGS) is None
    assert bc.layers_for_engine(model, None, None, SETTINGS) is None  # automatic: CUDA models only
    assert bc.helper(model) is None


def test_a_helper_still_running_is_stopped(tmp_path, monkeypatch):
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(bc, "HELPER_MODULE", "sleeper")
    helper = bc.Helper({"config": {}})
    assert helper.state() == "running"
    began = time.perf_counter()
    helper.stop()  # what the process runs at exit
    assert helper.state() == "failed" and time.perf_counter() - began < 15


def test_the_slim_copy_keeps_one_layer_of_each_kind():
    plain = LlamaConfig(num_hidden_layers=16)
    assert bc.slim_config(plain).num_hidden_layers == 1 and plain.num_hidden_layers == 16
    kinds = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    mixed = LlamaConfig(num_hidden_layers=12)
    mixed.layer_types = kinds
    slim = bc.slim_config(mixed)
    assert slim.num_hidden_layers == 2 and slim.layer_types == ["sliding_attention", "full_attention"]
    assert mixed.layer_types == kinds
    assert bc.slim_config(PretrainedConfig()) is None  # no num_hidden_layers: the engine compiles in-process


def test_a_tensor_parallel_engine_refuses_background_and_says_what_to_pass(monkeypatch):
    from hf_paged.parallel import _lockstep as lockstep

    monkeypatch.setattr(lockstep, "tensor_parallel", lambda model: object())  # as for a model sharded by tp_plan
    with pytest.raises(ValueError, match="compile_layers='background' serves a model on one device.*pass "
                                         "compile_layers=None or True"):
        lockstep.for_model(_tiny(), "background", True)


def test_compile_layers_background_is_a_setting_and_other_words_are_refused():
    assert hf_paged.EngineConfig(compile_layers="background").compile_layers == "background"
    with pytest.raises(ValueError, match="compile_layers must be True, False, None .* or 'background'"):
        hf_paged.EngineConfig(compile_layers="later")
