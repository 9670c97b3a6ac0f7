"""``hf-paged bench kernels`` runs the decode and the prefill benchmarks, each writing its JSON."""

from __future__ import annotations

import pytest

from hf_paged import cli
from hf_paged.bench import kernels as decode_bench
from hf_paged.bench import prefill as prefill_bench


@pytest.mark.parametrize("only, want", [(None, ["decode", "prefill"]), ("decode", ["decode"]), ("prefill", ["prefill"])])
def test_bench_kernels_runs_decode_and_prefill(monkeypatch, tmp_path, only, want):
    ran = []
    monkeypatch.setattr(decode_bench, "run", lambda json_path, head_dims, sweep: ran.append(("decode", json_path)))
    monkeypatch.setattr(prefill_bench, "run", lambda json_path, head_dims, sweep: ran.append(("prefill", json_path)))
    argv = ["bench", "kernels", "--json", str(tmp_path / "k.json"), "--no-sweep"] + (["--only", only] if only else [])
    assert cli.main(argv) in (0, None)
    assert [name for name, _ in ran] == want
    paths = dict(ran)
    if "prefill" in paths:
        assert str(paths["prefill"]).endswith("k_prefill.json")
