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
that the grouped product runs as one cuBLAS call where the skinny kernel does not serve it: ``HF_PAGED_TP_PACK``
(:func:`packed_groups`) says which groups, ``all`` adds each MLP's gate/up, ``0`` leaves every shard where it is.

With ``HF_PAGED_TP_PREFETCH_MB`` set (opt-in, :func:`set_prefetch`) each rowwise shard's all-reduce also carries an L2
prefetch hint: the first bytes of the weight the next product reads (after o_proj the MLP's gate, after down_proj the
next layer's packed q/k/v). peer_sum's kernel asks the L2 to fetch them while it waits for the other ranks, when the
memory would otherwise idle, so that the product may find part of its weight in the cache.

Only the two plain styles are taken (colwise with a sharded output, rowwise with a replicated one, as the Llama,
Mistral, Qwen and Gemma plans use); any other sharded linear makes :func:`install` refuse with the reason, and the
engine runs the layers eagerly.
"""

from __future__ import annotations

import inspect
import os

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hf_paged.compile import _patches as patches
from hf_paged.compile import _skinny_linears as skinny_linear
from hf_paged.parallel import _all_reduce as tp_all_reduce  # (registers hf_paged::tp_all_reduce)
from hf_paged.hf._placement import decoder_layers
from hf_paged.kernels import _skinny as skinny


class LocalLinear:
    """A sharded linear's ``forward``: transformers' own (``eager``) outside compiled code, the local product (and
    for a rowwise shard the sum over ranks) inside it."""

    def __init__(self, module: torch.nn.Linear, eager, rowwise: bool, group):
        self.eager, self.rowwise, self.group = eager, rowwise, group
        self.prefetch: torch.Tensor | None = None  # a rowwise shard's L2 prefetch hint (set by install)
        self.refresh(module)

    def refresh(self, module: torch.nn.Linear) -> None:
        """Take the module's current local shards (views of the DTensors' storage, not copies): parameters set on
        the module since are served from the next compile on (the compiled code guards on these tensors)."""
        self.weight = module.weight.to_local()
        bias = module.bias
        self.bias = None if bias is None else (bias.to_local() if hasattr(bias, "to_local") else bias)
        self.routing = skinny_linear
        self.skinny = skinny_linear.skip_reason_of(self.weight, self.bias, self.weight.dtype) is None

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The local product: the skinny op (``hf_paged::linear``, which the engine's grouping pass merges for
        q/k/v and gate/up) inside the engine's decode steps where its kernel can read the shard, else F.linear."""
        if self.skinny and self.routing.is_active():
            return skinny.linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def __call__(self, *args, **kwargs):
        if not torch.compiler.is_compiling() or torch.is_grad_enabled() or len(args) != 1 or kwargs:
            return self.eager(*args, **kwargs)
        x = args[0]
        if not self.rowwise:
            return self._product(x, self.bias)
        hint = () if self.prefetch is None else (self.prefetch,)
        out = torch.ops.hf_paged.tp_all_reduce(self._product(x, None), self.group.group_name, *hint)
        return out if self.bias is None else out + self.bias


def install(model: torch.nn.Module, group) -> str | None:
    """Put a :class:`LocalLinear` on every sharded linear of ``model``'s decoder layers (once; later calls refresh
    their shards) and set up the all-reduce they sum with. Returns None when done, else why it cannot be done (no
    linear is wrapped then)."""
    layers = decoder_layers(model)
    if layers is None:
        return "no list of decoder layers found on the model"
    plans = []
    for name, module in layers.named_modules():
        if isinstance(local := patches.patch_of(module, "tp_linears"), LocalLinear):
            local.refresh(module)
            continue
        weight = getattr(module, "weight", None)
        if not is_dtensor(weight):
            continue
        style = _style_of(module)
        if not isinstance(module, torch.nn.Linear) or style is None:
            return (f"layers.{name} is sharded in a way hf_paged does not compile ({type(module).__name__}, "
                    f"{'an unknown' if style is None else 'a'} tensor-parallel style)")
        plans.append((module, style))
    groups = packed_groups()
    if groups:
        pack_colwise(layers, [m for m, rowwise in plans if not rowwise], groups)
    for module, rowwise in plans:
        patches.install(module, "tp_linears", lambda eager: LocalLinear(module, eager, rowwise, group))
    # what the rowwise shards' sums will be: one set-up per dtype, in the same order on every rank (a collective)
    sums = {(str(f.weight.dtype), f.weight.dtype, f.weight.device) for m in layers.modules()
            if isinstance(f := patches.patch_of(m, "tp_linears"), LocalLinear) and f.rowwise}
    for _, dtype, device in sorted(sums, key=lambda s: s[0]):
        tp_all_reduce.prepare(group, dtype, device)
    # the prefetch hints serve where peer_sum's kernel takes them (its group set up on CUDA)
    set_prefetch(layers, prefetch_bytes() if tp_all_reduce.fused_ready(group.group_name) else 0)
    return None


