"""Every private symbol of torch, transformers and accelerate that hf_paged uses, behind one name here each.

A private symbol (a leading underscore, or a public name under a private path such as ``torch._inductor``) may change
or go in any release. hf_paged reaches each one only through a function or constant of this module, which says what
hf_paged needs it for and on which releases it was checked, falls back where a fallback serves (an older torch
without an option) and otherwise fails with an error naming the symbol. ``tests/test_compat.py`` holds one test per
symbol that fails loudly when an installed release no longer provides it, or no longer behaves as hf_paged relies
on, and a test that no module of hf_paged but this one reaches them.

This module is a leaf: it imports only torch, transformers and the standard library (accelerate is never imported:
its hook is only read off a model). Private imports happen inside the functions (or on first use, for the classes
read at import time), so that one symbol gone from a release breaks only what uses it.

Checked on torch 2.11 (the GPU box) and 2.13 (CPU), transformers 5.17 and 5.24, accelerate 1.15.

==========================================================  ===========================  ===============================
symbol                                                      used for                     where: through
==========================================================  ===========================  ===============================
torch._dynamo.config.patch: recompile_limit,                the compiled layers'         compile/_layers.py:
accumulated_recompile_limit (cache_size_limit,              recompile limits and dynamo  dynamo_config_patch
accumulated_cache_size_limit before torch 2.7)              settings while the engine's
                                                            calls run

torch._dynamo.config.nested_graph_breaks                    whether a tensor-parallel    compile/_layers.py:
                                                            layer can trace as one       has_dynamo_option,
                                                            graph around attention's     NESTED_GRAPH_BREAKS
                                                            graph break

torch.fx.experimental._config.patch: use_duck_shape         no duck shaping in the       compile/_layers.py:
                                                            compiled layers (no          no_duck_shaping
                                                            recompile mid-run)

torch._inductor.config: post_grad_custom_pre_pass,          options of hf_paged's own    compile/_layers.py,
triton.enable_pdl, triton.cudagraphs                        compiles: the graph passes,  parallel/_fuse_all_reduce.py,
                                                            PDL, CUDA graphs             generate/_optimize.py:
                                                                                         inductor_has_option,
                                                                                         INDUCTOR_CUSTOM_PRE_PASS,
                                                                                         INDUCTOR_PDL,
                                                                                         INDUCTOR_CUDAGRAPHS

torch._inductor.config.force_disable_caches                 whether torch's compile      compile/_cache.py:
                                                            caches are off (hf_paged's   compile_caches_disabled
                                                            artifact files then too)

torch._dynamo.exc.TorchDynamoException,                     compiler failures told from  compile/_layers.py:
torch._inductor.exc.InductorError                           the model's own errors       compiler_errors

torch._dynamo.mark_static_address                           fixed-address inputs of a    generate/_static_decode.py:
                                                            compiled generate decode     mark_static_address
                                                            step

torch._inductor.custom_graph_pass.CustomGraphPass           base class of the engine's   compile/_group_linears.py:
                                                            graph passes                 CustomGraphPass

torch._inductor.custom_graph_pass.get_hash_for_files        the passes' uuid             compile/_group_linears.py,
                                                            (inductor's FX graph cache   parallel/_fuse_all_reduce.py:
                                                            key)                         get_hash_for_files

torch.multiprocessing.reductions.StorageWeakRef             whether fake tensors share   compile/_group_linears.py:
                                                            a storage (packed q/k/v      same_storage
                                                            weights)

torch.distributed.distributed_c10d._resolve_process_group   the group behind             parallel/_all_reduce.py:
                                                            tp_all_reduce's group name   resolve_process_group

torch.distributed._symmetric_memory:                        peer_sum's buffers, mapped   parallel/_all_reduce.py:
enable_symm_mem_for_group, empty, rendezvous (its handle's  by every rank of the group   enable_symmetric_memory,
buffer_ptrs, rank, world_size, buffer_size)                                              symmetric_empty,
                                                                                         symmetric_rendezvous

DTensor._local_tensor                                       moving a rank's q/k/v        parallel/_linears.py:
                                                            shards into one buffer       dtensor_local_tensor

Tensor._version (the version counter of a tensor)          whether the model's weights  engine/_core.py:
                                                            changed in place since the   version_sum
                                                            KV was computed

torch.ops.aten._flash_attention_forward                     torch's own varlen FA2,      bench/_prefill.py:
                                                            timed beside hf_paged's      flash_attention_forward
                                                            prefill

transformers.generation.continuous_batching.requests:       generate_batch's results,    engine/_generate_batch.py,
GenerationOutput, RequestStatus                             transformers' own class      engine/_data_parallel.py:
                                                                                         GenerationOutput, RequestStatus

GenerationConfig._get_default_generation_params             the global defaults of       engine/_sampling_params.py:
                                                            unset generation fields      default_generation_params

CompileConfig._compile_all_devices                          generate's                   generate/_optimize.py:
                                                            compile-on-any-device flag,  compile_all_devices,
                                                            kept on a copied compile     set_compile_all_devices
                                                            config

PreTrainedModel._compiled_call,                             forgetting generate's        generate/_adapter.py:
PreTrainedModel._last_compile_config                        compiled forward             COMPILED_CALL_ATTRIBUTES

PretrainedConfig._attn_implementation                       whether a model runs the     hf/_register.py:
                                                            paged attention already      attn_implementation

Cache._is_user_defined (a property hf_paged overrides)      the sign that a generate     generate/_adapter.py:
                                                            call begins (the cache       user_defined_flag_from
                                                            resets)

PreTrainedModel._from_config                                the CLI's embedded default   cli/default_model.py:
                                                            model, random weights        model_from_config

GenerationMixin._prepare_cache_for_generation               generate's default paged     generate/_default_cache.py:
                                                            cache (wrapped once)         wrap_prepare_cache

model._hf_hook (accelerate's AlignDevicesHook)              a keyword argument           hf/_placement.py:
                                                            accelerate's hook leaves in  accelerate_hook
                                                            place
==========================================================  ===========================  ===============================

Not here, though close: ``torch.fx.experimental.symbolic_shapes.statically_known_true`` and
``torch.ops.prims.convert_element_type`` (public paths), ``torch.compiler.skip_guard_on_all_nn_modules_unsafe``,
``PreTrainedModel.get_compiled_call`` (public), and the closure of transformers' tensor-parallel ``forward`` wrapper
that ``parallel/_linears.py`` reads (``inspect.getclosurevars``: no private name, but an implementation detail);
``argparse.HelpFormatter._get_help_string`` (``cli/_arguments.py``) is the standard library's.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import operator
import warnings
from collections.abc import Callable

import torch
import transformers

class PrivateSymbolMissing(RuntimeError):
    """A private torch/transformers/accelerate symbol hf_paged needs is gone from the installed release."""


def _missing(symbol: str, needed_for: str, exc: BaseException | None = None) -> PrivateSymbolMissing:
    return PrivateSymbolMissing(
        f"hf_paged needs {symbol} ({needed_for}), which the installed torch {torch.__version__} / transformers "
        f"{transformers.__version__} does not provide{f' ({type(exc).__name__}: {exc})' if exc else ''}; "
        f"hf_paged was checked with torch 2.11-2.13 and transformers 5.17-5.24: install one of those, or update "
        f"hf_paged/_compat.py")


def _private(owner, name: str, needed_for: str):
    """``owner.name``, where ``owner`` is an object or a module's dotted name (imported here); raises
    :class:`PrivateSymbolMissing` naming the symbol where the installed release lacks it."""
    try:
        return getattr(importlib.import_module(owner) if isinstance(owner, str) else owner, name)
    except (ImportError, AttributeError) as exc:
        where = owner if isinstance(owner, str) else owner.__name__
        raise _missing(f"{where}.{name}", needed_for, exc) from exc


# ===== torch: dynamo, inductor and the shape environment ============================================================

#: Newer dynamo option names and what torch releases before 2.7 called them.
_DYNAMO_RENAMED = {"recompile_limit": "cache_size_limit", "accumulated_recompile_limit": "accumulated_cache_size_limit"}


def has_dynamo_option(name: str) -> bool:
    """Whether this torch's dynamo has the config option ``name``.

    Symbol: ``torch._dynamo.config.<name>`` (the config module raises ``AttributeError`` for a name it does not
    know). hf_paged asks whether ``nested_graph_breaks`` exists before tracing a tensor-parallel model's layers with it
    (``compile/_layers.py``). Checked on torch 2.11 and 2.13."""
    import torch._dynamo.config as dynamo_config

    return hasattr(dynamo_config, name)


#: Dynamo's option that resumes a graph break inside a nested call in one graph with the rest of the caller
#: (``torch._dynamo.config.nested_graph_breaks``): the compiled layers of a tensor-parallel model trace with it where
#: it exists, so that the attention all-reduce meets its residual add and norm. Present in torch 2.11 and 2.13.
NESTED_GRAPH_BREAKS = "nested_graph_breaks"


def dynamo_config_patch(**settings) -> contextlib.AbstractContextManager:
    """``torch._dynamo.config.patch(**settings)``, with option names this torch knows.

    Symbol: ``torch._dynamo.config.patch``. hf_paged raises the recompile limits (``recompile_limit``,
    ``accumulated_recompile_limit``) while the engine's compiled layers serve a call, and sets the dynamo settings of
    a ``LayerCompile`` (``compile/_layers.py``). Version gate: torch before 2.7 named the limits ``cache_size_limit``
    and ``accumulated_cache_size_limit``; those names are used where the new ones are missing. An option neither
    name of which exists raises :class:`PrivateSymbolMissing`. Checked on torch 2.11 and 2.13."""
    import torch._dynamo.config as dynamo_config

    named = {}
    for key, value in settings.items():
        name = key if has_dynamo_option(key) else _DYNAMO_RENAMED.get(key, key)
        if not has_dynamo_option(name):
            raise _missing(f"torch._dynamo.config.{key}", "a dynamo setting of the engine's compiled layers")
        named[name] = value
    return dynamo_config.patch(**named)


def no_duck_shaping() -> contextlib.AbstractContextManager:
    """A context in which dynamo gives each dynamic size its own symbol, equal sizes included (no duck shaping).

    Symbol: ``torch.fx.experimental._config.patch(use_duck_shape=False)``. The engine's inputs are views of fixed
    buffers: with duck shaping a step whose token count equals a buffer's width would compile again, mid-run
    (``compile/_layers.py``). Falls back to no change where this torch lacks the option (such a step then
    recompiles once). Checked on torch 2.11 and 2.13."""
    import torch.fx.experimental._config as shape_config  # (every supported torch has the module)

    has_option = hasattr(shape_config, "use_duck_shape")
    return shape_config.patch(use_duck_shape=False) if has_option else contextlib.nullcontext()


#: Inductor's option for a custom pass over the post-grad graph (``torch._inductor.config.post_grad_custom_pre_pass``,
#: a ``CustomGraphPass``): hf_paged's grouped linears and fused all-reduces run there. torch 2.11 and 2.13.
INDUCTOR_CUSTOM_PRE_PASS = "post_grad_custom_pre_pass"
#: Inductor's option to launch its Triton kernels with programmatic dependent launch
#: (``torch._inductor.config.triton.enable_pdl``): set for tensor-parallel layers where it exists (torch 2.11, 2.13).
INDUCTOR_PDL = "triton.enable_pdl"
#: Inductor's CUDA-graph option (``torch._inductor.config.triton.cudagraphs``), what ``mode="reduce-overhead"`` stands
#: for: ``optimize_generate`` sets it where it adds options to a compile config. torch 2.11 and 2.13.
INDUCTOR_CUDAGRAPHS = "triton.cudagraphs"


def inductor_has_option(name: str) -> bool:
    """Whether this torch's inductor has the config option ``name`` (dotted: ``"triton.enable_pdl"``).

    Symbol: ``torch._inductor.config``. hf_paged asks it before passing ``triton.enable_pdl`` to its compiled
    layers (``parallel/_fuse_all_reduce.py``'s ``layer_compile``); the other options it passes are checked by the
    tests.
    Checked on torch 2.11 and 2.13."""
    import torch._inductor.config as config  # walked down to the option, a part of ``name`` at a time

    for part in name.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


def compile_caches_disabled() -> bool:
    """Whether torch's on-disk compile caches are switched off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``, or the
    option set in the process): hf_paged then neither loads nor saves its bundles of cache artifacts
    (``compile/_cache.py``).

    Symbol: ``torch._inductor.config.force_disable_caches``. Falls back to False (caches on, torch's default) where
    this torch lacks the option. Checked on torch 2.11 and 2.13."""
    from torch._inductor import config as inductor_config

    return bool(getattr(inductor_config, "force_disable_caches", False))


def compiler_errors() -> tuple[type[BaseException], ...]:
    """The exception types by which torch's compiler reports its own failures (not the compiled code's).

    Symbols: ``torch._dynamo.exc.TorchDynamoException`` and ``torch._inductor.exc.InductorError``. The engine's
    compiled layers switch to eager for good on these, and let the model's own errors through
    (``compile/_layers.py``). Version gate: ``InductorError`` (newer torch) is left out where it is missing (older
    inductor errors reach the caller as ``BackendCompilerFailed``, a ``TorchDynamoException``). Checked on torch 2.11
    and 2.13."""
    import torch._inductor.exc as inductor_exc

    errors = (_private("torch._dynamo.exc", "TorchDynamoException", "telling compiler failures apart"),)
    return errors + ((inductor_exc.InductorError,) if hasattr(inductor_exc, "InductorError") else ())  # (older torch)


def mark_static_address(t: torch.Tensor) -> None:
    """Tell dynamo that ``t`` keeps its address from call to call (CUDA graphs then read it in place).

    Symbol: ``torch._dynamo.mark_static_address``. A compiled ``generate`` decode step reads the step's metadata
    and writes the KV pool at fixed addresses; inductor's CUDA graphs skip a step whose mutated inputs are not
    marked so (``generate/_static_decode.py``). No fallback: every torch that hf_paged installs with (2.4 on) has it
    (it came in 2.1), and :class:`PrivateSymbolMissing` names it where a release drops it. Checked on torch 2.11 and
    2.13."""
    _private("torch._dynamo", "mark_static_address", "a compiled decode step's fixed-address inputs")(t)


class _CustomGraphPassStandIn:
    """What inductor's ``CustomGraphPass`` asks of a pass (``__call__`` on the graph, ``uuid`` for the cache), for
    a torch without the class (it then takes any callable as the pass and caches no graph with one)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        raise NotImplementedError

    def uuid(self) -> bytes | None:
        raise NotImplementedError


