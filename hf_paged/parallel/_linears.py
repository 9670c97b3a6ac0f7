"""Tensor-parallel linears as plain local products for compiled code.

transformers shards a ``tp_plan="auto"`` model's linears by turning their weights into DTensors and wrapping each
module's ``forward``: at inference a colwise linear multiplies by its local rows, a rowwise one by its local columns
and then all-reduces its partial output in place (``dist.all_reduce``). Each call swaps the module's DTensor
parameters for their local tensors and back. That is cheap eagerly, but ``torch.compile`` cannot fuse across it, which
is why the engine used to run a tensor-parallel model's layers eagerly: ~25 small kernels per layer outside the
products, 1.9-2.9 ms of an 8B decode step on two GPUs.

:func:`install` puts a :class:`LocalLinear` in front of each sharded linear's ``forward``. Eager calls (and calls
that need gradients) still take transformers' own path; only inside ``torch.compile`` does it multiply by the local
tensors directly and sum a rowwise output with ``hf_paged::tp_all_reduce``, a custom op the compiler treats as
opaque (so a layer stays one graph around it). The compiled decoder layers then hold the same math as transformers'
inference path: the same local products, the same sum over ranks, the bias added once after it.

:func:`install` also moves each attention's q/k/v local shards end to end into one buffer (:func:`pack_colwise`), so
that the grouped product runs as one cuBLAS call where the skinny kernel does not serve it: one product where cuBLAS
ran three (25.6 us for a rank's three shards of the 8B shape at 16-64 rows on an H100, whose k and v shards alone
read at 0.8 TB/s). Each MLP's gate/up stay apart: two 7168-row products cost what one 14336-row product and the copy
that splits its output cost.

Only the two plain styles are taken (colwise with a sharded output, rowwise with a replicated one, as the Llama,
Mistral, Qwen and Gemma plans use); any other sharded linear makes :func:`install` refuse with the reason, and the
engine runs the layers eagerly.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hf_paged import _compat, _forward_context
from hf_paged.compile import _patches as patches
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.compile._packed_weights import pack_siblings
from hf_paged.parallel import _all_reduce as tp_all_reduce  # (registers hf_paged::tp_all_reduce)
from hf_paged.hf._placement import decoder_layers
from hf_paged.kernels import _skinny as skinny


def local_shards(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The local shards of ``module``'s weight and bias (views of the DTensors' storage, not copies; a bias that is
    not a DTensor as it is)."""
    bias = module.bias
    return module.weight.to_local(), (bias.to_local() if isinstance(bias, DTensor) else bias)


class LocalLinear:
    """A sharded linear's ``forward``: transformers' own (``eager``) outside compiled code, the local product (and
    for a rowwise shard the sum over ranks) inside it."""

    def __init__(self, module: torch.nn.Linear, eager, rowwise: bool, group):
        self.eager, self.rowwise, self.group = eager, rowwise, group
        self.refresh(module)

    def refresh(self, module: torch.nn.Linear) -> None:
        """Take the module's current local shards (views of the DTensors' storage, not copies): parameters set on
        the module since are served from the next compile on (the compiled code guards on these tensors)."""
        self.weight, self.bias = local_shards(module)
        self.skinny = skinny_linear.skip_reason(self.weight, self.bias, self.weight.dtype) is None

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The local product: the skinny op (``hf_paged::linear``, which the engine's grouping pass merges for
        q/k/v and gate/up) inside the engine's decode steps where its kernel can read the shard, else F.linear."""
        if self.skinny and _forward_context.skinny_linears():
            return skinny.linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def __call__(self, *args, **kwargs):
        if not torch.compiler.is_compiling() or torch.is_grad_enabled() or len(args) != 1 or kwargs:
            return self.eager(*args, **kwargs)
        x = args[0]
        if not self.rowwise:
            return self._product(x, self.bias)
        out = torch.ops.hf_paged.tp_all_reduce(self._product(x, None), self.group.group_name)
        return out if self.bias is None else out + self.bias


