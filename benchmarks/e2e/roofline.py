"""Where the time of an ``hf_paged.Engine`` run goes, phase by phase, against the card's roofline.

The ``roofline`` workload of ``benchmarks/e2e/throughput.py``: the anchor's requests go through an ``hf_paged.Engine``
built as ``generate_batch`` builds its one (the same budget, ``block_size`` 16 unless ``--defaults``, automatic pool
sizing for the workload), once timed without a profiler (the row's tok/s) and once more, on a fresh engine, under
``torch.profiler`` (CUDA and CPU activity) from the first step to the last. The run's kernels are sorted into phases and
each phase's GPU time is set beside the time its work takes at the card's measured rates.

Steps. The benchmark wraps the engine's launch of each step (``EngineCore._launch``, read here, not an API) in a
``torch.profiler.record_function`` range named by the step's kind and reads, before the launch, each scheduled
sequence's computed tokens ``c``, new tokens ``n`` and whether it samples. A token is a decode token when its
sequence computes one token past its prompt (``n == 1`` and ``c >= prompt length``), else a prefill token. A step is
``prefill`` (prefill tokens only), ``decode`` (decode tokens only) or ``mixed`` (both: the chunked prefill of later
prompts while earlier ones decode); mixed steps get their own GEMM and attention rows rather than a split of their
kernels, which are single launches over both kinds of token. The sampler's call is wrapped in a range of its own.

Kernels to steps. A kernel belongs to the step whose range held the host operator that launched it (the profiler's
link from a kernel to its operator); a kernel without that link (the kernels of a replayed CUDA graph may have
none) belongs to the step of the kernel or copy before it on the device, which ran the stream in launch order
(``kernels_placed_by_order`` counts them).

Kernels to phases, by name (:func:`classify_kernel`): the KV write (``write_kv``, ``fix_scales`` of an fp8 cache),
attention (hf_paged's ``paged_decode``/``paged_prefill`` kernels, flash-attn's), GEMMs (cuBLAS/cuBLASLt: ``gemm``,
``gemv``, ``nvjet``, ``cutlass``, ``xmma``, ``splitKreduce``; inductor's ``triton_tem`` matmul templates; hf_paged's
``skinny_gemm``; ``lm_head`` is one of them: it is not told apart), the sampler (anything launched inside its range,
and ``argmax``/``topk``/``softmax``/sampling kernels anywhere), copies (``Memcpy``/``Memset``), norms/rotary/elementwise
(torch's elementwise, reduce, index, cat and scan kernels, inductor's fused ``triton_poi``/``triton_red``/
``triton_per`` kernels, hf_paged's ``advance_decode``), and ``other`` for what none of these names (NCCL,
``peer_sum``, anything new), so that the phases always sum to the run's total kernel time. On a CPU (``--smoke``)
the profiler's host operators stand in for kernels, each with its self time (``aten::mm`` is a GEMM,
``aten::argmax`` the sampler); the numbers mean nothing there.

Work, per step, from the model's config and the step's ``c``/``n``/sample columns (``T`` tokens, ``R`` sampled rows,
``L`` layers, hidden ``H``, intermediate ``I``, ``h`` heads, ``g`` KV heads, head size ``d``, vocabulary ``V``, ``b``
bytes per weight/activation element, ``k`` bytes per KV element):

- GEMMs: FLOPs = 2 * T * P + 2 * R * V * H, where P = L * (H*h*d + 2*H*g*d + h*d*H + 3*H*I) are the parameters of
  q, k, v, o, gate, up and down, and lm_head runs on the sampled rows only (the engine computes the logits of each
  sequence's last token, ``logits_to_keep``; a prefill chunk that does not end its prompt samples nothing). Bytes =
  the weights read once per step, (P + V*H) * b (P * b when nothing samples); activations are left out.
- Attention: FLOPs = 4 * h * d * L * (causal pairs), where a sequence's new tokens at positions c..c+n-1 see
  n*c + n*(n+1)/2 keys in all; bytes = the KV the step reads, (c + n) * L * 2 * g * d * k per sequence.
- KV write: bytes = T * L * 2 * g * d * (b + k) (the new keys and values read, then written into the pool).
- Sampler: bytes = R * V * (bytes per logit): the logits read once.
- Norms/rotary/elementwise: bytes = T * (L * (8*H + 3*I + 2*(h+g)*d) + 4*H) * b: what the work between the GEMMs
  must read and write per token if each gap were one fused pass (per layer: the residual add and norm after o_proj
  and after down, 4*H each; SiLU(gate)*up, 3*I; rotary on q and k, 2*(h+g)*d; per token: the embedding lookup and
  the final norm, 2*H each).

Roofline time of a phase = the sum over its steps of max(FLOPs / matrix rate, bytes / copy rate); efficiency =
roofline / GPU time. The rates are measured on the same card in the same run, before the engine is built: the copy
rate is the best of several device-to-device copies of a 4 GiB tensor (bytes read + written / time), the matrix
rate the best of several 8192^3 matmuls in the model's dtype (2*M*N*K / time). Copies and ``other`` have no work
(no roofline). Host gaps = the profiled run's wall time not covered by any kernel or copy (overlaps merged); their
roofline is zero. The total line sums the kernel time of every phase; its efficiency is the phases' roofline over
it, and ``wall_efficiency`` the same roofline over the profiled wall time.
"""

