"""Regenerate the tables that README.md and docs/ carry, from their sources.

A generated table sits in a Markdown file between two markers:

    <!-- table: KIND [SOURCE ...] -->
    ...
    <!-- end table -->

``KIND`` names one of the renderers below and each ``SOURCE`` a result file under ``benchmarks/results/`` (tables of
``hf_paged.envs`` and ``EngineConfig`` take none). The files no doc's table shows any more sit in
``benchmarks/results/archive/``, whose README indexes them. A table names its card, versions, date and file under it,
as the result file records them ("not recorded" where it does not; the date then comes from the file's name).

    python docs/tables.py             # rewrite every table of README.md, docs/*.md and the archive's index
    python docs/tables.py --check     # exit 1, naming each table that is not what its sources give
    python docs/tables.py --readme benchmarks/results/NEW.json   # the README's benchmark table from another run
                                                                 # (a result file of benchmarks.e2e.throughput)

``tests/test_docs.py`` runs the check, so a table cannot drift from its sources (a changed default in
``EngineConfig``, a new switch in ``hf_paged/envs.py``, an edited result file).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # the checkout, when hf_paged is not installed
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"<!-- table: (?P<spec>[^>]*?) -->\n(?P<body>.*?)<!-- end table -->", re.S)
VERSIONS = ("torch", "transformers", "flash_attn")


# ----------------------------------------------------------------------------------------------------------------
# result files: what they record


def load(name: str) -> dict | list:
    return json.loads((ROOT / name).read_text())


def _first(obj, key: str, depth: int = 0):
    """The first value of ``key`` in a result file (top level, then its rows), or None."""
    if depth > 3:
        return None
    if isinstance(obj, dict):
        if key in obj and not isinstance(obj[key], (dict, list)):
            return obj[key]
        for value in obj.values():
            if isinstance(value, (dict, list)) and (found := _first(value, key, depth + 1)) is not None:
                return found
    elif isinstance(obj, list):
        for value in obj[:8]:
            if (found := _first(value, key, depth + 1)) is not None:
                return found
    return None


def meta(name: str) -> dict:
    """Card, versions and date as the result file records them (None where it does not)."""
    data = load(name)
    card = next((v for k in ("card", "device", "gpu") if (v := _first(data, k)) is not None), None)
    return {"card": card, **{k: _first(data, k) for k in VERSIONS}, "date": _first(data, "date")}


def name_date(name: str) -> str | None:
    found = re.search(r"_(\d{4}-\d\d-\d\d)", Path(name).name)
    return found.group(1) if found else None


def caption(names: list[str], doc: Path, command: str = "") -> str:
    """The line under a table: card, versions, date and the result files, linked from ``doc``."""
    info = meta(names[0])
    versions = ", ".join(f"{k.replace('_', '-')} {info[k]}" for k in VERSIONS if info[k])
    date = info["date"] or name_date(names[0]) or "date not recorded"
    links = ", ".join(f"[`{Path(n).name}`]({os.path.relpath(ROOT / n, doc.parent)})" for n in names)
    parts = [info["card"] or "card not recorded", versions or "versions not recorded", date]
    text = f"_{'; '.join(parts)}. {command}Results: {links}._"
    # a code span is never cut: its spaces are held as NUL while the lines are filled
    text = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), text)
    return textwrap.fill(text, width=116, break_long_words=False, break_on_hyphens=False).replace("\0", " ")


def table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, rule, *rows])


def tok(x: float) -> str:
    return f"{x:,.0f}"


def ms(x: float) -> str:
    return f"{x:.2f}"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


# ----------------------------------------------------------------------------------------------------------------
# renderers: KIND -> function(doc, *sources) -> Markdown

E2E_WORKLOADS = {
    "anchor": "256 requests (the anchor)",
    "min_new": "the anchor, `min_new_tokens=256`",
    "r64": "64 requests",
    "r1024": "1,024 requests",
    "latency": "batch 1, 512-token prompt: ms per output token",
}
E2E_SYSTEMS = {"hf_paged": "hf_paged", "hf_paged_eager_layers": "hf_paged, transformers' eager modules",
               "hf_paged_compiled": "hf_paged, `compile_layers=True, layer_kernels=False`",
               "hf_paged_cublas": "hf_paged, `skinny_linear=False`", "transformers": "transformers {v} CB",
               "transformers_box": "transformers {v} CB (second install)"}


def e2e(doc: Path, name: str) -> str:
    """``benchmarks/e2e/throughput.py`` rows: output tok/s (ms per token for latency) per system, and hf_paged's
    ratio to transformers' continuous batching (the baseline, in the same run); a run with ``--calls`` adds a row of
    the later calls' median rate under each workload's first call."""
    rows = [r for r in load(name)["rows"] if r.get("status") == "ok" and r["workload"] in E2E_WORKLOADS]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    first = {(r["system"], r["workload"]): r["ms_per_token"] if r["workload"] == "latency" else r["tok_per_s"]
             for r in rows}
    later = {(r["system"], r["workload"]): r["later_tok_per_s"] for r in rows if r.get("later_tok_per_s")}
    version = {r["system"]: r.get("transformers", "") for r in rows}
    header = ["workload"] + [E2E_SYSTEMS.get(s, s).format(v=version[s]) for s in systems]
    baseline = "transformers" in systems and "hf_paged" in systems
    if baseline:
        header.append("hf_paged vs transformers")
    out = []
    for workload, name_of_row in E2E_WORKLOADS.items():
        for label, value in ((name_of_row, first), (f"{name_of_row}, later calls", later)):
            if not any(w == workload for _, w in value):
                continue
            latency = workload == "latency"
            cells = [label] + [(f"{ms(value[s, workload])} ms" if latency else f"{tok(value[s, workload])} tok/s")
                               if (s, workload) in value else "-" for s in systems]
            if baseline and ("hf_paged", workload) in value and ("transformers", workload) in value:
                a, b = value["hf_paged", workload], value["transformers", workload]
                cells.append(ratio(b / a) + " faster" if latency else ratio(a / b))
            elif baseline:
                cells.append("-")
            out.append(cells)
    return table(header, out) + "\n\n" + caption([name], doc, "`python -m benchmarks.e2e.throughput`. ")


def sweep(doc: Path, name: str) -> str:
    """``benchmarks/e2e/throughput.py --sweep``: hf_paged alone over a grid of ``max_batch_tokens`` x
    ``max_num_seqs`` and its automatic choice of that run, per workload; the row of today's automatic point on CUDA
    (``RULES["cuda"]`` of ``hf_paged/engine/_sizing.py``) in bold."""
    from hf_paged.engine._sizing import RULES

    rows = [r for r in load(name)["rows"] if r.get("status") == "ok" and r["workload"] in E2E_WORKLOADS]
    workloads = [w for w in E2E_WORKLOADS if any(r["workload"] == w for r in rows)]
    # batch 1: the spacing of the per-token timestamps where the run has them (the figure the sweep judges by)
    value = {(r["label"], r["workload"]): (r.get("ms_per_token_timestamps") or r["ms_per_token"])
             if r["workload"] == "latency" else r["tok_per_s"] for r in rows}
    rule = f"{RULES['cuda'].max_batch_tokens}x{RULES['cuda'].max_num_seqs}"
    out = []
    for r in rows:
        if r["workload"] != workloads[0]:
            continue
        budget = r["budget"]
        if budget["max_batch_tokens"] is None:
            chose = re.search(r"max_batch_tokens=(\d+).*?max_num_seqs=(\d+)", r.get("engine") or "")
            first = E2E_WORKLOADS[workloads[0]].split(" (")[0]
            label = (f"automatic in that run ({chose[1]} x {chose[2]} on the {first})" if chose
                     else "automatic in that run")
        else:
            label = f"{budget['max_batch_tokens']} x {budget['max_requests']}"
        cells = [(f"{ms(value[r['label'], w])} ms" if w == "latency" else tok(value[r["label"], w]))
                 if (r["label"], w) in value else "-" for w in workloads]
        if label.replace(" ", "") == rule:
            label, cells = f"**{label}** (automatic on CUDA)", [f"**{c}**" for c in cells]
        out.append([label] + cells)
    header = ["max_batch_tokens x max_num_seqs"] + [
        "batch 1: ms per output token" if w == "latency" else f"{E2E_WORKLOADS[w]}: tok/s" for w in workloads]
    return table(header, out) + "\n\n" + caption([name], doc, "`python -m benchmarks.e2e.throughput --sweep`. ")


COLD_SYSTEMS = {"generate_batch": "`generate_batch`", "generate_batch_eager": "`generate_batch`, layers eager",
                "generate_batch_background": "`generate_batch`, compile in the background",
                "engine": "`Engine`, `stream`",
                "generate": "`generate` + `optimize_generate`, batch 1", "serve": "`hf-paged serve`",
                "serve_background": "`hf-paged serve --compile-layers background`",
                "transformers": "transformers' `generate_batch`"}


def cold_start(doc: Path, name: str) -> str:
    """``benchmarks/e2e/cold_start.py``: seconds from the process's spawn to import, load, first token and steady state,
    in a first process (empty caches) and a second one, per system; the same call again; dynamo's compile time."""
    from benchmarks.e2e.cold_start import medians

    data = load(name)
    keys = ("import", "load", "ready", "first_token", "steady", "second_call", "dynamo_s")
    out = [[COLD_SYSTEMS.get(r["system"], r["system"]), r["process"]]
           + ["-" if r.get(k) is None else f"{r[k]:.2f}" for k in keys]
           for r in medians(data["rows"]) if r.get("status") == "ok" and r["process"] in ("first", "second", "portable")]
    header = ["system", "process", "import", "load", "ready", "first token", "steady", "the call again", "dynamo"]
    work = data.get("meta", {})
    line = (f"{work['prompts']} prompts of the anchor, {work['new_tokens']} new tokens each, seconds. "
            if "prompts" in work and "new_tokens" in work else "seconds. ")
    rounds = max((r.get("round", 0) + 1 for r in data["rows"]), default=1)
    line += f"Medians of {rounds} rounds, the systems' order reversed every other round. " if rounds > 1 else ""
    return table(header, out, "llrrrrrrr") + "\n\n" + caption(
        [name], doc, line + "`python -m benchmarks.e2e.cold_start`. ")


