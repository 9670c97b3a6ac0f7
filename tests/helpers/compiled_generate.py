"""What the compiled-``generate`` tests share: greedy settings for the tiny models, a ``torch.compile`` backend that
counts graphs and calls, and a ``CompileConfig`` that transformers honours on the CPU too."""

from __future__ import annotations

import torch
from tiny_models import EOS, PAD
from transformers import CompileConfig

GREEDY = dict(do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


class CountingBackend:
    """A torch.compile backend that records each graph it compiles and each call of a compiled graph."""

    def __init__(self, inner: str = "eager"):
        self.inner, self.graphs, self.calls = inner, 0, 0

    def __deepcopy__(self, memo) -> CountingBackend:
        return self  # generate deep-copies its compile_config: keep counting here

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        run = gm.forward if self.inner == "eager" else torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)

        def counted(*args):
            self.calls += 1
            return run(*args)

        return counted


def compile_config(backend, fullgraph: bool = True) -> CompileConfig:
    config = CompileConfig(fullgraph=fullgraph, backend=backend, mode=None)
    config._compile_all_devices = True  # transformers compiles only on CUDA unless told
    return config