from __future__ import annotations

import bisect
import copy
import gc
import re
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.e2e.decode_profile import _covered_us, _is_annotation, engine_kwargs_split
from benchmarks.e2e.systems import Budget, sync
from benchmarks.e2e.workloads import Workload
import hf_paged
from hf_paged.bench import time_calls
from hf_paged.engine import Workload as EngineWorkload

KINDS = ("prefill", "mixed", "decode")
PHASES = ("prefill GEMMs", "prefill attention", "mixed GEMMs", "mixed attention", "decode GEMMs", "decode attention",
          "KV write", "sampler", "norms/rotary/elementwise", "copies", "other")
HOST_GAPS = "host gaps"
TOP_KERNELS = 40  # the kernels with the most GPU time, by name, kept in the row (and the first 15 printed)
STEP_RANGE, SAMPLER_RANGE = "roofline.step", "roofline.sampler"

# Kernel-name patterns, tried in this order (case-insensitive); what matches none is "other".
_CLASSES = (
    ("copy", r"^memcpy|^memset"),
    ("kv_write", r"write_kv|fix_scales|reshape_and_cache|store_kv"),
    ("attention", r"paged_decode|paged_prefill|flash|fmha|attention|attn"),
    ("elementwise", r"^triton_(poi|red|per)_"),  # inductor's fused pointwise and reduction kernels
    ("gemm", r"gemm|gemv|nvjet|cutlass|cublas|xmma|splitkreduce|s16816|s1688|^triton_tem|skinny|matmul"
             r"|(^|[^a-z])(mm|bmm|addmm|_addmm_activation|linear)($|[^a-z])"),
    ("sampler", r"argmax|argmin|topk|sort|softmax|multinomial|exponential|gumbel"),
    ("elementwise", r"elementwise|reduce_kernel|norm|rotary|rope|index|gather|scatter|catarray|(^|[^a-z])cat($|[^a-z])"
                    r"|copy|fill|advance_decode|arange|cumsum|scan|where|silu|embedding|^aten::|at::native::"),
)
_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in _CLASSES]


def classify_kernel(name: str) -> str:
    """The class of a kernel (or, on the CPU, a leaf operator) by its name: ``copy``, ``kv_write``, ``attention``,
    ``gemm``, ``sampler``, ``elementwise`` or ``other``."""
    for cls, pattern in _PATTERNS:
        if pattern.search(name):
            return cls
    return "other"