def engine_start(doc: Path, name: str) -> str:
    """``benchmarks/engine/start.py``: per variant (decode-graph sizes) and process kind, the medians of a kept
    engine's start, its batch-1 decode and the dynamo frames traced by the end of the engine's start."""
    data = load(name)
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in data["rows"]:
        if r.get("status") == "ok":
            groups.setdefault((r["variant"], r["process"]), []).append(r)
    out = []
    for (variant, process), rows in groups.items():
        med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
        spread = (f" ({min(r['engine_s'] for r in rows):.2f}-{max(r['engine_s'] for r in rows):.2f})"
                  if len(rows) > 1 else "")
        out.append([variant, process, str(len(rows)), ", ".join(map(str, rows[0]["sizes"] or [])) or "-",
                    f"{med('engine_s'):.2f}{spread}", f"{med('b1_ms'):.3f}", f"{med('frames_at_start'):.0f}"])
    header = ["variant", "process", "n", "graphs at start", "`Engine(...)`, s (range)", "batch 1, ms per token",
              "dynamo frames"]
    return table(header, out, "llrlrrr") + "\n\n" + caption([name], doc, "`python -m benchmarks.engine.start`. ")


AB_FIGURES = {
    "hf_paged anchor": ("anchor, `generate_batch`, output tok/s", tok),
    "hf_paged latency": ("batch 1, `generate_batch`, ms per output token", ms),
    "anchor, no settings, first call tok/s": ("anchor, no settings, a process's first call, output tok/s", tok),
    "anchor, no settings, later calls tok/s": ("anchor, no settings, its later calls, output tok/s", tok),
    "engine start s, a later process": ("a kept engine's start (`Engine(model)`), a later process, s", ms),
    "engine start, batch 1 ms/token": ("that engine's batch-1 decode, ms per output token", ms),
    "generate optimized B1 ms/step": ("`generate` + `optimize_generate`, batch 1, ms per decode step", ms),
    "generate optimized B64 ms/step": ("`generate` + `optimize_generate`, batch 64, ms per decode step", ms),
    "generate optimized B64 ms/token all-in": ("`generate` + `optimize_generate`, batch 64, ms per token, whole call",
                                               ms),
}