PREFETCH_ENV = "HF_PAGED_TP_PREFETCH_MB"
DEFAULT_PREFETCH_MB = 0


def prefetch_bytes() -> int:
    """``HF_PAGED_TP_PREFETCH_MB`` (read when an engine is built) in bytes: how much of the next product's weight each
    rowwise shard's all-reduce asks the L2 to fetch while the ranks exchange. Off (0) by default: 16 MiB made the
    8B-shaped decode step at batch 64 on two H200s 0.10 ms slower, not faster (2026-11-27, docs/multi_gpu.md)."""
    value = os.environ.get(PREFETCH_ENV, str(DEFAULT_PREFETCH_MB))
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if not 0 <= mb <= 1024:
        raise ValueError(f"{PREFETCH_ENV}={value!r}: use a number of MiB from 0 (no prefetch) to 1024; the default is "
                         f"{DEFAULT_PREFETCH_MB}")
    return int(mb * (1 << 20)) // 16 * 16


def set_prefetch(layers: torch.nn.Module, limit: int) -> int:
    """Give each rowwise :class:`LocalLinear` of ``layers`` its L2 prefetch: the first ``limit`` bytes of the weights
    of the colwise shards after it in module order (o_proj: the MLP's gate; down_proj: the next layer's q/k/v), as
    one flat view over as many of them as lie end to end from the first (q/k/v packed: all three). The all-reduce's
    kernel then fetches them into the L2 while it waits for its peers, and the product that reads its sum finds them
    there. The last layer's down_proj, and every shard where ``limit`` is 0, get none. Returns how many got one."""
    linears = [f for m in layers.modules() if isinstance(f := patches.patch_of(m, "tp_linears"), LocalLinear)]
    given = 0
    for i, f in enumerate(linears):
        if not f.rowwise:
            continue
        run = []
        for g in linears[i + 1:]:
            if g.rowwise:
                break
            run.append(g.weight)
        f.prefetch = _head(run, limit) if run and limit > 0 else None
        given += f.prefetch is not None
    return given