# ----- the model's work ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What the work formulas read from the model: sizes, and bytes per weight (``b``) and per KV element (``k``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    b: int
    k: int

    @classmethod
    def of(cls, config, dtype: torch.dtype, kv_dtype: torch.dtype) -> Shape:
        config = config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads, head_dim, config.vocab_size,
                   dtype.itemsize, kv_dtype.itemsize)

    @property
    def linear_params(self) -> int:
        """q, k, v, o, gate, up and down of every layer."""
        h, g, d, hid = self.heads, self.kv_heads, self.head_dim, self.hidden
        return self.layers * (hid * h * d + 2 * hid * g * d + h * d * hid + 3 * hid * self.intermediate)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.k

    @property
    def elementwise_elements_per_token(self) -> int:
        per_layer = 8 * self.hidden + 3 * self.intermediate + 2 * (self.heads + self.kv_heads) * self.head_dim
        return self.layers * per_layer + 4 * self.hidden


@dataclass(frozen=True)
class Step:
    """One launched step: its kind and the totals its work needs (``of``: from its per-sequence columns)."""

    kind: str
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    sampled: int
    causal_pairs: int
    kv_read_tokens: int
    logit_bytes: int = 0  # bytes per logit the sampler read (set when it runs)

    @classmethod
    def of(cls, computed, new, sample, decode) -> Step:
        """``computed[i]``/``new[i]``: sequence ``i``'s tokens computed before the step and computed in it;
        ``sample[i]``: it samples; ``decode[i]``: its token is a decode token."""
        c, n = np.asarray(computed, np.int64), np.asarray(new, np.int64)
        decode = np.asarray(decode, bool)
        decode_tokens = int(n[decode].sum())
        prefill_tokens = int(n.sum()) - decode_tokens
        kind = "mixed" if prefill_tokens and decode_tokens else "decode" if decode_tokens else "prefill"
        return cls(kind, int(n.sum()), prefill_tokens, decode_tokens, int(np.count_nonzero(sample)),
                   int((n * c + n * (n + 1) // 2).sum()), int((c + n).sum()))


def step_work(shape: Shape, step: Step) -> dict[str, tuple[float, float]]:
    """``{phase: (FLOPs, bytes)}`` of one step (see the module doc)."""
    s = shape
    gemm_flops = 2.0 * step.tokens * s.linear_params + 2.0 * step.sampled * s.vocab * s.hidden
    gemm_bytes = float((s.linear_params + (s.vocab * s.hidden if step.sampled else 0)) * s.b)
    attention_flops = 4.0 * s.heads * s.head_dim * s.layers * step.causal_pairs
    attention_bytes = float(step.kv_read_tokens * s.kv_bytes_per_token)
    kv_write = float(step.tokens * s.layers * 2 * s.kv_heads * s.head_dim * (s.b + s.k))
    return {
        f"{step.kind} GEMMs": (gemm_flops, gemm_bytes),
        f"{step.kind} attention": (attention_flops, attention_bytes),
        "KV write": (0.0, kv_write),
        "sampler": (0.0, float(step.sampled * s.vocab * step.logit_bytes)),
        "norms/rotary/elementwise": (0.0, float(step.tokens * s.elementwise_elements_per_token * s.b)),
    }


# ----- the rates ---------------------------------------------------------------------------------------------


def measure_rates(device: torch.device, dtype: torch.dtype, copy_bytes: int = 4 << 30, matmul_size: int = 8192,
                  reps: int = 5) -> dict:
    """The card's copy rate (bytes read + written per second, device to device) and matrix rate (FLOPs per second
    of a square matmul in ``dtype``), each the best of ``reps`` after one untimed run."""
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), reps, device)
    del src, dst
    a = torch.randn(matmul_size, matmul_size, dtype=dtype, device=device)
    bm, out = torch.randn_like(a), torch.empty_like(a)
    matmul_s = _best_seconds(lambda: torch.mm(a, bm, out=out), reps, device)
    del a, bm, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * copy_bytes / copy_s, "matmul_flops_per_s": 2 * matmul_size**3 / matmul_s,
            "copy_bytes": copy_bytes, "matmul_size": matmul_size, "matmul_dtype": str(dtype).removeprefix("torch."),
            "rate_reps": reps}