def ab(doc: Path, name: str) -> str:
    """``benchmarks/e2e/ab_checkouts.py``: each figure's median over the rounds, per checkout, and new / old."""
    data = load(name)
    figures: dict[tuple[str, str], list[float]] = {}
    for r in data["rounds"]:
        for key, x in r["figures"].items():
            figures.setdefault((key, r["checkout"]), []).append(x)
    rounds = len({r["round"] for r in data["rounds"]})
    out = []
    for key, (label, fmt) in AB_FIGURES.items():
        if (key, "old") in figures and (key, "new") in figures:
            old, new = statistics.median(figures[key, "old"]), statistics.median(figures[key, "new"])
            out.append([label, fmt(old), fmt(new), f"{new / old:.2f}"])
    head = table(["figure (median of %d round%s)" % (rounds, "s" * (rounds > 1)), "code before", "code after",
                  "after / before"], out)
    return head + "\n\n" + caption([name], doc, "`python -m benchmarks.e2e.ab_checkouts`. ")


def roofline(doc: Path, *names: str) -> str:
    """``benchmarks.e2e.throughput --workloads roofline``: GPU time per phase of each file's run (in the files'
    order), the phase's roofline (the last file's rates) and the last run's efficiency; then the total, host gaps and
    tok/s."""
    rows = [next(r for r in load(n)["rows"] if r["workload"] == "roofline") for n in names]
    last = rows[-1]
    out = []
    for i, phase in enumerate(last["phases"]):
        times = [ms(r["phases"][i]["gpu_ms"]) if r["phases"][i]["phase"] == phase["phase"] else "-" for r in rows]
        line = "-" if phase["roofline_ms"] is None else ms(phase["roofline_ms"])
        eff = "-" if phase["efficiency"] is None else f"{phase['efficiency']:.0%}"
        out.append([phase["phase"], *times, line, eff])
    out.append(["**total kernel time**", *(ms(r["total"]["gpu_ms"]) for r in rows), ms(last["total"]["roofline_ms"]),
                f"{last['total']['efficiency']:.0%}"])
    out.append(["host gaps", *(ms(r["host_gaps"]["gpu_ms"]) for r in rows), "0.00", "-"])
    out.append(["tok/s, profiled run", *(tok(r["profiled_tok_per_s"]) for r in rows), "-", "-"])
    labels = [f"GPU ms, file {i}" if len(names) > 1 else "GPU ms" for i in range(1, len(names) + 1)]
    head = table(["phase", *labels, "roofline ms", "efficiency"], out)
    rates = (f"Copy rate {last['copy_bytes_per_s'] / 1e12:.2f} TB/s and matrix rate "
             f"{last['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, measured in the last run. ")
    return head + "\n\n" + caption(
        list(names), doc, rates + "`python -m benchmarks.e2e.throughput --workloads roofline`. ")


