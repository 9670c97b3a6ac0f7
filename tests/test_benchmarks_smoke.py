"""Every benchmark's smoke mode runs on the CPU, and the pieces measure what they say: every run does all its work,
the decode profile is pure decode, merged files keep one row per (system, workload), the busy-time union matches a
brute-force count.

These tests check the structure of what a run writes (rows, counts, which fields are set, timestamps in order), never
how fast it was: on a loaded CPU a time, or a difference or ratio of times, says nothing (timing is the benchmarks'
job)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import runpy
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import ROOT
from benchmarks.e2e import ab_checkouts, anchor_repeat, cold_start
from benchmarks.e2e import plot as plot_e2e
from benchmarks.e2e import throughput as e2e_throughput
from benchmarks.e2e.decode_profile import _covered_us
from benchmarks.e2e.other_transformers import shadowed_transformers_env
from benchmarks.e2e.report import read_rows
from benchmarks.engine import graph_capture, step_host_parts
from benchmarks.engine import overhead as engine_overhead
from benchmarks.engine import start as engine_start
from benchmarks.engine import weight_check
from benchmarks.generate import host_overhead as generate_host_overhead
from benchmarks.generate import latency as generate_latency
from benchmarks.kernels import argmax as argmax_bench
from benchmarks.kernels import decode_gemm


def _run(main, argv: list[str]) -> str:
    """``main(argv)`` in this process; its stdout. The smoke mode sets torch's thread count: restored after."""
    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(argv)
    finally:
        torch.set_num_threads(threads)
    return out.getvalue()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("e2e") / "smoke.json"
    out = _run(e2e_throughput.main, ["--smoke", "--systems", "hf_paged,transformers",
                                     "--workloads", "anchor,latency,profile", "--json", str(path)])
    return path, out


@pytest.mark.slow
def test_e2e_smoke_prints_the_plan_first_and_the_table_last(smoke):
    lines = smoke[1].splitlines()
    assert "runs, in order: hf_paged: anchor, latency, profile; transformers: anchor, latency" in lines[0]
    assert any("hf_paged / transformers" in line for line in lines[-4:])


@pytest.mark.slow
def test_e2e_smoke_every_run_does_all_its_work(smoke):
    rows = {(r["system"], r["workload"]): r for r in json.loads(smoke[0].read_text())["rows"]}
    assert set(rows) == {("hf_paged", "anchor"), ("hf_paged", "latency"), ("hf_paged", "profile"),
                         ("transformers", "anchor"), ("transformers", "latency")}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["tokens"] == row["expected_tokens"] > 0
        assert row["budget"] == {"max_batch_tokens": 256, "max_requests": 16}
    assert rows["hf_paged", "anchor"]["tokens"] == rows["transformers", "anchor"]["tokens"] == 4 * 4
    assert rows["hf_paged", "latency"]["tokens"] == 2  # 4 new tokens less the 2 of the shorter call
    assert rows["hf_paged", "latency"]["short_call_new_tokens"] == 2
    anchor = rows["hf_paged", "anchor"]
    assert anchor["tok_per_s"] == pytest.approx(anchor["tokens"] / anchor["seconds"])
    for system in ("hf_paged", "transformers"):  # one list per timed call
        pauses = rows[system, "anchor"]["full_collections_s"]
        assert len(pauses) == 1 and all(s > 0 for s in pauses[0])


def test_full_collections_records_only_full_collections_inside_its_block():
    import gc

    from benchmarks.e2e.systems import FullCollections

    gc.collect()
    with FullCollections() as full:
        gc.collect(0)
        gc.collect(1)
        assert full.seconds == []
        gc.collect()
        gc.collect(2)
    gc.collect()
    assert len(full.seconds) == 2 and all(s > 0 for s in full.seconds)


@pytest.mark.slow
def test_e2e_smoke_profile_is_steady_decode(smoke):
    row = next(r for r in json.loads(smoke[0].read_text())["rows"] if r["workload"] == "profile")
    assert row["pure_decode"] and row["batch"] == 4 and row["tokens"] == row["steps"] * row["batch"]
    assert 0 < row["busy_fraction"] <= row["busy_fraction_with_copies"] <= 1.0 + 1e-6
    assert row["ms_per_step"] == pytest.approx(1e3 * row["seconds"] / row["steps"])