def _best_seconds(fn, reps: int, device: torch.device) -> float:
    """The fastest of ``reps`` runs of ``fn`` after one untimed run (``hf_paged.bench.time_calls``, eager)."""
    return time_calls([fn], graph=False, reps=reps, device=device).min_s


# ----- the run -----------------------------------------------------------------------------------------------


def run_roofline(model: torch.nn.Module, workload: Workload, budget: Budget, engine_kwargs: dict, vocab: int,
                 smoke: bool = False) -> dict:
    """Rates, a timed run and a profiled run of ``workload`` through an ``hf_paged.Engine``; the phase table."""
    device = model.device
    rates = (measure_rates(device, model.dtype, copy_bytes=16 << 20, matmul_size=256, reps=3) if smoke
             else measure_rates(device, model.dtype))
    options = {**({} if budget.is_default else {"block_size": 16}), **engine_kwargs}
    accepted, ignored = engine_kwargs_split(options)
    prompts, generation = workload.prompts(vocab), workload.generation_config()
    sizes = EngineWorkload(tuple(len(p) + workload.new_tokens for p in prompts))

    def engine() -> hf_paged.Engine:
        built = hf_paged.Engine(model, max_batch_tokens=budget.max_batch_tokens, max_num_seqs=budget.max_requests,
                                workload=sizes, **accepted)
        for prompt in prompts:
            built.add_request(prompt, copy.deepcopy(generation))
        return built

    # the timed run (tok/s without a profiler); the engine's compile and autotuning warm up here too
    timed = engine()
    seconds, tokens = _run_to_end(timed)
    timed.close()
    del timed
    gc.collect()  # its pool, before the next engine sizes its own from the free memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    profiled = engine()
    recorder = StepRecorder(profiled)
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        profiled_seconds, profiled_tokens = _run_to_end(profiled)
    shape = Shape.of(model.config, model.dtype, profiled.runner.pool.dtype)
    backends = {k: profiled.stats().get(k) for k in ("prefill_backend", "decode_backend")}
    profiled.close()
    analysis = analyse(prof.events(), recorder.steps, shape, rates, profiled_seconds, on_cuda)
    return {"tokens": tokens, "expected_tokens": len(prompts) * workload.new_tokens, "seconds": seconds,
            "profiled_seconds": profiled_seconds, "profiled_tokens": profiled_tokens,
            "profiled_tok_per_s": profiled_tokens / profiled_seconds if profiled_seconds > 0 else None,
            "device_activity": "cuda kernels" if on_cuda else "cpu (host ops, self time)", **rates, **analysis,
            "shape": vars(shape), **backends,
            "engine_kwargs_ignored_by_engine": ignored}


def _run_to_end(engine: hf_paged.Engine) -> tuple[float, int]:
    sync()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    return time.perf_counter() - start, engine.stats()["generated_tokens"]


class StepRecorder:
    """Wraps the engine's step launch and its sampler (this engine only) in named profiler ranges and records each
    launched step's :class:`Step`."""

    def __init__(self, engine: hf_paged.Engine):
        self.steps: list[Step] = []
        launch, sampler = engine._launch, engine.sampler

        def recorded_launch(batch):
            step = self._step(batch)
            self.steps.append(step)
            with record_function(f"{STEP_RANGE}#{len(self.steps) - 1}.{step.kind}"):
                return launch(batch)

        def recorded_sampler(logits, sampling):
            if self.steps:
                self.steps[-1] = _with_logit_bytes(self.steps[-1], logits.element_size())
            with record_function(SAMPLER_RANGE):
                return sampler(logits, sampling)

        engine._launch, engine.sampler = recorded_launch, recorded_sampler

    @staticmethod
    def _step(batch) -> Step:
        seqs = batch.seqs
        c = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, len(seqs))
        prompt = np.fromiter((s.num_prompt_tokens for s in seqs), np.int64, len(seqs))
        n = np.asarray(batch.num_tokens, np.int64)
        return Step.of(c, n, batch.sample, (n == 1) & (c >= prompt))