def tp(doc: Path, *names: str) -> str:
    """``benchmarks/parallel/tensor_parallel.py``: each multi-GPU row against the file's one-GPU row of the same system.
    hf_paged rows: the steady decode step at batch 64; transformers rows: its decode rate by subtracting a short
    call (1 or 2 new tokens, as the row says) from a 256-token call (the only measure the benchmark has for it)."""
    out = []
    for name in names:
        rows = [r for r in load(name)["rows"] if r.get("status") == "ok"]
        for r in rows:
            if r["gpus"] == 1:
                continue
            base = "transformers" if r["system"] == "transformers" else "hf_paged"
            one = next((o for o in rows if o["gpus"] == 1 and o["system"] == base), None)
            if base == "transformers":
                rate, one_rate, step = r["decode_tok_per_s"], one and one["decode_tok_per_s"], "-"
                short = r.get("decode", {}).get("short_call_new_tokens", 1)  # (files before the field: 1)
                method = f"256-token call minus {short}-token call"
            else:
                rate, one_rate, step = r["steady"]["tok_per_s"], one and one["steady"]["tok_per_s"], ms(
                    r["steady"]["ms_per_step"])
                method = "steady step"
            one_step = ms(one["steady"]["ms_per_step"]) if one and "steady" in one else "-"
            latency = "-"
            if r.get("ms_per_token") and one and one.get("ms_per_token"):
                latency = f"{ms(one['ms_per_token'])} / {ms(r['ms_per_token'])}"
            call = f" (call {r['call']}; 1 GPU: call {one['call']})" if one and "call" in r else ""
            out.append([r["system"] + call, str(r["gpus"]), method, one_step, step, tok(rate),
                        ratio(rate / one_rate) if one_rate else "-", latency, f"`{Path(name).name}`"])
    header = ["system", "GPUs", "batch 64 measured by", "1 GPU ms/step", "ms/step", "tok/s", "vs 1 GPU",
              "batch 1 ms/token, 1 GPU / these", "file"]
    return table(header, out, "lrlrrrrrl") + "\n\n" + caption(
        list(names), doc, "`python -m benchmarks.parallel.tensor_parallel`. ")