def get_hash_for_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    """A hash of the contents of the files at ``paths`` (and ``extra``).

    Symbol: ``torch._inductor.custom_graph_pass.get_hash_for_files``. The graph passes' ``uuid`` hashes their own
    source, so that inductor's FX graph cache tells graphs compiled with and without them (or with another version)
    apart (``compile/_group_linears.py``, ``parallel/_fuse_all_reduce.py``). Falls back to a SHA-256 of the files'
    bytes where this torch lacks it. Checked on torch 2.11 and 2.13."""
    try:
        from torch._inductor.custom_graph_pass import get_hash_for_files as torch_hash
    except ImportError:
        digest = hashlib.sha256(extra.encode())
        for path in paths:
            with open(path, "rb") as f:
                digest.update(f.read())
        return digest.digest()
    return torch_hash(paths, extra)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (fake tensors too) are views of one storage.

    Symbol: ``torch.multiprocessing.reductions.StorageWeakRef`` (undocumented: two weak references to one storage
    compare equal). The grouped-linears pass reads from a graph's fake inputs whether a group's weights lie end to
    end in one buffer (``compile/_group_linears.py``); fake tensors have no data pointer to compare. No fallback:
    raises :class:`PrivateSymbolMissing`. Checked on torch 2.11 and 2.13."""
    StorageWeakRef = _private("torch.multiprocessing.reductions", "StorageWeakRef", "packed q/k/v weights")
    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


# ===== torch.distributed ============================================================================================

def resolve_process_group(group_name: str):
    """The process group registered under ``group_name``.

    Symbol: ``torch.distributed.distributed_c10d._resolve_process_group``. ``hf_paged::tp_all_reduce`` is a custom op,
    which takes the group by name (a string); its NCCL path sums over the group that name stands for
    (``parallel/_all_reduce.py``). No fallback: raises :class:`PrivateSymbolMissing`. Checked on torch 2.11 and
    2.13."""
    return _private("torch.distributed.distributed_c10d", "_resolve_process_group", "tp_all_reduce's group")(group_name)


_SYMMETRIC_MEMORY = "torch.distributed._symmetric_memory"


def enable_symmetric_memory(group_name: str) -> None:
    """Let the group named ``group_name`` exchange symmetric-memory buffers.

    Symbol: ``torch.distributed._symmetric_memory.enable_symm_mem_for_group``, needed before a rendezvous in older
    torch and deprecated (a no-op, with a ``FutureWarning``, silenced here) in newer; peer_sum's set-up calls it
    (``parallel/_all_reduce.py``). Checked on torch 2.11 and 2.13. Where this raises, peer_sum is not set up and
    the all-reduces take NCCL."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _private(_SYMMETRIC_MEMORY, "enable_symm_mem_for_group", "peer_sum's set-up")(group_name)