def install(model: torch.nn.Module, group) -> str | None:
    """Put a :class:`LocalLinear` on every sharded linear of ``model``'s decoder layers (once; later calls refresh
    their shards) and set up the all-reduce they sum with. Returns None when done, else why it cannot be done (no
    linear is wrapped then)."""
    if (layers := decoder_layers(model)) is None:
        return "no list of decoder layers found on the model"
    plans = []
    for name, module in layers.named_modules():
        if isinstance(local := patches.patch_of(module, "tp_linears"), LocalLinear):
            local.refresh(module)
            continue
        if not isinstance(getattr(module, "weight", None), DTensor):
            continue
        style = _style_of(module)
        if not isinstance(module, torch.nn.Linear) or style is None:
            return (f"layers.{name} is sharded in a way hf_paged does not compile ({type(module).__name__}, "
                    f"{'an unknown' if style is None else 'a'} tensor-parallel style)")
        plans.append((module, style))
    pack_colwise(layers, [m for m, rowwise in plans if not rowwise])
    for module, rowwise in plans:
        patches.install(module, "tp_linears", lambda eager: LocalLinear(module, eager, rowwise, group))
    sums = [f for m in layers.modules()
            if isinstance(f := patches.patch_of(m, "tp_linears"), LocalLinear) and f.rowwise]
    if sums:  # the all-reduce the rowwise shards sum with, set up on every rank at once (a collective)
        tp_all_reduce.prepare(group, sums[0].weight.device)
    return None


#: Colwise shards of one module that read the same input, packed end to end (see :func:`pack_colwise`): q/k/v.
PACKED_GROUPS = (("q_proj", "k_proj", "v_proj"),)


def pack_colwise(layers: torch.nn.Module, colwise: list[torch.nn.Module]) -> int:
    """Move the local shards of each group of :data:`PACKED_GROUPS` among ``colwise`` linears into one buffer, end to
    end (the DTensors keep their shapes and values; only their storage moves, the old one is freed). Inside the
    compiled layers the group's products then run as one (``hf_paged.kernels._skinny.packed_rows``) where the skinny
    kernel does not serve them. Returns the number of groups packed (or found packed)."""
    wanted = {id(p) for m in colwise for p in (m.weight, m.bias) if p is not None}
    return pack_siblings(layers, PACKED_GROUPS, lambda p: _own_local(p) if id(p) in wanted else None)


def _own_local(param: torch.Tensor) -> torch.Tensor | None:
    """A DTensor's own local tensor (``to_local()`` hands views of it), or None where ``param`` is not a DTensor or
    this torch keeps it elsewhere."""
    local = _compat.dtensor_local_tensor(param) if isinstance(param, DTensor) else None
    return local if isinstance(local, torch.Tensor) and local.data_ptr() == param.to_local().data_ptr() else None


def installed(model: torch.nn.Module) -> int:
    """How many of ``model``'s linears carry a :class:`LocalLinear`."""
    return len(patches.patched(model.modules(), "tp_linears"))


def _style_of(module: torch.nn.Module) -> bool | None:
    """True for transformers' plain rowwise style (partial output summed into a replicated one), False for its plain
    colwise style (local output features), None for anything else; read from the wrapper transformers installed on
    ``module.forward`` and checked against the weight's placement."""
    forward = module.__dict__.get("forward")
    if not callable(forward):
        return None
    try:
        style = inspect.getclosurevars(forward).nonlocals.get("self")
    except (TypeError, ValueError):
        return None
    kind = type(style).__name__
    placements = getattr(module.weight, "placements", ())
    if len(placements) != 1 or not placements[0].is_shard():
        return None
    dim = placements[0].dim % module.weight.ndim
    output = getattr(style, "output_layouts", None)
    if output is None or not getattr(style, "use_local_output", False):
        return None
    if kind == "ColwiseParallel" and dim == 0 and output.is_shard() and output.dim in (-1, 1):
        return False
    if kind == "RowwiseParallel" and dim == 1 and output.is_replicate():
        return True
    return None