def dp(doc: Path, name: str) -> str:
    """``benchmarks/parallel/data_parallel.py``: output tok/s per process count."""
    rows = [r for r in load(name)["rows"] if r.get("status") == "ok"]
    one = next(r["tok_per_s"] for r in rows if r["processes"] == 1)
    out = [[str(r["processes"]), tok(r["tok_per_s"]), ratio(r["tok_per_s"] / one)] for r in rows]
    return table(["processes (one GPU each)", "output tok/s", "vs 1"], out) + "\n\n" + caption(
        [name], doc, "`python -m benchmarks.parallel.data_parallel`. ")


def serve(doc: Path, name: str) -> str:
    """``benchmarks/serving/compare.py``: both servers under the same streaming load."""
    data = load(name)
    labels = {"hf_paged": "`hf-paged serve`", "transformers": "`transformers serve --continuous-batching`"}
    out = [[labels.get(r["system"], r["system"]), tok(r["output_tok_per_s"]), f"{r['ttft_p50_ms']:.0f} ms",
            f"{r['ttft_p99_ms']:.0f} ms", f"{r['tpot_p50_ms']:.1f} ms", f"{r['tpot_p99_ms']:.1f} ms"]
           for r in data["rows"] if r.get("status") == "ok"]
    load_line = (f"{data['requests']} requests ({data['prompt_tokens']:,} prompt tokens), {data['clients']} "
                 f"streaming clients, {data['max_tokens']} new tokens each. ")
    return table(["server", "output tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"], out) + "\n\n" + \
        caption([name], doc, load_line + "`python -m benchmarks.serving.compare`. ")


GENERATE_SYSTEMS = {"static": '`cache_implementation="static"`', "hf_paged_compiled": "hf_paged, compiled",
                    "hf_paged_optimized": "hf_paged, compiled + `optimize_generate`", "sdpa": "sdpa",
                    "flash_attention_2": "flash_attention_2", "hf_paged": "hf_paged, eager"}