@pytest.mark.slow
def test_merge_keeps_one_row_per_label_and_workload_and_plots(smoke, tmp_path):
    merged = tmp_path / "merged.json"
    out = _run(e2e_throughput.main, ["--merge", str(smoke[0]), str(smoke[0]), "--json", str(merged)])
    assert len(read_rows([merged])) == len(read_rows([smoke[0]])) == 5
    assert "latency" in out and "steady decode, hf_paged" in out
    pytest.importorskip("matplotlib")
    plot_e2e.plot(read_rows([merged]), str(tmp_path / "e2e.png"))
    assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"


def test_busy_time_is_the_union_of_intervals():
    rng = random.Random(0)
    for _ in range(50):
        intervals = [(s, s + rng.randint(0, 30)) for s in (rng.randint(0, 200) for _ in range(rng.randint(0, 12)))]
        covered = {t for start, end in intervals for t in range(start, end)}
        assert _covered_us(intervals) == len(covered)


def test_no_shadowed_transformers_without_a_pythonpath_entry(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "")
    env, reason = shadowed_transformers_env()
    assert env is None and "not imported from a PYTHONPATH entry" in reason


def test_engine_overhead_smoke():
    out = _run(engine_overhead.main, ["--requests", "8", "--context", "100", "--steps", "5",
                                      "--threads", str(torch.get_num_threads())])
    assert "8 running requests" in out and "engine overhead per decode step: median" in out


@pytest.mark.slow
def test_weight_check_smoke_times_every_case_on_one_kept_engine():
    results = {}
    _run(lambda argv: results.update(weight_check.main(argv)), ["--smoke", "--threads", "1"])
    cases = [f"{case}, {how}: call s" for case in ("unchanged", "after a step") for how in ("check", "reset")]
    assert set(results) == {"check_weights us", "version sum us", *cases} and all(v > 0 for v in results.values())


def test_engine_overhead_with_min_new_tokens_keeps_every_request_running():
    """With --min-new-tokens the stub's top token is the EOS on every row: only the sampler's EOS mask keeps the
    requests running (the benchmark raises when one finished)."""
    out = _run(engine_overhead.main, ["--requests", "4", "--context", "60", "--steps", "4", "--vocab", "512",
                                      "--min-new-tokens", "1000"])
    assert "4 running requests" in out and "min_new_tokens 1000" in out


def test_engine_overhead_reports_the_stepping_threads_cpu_time():
    out = _run(engine_overhead.main, ["--requests", "4", "--context", "60", "--steps", "4"])
    line = next(l for l in out.splitlines() if l.startswith("CPU time of the stepping thread per step: median"))
    assert float(line.split("median ")[1].split(" ms")[0]) > 0


def test_step_host_parts_times_the_parts_and_puts_them_back():
    """The parts a step calls are timed (the eager path's plan and forward on the CPU), and the engine's classes are
    as before once it returns."""
    from hf_paged.engine import _scheduler as scheduler
    from hf_paged.runner import _model_runner as model_runner

    before = (scheduler.Scheduler.__dict__["schedule"], model_runner.plan_step)
    out = _run(step_host_parts.main, ["--requests", "4", "--context", "60", "--steps", "4", "--model", "stub"])
    parts = {l.split()[0]: float(l.split()[1]) for l in out.splitlines() if l.endswith("ms per step")}
    assert {"Scheduler.schedule", "plan_step", "ModelRunner.forward", "EngineCore._commit"} <= set(parts), out
    assert all(ms > 0 for ms in parts.values()), parts
    assert (scheduler.Scheduler.__dict__["schedule"], model_runner.plan_step) == before