def _with_logit_bytes(step: Step, size: int) -> Step:
    return Step(step.kind, step.tokens, step.prefill_tokens, step.decode_tokens, step.sampled, step.causal_pairs,
                step.kv_read_tokens, size)


# ----- the analysis ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernel:
    """A device event (on the CPU: a host operator): name, start and end (us), the time it counts for (a kernel's
    duration; an operator's self time, its children's left out) and the host time it was launched at (None when the
    profiler did not link it to an operator)."""

    name: str
    start: float
    end: float
    duration: float
    launched_at: float | None


def kernels_of(events, on_cuda: bool) -> tuple[list[Kernel], list[tuple[str, float, float]],
                                                list[tuple[str, float, float]]]:
    """The run's kernels (or leaf host operators), the profiler ranges ``(name, start, end)`` of its steps and
    sampler calls on the host, and the same ranges on the device (the profiler's GPU-side spans of a
    ``record_function`` range: from the first kernel launched inside it to the end of the last), from
    ``prof.events()``."""
    kind = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    cpu = torch.autograd.DeviceType.CPU
    ranges = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.device_type == cpu and e.name.startswith((STEP_RANGE, SAMPLER_RANGE))]
    device_ranges = [(e.name, e.time_range.start, e.time_range.end) for e in events
                     if on_cuda and e.device_type == kind and e.name.startswith((STEP_RANGE, SAMPLER_RANGE))]
    if on_cuda:
        ops = {e.id: e.time_range.start for e in events
               if e.device_type == cpu and not getattr(e, "linked_correlation_id", 0)}
        kernels = [Kernel(e.name, e.time_range.start, e.time_range.end, e.time_range.end - e.time_range.start,
                          ops.get(getattr(e, "linked_correlation_id", 0)))
                   for e in events if e.device_type == kind and not _is_annotation(e)
                   and not e.name.startswith(("roofline.", "gpu_user_annotation"))]
    else:
        kernels = [Kernel(e.name, e.time_range.start, e.time_range.end, e.self_cpu_time_total, e.time_range.start)
                   for e in events if e.device_type == kind and not _is_annotation(e)
                   and not e.name.startswith("roofline.")]
    return kernels, ranges, device_ranges


def place(kernels: list[Kernel], ranges: list[tuple[str, float, float]],
          device_ranges: list[tuple[str, float, float]] = ()) -> tuple[list[int | None], list[bool], int]:
    """Each kernel's step (index into the recorded steps, None: no step) and whether the sampler launched it; and
    how many kernels were placed by their order on the device.

    A kernel linked to the host operator that launched it takes the step (and sampler) range around that launch;
    one without such a link (the profiler of some torch releases links none; a replayed CUDA graph's kernels) takes
    the device-side span of a range that holds its start; what neither places takes the step of the kernel before
    it on the device."""
    host_steps, host_samplers = _spans(ranges)
    device_steps, device_samplers = _spans(device_ranges)
    step_of: list[int | None] = []
    in_sampler: list[bool] = []
    for k in kernels:
        step = _within(host_steps, k.launched_at) if k.launched_at is not None else None
        sampler = k.launched_at is not None and _within(host_samplers, k.launched_at) is not None
        if step is None:
            step = _within(device_steps, k.start)
            sampler = sampler or _within(device_samplers, k.start) is not None
        step_of.append(step)
        in_sampler.append(sampler)
    # the unplaced take the step of the kernel before them on the device (the first ones: the one after)
    order = sorted(range(len(kernels)), key=lambda j: kernels[j].start)
    unplaced = sum(s is None for s in step_of)
    last = None
    for j in order:
        if step_of[j] is None:
            step_of[j] = last
        else:
            last = step_of[j]
    following = None
    for j in reversed(order):
        if step_of[j] is None:
            step_of[j] = following
        else:
            following = step_of[j]
    return step_of, in_sampler, unplaced