def generate(doc: Path, name: str) -> str:
    """``benchmarks/generate/latency.py``: ms per decode step of ``model.generate`` per batch and system (the first
    call, compile included, in seconds)."""
    rows = [r for r in load(name)["rows"] if r.get("status") == "ok"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    all_in = all("ms_per_token_all_in" in r for r in rows)  # (files written before the field: steps only)
    cell = {(r["system"], r["batch"]): f"{r['ms_per_step']:.2f}"
            + (f" / {r['ms_per_token_all_in']:.2f}" if all_in else "") + f" ({r['first_call_s']:.1f} s)" for r in rows}
    batches = sorted({r["batch"] for r in rows})
    out = [[str(b)] + [cell.get((s, b), "-") for s in systems] for b in batches]
    what = "ms per decode step / ms per token of the whole call" if all_in else "ms per decode step"
    return table(["batch"] + [GENERATE_SYSTEMS.get(s, s) for s in systems], out) + "\n\n" + caption(
        [name], doc, f"`python -m benchmarks.generate.latency`, {what} (first call with its compile). ")


def decode(doc: Path, name: str) -> str:
    """``hf-paged bench kernels`` decode rows at head_dim 128: us (% of the copy bandwidth measured in the run)."""
    data = load(name)
    rows = [r for r in data["rows"] if r["head_dim"] == 128 and r["ctx"] and not r["window"] and not r["softcap"]]
    cell = {(r["batch"], r["ctx"], r["impl"]): r for r in rows}
    shapes = list(dict.fromkeys((r["batch"], r["ctx"]) for r in rows))
    impls = [i for i in ("ours-bs16", "ours-nopdl-bs16", "ours-fp8-bs16", "flash-bs256")
             if any(k[2] == i for k in cell)]
    labels = {"ours-bs16": "cuda, block 16", "ours-nopdl-bs16": "cuda, block 16, no PDL",
              "ours-fp8-bs16": "cuda, fp8 cache, block 16", "flash-bs256": "flash-attn, block 256"}
    out = []
    for b, c in shapes:
        cells = [f"{b} x {c}"]
        for i in impls:
            r = cell.get((b, c, i))
            cells.append("-" if r is None else f"{r['us']:.1f} ({r['pct_copy']:.0f}%)" if i != "ours-fp8-bs16"
                         else f"{r['us']:.1f}")
        ours, flash = cell.get((b, c, "ours-bs16")), cell.get((b, c, "flash-bs256"))
        cells.append(ratio(flash["us"] / ours["us"]) if ours and flash else "-")
        out.append(cells)
    copy = f"copy bandwidth {data['copy_tbps']:.2f} TB/s. " if "copy_tbps" in data else ""
    return table(["batch x context"] + [labels[i] for i in impls] + ["flash / cuda"], out) + "\n\n" + caption(
        [name], doc, f"`hf-paged bench kernels --only decode --no-sweep --head-dims 128`, us (% of copy); {copy}")


def prefill(doc: Path, *names: str) -> str:
    """``hf-paged bench kernels --only prefill`` rows: TFLOP/s of the mma and wgmma kernels and flash-attn's varlen
    kernel, and the cuda backend's default on Hopper (its routing table) against flash-attn."""
    from hf_paged.attention.backends._cuda import _WGMMA_BY_HEAD_DIM

    impl_of = {"mma": "ours-bs16", "wgmma": "ours-wgmma-bs16", "wgmma-serial": "ours-wgmma-serial-bs16"}
    chosen_file: dict[tuple[int, str], dict] = {}  # a row's figures all come from the last file with wgmma rows
    for name in names:
        cells: dict[tuple[int, str], dict] = {}
        for r in load(name)["rows"]:
            if not r["window"] and not r["softcap"]:
                cells.setdefault((r["head_dim"], r["shape"]), {})[r["impl"]] = r["tflops"]
        chosen_file.update({key: row for key, row in cells.items() if "ours-wgmma-bs16" in row})
    out = []
    for (d, shape), row in sorted(chosen_file.items(), key=lambda kv: kv[0][0]):
        default = _WGMMA_BY_HEAD_DIM.get(d, "mma")
        flash, chosen = row.get("flash-varlen"), row.get(impl_of[default])
        figures = [row.get(i) for i in ("ours-bs16", "ours-wgmma-bs16", "ours-wgmma-serial-bs16", "flash-varlen")]
        out.append([str(d), shape] + [f"{x:.1f}" if x else "-" for x in figures]
                   + [default, f"{chosen / flash:.2f}" if chosen and flash else "-"])
    header = ["head_dim", "shape", "mma", "wgmma", "wgmma serial", "flash-attn varlen", "default on Hopper",
              "default / flash"]
    return table(header, out, "rlrrrrlr") + "\n\n" + caption(
        list(names), doc, "`hf-paged bench kernels --only prefill --no-sweep`, causal, bf16, 32 query / 8 KV heads, "
        "block 16, TFLOP/s. ")


def allreduce(doc: Path, name: str) -> str:
    """``benchmarks.parallel.all_reduce_latency``: us per all-reduce of a decode step's size, 64 calls per graph."""
    data = load(name)
    methods = {"nccl": "NCCL", "torch-one-shot": "torch one-shot", "hf_paged": "hf_paged `peer_sum`",
               "hf_paged+add": "+ residual add", "hf_paged+add+norm": "+ add and RMSNorm"}
    cell = {(t["kib"], t["method"]): t["us_per_call"] for t in data["timings"]}
    present = [m for m in methods if any(k[1] == m for k in cell)]
    out = [[f"{kib} KiB"] + [f"{cell[kib, m]:.2f}" if (kib, m) in cell else "-" for m in present]
           for kib in sorted({k for k, _ in cell})]
    return table(["bf16 size"] + [methods[m] for m in present], out) + "\n\n" + caption(
        [name], doc,
        f"{data.get('world_size', 2)} GPUs, `torchrun -m benchmarks.parallel.all_reduce_latency`, us per call. ")


def envs_table(doc: Path) -> str:
    """Every ``HF_PAGED_*`` switch, from the table in ``hf_paged/envs.py``'s docstring (the one source)."""
    from hf_paged import envs

    lines = envs.__doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    spans = [(m.start(), m.end()) for m in re.finditer(r"=+", lines[rules[0]])]
    rows: list[list[str]] = []
    for line in lines[rules[1] + 1:rules[2]]:
        cols = [line[a:b if i + 1 < len(spans) else None].strip() for i, (a, b) in enumerate(spans)]
        if cols[0]:
            rows.append(cols)
        else:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cols)]
    out = [[re.sub(r"``([^`]+)``", r"`\1`", c) for c in row] for row in rows]
    return table(["variable", "values (default first)", "what it does"], out, "lll")


