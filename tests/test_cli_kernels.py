"""``hf-paged bench kernels`` runs the decode and the prefill benchmarks, each writing its JSON, with the head dims
asked for; without the CUDA kernels it says why in one line (status 1) and runs nothing."""

from __future__ import annotations

import pytest

from hf_paged import cli, kernels
from hf_paged.bench import kernels as decode_bench
from hf_paged.bench import prefill as prefill_bench
from hf_paged.kernels import build


@pytest.fixture
def ran(monkeypatch) -> list:
    ran = []
    for name, bench in (("decode", decode_bench), ("prefill", prefill_bench)):
        monkeypatch.setattr(bench, "run", lambda json_path, head_dims, sweep, name=name: ran.append(
            (name, json_path, head_dims)))
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
    assert [name for name, _, _ in ran] == want
    paths = {name: path for name, path, _ in ran}
    if "prefill" in paths:
        assert str(paths["prefill"]).endswith("k_prefill.json")
    assert all(head_dims == (128, 64) for _, _, head_dims in ran)


def test_bench_kernels_takes_the_head_dims_asked_for(ran, kernels_available, tmp_path):
    assert cli.main(["bench", "kernels", "--json", str(tmp_path / "k.json"), "--head-dims", "64,256"]) == 0
    assert [head_dims for _, _, head_dims in ran] == [(64, 256), (64, 256)]


def test_bench_kernels_without_the_kernels_says_why_and_runs_nothing(ran, monkeypatch, capsys):
    monkeypatch.setattr(build, "missing_requirement", lambda: "no CUDA GPU is visible")
    assert cli.main(["bench", "kernels", "--no-sweep"]) == 1
    out, err = capsys.readouterr()
    assert err == ("hf-paged bench kernels: error: needs hf_paged's CUDA kernels, which are unavailable here: "
                   "no CUDA GPU is visible\n")
    assert ran == [] and out == ""