def test_stub_model_keeps_rows_like_a_causal_lm():
    stub = engine_overhead.StubModel(vocab=32, max_rows=16)
    ids = torch.zeros(1, 10, dtype=torch.long)
    assert stub(ids, logits_to_keep=torch.tensor([2, 5, 9])).logits.shape == (1, 3, 32)
    assert stub(ids, logits_to_keep=0).logits.shape == (1, 10, 32)
    assert stub(ids, logits_to_keep=1).logits.shape == (1, 1, 32)


@pytest.mark.slow
def test_generate_latency_fresh_cache_builds_a_cache_per_call(tmp_path, monkeypatch):
    """``--fresh-cache``: every call of a paged system gets a new cache (one kept cache otherwise), same tokens."""
    import hf_paged

    built = []

    class Counted(hf_paged.PagedAttentionCache):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(hf_paged, "PagedAttentionCache", Counted)
    runs = {}
    for fresh in (False, True):
        built.clear()
        path = tmp_path / f"latency_{fresh}.json"
        _run(generate_latency.main, ["--smoke", "--batches", "2", "--systems", "hf_paged,hf_paged_compiled",
                                     "--repeats", "1", "--json", str(path)] + ["--fresh-cache"] * fresh)
        data = json.loads(path.read_text())
        assert data["settings"]["fresh_cache"] == str(fresh)
        assert all(r["status"] == "ok" and r["tokens_match"] == 2 for r in data["rows"]), data["rows"]
        runs[fresh] = len(built)
    assert runs[False] == 2  # one kept cache per system
    assert runs[True] >= 2 * 3  # each system's calls: the first, then one of each length