def engine_config(doc: Path) -> str:
    """``EngineConfig``'s fields: default, the ``hf-paged`` flag made from it, and ``Engine``'s docstring line."""
    from hf_paged import Engine, EngineConfig

    args = _docstring_args(inspect.getdoc(Engine) or "")
    out = []
    for f in dataclasses.fields(EngineConfig):
        flag = f"`--{f.name.replace('_', '-')}`" if f.metadata.get("help") else "-"
        out.append([f"`{f.name}`", f"`{f.default!r}`", flag, args.get(f.name, "")])
    return table(["field", "default", "`hf-paged` flag", "what it does (`Engine`'s docstring)"], out, "llll")


def _docstring_args(doc: str) -> dict[str, str]:
    """Each entry of a Google-style ``Args:`` section, shortened to its first clause and its ``None:`` sentence."""
    text = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    entries = re.findall(r"^ {4}(\w+): (.*?)(?=^ {4}\w+:|^\S|\Z)", text, re.M | re.S)
    out = {}
    for name, body in entries:
        clauses = _clauses(" ".join(body.split()))
        kept = clauses[:1] + [c for c in clauses[1:] if c.startswith("None:")]
        out[name] = re.sub(r"``([^`]+)``", r"`\1`", "; ".join(kept))
    return out


def _clauses(text: str) -> list[str]:
    """``text`` cut at each ". " or "; " outside parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ".;" and text[i + 1:i + 2] in (" ", "") and not text[max(0, i - 3):i].endswith("e.g"):
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip().rstrip("."))
    return [c for c in out if c]


def decode_gemm(doc: Path, name: str) -> str:
    """``benchmarks.kernels.decode_gemm``: a decode step's linear products per row count, us (% of their roofline) per
    system, and the step's sum."""
    data = load(name)
    labels = {"cublas": "cuBLAS", "cublaslt": "cuBLASLt", "splitk2": "split-K 2", "splitk4": "split-K 4",
              "autotuned": "inductor max-autotune"}
    systems = [s for s in labels if any(f"{s}_us" in r for r in data["rows"])]

    def cell(r: dict, s: str, digits: int = 1) -> str:
        us = r.get(f"{s}_us")
        return "-" if us is None else f"{us:.{digits}f} ({100 * r['roofline_us'] / us:.0f}%)"

    out = [[f"{r['product']} ({r['n']} x {r['k']})", str(r["rows"]), f"{r['roofline_us']:.1f}"]
           + [cell(r, s) for s in systems] for r in data["rows"]]
    out += [[f"one decode step of {t['model']}", str(t["rows"]), f"{t['roofline_us']:.0f}"]
            + [cell(t, s, 0) for s in systems] for t in data.get("step_totals", [])]
    rates = data["meta"]
    line = (f"us (% of the roofline); copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matrix "
            f"{rates['matrix_flops_per_s'] / 1e12:.0f} TFLOP/s in the same run. "
            "`python -m benchmarks.kernels.decode_gemm`. ")
    return table(["product (N x K)", "rows", "roofline us"] + [labels[s] for s in systems], out) + "\n\n" + caption(
        [name], doc, line)