def _spans(ranges) -> tuple[tuple[list[float], list[tuple[float, float, int]]], tuple[list[float], list]]:
    """Step ranges ``(starts, [(start, end, step index)])`` and sampler ranges ``(starts, [(start, end, 0)])``,
    sorted by start."""
    steps = sorted((start, end, int(name.split("#")[1].split(".")[0]))
                   for name, start, end in ranges if name.startswith(STEP_RANGE))
    samplers = sorted((start, end, 0) for name, start, end in ranges if name == SAMPLER_RANGE)
    return ([s[0] for s in steps], steps), ([s[0] for s in samplers], samplers)


def _within(spans, t: float) -> int | None:
    """The value (step index) of the last span starting at or before ``t`` if it still holds ``t``."""
    starts, items = spans
    i = bisect.bisect_right(starts, t) - 1
    return items[i][2] if i >= 0 and t <= items[i][1] else None


def phase_of(cls: str, kind: str | None, sampler_range: bool) -> str:
    """The table row of a kernel of class ``cls`` launched by a step of ``kind`` (None: no step)."""
    if cls == "copy":
        return "copies"
    if sampler_range or cls == "sampler":
        return "sampler"
    if cls in ("gemm", "attention"):
        return "other" if kind is None else f"{kind} {'GEMMs' if cls == 'gemm' else 'attention'}"
    return {"kv_write": "KV write", "elementwise": "norms/rotary/elementwise"}.get(cls, "other")


def analyse(events, steps: list[Step], shape: Shape, rates: dict, wall_s: float, on_cuda: bool) -> dict:
    """The phase table of a profiled run: ``phases`` (one dict per row of :data:`PHASES`), ``total``, host gaps,
    per step kind a summary (``step_kinds``), and how the kernels were placed."""
    kernels, ranges, device_ranges = kernels_of(events, on_cuda)
    step_of, in_sampler, unplaced = place(kernels, ranges, device_ranges)
    gpu_us = dict.fromkeys(PHASES, 0.0)
    kind_us = dict.fromkeys(KINDS, 0.0)
    by_name: dict[tuple[str, str], list[float]] = {}  # (kernel name, phase): [GPU us, count]
    for k, s, smp in zip(kernels, step_of, in_sampler):
        kind = steps[s].kind if s is not None and s < len(steps) else None
        phase = phase_of(classify_kernel(k.name), kind, smp)
        gpu_us[phase] += k.duration
        entry = by_name.setdefault((k.name, phase), [0.0, 0])
        entry[0], entry[1] = entry[0] + k.duration, entry[1] + 1
        if kind is not None:
            kind_us[kind] += k.duration
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    matrix, copy_rate = rates["matmul_flops_per_s"], rates["copy_bytes_per_s"]
    work = {p: [0.0, 0.0, 0.0] for p in PHASES}  # FLOPs, bytes, roofline seconds
    kind_roof = dict.fromkeys(KINDS, 0.0)
    for step in steps:
        for phase, (flops, nbytes) in step_work(shape, step).items():
            roof = max(flops / matrix, nbytes / copy_rate)
            w = work[phase]
            w[0], w[1], w[2] = w[0] + flops, w[1] + nbytes, w[2] + roof
            kind_roof[step.kind] += roof
    rows = []
    for phase in PHASES:
        flops, nbytes, roof = work[phase]
        has_work = phase not in ("copies", "other")
        rows.append(_row(phase, gpu_us[phase] / 1e3, flops if has_work else None, nbytes if has_work else None,
                         roof * 1e3 if has_work else None, matrix, copy_rate))
    total_ms = sum(k.duration for k in kernels) / 1e3
    roof_ms = sum(r["roofline_ms"] or 0.0 for r in rows)
    busy_ms = _covered_us([(k.start, k.end) for k in kernels]) / 1e3
    wall_ms = wall_s * 1e3
    return {
        "phases": rows,
        "total": {"phase": "total", "gpu_ms": total_ms, "roofline_ms": roof_ms,
                  "efficiency": roof_ms / total_ms if total_ms > 0 else None,
                  "wall_ms": wall_ms, "wall_efficiency": roof_ms / wall_ms if wall_ms > 0 else None},
        "host_gaps": {"phase": HOST_GAPS, "gpu_ms": max(wall_ms - busy_ms, 0.0), "roofline_ms": 0.0,
                      "device_busy_ms": busy_ms},
        "step_kinds": {kind: {"steps": sum(s.kind == kind for s in steps),
                              "prefill_tokens": sum(s.prefill_tokens for s in steps if s.kind == kind),
                              "decode_tokens": sum(s.decode_tokens for s in steps if s.kind == kind),
                              "gpu_ms": kind_us[kind] / 1e3, "roofline_ms": kind_roof[kind] * 1e3,
                              "efficiency": kind_roof[kind] * 1e6 / kind_us[kind] if kind_us[kind] else None}
                       for kind in KINDS},
        "kernels": len(kernels), "kernels_placed_by_order": unplaced,
        "device_ranges": len(device_ranges),
        "top_kernels": [{"name": name[:160], "phase": phase, "gpu_ms": us / 1e3, "count": count}
                        for (name, phase), (us, count) in top],
    }