def test_generate_latency_smoke(tmp_path):
    """Every system of the plain-generate benchmark runs (flash-attn's skips on the CPU), the compiled ones compile
    (one graph for the decode step) and every system gives hf_paged eager's tokens on the tiny float32 model."""
    path = tmp_path / "latency.json"
    out = _run(generate_latency.main, ["--smoke", "--batches", "2", "--json", str(path)])
    rows = {r["system"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == set(generate_latency.SYSTEMS)
    assert rows["flash_attention_2"]["status"].startswith("skipped")
    assert rows["hf_paged_compiled_skinny"]["status"].startswith("skipped")  # CUDA only
    for name in ("sdpa", "hf_paged", "hf_paged_compiled", "static", "hf_paged_optimized"):
        row = rows[name]
        # (ms_per_step is a difference of two walls: on a loaded 2-core CPU with 6 tokens and one repeat its sign is
        # noise, so only that it was measured is checked here; warm_call_s is one wall)
        assert row["status"] == "ok" and math.isfinite(row["ms_per_step"]) and row["warm_call_s"] > 0, row
        assert row["ms_per_token_all_in"] == pytest.approx(row["warm_call_s"] / 6 * 1e3, abs=0.1), row  # (rounded)
        assert row["one_token_call_s"] > 0, row
        assert row["tokens_match"] == 2, row
        assert row["card"].startswith("CPU") and row["torch"] == torch.__version__ and row["date"], row
        assert row["hf_paged_commit"] is None or row["hf_paged_commit"][:7].isalnum(), row
    assert rows["hf_paged_compiled"]["graphs"] == 1 and rows["static"]["graphs"] >= 1
    assert rows["hf_paged_optimized"]["graphs"] == 1
    assert "| 2 |" in out.splitlines()[-4] and "[5/7] static, batch 2" in out
    tables = runpy.run_path(str(ROOT / "docs" / "tables.py"), run_name="docs_tables")
    text = tables["generate"](ROOT / "docs" / "benchmarks.md", str(path))
    sdpa = rows["sdpa"]
    assert f"| {sdpa['ms_per_step']:.2f} / {sdpa['ms_per_token_all_in']:.2f} ({sdpa['first_call_s']:.1f} s) |" in text
    assert "ms per decode step / ms per token of the whole call" in " ".join(text.split())  # (the caption wraps)


@pytest.mark.slow
def test_generate_latency_isolated_runs(tmp_path):
    """--isolate: each run in a process of its own, its row and tokens brought back (tokens_match needs them)."""
    path = tmp_path / "latency.json"
    _run(generate_latency.main, ["--smoke", "--batches", "1", "--systems", "hf_paged,hf_paged_optimized",
                                 "--isolate", "--json", str(path)])
    rows = {r["system"]: r for r in json.loads(path.read_text())["rows"]}
    for row in rows.values():
        assert row["status"] == "ok" and row["tokens_match"] == 1 and row["first_call_s"] > 0, row
    assert rows["hf_paged_optimized"]["graphs"] == 1


@pytest.mark.slow
def test_generate_host_overhead_smoke():
    """Every system of the host-overhead benchmark runs every decode step compiled (the script asserts it)."""
    out = _run(generate_host_overhead.main, ["--batch", "2", "--new-tokens", "4", "--repeats", "1", "--rounds", "1"])
    assert "| static |" in out and "| hf_paged_compiled |" in out


@pytest.mark.slow
def test_generate_host_overhead_guard_filter_reaches_dynamo(monkeypatch):
    """--guard-filter: dynamo hands the compile's guards to the filter, which drops those on nn modules; every step
    still runs compiled (the script asserts it) on a model of the --layers asked for."""
    seen = []

    def counting(entries):
        keep = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
        seen.append((len(keep), keep.count(False)))
        return keep

    monkeypatch.setitem(generate_host_overhead.GUARD_FILTERS, "all", counting)
    out = _run(generate_host_overhead.main, ["--batch", "1", "--new-tokens", "4", "--repeats", "1", "--rounds", "1",
                                             "--layers", "3", "--guard-filter", "all"])
    assert "3 layers" in out and "guard filter all" in out
    assert len(seen) >= 2 and all(dropped > 0 for _, dropped in seen), seen


@pytest.mark.slow
def test_generate_step_parts_times_every_compiled_decode_step(monkeypatch):
    """The host split wraps generate's prepare and compiled calls without breaking generate's kwargs check, and
    counts one compiled call per decode step (on the CPU: a tiny model compiled with the eager backend)."""
    from benchmarks.e2e.workloads import SMOKE_SHAPE, load_model
    from benchmarks.generate import step_parts as generate_step_parts

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    settings = generate_latency.parse_args(["--smoke", "--new-tokens", str(generate_step_parts.NEW_TOKENS)])
    model = load_model(SMOKE_SHAPE, "cpu", "hf_paged")
    batch = generate_latency.prompts(1, settings.lengths, SMOKE_SHAPE["vocab_size"], "cpu")
    torch._dynamo.reset()
    call = generate_latency.generate_call("hf_paged_compiled", model, batch, settings)
    prepare_us, compiled_us = generate_step_parts.host_parts(model, call)
    assert prepare_us > 0 and compiled_us > 0
    assert "prepare_inputs_for_generation" not in model.__dict__, "the timing wrappers are removed"


# Each part of the smoke run once in some checkout, latency in both (to pair), in two tests two workers can share
AB_SMOKE_PARTS = {"latency,defaults@new": {("old", "latency"), ("new", "latency"), ("new", "defaults")},
                  "start@old": {("old", "start")}}


@pytest.mark.slow
@pytest.mark.parametrize("parts", sorted(AB_SMOKE_PARTS))
def test_ab_checkouts_smoke_runs_each_part_in_its_checkouts(tmp_path, parts):
    """One round, this checkout as both sides: each part's figures come back for each side it runs in, from a
    process of its own; the medians pair a part run in both and leave one run in a single checkout unpaired."""
    out = tmp_path / "ab.json"
    root = str(ROOT)
    printed = _run(ab_checkouts.main, ["--old", root, "--new", root, "--rounds", "1", "--parts", parts, "--smoke",
                                       "--json", str(out)])
    result = json.loads(out.read_text())
    runs = {(run["checkout"], run["part"]): run["figures"] for run in result["rounds"]}
    assert set(runs) == AB_SMOKE_PARTS[parts]
    assert [run["checkout"] for run in result["rounds"]] == sorted((r["checkout"] for r in result["rounds"]),
                                                                   key=["new", "old"].index)  # --first new
    for side, part in runs:
        figures = runs[side, part]
        if part == "start":  # (batch 1 ms/token is a difference of two walls: only that it was measured)
            assert set(figures) == {"engine start s, a later process", "engine start, batch 1 ms/token"}
            assert figures["engine start s, a later process"] > 0
            assert math.isfinite(figures["engine start, batch 1 ms/token"])
        elif part == "latency":
            assert set(figures) == {"hf_paged latency"} and figures["hf_paged latency"] > 0
        else:
            assert set(figures) == {"anchor, no settings, first call tok/s", "anchor, no settings, later calls tok/s",
                                    "r64, no settings, first call tok/s", "r64, no settings, later calls tok/s",
                                    "latency, no settings, ms/token"}
            assert all(v > 0 for v in figures.values())
    by_figure = ab_checkouts.medians(result)
    for side, part in runs:
        paired = (("old" if side == "new" else "new"), part) in runs
        for name in runs[side, part]:
            assert set(by_figure[name]) == ({"old", "new"} if paired else {side}), name
            line = next(l for l in printed.splitlines() if l.startswith(name))
            assert (" - " in line) != paired, line  # an unpaired figure prints "-" for the other checkout


def test_ab_checkouts_parts_name_a_part_and_optionally_a_checkout():
    assert ab_checkouts.parse_parts("latency, start@new") == [("latency", None), ("start", "new")]
    for bad in ("latency,warp", "start@both", ""):
        with pytest.raises(ValueError, match="--parts"):
            ab_checkouts.parse_parts(bad)


@pytest.mark.slow
def test_data_parallel_smoke_runs_two_processes_and_does_all_the_work(tmp_path):
    from benchmarks.parallel import data_parallel

    out = tmp_path / "dp.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        data_parallel.main(["--smoke", "--gpus", "1,2", "--requests", "128", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    assert all(r["status"] == "ok" and r["tokens"] == r["expected_tokens"] > 0 for r in rows), rows
    assert buf.getvalue().rstrip().splitlines()[-1].split()[0] == "2"  # the table comes last


def test_graph_capture_timeline_splits_each_call_into_its_steps(tmp_path):
    path = tmp_path / "capture.json"
    out = _run(graph_capture.main, ["--smoke", "--reps", "1", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["on_demand", "start", "largest"]
    for r in rows:
        assert r["tokens"] == r["expected_tokens"] == 4 * 4
        assert r["mixed_steps"] >= 1 and r["full_steps"] + r["tail_steps"] >= 3  # 4 new tokens: 3 decode steps
        parts = r["before_first_step_s"] + r["mixed_s"] + r["full_s"] + r["tail_s"]
        assert parts == pytest.approx(r["wall_s"], rel=1e-9)  # every moment of the call is in one part
        assert 0 < r["setup_s"] <= r["before_first_step_s"]  # the set-up is part of what comes before
    assert "padding: CUDA graphs only, skipped on the CPU" in out and "largest" in out.splitlines()[-1]


def test_anchor_repeat_table_pools_runs_by_tag(tmp_path):
    """Rows from a multi-row file and a single-row file; runs named old1/old3 pool into "old", the median is over
    every timed call of the tag, and a row cut before its profile prints dashes."""
    row = lambda tag, rates, ms=None: {"tag": tag, "rates": rates, "median": sorted(rates)[len(rates) // 2],
                                        "decode_ms_per_step": ms, "busy_fraction": None if ms is None else 0.9}
    (tmp_path / "a.json").write_text(json.dumps({"rows": [row("old1", [10.0, 30.0, 20.0], 3.5),
                                                          row("new2", [40.0, 50.0, 60.0], 3.4)]}))
    (tmp_path / "b.json").write_text(json.dumps(row("old3", [100.0, 200.0])))
    out = _run(anchor_repeat.main, ["--table", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert "old: median of 5 runs 30 tok/s" in out
    assert "new: median of 3 runs 50 tok/s" in out
    cut = next(line for line in out.splitlines() if line.startswith("old3"))
    assert cut.split()[-2:] == ["-", "-"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_anchor_repeat_refuses_without_a_gpu():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        anchor_repeat.main(["--reps", "1"])
    assert "needs a CUDA GPU" in err.getvalue()


@pytest.mark.slow
def test_e2e_sweep_runs_every_point_once_and_compares_the_automatic_choice(tmp_path):
    path = tmp_path / "sweep.json"
    out = _run(e2e_throughput.main, ["--sweep", "--smoke", "--json", str(path)])
    data = json.loads(path.read_text())
    rows = data["rows"]
    labels = [f"hf_paged {t}x{n}" for t in (128, 256) for n in (2, 4)] + ["hf_paged auto"]  # automatic last
    assert [(r["workload"], r["label"]) for r in rows] == [(w, label) for w in ("anchor", "r64", "latency")
                                                             for label in labels]
    for row in rows:
        assert row["status"] == "ok" and row["card"] and row["torch"] and row["transformers"], row
        assert row["tokens"] == row["expected_tokens"] > 0
    auto = next(r for r in rows if r["label"] == "hf_paged auto" and r["workload"] == "anchor")
    assert auto["budget"] == {"max_batch_tokens": None, "max_requests": None}
    assert "max_batch_tokens=2048 (automatic" in auto["engine"]  # what the engine picked, from its start-up line
    fixed = next(r for r in rows if r["label"] == "hf_paged 256x2" and r["workload"] == "anchor")
    assert "max_batch_tokens=256 (given)" in fixed["engine"] and "max_num_seqs=2 (given)" in fixed["engine"]
    assert out.count("automatic / best:") == 3 and out.count("<- best") == 3


@pytest.mark.slow
def test_e2e_defaults_gives_hf_paged_no_settings(tmp_path):
    path = tmp_path / "defaults.json"
    _run(e2e_throughput.main, ["--defaults", "--smoke", "--systems", "hf_paged", "--workloads", "anchor",
                               "--json", str(path)])
    (row,) = json.loads(path.read_text())["rows"]
    assert row["status"] == "ok" and row["defaults"] and row["budget"] == {"max_batch_tokens": None,
                                                                           "max_requests": None}
    assert "max_num_seqs=4 (automatic: the call's sequences (4))" in row["engine"]


def test_engine_start_variants_name_the_graph_sizes_they_give():
    assert engine_start.split_variants("auto-1,auto+1") == ["auto-1", "auto+1"]
    assert engine_start.split_variants("1,2,4;auto") == ["1,2,4", "auto"]
    assert engine_start.split_variants("1,2,4") == ["1,2,4"]
    assert engine_start.graph_sizes("auto") is None
    without, with_one = engine_start.graph_sizes("auto-1"), engine_start.graph_sizes("auto+1")
    assert without[0] == 2 and without[-1] == 256 and with_one == [1, *without]
    assert engine_start.graph_sizes("4,1,2") == [1, 2, 4]


@pytest.fixture(scope="session")
def bytecode_dir(tmp_path_factory) -> Path:
    """One bytecode folder for the cold-start and engine-start runs of this process: where Python writes no
    bytecode, the first run compiles the packages there and the later ones find them compiled."""
    return tmp_path_factory.mktemp("bytecode")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["auto", "1,2"])
def test_engine_start_smoke_times_a_first_process(tmp_path, bytecode_dir, variant):
    """Each variant's path (no settings; a size list) in a test of its own, a first process each (a later process
    runs in the A/B smoke's ``start`` part, which calls this script with ``--rounds 1``)."""
    rounds = 0
    path = tmp_path / "start.json"
    out = _run(engine_start.main, ["--smoke", "--rounds", str(rounds), "--variants", variant, "--json", str(path),
                                   "--bytecode-dir", str(bytecode_dir)])
    data = json.loads(path.read_text())
    assert data["meta"]["card"].startswith("CPU") and data["meta"]["smoke"] and data["meta"]["date"]
    assert [(r["variant"], r["process"]) for r in data["rows"]] == [(variant, "first")] + [(variant, "second")] * rounds
    for row in data["rows"]:
        assert row["status"] == "ok", row
        # (b1_ms is a difference of two walls, its sign noise on a loaded CPU: only that it was measured)
        assert 0 < row["import"] <= row["load"] and row["engine_s"] > 0 and math.isfinite(row["b1_ms"]), row
    assert f"| {variant} | {'second' if rounds else 'first'} | 1 |" in out.splitlines()[-1]


# The systems in two tests that two workers can share, each with one system that also runs a second process
COLD_START_GROUPS = {"batch": (("generate_batch", "generate_batch_eager", "transformers"), ("generate_batch",)),
                     "others": (("engine", "generate", "serve"), ("engine",))}


def test_cold_start_groups_cover_every_system():
    assert sorted(s for systems, _ in COLD_START_GROUPS.values() for s in systems) == sorted(cold_start.SYSTEMS)


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(COLD_START_GROUPS))
def test_cold_start_smoke_times_every_system_in_a_first_process(tmp_path, bytecode_dir, group):
    """Every system in a first process; a second process only for the systems of ``--second``."""
    systems, second = COLD_START_GROUPS[group]
    path = tmp_path / "cold.json"
    out = _run(cold_start.main, ["--smoke", "--prompts", "2", "--new-tokens", "2", "--json", str(path),
                                 "--model-dir", str(tmp_path / "model"), "--systems", ",".join(systems),
                                 "--second", ",".join(second), "--bytecode-dir", str(bytecode_dir)])
    data = json.loads(path.read_text())
    assert data["meta"]["card"].startswith("CPU") and data["meta"]["hf_paged"] and data["meta"]["date"]
    assert data["meta"]["bytecode"].startswith("as installed" if not cold_start.writes_no_bytecode()
                                               else "compiled beforehand")
    rows = {(r["system"], r["process"]): r for r in data["rows"]}
    assert set(rows) == {(s, "first") for s in systems} | {(s, "second") for s in second}
    for (system, _), row in rows.items():
        assert row["status"] == "ok", row
        assert 0 < row["first_token"] <= row["steady"] and row["second_call"] > 0, row
        if system in cold_start.SERVERS:
            assert row["ready"] <= row["first_token"]
        else:
            assert 0 < row["import"] <= row["load"] <= row["first_token"], row
            if system == "transformers":  # transformers' baseline runs without hf_paged, on a model it never touched
                assert row["hf_paged_patches"] == 0 and not row["hf_paged_imported"], row
            else:
                assert row["hf_paged_imported"], row
    for system in second:
        assert f"| {system} | second |" in out


def test_cold_start_second_names_systems_that_run():
    args = cold_start.parse_args(["--systems", "engine,serve", "--second", "serve"])
    assert args.second == ["serve"] and cold_start.parse_args(["--systems", "engine"]).second == ["engine"]
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        cold_start.parse_args(["--systems", "engine", "--second", "serve"])
    assert "--second: ['serve'] not in --systems" in err.getvalue()


@pytest.mark.slow
def test_cold_start_compiles_the_childrens_bytecode_where_python_writes_none(tmp_path, monkeypatch):
    """Where this Python writes no bytecode, the children get one folder of compiled bytecode
    (``PYTHONPYCACHEPREFIX``) for the packages they import, the standard library left out; elsewhere nothing
    changes."""
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert not cold_start.writes_no_bytecode()
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert cold_start.writes_no_bytecode()
    assert cold_start._env({})["PYTHONDONTWRITEBYTECODE"] == "1"
    env = cold_start._env({"PYTHONPYCACHEPREFIX": str(tmp_path)})
    assert "PYTHONDONTWRITEBYTECODE" not in env and env["PYTHONPYCACHEPREFIX"] == str(tmp_path)
    folders = [Path(f) for f in cold_start.package_folders(["generate_batch"])]
    assert {"torch", "transformers", "hf_paged"} <= {f.name for f in folders}
    assert not {"json", "asyncio", "email"} & {f.name for f in folders}  # the standard library has its own
    small = ROOT / "hf_paged" / "cli"
    cold_start.compile_bytecode([str(small)], tmp_path)
    compiled = {p.name.split(".")[0] for p in tmp_path.rglob("*.pyc")}
    assert {p.stem for p in small.glob("*.py")} <= compiled


@pytest.mark.slow
def test_cold_start_child_sets_up_only_its_own_system(tmp_path, monkeypatch):
    """A child process builds only its system's call: transformers' baseline must not run on a model that
    ``optimize_generate`` (the ``generate`` system's set-up) has routed through hf_paged's linears."""
    import hf_paged

    setups = []
    monkeypatch.setattr(hf_paged, "optimize_generate", lambda model, *a, **kw: setups.append(model))
    result = tmp_path / "result.json"
    cold_start.main(["--child", "transformers", "--smoke", "--prompts", "2", "--new-tokens", "2",
                     "--result", str(result)])
    row = json.loads(result.read_text())
    assert setups == [] and row["hf_paged_patches"] == 0
    assert row["second_call"] > 0 and row["at"]["load"] <= row["at"]["steady"]


def test_decode_gemm_adds_a_step_from_each_products_calls_and_checks_its_row_counts():
    """A decode step is each layer's products times the layer count plus lm_head once; a row count left without
    every product, or a system missing from one product, gives no total for it."""
    products = decode_gemm.MODELS["1b"]["products"]
    times = {name: random.uniform(1, 100) for name in products}
    rows = [dict(model="Llama-3.2-1B", product=name, rows=m, roofline_us=times[name] / 2, cublas_us=times[name],
                 **({"autotuned_us": times[name] * 3} if m == 256 and name != "down" else {}))
            for m in (64, 256) for name in products]
    rows.append(dict(model="Llama-3.2-1B", product="o", rows=128, roofline_us=1.0, cublas_us=2.0))
    totals = decode_gemm.step_totals(rows, ["cublas", "autotuned"])
    want = 16 * sum(t for name, t in times.items() if name != "lm_head") + times["lm_head"]
    assert [t["rows"] for t in totals] == [64, 256]
    for total in totals:
        assert total["cublas_us"] == pytest.approx(want, abs=0.1)
        assert total["roofline_us"] == pytest.approx(want / 2, abs=0.1)
        assert "autotuned_us" not in total
    args = decode_gemm.parse_args(["--rows", "64,256", "--autotune", "256"])
    assert (args.rows, args.autotune, args.models) == ([64, 256], [256], ["1b"])
    for bad in (["--rows", "64", "--autotune", "256"], ["--models", "70b"], ["--rows", "0"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            decode_gemm.parse_args(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_stage_argmax_gives_argmaxs_first_maximum_ties_and_all_equal_rows_included(dtype):
    for seed in range(4):
        x = argmax_bench.logits(5, 1024, dtype, "cpu", seed)  # each row's maximum at 2-3 places
        x[4] = 1.0  # a row of one value: the first index
        for chunks in (8, 32, 128):
            assert torch.equal(argmax_bench.two_stage(chunks)(x), x.argmax(-1)), (seed, chunks)
    assert argmax_bench.two_stage(8)(x)[4] == 0


def test_argmax_benchmark_smoke_checks_every_variant_and_writes_its_rows(tmp_path, capsys):
    path = tmp_path / "argmax.json"
    argmax_bench.main(["--smoke", "--rows", "1,8,64", "--chunks", "16,7,64", "--dtypes", "float32",
                       "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["meta"]["card"].startswith("CPU") and data["meta"]["date"]
    assert [r["rows"] for r in data["rows"]] == [1, 8]  # the smoke run keeps rows of at most 8
    for row in data["rows"]:
        assert row["vocab"] == 4096 and {"torch_us", "two_stage_16_us", "two_stage_64_us"} <= row.keys()
        assert "two_stage_7_us" not in row  # 7 does not divide the vocabulary
    assert "| 8 x 4096 | float32 |" in capsys.readouterr().out
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        argmax_bench.parse_args(["--vocab", "1000", "--chunks", "7,9"])