def results(doc: Path, folder: str = "") -> str:
    """Every result file directly under ``benchmarks/results/`` (``folder`` "archive": under its ``archive/``), with
    what it records of card, versions and date."""
    out = []
    for path in sorted((RESULTS / folder).glob("*.json")):
        info = meta(str(path.relative_to(ROOT)))
        date = info["date"] or f"{name_date(path.name) or '?'} (file name)"
        cells = [info["card"] or "not recorded"] + [info[k] or "not recorded" for k in VERSIONS] + [date]
        out.append([f"[`{path.name}`]({os.path.relpath(path, doc.parent)})"] + cells)
    return table(["file", "card", "torch", "transformers", "flash-attn", "date"], out, "llllll")


RENDERERS = {"e2e": e2e, "sweep": sweep, "cold-start": cold_start, "engine-start": engine_start, "ab": ab,
             "roofline": roofline, "tp": tp, "dp": dp, "serve": serve, "generate": generate, "decode": decode,
             "decode-gemm": decode_gemm,
             "prefill": prefill, "allreduce": allreduce,
             "envs": envs_table, "engine-config": engine_config, "results": results}


# ----------------------------------------------------------------------------------------------------------------
# the files


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), RESULTS / "archive" / "README.md"]


def render(doc: Path, spec: str) -> str:
    kind, *sources = spec.split()
    if kind not in RENDERERS:
        raise ValueError(f"{doc.relative_to(ROOT)}: unknown table kind {kind!r} (one of {', '.join(RENDERERS)})")
    return RENDERERS[kind](doc, *sources).rstrip() + "\n"


def regenerate(doc: Path, text: str) -> str:
    return MARKER.sub(lambda m: f"<!-- table: {m['spec']} -->\n{render(doc, m['spec'])}<!-- end table -->", text)


def specs(doc: Path) -> list[str]:
    return [m["spec"] for m in MARKER.finditer(doc.read_text())]


def stale() -> list[str]:
    """``file: spec`` of every table that is not what its sources give."""
    out = []
    for doc in documents():
        text = doc.read_text()
        for m in MARKER.finditer(text):
            if m["body"] != render(doc, m["spec"]):
                out.append(f"{doc.relative_to(ROOT)}: {m['spec']}")
    return out


def point_readme(name: str) -> None:
    """Make the README's benchmark table (the ``e2e`` one) come from ``name``."""
    path = Path(name).resolve()
    if not path.is_file():
        raise SystemExit(f"{name}: no such file")
    rel = path.relative_to(ROOT).as_posix()
    readme = ROOT / "README.md"
    text, count = re.subn(r"<!-- table: e2e \S+ -->", f"<!-- table: e2e {rel} -->", readme.read_text())
    if count != 1:
        raise SystemExit("README.md has no <!-- table: e2e FILE --> marker")
    readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which tables differ from their sources")
    parser.add_argument("--readme", metavar="RESULTS_JSON", help="point the README's benchmark table at this file")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale()
        for line in differ:
            print(f"stale: {line}")
        if differ:
            print("run: python docs/tables.py")
        return 1 if differ else 0
    if args.readme:
        point_readme(args.readme)
    for doc in documents():
        text = doc.read_text()
        new = regenerate(doc, text)
        if new != text:
            doc.write_text(new)
            print(f"rewrote {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