def _row(phase: str, gpu_ms: float, flops, nbytes, roof_ms, matrix: float, copy_rate: float) -> dict:
    bound = None
    if roof_ms:
        bound = "matrix" if flops / matrix >= nbytes / copy_rate else "copy"
    return {"phase": phase, "gpu_ms": gpu_ms, "flops": flops, "bytes": nbytes, "roofline_ms": roof_ms,
            "efficiency": roof_ms / gpu_ms if roof_ms is not None and gpu_ms > 0 else None, "bound": bound}


def format_table(row: dict) -> str:
    """The phase table of a roofline row, as printed."""
    lines = [f"where the time goes ({row['label']}, {row.get('card', '?')}): copy rate "
             f"{row['copy_bytes_per_s'] / 1e12:.2f} TB/s, matrix rate {row['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s "
             f"(measured); {row['device_activity']}",
             f"{'phase':<26}{'GPU ms':>10}{'TFLOP':>9}{'GB':>9}{'roofline ms':>13}{'efficiency':>12}  bound"]
    num = lambda v, scale, fmt: "-" if v is None else format(v / scale, fmt)
    for r in row["phases"] + [row["total"], row["host_gaps"]]:
        lines.append(f"{r['phase']:<26}{r['gpu_ms']:>10.1f}{num(r.get('flops'), 1e12, '.2f'):>9}"
                     f"{num(r.get('bytes'), 1e9, '.2f'):>9}{num(r.get('roofline_ms'), 1, '.1f'):>13}"
                     f"{num(r.get('efficiency'), 0.01, '.0f') + ('%' if r.get('efficiency') is not None else ''):>12}"
                     f"  {r.get('bound') or ''}")
    total = row["total"]
    lines.append(f"{'wall (profiled)':<26}{total['wall_ms']:>10.1f}{'':>18}{total['roofline_ms']:>13.1f}"
                 f"{num(total['wall_efficiency'], 0.01, '.0f') + '%':>12}")
    kinds = "; ".join(f"{k}: {v['steps']} steps, {v['gpu_ms']:.1f} GPU ms, roofline {v['roofline_ms']:.1f} ms"
                      + (f" ({v['efficiency']:.0%})" if v["efficiency"] is not None else "")
                      for k, v in row["step_kinds"].items())
    lines.append(f"steps: {kinds}")
    rate = lambda v: "n/a" if not v else f"{v:,.0f}"
    lines.append(f"tok/s: {rate(row.get('tok_per_s'))} unprofiled, {rate(row.get('profiled_tok_per_s'))} profiled; "
                 f"{row['kernels']:,} kernels, {row['kernels_placed_by_order']:,} placed by device order")
    if row.get("top_kernels"):
        lines.append("kernels with the most GPU time:")
        lines += [f"  {k['gpu_ms']:>9.1f} ms {k['count']:>7,}x  {k['phase']:<26} {k['name'][:90]}"
                  for k in row["top_kernels"][:15]]
    return "\n".join(lines)
