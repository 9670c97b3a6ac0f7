"""One test per private torch/transformers/accelerate symbol behind ``hf_paged._compat``: each fails, naming the
symbol and what to do, when the installed release no longer provides it or no longer behaves as hf_paged relies on.
A last test checks that no module of hf_paged but ``_compat`` reaches a private symbol."""

from __future__ import annotations

import ast
import inspect
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from hf_paged import _compat

PACKAGE = Path(__file__).resolve().parent.parent / "hf_paged"
#: (major, minor) of the installed torch: symbols that newer releases must have are checked from 2.11 on
TORCH_VERSION = tuple(map(int, re.match(r"(\d+)\.(\d+)", torch.__version__).groups()))


def require(condition, symbol: str, relied_on: str) -> None:
    """Fail loudly unless ``condition``: which symbol, what hf_paged relies on, and what to do."""
    if not condition:
        pytest.fail(
            f"{symbol}: {relied_on} no longer holds on torch {torch.__version__} / transformers "
            f"{transformers.__version__}. hf_paged reaches it only through hf_paged/_compat.py: adapt the function "
            f"there (a version gate or a fallback) for this release, or pin a release it was checked on (torch "
            f"2.11-2.13, transformers 5.17-5.24).", pytrace=False)


def tiny_llama(**kwargs):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs).eval()


# ===== torch: dynamo, inductor, the shape environment ===============================================================

def test_dynamo_config_patch_sets_the_recompile_limits():
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if _compat.has_dynamo_option("recompile_limit") else "cache_size_limit"
    require(_compat.has_dynamo_option(name), "torch._dynamo.config.recompile_limit",
            "the option (or cache_size_limit before torch 2.7) exists")
    before = getattr(dynamo_config, name)
    with _compat.dynamo_config_patch(recompile_limit=before + 7, accumulated_recompile_limit=999):
        require(getattr(dynamo_config, name) == before + 7, "torch._dynamo.config.patch",
                "patch(recompile_limit=...) sets the limit inside the context")
    require(getattr(dynamo_config, name) == before, "torch._dynamo.config.patch", "the limit is restored after it")
    with pytest.raises(_compat.PrivateSymbolMissing, match="no_such_option"):
        _compat.dynamo_config_patch(no_such_option=1)


def test_dynamo_has_nested_graph_breaks():
    import torch._dynamo.config as dynamo_config

    require(_compat.has_dynamo_option("recompile_limit") or _compat.has_dynamo_option("cache_size_limit"),
            "torch._dynamo.config.recompile_limit", "the config module answers hasattr for its options")
    with pytest.raises(AttributeError):
        dynamo_config.no_such_option  # noqa: B018 - what has_dynamo_option's hasattr relies on
    assert not _compat.has_dynamo_option("no_such_option")
    if TORCH_VERSION >= (2, 11):
        require(_compat.has_dynamo_option(_compat.NESTED_GRAPH_BREAKS), "torch._dynamo.config.nested_graph_breaks",
                "the option exists (the tensor-parallel layers' attention all-reduce fuses with it)")
        with _compat.dynamo_config_patch(**{_compat.NESTED_GRAPH_BREAKS: True}):
            require(getattr(dynamo_config, _compat.NESTED_GRAPH_BREAKS) is True,
                    "torch._dynamo.config.nested_graph_breaks", "patch sets it")


