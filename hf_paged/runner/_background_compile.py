"""Compiling the model's layers without keeping a process's first calls waiting (``compile_layers="background"``).

A process's first compile of the layers takes 10-15 s (1B model on an H200): dynamo's tracing, then inductor's code
generation and Triton's kernel builds. All but the tracing lands in torch's on-disk caches (inductor's FX graph
cache, the AOTAutograd cache, Triton's kernels), keyed by the graphs' content, and a decoder layer's graph does not
depend on how many layers the model has. So a helper process builds a slim copy of the model (its config with one
layer of each kind, random weights, on the same device), runs an engine of the same settings on it and exits; the
graphs it compiled are then in the caches. Engines started before it is done run the layers eagerly; an engine
started after it compiles the full model from the caches (a second process's cost: dynamo's tracing). On a CPU, a
4-layer tiny Llama compiled in 3.3 s after a 1-layer copy's compile in another process (every graph from the
caches), against 15.7 s with empty caches.

An engine compiles at once where that is cheap already: compile artifacts of this model and settings on disk (an
earlier process compiled it, ``hf_paged.compile._cache``) or compiled code in this process. Where the helper cannot
help (a config without ``num_hidden_layers``) or fails (a model class its config does not rebuild, no memory), the
engine compiles in this process, as ``compile_layers=True`` does, and a failure is logged with the helper's last
lines. An engine of one call (``generate_batch``) decides at its start; a long-lived one (``Engine``, a server)
started before the helper is done switches to the compiled layers between two steps once it is (``ModelRunner.
take_compiled_layers``: its decode graphs captured anew), or keeps its layers eager if the helper failed. A helper
still running when the process exits is stopped.

The helper runs ``python -m hf_paged.engine._background_helper SPEC`` (a JSON file: the slim config, dtype, device and
engine settings).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hf_paged.compile import _layers as compiled_layers
from hf_paged.compile._layers import CompiledLayers, LayerCompile

logger = logging.getLogger("hf_paged")

#: ``Engine(compile_layers=BACKGROUND)``.
BACKGROUND = "background"

#: The engine settings the helper's engine takes from the engine that started it (those that decide the compiled
#: graphs or the shapes they are warmed on).
HELPER_SETTINGS = ("block_size", "max_batch_tokens", "max_num_seqs", "cuda_graphs", "cuda_graph_capture",
                   "skinny_linear", "kv_cache_dtype", "backend")

#: KV blocks of the helper's engine: its few short prompts and the padding rows of its graph captures.
HELPER_BLOCKS = 64

_ATTRIBUTE = "_hf_paged_background_compile"

#: The helper process's program (run by name: it imports the engine, which imports this module).
HELPER_MODULE = "hf_paged.engine._background_helper"


class Helper:
    """The helper process of one model: its state (``"running"``, ``"done"``, ``"failed"``) and its log."""

    def __init__(self, spec: dict):
        self.folder = Path(tempfile.mkdtemp(prefix="hf_paged_background_compile_"))
        (self.folder / "spec.json").write_text(json.dumps(spec))
        self.log = self.folder / "helper.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", HELPER_MODULE, str(self.folder / "spec.json")],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # this process's environment
        self.reported = False
        atexit.register(self.stop)

    def state(self) -> str:
        code = self.process.poll()
        return "running" if code is None else "done" if code == 0 else "failed"

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the helper to end (at most ``timeout`` seconds); its state."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout)
        return self.state()

    def report(self, then: str) -> None:
        """Warn once that the helper failed, with its last lines, and what happens ``then``."""
        if not self.reported:
            self.reported = True
            logger.warning("hf_paged: the helper process compiling the layers failed (exit %s: %s); %s",
                           self.process.returncode, self.log_tail(), then)

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            if self.wait(10) == "running":
                self.process.kill()


def layers_for_engine(model: torch.nn.Module, setting, how: LayerCompile | None,
                      settings: dict) -> CompiledLayers | None:
    """The compiled layers an engine of ``model`` starts with under ``compile_layers=setting``: as
    ``compiled_layers.for_engine`` decides, and for :data:`BACKGROUND` (see the module docstring) None (eager) while
    the helper runs; ``settings``: the engine's resolved settings (:data:`HELPER_SETTINGS` go to the helper)."""
    layers = compiled_layers.for_engine(model, setting, how)  # hands the artifacts of an earlier process to torch
    if setting != BACKGROUND or layers is None:
        return layers
    helper = getattr(model, _ATTRIBUTE, None)
    if helper is None:
        if layers.warm_batch_sizes or layers.artifacts.loaded:
            return layers  # compiled in this process already, or an earlier process's code in the caches
        if (slim := slim_config(model.config)) is None:
            logger.info("hf_paged: compiling the layers now: no slim copy of a %s config (no num_hidden_layers)",
                        type(model.config).__name__)
            return layers
        engine = {name: settings[name] for name in HELPER_SETTINGS if name in settings}  # tuples go as JSON lists
        helper = Helper({"config": slim.to_dict(), "dtype": str(model.dtype).removeprefix("torch."),
                         "device": str(next(model.parameters()).device), "engine": engine})
        object.__setattr__(model, _ATTRIBUTE, helper)  # not a submodule
        logger.info("hf_paged: the engine runs the model's layers eagerly while a helper process compiles a slim "
                    "copy of them (pid %d); engines started after it compile from torch's caches",
                    helper.process.pid)
        return None
    if (state := helper.state()) == "running":
        return None
    if state == "failed":
        helper.report("compiling them in this process")
    return layers


def helper(model: torch.nn.Module) -> Helper | None:
    """The helper process started for ``model``, if any."""
    return getattr(model, _ATTRIBUTE, None)


def slim_config(config):
    """``config`` with one decoder layer of each kind (``layer_types``: the first of each), or None where it names
    no ``num_hidden_layers``."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        return None
    slim = copy.deepcopy(config)
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(kinds) == layers:
        slim.layer_types = list(dict.fromkeys(kinds))  # each kind once, in the order of its first layer
        slim.num_hidden_layers = len(slim.layer_types)
    else:
        slim.num_hidden_layers = 1
    return slim
