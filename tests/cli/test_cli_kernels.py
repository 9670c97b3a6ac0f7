"""``hf-paged bench kernels`` runs the decode and the prefill benchmarks, each writing its JSON, with the head dims
and the sliding-window / softcap rows asked for; without the CUDA kernels it says why in one line (status 1) and runs
nothing. The tables and the windowed FLOP count, on the CPU."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from hf_paged import cli, kernels
from hf_paged.bench import _kernels as decode_bench
from hf_paged.bench import _prefill as prefill_bench
from hf_paged.kernels import _build as build


@pytest.fixture
def ran(monkeypatch) -> list:
    ran = []
    for name, bench in (("decode", decode_bench), ("prefill", prefill_bench)):
        monkeypatch.setattr(bench, "run", lambda json_path, head_dims, sweep, windows, softcaps, name=name: ran.append(
            (name, json_path, head_dims, windows, softcaps)))
    return ran


@pytest.fixture
def kernels_available(monkeypatch) -> None:
    monkeypatch.setattr(build, "missing_requirement", lambda: None)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: None)


@pytest.mark.parametrize("only, want", [(None, ["decode", "prefill"]), ("decode", ["decode"]),
                                        ("prefill", ["prefill"])])
def test_bench_kernels_runs_decode_and_prefill(ran, kernels_available, tmp_path, only, want):
    argv = ["bench", "kernels", "--json", str(tmp_path / "k.json"), "--no-sweep"] + (["--only", only] if only else [])
    assert cli.main(argv) == 0
    assert [name for name, *_ in ran] == want
    paths = {name: path for name, path, *_ in ran}
    if "prefill" in paths:
        assert str(paths["prefill"]).endswith("k_prefill.json")
    assert all(dims == (128, 64) and windows == () and softcaps == () for _, _, dims, windows, softcaps in ran)


def test_bench_kernels_takes_the_head_dims_asked_for(ran, kernels_available, tmp_path):
    assert cli.main(["bench", "kernels", "--json", str(tmp_path / "k.json"), "--head-dims", "64,256"]) == 0
    assert [head_dims for _, _, head_dims, *_ in ran] == [(64, 256), (64, 256)]


def test_bench_kernels_adds_window_and_softcap_rows(ran, kernels_available, tmp_path):
    argv = ["bench", "kernels", "--json", str(tmp_path / "k.json"), "--windows", "4096,1000", "--softcaps", "50"]
    assert cli.main(argv) == 0
    assert [(windows, softcaps) for *_, windows, softcaps in ran] == [((4096, 1000), (50.0,))] * 2


@pytest.mark.parametrize("flag, value", [("--windows", "0"), ("--windows", "4k"), ("--softcaps", "-1"),
                                         ("--softcaps", "nan")])
def test_bench_kernels_refuses_bad_options(ran, kernels_available, capsys, flag: str, value: str):
    assert cli.main(["bench", "kernels", f"{flag}={value}"]) == 2 and ran == []
    assert "expected comma-separated positive" in capsys.readouterr().err


def test_score_option_rows():
    """Each window and each softcap alone, and every pair; nothing without options."""
    assert decode_bench.score_options((), ()) == []
    assert decode_bench.score_options((4096,), (50.0,)) == [(0, 50.0), (4096, 0.0), (4096, 50.0)]


@pytest.mark.parametrize("prefix, new, window", [(0, 2048, 4096), (0, 2048, 1000), (2048, 2048, 1000),
                                                 (2048, 2048, 3000), (5, 1, 3)])
def test_windowed_prefill_flops_count_the_visible_pairs(prefix: int, new: int, window: int):
    brute = sum(min(i + 1, window) for i in range(prefix, prefix + new))
    assert prefill_bench.visible_pairs(prefix, new, window) == brute
    assert prefill_bench.visible_pairs(prefix, new) == new * prefix + new * new / 2  # anchors.md's count


def test_bench_kernels_without_the_kernels_says_why_and_runs_nothing(ran, monkeypatch, capsys):
    monkeypatch.setattr(build, "missing_requirement", lambda: "no CUDA GPU is visible")
    assert cli.main(["bench", "kernels", "--no-sweep"]) == 1
    out, err = capsys.readouterr()
    assert err == ("hf-paged bench kernels: error: needs hf_paged's CUDA kernels, which are unavailable here: "
                   "no CUDA GPU is visible\n")
    assert ran == [] and out == ""


def test_tables_show_window_and_softcap_rows(capsys):
    """The tables print the option rows beside the plain ones (results as the benchmarks write them)."""
    decode_rows = [asdict(decode_bench.Row(128, 8, 4096, impl, us, 1.0, 50.0, "graph", "", window, cap))
                   for impl, us, window, cap in [("ours-bs16", 30.0, 0, 0.0), ("flash-bs256", 33.0, 0, 0.0),
                                                 ("ours-bs16", 10.0, 1024, 50.0), ("flash-bs256", 12.0, 1024, 50.0)]]
    decode_bench.print_table({"device": "GPU", "copy_tbps": 3.0, "rows": decode_rows})
    prefill_rows = [asdict(prefill_bench.Row(128, shape, impl, 1.0, tflops, "graph", "", window, cap))
                    for shape, impl, tflops, window, cap in [("8x2048", "ours-bs16", 280.0, 0, 0.0),
                                                             ("8x2048 w1024 cap50", "ours-bs16", 200.0, 1024, 50.0),
                                                             ("8x2048 w1024 cap50", "flash-varlen", 250.0, 1024, 50.0)]]
    prefill_bench.print_table({"device": "GPU", "rows": prefill_rows})
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:5] == ["128", "8", "4096", "1024", "50.0"] and line.endswith("1.20x") for line in lines)
    assert any(line.split()[:5] == ["128", "8", "4096", "-", "-"] and line.endswith("1.10x") for line in lines)
    assert any("8x2048 w1024 cap50" in line and "0.80" in line for line in lines)


def test_prefill_table_has_the_fp8_column(capsys):
    """``ours-fp8-bs16`` (prefill over the e4m3 cache) prints beside the bf16 rows of its shape."""
    rows = [asdict(prefill_bench.Row(128, "8x2048", impl, 1.0, tflops, "graph", "", 0, 0.0))
            for impl, tflops in [("ours-bs16", 280.0), ("ours-fp8-bs16", 250.0), ("flash-varlen", 300.0)]]
    prefill_bench.print_table({"device": "GPU", "rows": rows})
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "shape" in line)
    assert header.split("|")[2].strip() == "ours-fp8-bs16"
    assert any("8x2048" in line and line.split("|")[2].strip() == "250.0" for line in lines)