def symmetric_empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor in symmetric memory (peers of its group can map it).

    Symbol: ``torch.distributed._symmetric_memory.empty``: peer_sum's buffer (``parallel/_all_reduce.py``).
    Checked on torch 2.11 and 2.13."""
    return _private(_SYMMETRIC_MEMORY, "empty", "peer_sum's buffers")(shape, dtype=dtype, device=device)


def symmetric_rendezvous(tensor: torch.Tensor, group):
    """Exchange ``tensor`` (from :func:`symmetric_empty`) with ``group``'s ranks; returns the handle, whose
    ``buffer_ptrs``, ``rank``, ``world_size`` and ``buffer_size`` peer_sum reads.

    Symbol: ``torch.distributed._symmetric_memory.rendezvous`` (and its ``_SymmetricMemory`` handle)
    (``parallel/_all_reduce.py``). Checked on torch 2.11 and 2.13."""
    return _private(_SYMMETRIC_MEMORY, "rendezvous", "peer_sum's buffers")(tensor, group)


def dtensor_local_tensor(tensor) -> torch.Tensor | None:
    """The DTensor's own local tensor (``to_local()`` hands out views of it), or None where ``tensor`` has none.

    Symbol: ``torch.distributed.tensor.DTensor._local_tensor``. Packing a rank's q/k/v shards end to end moves that
    tensor's storage (``set_``) so the DTensor keeps serving the same values from the new buffer
    (``parallel/_linears.py``). Falls back to None (the shards then stay where they are). Checked on torch 2.11 and
    2.13."""
    return getattr(tensor, "_local_tensor", None)


def version_sum(tensors: list[torch.Tensor]) -> int:
    """The sum of the tensors' version counters: it grows whenever one of them is changed in place.

    Symbol: ``torch.Tensor._version``, which every in-place op on a tensor (or a view of it) raises by one, autograd
    on or off: an optimizer step, ``load_state_dict``, ``param.copy_(...)`` under ``no_grad``; not a write through
    ``param.data``, which has a counter of its own, nor torch's fused optimizer kernels (the engine's optimizer step
    hook raises the counters after those: ``engine/_core.py``). The engine compares the sum over the model's parameters with the
    one its KV was computed under, once per step (a C-speed sum: ~0.1 us a tensor), and forgets the KV computed with
    weights that have changed since (``engine/_core.py``). Checked on torch 2.11 and 2.13."""
    return sum(map(_VERSION, tensors))


_VERSION = operator.attrgetter("_version")


# ===== torch: ops ===================================================================================================

def flash_attention_forward():
    """torch's own varlen flash-attention 2 op, ``torch.ops.aten._flash_attention_forward``.

    hf_paged's prefill benchmark times it beside its own kernel (``bench/_prefill.py``): called as
    ``(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=...)``,
    output first. No fallback: raises :class:`PrivateSymbolMissing`. Checked on torch 2.11 and 2.13."""
    try:
        return torch.ops.aten._flash_attention_forward
    except (AttributeError, RuntimeError) as exc:
        raise _missing("torch.ops.aten._flash_attention_forward", "the prefill benchmark's torch-fa2 row",
                       exc) from exc


# ===== transformers =================================================================================================

def default_generation_params() -> dict:
    """transformers' global defaults of the generation fields that a model and the caller left unset.

    Symbol: ``GenerationConfig._get_default_generation_params`` (a static method). ``SamplingParams.resolve``
    fills unset fields from it last, as ``generate`` does (``engine/_sampling_params.py``). No fallback: raises
    :class:`PrivateSymbolMissing`. Checked on transformers 5.17 and 5.24."""
    return _private(transformers.GenerationConfig, "_get_default_generation_params",
                    "the defaults of unset generation fields")()


def compile_all_devices(config) -> bool | None:
    """``CompileConfig._compile_all_devices``: whether ``generate`` compiles its forward on any device (not only on
    CUDA and the like).

    ``optimize_generate`` copies a compile config with more options and keeps this flag on the copy
    (``generate/_optimize.py``); the CPU tests set it. Raises :class:`PrivateSymbolMissing` where ``CompileConfig``
    no longer has it (the copy would silently lose it). Checked on transformers 5.17 and 5.24."""
    _private(type(config), "_compile_all_devices", "keeping a compile config's compile-on-any-device flag")
    return config._compile_all_devices


def set_compile_all_devices(config, value: bool | None) -> None:
    """Set ``CompileConfig._compile_all_devices`` on ``config`` (see :func:`compile_all_devices`)."""
    _private(type(config), "_compile_all_devices", "keeping a compile config's compile-on-any-device flag")
    config._compile_all_devices = value


#: The attributes in which ``PreTrainedModel.get_compiled_call`` keeps the compiled forward and the compile config it
#: was made with: ``optimize_generate`` and ``restore_generate`` drop them so that the next compiled step traces the
#: model anew (``generate/_adapter.py``'s ``forget_compiled_call``). Checked on transformers 5.17 and 5.24.
COMPILED_CALL_ATTRIBUTES = ("_compiled_call", "_last_compile_config")


def attn_implementation(config) -> str | None:
    """The attention implementation a model config names (``"hf_paged"``, ``"sdpa"``, ...), None if unset.

    Symbol: ``PretrainedConfig._attn_implementation``. The engine switches a model to the paged attention only where
    it runs another (``hf/_register.py``). Falls back to None (the engine then sets the attention, which is harmless).
    Checked on transformers 5.17 and 5.24."""
    return getattr(config, "_attn_implementation", None)


def user_defined_flag_from(name: str) -> Callable[[type], type]:
    """A class decorator: the cache class's property ``name`` also serves as its ``Cache._is_user_defined``.

    Symbol: ``Cache._is_user_defined``, which ``generate`` sets (to True) on a cache the caller passed, once at the
    start of each call, before it asks ``get_seq_length()`` how much of the input to skip, and reads at the end
    (whether to return the cache). ``PagedAttentionCache`` answers it with a property whose setter resets the cache:
    the one sign a cache gets that a new call begins (``generate/_adapter.py``). Checked on transformers 5.17 and
    5.24 (``generate``'s ``_prepare_cache_for_generation`` sets it; ``Cache`` itself does not)."""
    def decorate(cls: type) -> type:
        prop = cls.__dict__.get(name)
        if not isinstance(prop, property) or prop.fset is None:
            raise TypeError(f"{cls.__name__}.{name} must be a property with a setter")
        setattr(cls, "_is_user_defined", prop)
        return cls

    return decorate


def wrap_prepare_cache(wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``generate``'s cache maker with ``wrap(current)``.

    Symbol: ``GenerationMixin._prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode,
    batch_size, max_cache_length)``, which puts the cache ``generate`` makes (a ``DynamicCache`` unless
    ``cache_implementation`` says otherwise) into ``model_kwargs``. Every supported transformers has it (checked on
    5.17 and 5.25), so there is no fallback: an ``AttributeError`` names it."""
    from transformers import GenerationMixin

    GenerationMixin._prepare_cache_for_generation = wrap(GenerationMixin._prepare_cache_for_generation)


def model_from_config(model_class: type, config, **kwargs) -> torch.nn.Module:
    """A model of ``model_class`` with random weights from ``config`` (``attn_implementation``, ``dtype``, ... in
    ``kwargs``), as ``from_config`` makes one, for a concrete class.

    Symbol: ``PreTrainedModel._from_config`` (a class method; the ``Auto`` classes' ``from_config`` calls it). The
    embedded default model of the CLI is built so (``cli/default_model.py``). No fallback: raises
    :class:`PrivateSymbolMissing`. Checked on transformers 5.17 and 5.24."""
    return _private(model_class, "_from_config", "the embedded default model")(config, **kwargs)


# ===== accelerate ===================================================================================================

def accelerate_hook(model: torch.nn.Module):
    """The hook accelerate installed on ``model`` (``dispatch_model``, ``device_map``), or None.

    Symbol: ``model._hf_hook`` (accelerate's ``add_hook_to_module``), an ``AlignDevicesHook`` (or a sequential
    hook) whose ``skip_keys`` name the keyword arguments it leaves where they are. hf_paged adds its own keyword
    there (``hf/_placement.py``). Falls back to None (no hook: nothing to tell). Checked on accelerate 1.15."""
    return getattr(model, "_hf_hook", None)


# ===== classes read at import time ==================================================================================

def __getattr__(name: str):
    """``CustomGraphPass``, ``GenerationOutput`` and ``RequestStatus``, imported on first use (and kept).

    - ``CustomGraphPass``: symbol ``torch._inductor.custom_graph_pass.CustomGraphPass``, the base class of the passes
      hf_paged hands inductor as ``post_grad_custom_pre_pass`` (``GroupLinears`` and ``LayerPasses``): inductor's FX
      graph cache keys a graph compiled with such a pass by its ``uuid``. Falls back to a plain stand-in class with
      the same two methods where this torch lacks it. Checked on torch 2.11 and 2.13.
    - ``GenerationOutput``, ``RequestStatus``: symbols ``transformers.generation.continuous_batching.requests.
      GenerationOutput`` and ``.RequestStatus`` (``GenerationOutput`` is not exported by the package).
      ``generate_batch`` returns transformers' own result class, as ``model.generate_batch`` does, with the status
      ``FINISHED`` or ``FAILED`` (``engine/_generate_batch.py``, ``engine/_data_parallel.py``). No fallback: an
      ``ImportError`` naming the symbol. Checked on transformers 5.17 and 5.24.
    """
    if name == "CustomGraphPass":
        try:
            from torch._inductor.custom_graph_pass import CustomGraphPass as value
        except ImportError:
            value = _CustomGraphPassStandIn
    elif name in ("GenerationOutput", "RequestStatus"):
        try:
            value = _private("transformers.generation.continuous_batching.requests", name, "generate_batch's results")
        except PrivateSymbolMissing as exc:
            raise ImportError(str(exc)) from exc
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value

