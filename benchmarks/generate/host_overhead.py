"""Host time per decode step of compiled ``generate``, measured on the CPU with a graph that does no work.

On a GPU, a compiled decode step replays a CUDA graph; what is left on the host is ``generate``'s own Python
(inputs, logits processors, stopping criteria), the mask function (for hf_paged: planning the step) and the
compiled call's guards. That host time bounds the step when the graph is short (batch 1). This script measures it
on the CPU with a tiny model: the compile backend runs each graph once and from then on returns those outputs
without running it (a step of no device work; the tokens repeat, which no stopping criterion here minds), so the
time per decode step is host time only. Per decode step: (wall of a ``--new-tokens`` call - wall of a 1-token
call) / (new tokens - 1), for

  static             sdpa with ``cache_implementation="static"`` (transformers' own compiled path)
  hf_paged_compiled  hf_paged with ``PagedAttentionCache(max_new_tokens=...)``
  hf_paged_optimized the same after ``hf_paged.optimize_generate(model)`` (planned masks, no guards on nn modules
                     whatever ``--guard-filter`` says; no decode linears on the CPU)

It is a CPU host-overhead measurement; it says nothing about GPU kernels. Both systems run in one process, one
thread, taking turns over ``--rounds`` (each compiled afresh); each number is the fastest of all calls (host time
is what is left when nothing else competes for the CPU).

``--layers`` sets the model's depth (the guards dynamo evaluates before each compiled call grow with it: ~3,400
for 16 layers) and ``--guard-filter inbuilt|all`` drops those on (built-in | all) nn modules (torch.compiler's
``skip_guard_on_*_nn_modules_unsafe`` filters, passed as the compile config's ``guard_filter_fn``).

    python -m benchmarks.generate.host_overhead [--batch 1] [--new-tokens 256] [--repeats 5] [--rounds 3]
        [--layers 16] [--guard-filter none|inbuilt|all]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import CompileConfig

from benchmarks.e2e.workloads import SMOKE_SHAPE, load_model
from benchmarks.generate.systems import GUARD_FILTERS, prompts
import hf_paged
from hf_paged.hf.compat import with_cache

SYSTEMS = ("static", "hf_paged_compiled", "hf_paged_optimized")


class FirstOutputs:
    """A torch.compile backend whose graphs run once ("eager") and then return those outputs without running."""

    def __init__(self):
        self.calls = 0

    def __deepcopy__(self, memo) -> FirstOutputs:
        return self  # generate deep-copies its compile_config

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        outputs = None

        def replay(*args):
            nonlocal outputs
            self.calls += 1
            if outputs is None:
                outputs = gm.forward(*args)
            return outputs

        return replay


def generate_call(system: str, models: dict, batch: dict, new_tokens: int, backend: FirstOutputs,
                  guard_filter=None):
    options = None if guard_filter is None else {"guard_filter_fn": guard_filter}
    config = CompileConfig(backend=backend, mode=None, fullgraph=True, options=options)
    config._compile_all_devices = True  # transformers compiles only on CUDA unless told
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None, compile_config=config)
    if system == "static":
        return lambda k: models["sdpa"].generate(**batch, max_new_tokens=k, cache_implementation="static", **common)
    model = models["hf_paged"]
    hf_paged.restore_generate(model)
    if system == "hf_paged_optimized":
        model.generation_config.compile_config = config
        hf_paged.optimize_generate(model)
        common.pop("compile_config")  # the model's, extended by optimize_generate
    cache = hf_paged.PagedAttentionCache(model.config, num_blocks=1024, block_size=16, max_new_tokens=new_tokens,
                                         compileable=True)
    return lambda k: model.generate(**with_cache(model, cache, **batch), max_new_tokens=k, **common)


def measure(system: str, models: dict, batch: dict, args: argparse.Namespace) -> dict:
    """The fastest of ``repeats`` calls: host microseconds per decode step."""
    torch._dynamo.reset()
    backend = FirstOutputs()
    call = generate_call(system, models, batch, args.new_tokens, backend, GUARD_FILTERS[args.guard_filter])
    call(args.new_tokens)  # compile
    steps = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        call(1)
        one = time.perf_counter() - start
        backend.calls = 0
        start = time.perf_counter()
        call(args.new_tokens)
        steps.append((time.perf_counter() - start - one) / (args.new_tokens - 1))
        assert backend.calls == args.new_tokens - 1, f"{system}: a decode step did not run compiled"
    return {"system": system, "us_per_step": min(steps) * 1e6}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the systems in turn (compiled afresh)")
    parser.add_argument("--layers", type=int, default=SMOKE_SHAPE["num_hidden_layers"],
                        help="decoder layers (default: the tiny model's own); the guards dynamo evaluates per step "
                             "grow with them")
    parser.add_argument("--guard-filter", choices=sorted(GUARD_FILTERS), default="none",
                        help="skip dynamo's guards on nn modules: none (default), inbuilt (torch.nn modules), all")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shape = {**SMOKE_SHAPE, "num_hidden_layers": args.layers}
    models = {attn: load_model(shape, "cpu", attn) for attn in ("sdpa", hf_paged.ATTN_IMPLEMENTATION)}  # same seed
    batch = prompts(args.batch, (8, 32), shape["vocab_size"], "cpu")
    rounds = [[measure(system, models, batch, args) for system in SYSTEMS] for _ in range(args.rounds)]
    rows = [min((r[i] for r in rounds), key=lambda row: row["us_per_step"]) for i in range(len(SYSTEMS))]
    print(f"host us per decode step on the CPU (tiny Llama, {args.layers} layers, batch "
          f"{args.batch}, {args.new_tokens} new tokens, guard filter {args.guard_filter}, graphs that do no work, "
          f"torch {torch.__version__})")
    print("| system | host us per decode step |\n|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['us_per_step']:.0f} |")
    return rows


if __name__ == "__main__":
    main()