def _head(weights: list[torch.Tensor], limit: int) -> torch.Tensor | None:
    """A flat view of the first ``limit`` bytes of the longest run of ``weights`` from the first that lie end to end
    in one storage (contiguous, one dtype and device), or None where the first is not contiguous."""
    first = weights[0]
    if not first.is_contiguous():
        return None
    end = first.data_ptr() + first.numel() * first.element_size()
    for w in weights[1:]:
        if (not w.is_contiguous() or w.dtype != first.dtype or w.device != first.device or w.data_ptr() != end
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            break
        end += w.numel() * w.element_size()
    numel = min(end - first.data_ptr(), limit) // first.element_size()
    return first.detach().as_strided((numel,), (1,)) if numel else None


#: Colwise shards of one module that read the same input, which can be packed end to end (see :func:`pack_colwise`).
PACKED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
PACK_ENV = "HF_PAGED_TP_PACK"
_PACK_CHOICES = {"0": (), "1": PACKED_GROUPS[:1], "all": PACKED_GROUPS}


def packed_groups() -> tuple[tuple[str, ...], ...]:
    """The groups :func:`install` packs, from ``HF_PAGED_TP_PACK`` (read when an engine is built): unset or ``1``,
    q/k/v (one product where cuBLAS ran three: 25.6 us for a rank's three shards of the 8B shape at 16-64 rows on an
    H100, whose k and v shards alone read at 0.8 TB/s); ``all``, gate/up too (opt-in: two 7168-row products cost
    what one 14336-row product and the copy that splits its output cost, and two GPU runs on different machines did
    not show a gain; docs/multi_gpu.md); ``0``, none."""
    value = os.environ.get(PACK_ENV, "1")
    if value not in _PACK_CHOICES:
        raise ValueError(f"{PACK_ENV}={value!r}: use 1 (pack q/k/v, the default), all (q/k/v and gate/up) or 0 "
                         "(pack nothing)")
    return _PACK_CHOICES[value]


def pack_colwise(layers: torch.nn.Module, colwise: list[torch.nn.Module],
                 groups: tuple[tuple[str, ...], ...] = PACKED_GROUPS) -> int:
    """Move the local shards of each group of ``groups`` (of :data:`PACKED_GROUPS`) among ``colwise`` linears into
    one buffer, end to end (the DTensors keep their shapes and values; only their storage moves, the old one is
    freed). Inside the compiled layers the group's products then run as one (``hf_paged.kernels._skinny.packed_rows``)
    where the skinny kernel does not serve them. Returns the number of groups packed (or found packed)."""
    wanted = {id(m) for m in colwise}
    packed = 0
    for parent in layers.modules():
        for names in groups:
            group = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, torch.nn.Linear) and id(m) in wanted for m in group) and _pack(group):
                packed += 1
    return packed


def _pack(modules: list[torch.nn.Linear]) -> bool:
    with torch.no_grad():
        weights = _own_locals([m.weight for m in modules])
        biases = [m.bias for m in modules]
        bias_locals = None if all(b is None for b in biases) else _own_locals(biases)
        if weights is None or (bias_locals is None and any(b is not None for b in biases)):
            return False
        first = weights[0]
        if any(not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
               for t in weights + (bias_locals or [])) or any(w.dim() != 2 or w.shape[1] != first.shape[1]
                                                              for w in weights):
            return False
        if skinny.packed_rows(weights, bias_locals or [None] * len(weights)) is not None:
            return True  # (an earlier engine packed them)
        for tensors in (weights, bias_locals) if bias_locals else (weights,):
            buffer = torch.cat([t.reshape(-1) for t in tensors])
            offset = 0
            for t in tensors:
                t.set_(buffer.untyped_storage(), offset, t.shape, t.stride())
                offset += t.numel()
    return True


def _own_locals(params: list) -> list[torch.Tensor] | None:
    """The DTensors' own local tensors (``to_local()`` hands views of them), or None where one is not a DTensor or
    this torch keeps it elsewhere."""
    if not all(is_dtensor(p) for p in params):
        return None
    locals_ = [getattr(p, "_local_tensor", None) for p in params]
    if any(not isinstance(t, torch.Tensor) or t.data_ptr() != p.to_local().data_ptr()
           for t, p in zip(locals_, params)):
        return None
    return locals_


def installed(model: torch.nn.Module) -> int:
    """How many of ``model``'s linears carry a :class:`LocalLinear`."""
    return len(patches.patched(model.modules(), "tp_linears"))


def is_dtensor(tensor) -> bool:
    return isinstance(tensor, DTensor)


def _style_of(module: torch.nn.Module) -> bool | None:
    """True for transformers' plain rowwise style (partial output summed into a replicated one), False for its plain
    colwise style (local output features), None for anything else; read from the wrapper transformers installed on
    ``module.forward`` and checked against the weight's placement."""
    forward = module.__dict__.get("forward")
    if forward is None or not callable(forward):
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
    if kind == "ColwiseParallel" and dim == 0 and getattr(style, "use_local_output", False):
        output = getattr(style, "output_layouts", None)
        if output is not None and output.is_shard() and output.dim in (-1, 1):
            return False
    if kind == "RowwiseParallel" and dim == 1 and getattr(style, "use_local_output", False):
        output = getattr(style, "output_layouts", None)
        if output is not None and output.is_replicate():
            return True
    return None
