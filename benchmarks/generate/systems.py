"""The systems ``benchmarks/generate/latency.py`` compares (its docstring describes them), set up for one ``generate``
call each: shared by ``benchmarks/generate/latency.py``, ``benchmarks/generate/step_parts.py`` and
``benchmarks/generate/host_overhead.py``."""

from __future__ import annotations

import argparse

import torch
from transformers import CompileConfig

import hf_paged
from hf_paged._forward_context import forward_context
from hf_paged.generate._optimize import with_options
from hf_paged.hf.compat import with_cache

SYSTEMS = ("sdpa", "flash_attention_2", "hf_paged", "hf_paged_compiled", "static", "hf_paged_compiled_skinny",
           "hf_paged_optimized")
ATTN = {"sdpa": "sdpa", "static": "sdpa", "flash_attention_2": "flash_attention_2", "hf_paged": "hf_paged",
        "hf_paged_compiled": "hf_paged", "hf_paged_compiled_skinny": "hf_paged", "hf_paged_optimized": "hf_paged"}
COMPILED = ("hf_paged_compiled", "static", "hf_paged_compiled_skinny", "hf_paged_optimized")
PAGED = ("hf_paged", "hf_paged_compiled", "hf_paged_compiled_skinny", "hf_paged_optimized")
# --guard-filter: dynamo guards dropped from every compiled system's step (torch.compiler's filters; "unsafe" in
# torch's words: a change to a module attribute then goes unnoticed, which generate's decode steps never make)
GUARD_FILTERS = {"none": None, "inbuilt": torch.compiler.skip_guard_on_inbuilt_nn_modules_unsafe,
                 "all": torch.compiler.skip_guard_on_all_nn_modules_unsafe}


def prompts(batch: int, lengths: tuple[int, int], vocab: int, device: str, seed: int = 0) -> dict:
    """``batch`` left-padded random prompts (pad 0), lengths uniform in ``lengths``."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (batch,), generator=gen).tolist()
    ids = torch.zeros(batch, max(sizes), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(sizes):
        ids[row, -n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[row, -n:] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def generate_call(system: str, model, batch: dict, args: argparse.Namespace):
    """A function running one ``generate`` of ``k`` new tokens for ``system``; returns its output ids."""
    device = batch["input_ids"].device
    compile_config = None
    if args.compile_backend is not None:
        compile_config = CompileConfig(backend=args.compile_backend, mode=None if device.type == "cpu" else
                                       "reduce-overhead")
        compile_config._compile_all_devices = True  # transformers compiles only on CUDA unless told
    common = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    hf_paged.restore_generate(model)  # the models are shared between systems
    if system == "hf_paged_optimized":
        if compile_config is not None:  # --compile-backend: as the model's own config, which optimize_generate extends
            model.generation_config.compile_config = compile_config
        hf_paged.optimize_generate(model)
        compile_config = None  # one given to generate would replace the model's
    if system == "hf_paged_compiled_skinny":
        # the engine's decode linears: hf_paged's skinny kernel, and the products sharing an input (q/k/v, gate/up)
        # grouped into one launch by an inductor pass; torch.compile takes either a mode or options, so the
        # options ask for CUDA graphs themselves (what "reduce-overhead" sets)
        from hf_paged.compile import _skinny_linears as skinny_linear
        from hf_paged.compile._group_linears import GroupLinears

        skinny_linear.install(model)
        options = {"post_grad_custom_pre_pass": GroupLinears(), "triton.cudagraphs": device.type == "cuda"}
        compile_config = CompileConfig(backend=args.compile_backend or "inductor", mode=None, options=options)
        compile_config._compile_all_devices = True
    if args.guard_filter != "none" and system in COMPILED and system != "hf_paged_optimized":
        compile_config = with_options(compile_config or CompileConfig(),
                                      {"guard_filter_fn": GUARD_FILTERS[args.guard_filter]})
    if compile_config is not None and system in COMPILED:
        common["compile_config"] = compile_config
    if system == "static":
        return warmed_stance(lambda k: model.generate(**batch, max_new_tokens=k, cache_implementation="static",
                                                      **common), args)
    if system not in PAGED:
        return lambda k: model.generate(**batch, max_new_tokens=k, **common)
    rows, width = batch["input_ids"].shape
    bs = args.block_size

    def new_cache() -> hf_paged.PagedAttentionCache:
        cache = hf_paged.PagedAttentionCache(
            model.config, num_blocks=rows * -(-(width + args.new_tokens) // bs) + 8, block_size=bs, device=device,
            dtype=model.dtype, max_new_tokens=args.new_tokens if system in COMPILED else None,
            compileable=(True if device.type == "cpu" else None) if system in COMPILED else False)
        if system in COMPILED and not cache.is_compileable:
            raise RuntimeError(f"the cache is not compileable here: {cache.compile_mode.reason}")
        return cache

    kept = None if args.fresh_cache else new_cache()  # --fresh-cache: one per call, as a user makes it

    def call(k):
        inputs = with_cache(model, kept or new_cache(), **batch)
        with forward_context(skinny_linears=system == "hf_paged_compiled_skinny"):
            return model.generate(**inputs, max_new_tokens=k, **common)

    return warmed_stance(call, args) if system in COMPILED else call


def warmed_stance(call, args: argparse.Namespace):
    """``call``, run after its first time under dynamo's skip-guard-eval stance when ``--skip-guard-eval``."""
    if not args.skip_guard_eval:
        return call
    calls = 0

    def staged(k):
        nonlocal calls
        calls += 1
        if calls == 1:
            return call(k)
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return call(k)

    return staged


def skip_reason(system: str, device: str) -> str | None:
    if system == "hf_paged_compiled_skinny" and device != "cuda":
        return "the skinny linear kernel runs on CUDA only"
    if system != "flash_attention_2":
        return None
    if device != "cuda":
        return "flash-attn runs on CUDA only"
    try:
        import flash_attn  # noqa: F401
    except ImportError as err:
        return f"flash-attn is not importable ({err})"
    return None