def _symbols_of_two_equal_sizes() -> list[str]:
    """The placeholders dynamo makes for ``f(a, b)`` with two inputs of the same size, compiled dynamic."""
    seen: list[list[str]] = []

    def backend(gm, example_inputs):
        seen.append([str(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"
                     and not isinstance(n.meta.get("example_value"), torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda a, b: a * 2 + b.sum(), backend=backend, dynamic=True)
    f(torch.ones(5), torch.ones(5))
    torch._dynamo.reset()
    return seen[0]


def test_no_duck_shaping_gives_equal_sizes_their_own_symbols():
    import torch.fx.experimental._config as shape_config

    require(hasattr(shape_config, "use_duck_shape"), "torch.fx.experimental._config.use_duck_shape",
            "the option exists (without it no_duck_shaping changes nothing and a full prefill recompiles mid-run)")
    with _compat.no_duck_shaping():
        require(shape_config.use_duck_shape is False, "torch.fx.experimental._config.patch",
                "patch(use_duck_shape=False) sets the option inside the context")
        separate = _symbols_of_two_equal_sizes()
    shared = _symbols_of_two_equal_sizes()
    require(len(set(separate)) == 2 and len(set(shared)) == 1, "torch.fx.experimental._config.use_duck_shape",
            f"equal sizes share a symbol with duck shaping ({shared}) and not without ({separate})")


def test_inductor_has_the_options_hf_paged_passes():
    import torch._inductor.config as inductor_config

    for name in (_compat.INDUCTOR_CUSTOM_PRE_PASS, _compat.INDUCTOR_CUDAGRAPHS):
        require(_compat.inductor_has_option(name), f"torch._inductor.config.{name}", "the option exists")
    require(isinstance(inductor_config.triton.cudagraphs, bool), "torch._inductor.config.triton.cudagraphs",
            "a bool option")
    if TORCH_VERSION >= (2, 11):
        require(_compat.inductor_has_option(_compat.INDUCTOR_PDL), "torch._inductor.config.triton.enable_pdl",
                "the option exists (tensor-parallel layers launch with PDL)")
    assert not _compat.inductor_has_option("triton.no_such_option")


@pytest.mark.slow  # inductor's compile: several seconds on a 2-core CPU
def test_inductor_runs_a_custom_pre_pass_given_in_the_compile_options():
    """The engine's graph passes reach inductor as ``post_grad_custom_pre_pass`` in a compile's own options; a
    ``CustomGraphPass`` subclass is called on the post-grad graph."""
    require(_compat.CustomGraphPass is not _compat._CustomGraphPassStandIn,
            "torch._inductor.custom_graph_pass.CustomGraphPass", "the class exists")
    require(set(getattr(_compat.CustomGraphPass, "__abstractmethods__", ())) == {"__call__", "uuid"},
            "torch._inductor.custom_graph_pass.CustomGraphPass", "its abstract methods are __call__ and uuid")
    calls = []

    class Recording(_compat.CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            calls.append(sum(1 for n in graph.nodes if n.op == "call_function"))

        def uuid(self) -> bytes:  # a fresh key: inductor's caches would serve an earlier run without the pass
            return token

    token = os.urandom(16)
    torch._dynamo.reset()
    f = torch.compile(lambda x: torch.relu(x) * 3 + 1, options={_compat.INDUCTOR_CUSTOM_PRE_PASS: Recording()})
    try:
        assert torch.equal(f(torch.arange(-2.0, 2.0)), torch.relu(torch.arange(-2.0, 2.0)) * 3 + 1)
    finally:
        torch._dynamo.reset()
    require(calls and calls[0] > 0, "torch._inductor.config.post_grad_custom_pre_pass",
            "inductor calls the CustomGraphPass given in torch.compile's options on the post-grad graph")


def test_compiler_errors_catch_compiler_failures_and_not_the_models_own():
    errors = _compat.compiler_errors()
    from torch._dynamo.exc import TorchDynamoException

    require(TorchDynamoException in errors, "torch._dynamo.exc.TorchDynamoException", "the class exists")
    if TORCH_VERSION >= (2, 11):
        from torch._inductor.exc import InductorError

        require(InductorError in errors, "torch._inductor.exc.InductorError", "the class exists")

    def broken(gm, example_inputs):
        raise RuntimeError("the backend broke")

    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as failed:
            torch.compile(lambda x: x + 1, backend=broken)(torch.ones(2))
        require(isinstance(failed.value, errors), "torch._dynamo.exc.TorchDynamoException",
                f"a backend's failure reaches the caller as one ({type(failed.value).__name__})")

        def own(x):
            if x.sum() > 0:
                raise ValueError("the model's own error")
            return x

        with pytest.raises(ValueError) as raised:
            torch.compile(own, backend="eager")(torch.ones(2))
        require(not isinstance(raised.value, errors), "torch._dynamo.exc.TorchDynamoException",
                "the compiled code's own errors pass through as they are")
    finally:
        torch._dynamo.reset()


def test_compile_caches_disabled_follows_torchs_switch_and_then_inductor_caches_nothing():
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    require(hasattr(inductor_config, "force_disable_caches"), "torch._inductor.config.force_disable_caches",
            "the option exists")
    with inductor_config.patch(force_disable_caches=False):
        assert not _compat.compile_caches_disabled()
    torch._dynamo.reset()
    counters.clear()
    try:
        with inductor_config.patch(force_disable_caches=True):
            assert _compat.compile_caches_disabled()
            torch.compile(lambda x: x * 3 + 1)(torch.ones(3))
        looked_up = sum(counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
        require(looked_up == 0, "torch._inductor.config.force_disable_caches",
                "with it set, inductor neither reads nor writes its FX graph cache")
    finally:
        torch._dynamo.reset()


def test_mark_static_address_marks_the_compiled_input_static():
    import torch._dynamo

    require(callable(getattr(torch._dynamo, "mark_static_address", None)), "torch._dynamo.mark_static_address",
            "the function exists (compiled generate steps copy their inputs without it)")
    marked, plain = torch.zeros(4), torch.zeros(4)
    _compat.mark_static_address(marked)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") for n in gm.graph.nodes
                    if n.op == "placeholder")
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(lambda a, b: a + b, backend=backend)(marked, plain)
    finally:
        torch._dynamo.reset()
    require(seen == ["unguarded", None], "torch._dynamo.mark_static_address",
            f"dynamo's graph takes the marked input as a static address, the other not (saw {seen})")


def test_get_hash_for_files_follows_the_files_contents(tmp_path):
    from torch._inductor.custom_graph_pass import get_hash_for_files

    require(list(inspect.signature(get_hash_for_files).parameters)[:2] == ["paths", "extra"],
            "torch._inductor.custom_graph_pass.get_hash_for_files", "it takes (paths, extra)")
    one, same, other = tmp_path / "one.py", tmp_path / "same.py", tmp_path / "other.py"  # (torch caches by path)
    one.write_text("a = 1\n")
    same.write_text("a = 1\n")
    other.write_text("a = 2\n")
    first = _compat.get_hash_for_files((str(one),))
    require(isinstance(first, bytes) and first == _compat.get_hash_for_files((str(same),)),
            "torch._inductor.custom_graph_pass.get_hash_for_files", "files of the same content give the same bytes")
    require(_compat.get_hash_for_files((str(other),)) != first != _compat.get_hash_for_files((str(one),), "x"),
            "torch._inductor.custom_graph_pass.get_hash_for_files", "another content (or extra) gives another hash")


def test_same_storage_tells_fake_views_of_one_buffer():
    from torch._subclasses.fake_tensor import FakeTensorMode

    buffer, other = torch.zeros(12), torch.zeros(4)
    require(_compat.same_storage(buffer[:4], buffer[4:]) and not _compat.same_storage(buffer, other),
            "torch.multiprocessing.reductions.StorageWeakRef", "weak references to one storage compare equal")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(buffer)
        require(_compat.same_storage(fake[:4], fake[8:]) and not _compat.same_storage(fake, mode.from_tensor(other)),
                "torch.multiprocessing.reductions.StorageWeakRef", "fake tensors' views of one storage compare equal")


# ===== torch.distributed ============================================================================================

def test_resolve_process_group_finds_the_group_of_a_name(single_process_group):
    import torch.distributed as dist

    group = _compat.resolve_process_group(single_process_group)
    require(group is dist.group.WORLD, "torch.distributed.distributed_c10d._resolve_process_group",
            "it returns the group registered under a name")
    out = torch.full((3,), 2.0)
    dist.all_reduce(out, group=group)
    assert torch.equal(out, torch.full((3,), 2.0))


def test_symmetric_memory_has_what_peer_sum_calls(single_process_group):
    from torch.distributed import _symmetric_memory as symm_mem

    for name, params in (("enable_symm_mem_for_group", ["group_name"]), ("rendezvous", ["tensor", "group"]),
                         ("empty", ["size", "dtype", "device"])):
        fn = getattr(symm_mem, name, None)
        require(callable(fn), f"torch.distributed._symmetric_memory.{name}", "the function exists")
        have = list(inspect.signature(fn).parameters)
        require(all(p in have for p in params), f"torch.distributed._symmetric_memory.{name}",
                f"it takes {params} (has {have})")
    handle = getattr(torch._C._distributed_c10d, "_SymmetricMemory", None)
    for attribute in ("buffer_ptrs", "rank", "world_size", "buffer_size"):
        require(hasattr(handle, attribute), f"torch.distributed._symmetric_memory.rendezvous(...).{attribute}",
                "the handle has the attribute peer_sum reads")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # silenced by _compat
        _compat.enable_symmetric_memory(single_process_group)


def test_dtensor_local_tensor_is_the_storage_to_local_views(single_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    tensor = DTensor.from_local(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)], run_check=False)
    local = _compat.dtensor_local_tensor(tensor)
    require(isinstance(local, torch.Tensor) and local.data_ptr() == tensor.to_local().data_ptr(),
            "torch.distributed.tensor.DTensor._local_tensor", "a DTensor keeps its local tensor there")
    moved = torch.arange(100.0, 106.0)
    local.set_(moved.untyped_storage(), 0, local.shape, local.stride())
    require(tensor.to_local().data_ptr() == moved.data_ptr() and torch.equal(tensor.to_local(), moved.view(3, 2)),
            "torch.distributed.tensor.DTensor._local_tensor",
            "moving its storage (set_) moves what to_local() reads (q/k/v packing)")
    assert _compat.dtensor_local_tensor(torch.ones(2)) is None


# ===== torch: ops ===================================================================================================

def test_version_sum_grows_with_every_in_place_change_of_a_weight_and_only_then():
    model = torch.nn.Linear(4, 4)
    params = list(model.parameters())
    before = _compat.version_sum(params)
    require(isinstance(before, int), "torch.Tensor._version", "every tensor has an integer version counter")
    with torch.no_grad():
        model(torch.ones(2, 4)), params[0].sum(), params[0].clone().add_(1)  # reads, and a copy's change
    require(_compat.version_sum(params) == before, "torch.Tensor._version", "reads leave the counter alone")
    changes = [lambda: model.load_state_dict({k: v + 1 for k, v in model.state_dict().items()}),
               lambda: torch.optim.SGD(model.parameters(), lr=0.1).step(),
               lambda: params[0].copy_(torch.zeros(4, 4)), lambda: params[1][0:2].mul_(2)]  # a view's change too
    for change in changes:
        model(torch.ones(2, 4)).sum().backward()
        last = _compat.version_sum(params)
        with torch.no_grad():
            change()
        require(_compat.version_sum(params) > last, "torch.Tensor._version",
                "load_state_dict, an optimizer step and in-place ops (on a view too) raise the counter")


def test_flash_attention_forward_takes_what_the_benchmark_passes():
    schema = _compat.flash_attention_forward().default._schema
    names = [a.name for a in schema.arguments]
    require(names[:10] == ["query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                           "is_causal", "return_debug_mask"] and "scale" in [a.name for a in schema.arguments
                                                                              if a.kwarg_only],
            "torch.ops.aten._flash_attention_forward",
            f"it takes (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale) "
            f"(schema: {schema})")
    require(schema.returns[0].name == "output", "torch.ops.aten._flash_attention_forward", "it returns output first")


# ===== transformers =================================================================================================

def test_generation_output_takes_what_generate_batch_fills():
    GenerationOutput, RequestStatus = _compat.GenerationOutput, _compat.RequestStatus
    for status in ("FINISHED", "FAILED"):
        require(hasattr(RequestStatus, status), "transformers.generation.continuous_batching.requests.RequestStatus",
                f"it has {status}")
    out = GenerationOutput(request_id="req_0", prompt_ids=[1, 2], generated_tokens=[3], logprobs=[-0.5], error=None,
                           status=RequestStatus.FAILED, created_time=1.0, lifespan=(1.0, 2.0), timestamps=[1.5])
    require((out.request_id, out.prompt_ids, out.generated_tokens, out.status, out.lifespan, out.timestamps)
            == ("req_0", [1, 2], [3], RequestStatus.FAILED, (1.0, 2.0), [1.5]) and out.is_finished(),
            "transformers.generation.continuous_batching.requests.GenerationOutput",
            "it takes request_id, prompt_ids, generated_tokens, logprobs, error, status, created_time, lifespan, "
            "timestamps")
    with pytest.raises(AttributeError):
        _compat.no_such_name  # noqa: B018


def test_default_generation_params_fill_unset_fields_only():
    defaults = _compat.default_generation_params()
    for key in ("max_length", "do_sample", "temperature", "top_k", "top_p", "num_return_sequences",
                "repetition_penalty", "output_scores"):
        require(key in defaults, "GenerationConfig._get_default_generation_params", f"its defaults include {key}")
    config = transformers.GenerationConfig(top_k=7)
    config.update(**defaults, defaults_only=True)
    require(config.top_k == 7 and config.top_p == defaults["top_p"] and config.do_sample == defaults["do_sample"],
            "GenerationConfig._get_default_generation_params",
            "update(**defaults, defaults_only=True) fills the unset fields and keeps the set ones")


def test_compile_all_devices_is_a_flag_generate_reads():
    config = transformers.CompileConfig()
    require(hasattr(transformers.CompileConfig, "_compile_all_devices")
            and _compat.compile_all_devices(config) is None,
            "CompileConfig._compile_all_devices", "the class attribute exists, None by default")
    _compat.set_compile_all_devices(config, True)
    require(_compat.compile_all_devices(config) is True and "_compile_all_devices" not in config.to_dict(),
            "CompileConfig._compile_all_devices", "it is set per instance and kept out of to_dict()")
    source = inspect.getsource(transformers.generation.utils)
    require("compile_config._compile_all_devices" in source, "CompileConfig._compile_all_devices",
            "generate reads it to compile on any device")

    class Flagless:  # a CompileConfig of a release without the flag: both ways are refused, naming it
        pass

    for call in (lambda: _compat.compile_all_devices(Flagless()),
                 lambda: _compat.set_compile_all_devices(Flagless(), True)):
        with pytest.raises(_compat.PrivateSymbolMissing, match=r"Flagless\._compile_all_devices \(keeping"):
            call()


def test_compiled_call_attributes_hold_generates_compiled_forward():
    model = tiny_llama(attn_implementation="eager")
    config = transformers.CompileConfig(backend="eager", mode=None)
    first = model.get_compiled_call(config)
    require(all(name in model.__dict__ for name in _compat.COMPILED_CALL_ATTRIBUTES)
            and model.get_compiled_call(config) is first, "PreTrainedModel._compiled_call/_last_compile_config",
            "get_compiled_call keeps its compiled forward and config there and reuses them")
    for name in _compat.COMPILED_CALL_ATTRIBUTES:
        model.__dict__.pop(name)
    require(model.get_compiled_call(config) is not first, "PreTrainedModel._compiled_call/_last_compile_config",
            "without them get_compiled_call compiles afresh")


def test_attn_implementation_names_the_models_attention():
    model = tiny_llama(attn_implementation="eager")
    require(_compat.attn_implementation(model.config) == "eager", "PretrainedConfig._attn_implementation",
            "it holds the attention the model was made with")
    model.set_attn_implementation("sdpa")
    require(_compat.attn_implementation(model.config) == "sdpa", "PretrainedConfig._attn_implementation",
            "set_attn_implementation updates it")


def test_generate_sets_the_user_defined_flag_before_reading_the_cache():
    from hf_paged.hf.compat import with_cache

    events = []

    @_compat.user_defined_flag_from("_flag")
    class Recording(transformers.DynamicCache):
        @property
        def _flag(self) -> bool:
            return self.__dict__.get("_seen", False)

        @_flag.setter
        def _flag(self, value: bool) -> None:
            events.append(("flag", value))
            self.__dict__["_seen"] = value

        def get_seq_length(self, *args, **kwargs) -> int:
            events.append(("length",))
            return super().get_seq_length(*args, **kwargs)

    require(not hasattr(transformers.cache_utils.Cache, "_is_user_defined")
            or isinstance(inspect.getattr_static(transformers.cache_utils.Cache, "_is_user_defined"), bool),
            "Cache._is_user_defined", "Cache leaves it a plain attribute that a subclass's property answers")
    model = tiny_llama(attn_implementation="eager")
    cache = Recording(config=model.config)
    ids = torch.tensor([[1, 5, 6, 7]])
    model.generate(**with_cache(model, cache, input_ids=ids, attention_mask=torch.ones_like(ids)), max_new_tokens=2,
                   do_sample=False, pad_token_id=0)
    require(events and events[0] == ("flag", True), "Cache._is_user_defined",
            f"generate sets it to True on a cache the caller passed, before it reads the cache (saw {events[:4]})")
    with pytest.raises(TypeError):
        _compat.user_defined_flag_from("no_such_property")(Recording)


def test_wrap_prepare_cache_sees_the_cache_generate_makes_and_generate_uses_it():
    """The wrapped maker runs once per ``generate`` call and leaves a ``DynamicCache`` in ``model_kwargs`` under the
    cache keyword, which generate then fills (its sequence length is the call's last position)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)  # random weights that end no row early (an end-of-sequence token would stop generate)
    model = _compat.model_from_config(transformers.LlamaForCausalLM, config, attn_implementation="eager").eval()
    original = transformers.GenerationMixin.__dict__["_prepare_cache_for_generation"]
    made = []

    def wrap(prepare):
        def recording(self, generation_config, model_kwargs, *args):
            result = prepare(self, generation_config, model_kwargs, *args)
            made.extend(v for k, v in model_kwargs.items() if k in ("cache", "past_key_values") and v is not None)
            return result
        return recording

    try:
        _compat.wrap_prepare_cache(wrap)
        ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(3))
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        transformers.GenerationMixin._prepare_cache_for_generation = original
    require(len(made) == 1 and isinstance(made[0], transformers.DynamicCache) and made[0].get_seq_length() == 7,
            "GenerationMixin._prepare_cache_for_generation",
            f"it puts the DynamicCache generate then fills into model_kwargs (saw {made})")


def test_model_from_config_makes_the_class_with_the_settings():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = _compat.model_from_config(transformers.LlamaForCausalLM, config, attn_implementation="eager",
                                      dtype=torch.float64)
    require(type(model) is transformers.LlamaForCausalLM and next(model.parameters()).dtype == torch.float64
            and _compat.attn_implementation(model.config) == "eager", "PreTrainedModel._from_config",
            "it makes the class with random weights and takes attn_implementation and dtype")


# ===== accelerate ===================================================================================================

def test_accelerate_hook_is_where_add_hook_to_module_puts_it():
    hooks = pytest.importorskip("accelerate.hooks")
    seen = {}

    class Module(torch.nn.Module):
        def forward(self, x, keep=None):
            seen.update(x=x.device.type, keep=keep.device.type)

    module = Module()
    assert _compat.accelerate_hook(module) is None
    hook = hooks.AlignDevicesHook(execution_device=torch.device("meta"))
    hooks.add_hook_to_module(module, hook)
    require(_compat.accelerate_hook(module) is hook, "model._hf_hook (accelerate)",
            "add_hook_to_module puts the hook there")
    require(hasattr(hook, "skip_keys"), "accelerate AlignDevicesHook.skip_keys", "the hook has skip_keys")
    hook.skip_keys = ["keep"]
    module(torch.ones(2), keep=torch.ones(2))
    require(seen == {"x": "meta", "keep": "cpu"}, "accelerate AlignDevicesHook.skip_keys",
            f"the hook moves the arguments but leaves the skipped keywords in place (saw {seen})")


# ===== nowhere else =================================================================================================

_PRIVATE_ROOTS = ("torch", "transformers", "accelerate")
#: The private names (attributes, functions, modules) of torch, transformers and accelerate that hf_paged uses, in
#: hf_paged/_compat.py and nowhere else (``test_no_module_but_compat_reaches_a_private_symbol``).
PRIVATE_ATTRIBUTES = (
    "_attn_implementation", "_compile_all_devices", "_compiled_call", "_from_config", "_get_default_generation_params",
    "_hf_hook", "_is_user_defined", "_last_compile_config", "_local_tensor", "_prepare_cache_for_generation",
    "_resolve_process_group", "_symmetric_memory", "_flash_attention_forward", "_version",
)


def _private_uses(path: Path) -> list[str]:
    """Private torch/transformers/accelerate symbols that the module at ``path`` names in code (not in comments or
    docstrings): imports with a private component, ``torch._x``-like chains, and the names of
    ``PRIVATE_ATTRIBUTES`` as attributes, strings or definitions."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names = [] if isinstance(node, ast.Import) else [a.name for a in node.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] in _PRIVATE_ROOTS and any(p.startswith("_") for p in parts[1:] + names):
                    found.append(f"line {node.lineno}: import of {module} ({', '.join(names)})")
        elif isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            chain.reverse()
            private = [i for i, p in enumerate(chain) if p.startswith("_") and not p.startswith("__")]
            if isinstance(base, ast.Name) and base.id in _PRIVATE_ROOTS and private:
                found.append(f"line {node.lineno}: {base.id}.{'.'.join(chain[:private[0] + 1])}")
            elif node.attr in PRIVATE_ATTRIBUTES:
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_ATTRIBUTES:
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in PRIVATE_ATTRIBUTES:
            found.append(f"line {node.lineno}: def {node.name}")
    return sorted(set(found))


def test_no_module_but_compat_reaches_a_private_symbol():
    compat = (PACKAGE / "_compat.py").read_text()
    assert [name for name in PRIVATE_ATTRIBUTES if name not in compat] == []  # (each one _compat.py does reach)
    uses = {str(p.relative_to(PACKAGE.parent)): u for p in sorted(PACKAGE.rglob("*.py"))
            if p.name != "_compat.py" and (u := _private_uses(p))}
    assert not uses, ("private torch/transformers/accelerate symbols outside hf_paged/_compat.py (add a function "
                      f"there, with its test in tests/test_compat.py, and call it): {uses}")


def test_the_private_use_reader_sees_each_kind(tmp_path):
    """The check above could pass vacuously if the reader missed a kind of use: it must find each here."""
    source = tmp_path / "uses.py"
    source.write_text("import torch._dynamo\nfrom torch.distributed import _symmetric_memory\n"
                      "from transformers.x import _y\nx = torch._dynamo.config\ny = model._hf_hook\n"
                      "z = getattr(config, '_attn_implementation', None)\n"
                      "class C:\n    def _is_user_defined(self): pass\n"
                      "ok = self._plan, torch.ops.hf_paged.linear, torch.__version__\n")
    assert len(_private_uses(source)) == 7, _private_uses(source)
