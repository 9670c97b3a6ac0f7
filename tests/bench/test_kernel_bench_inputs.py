"""The kernel benchmarks' input helpers (``hf_paged.bench._kernels``), on the CPU: the paged copies hold the logical
K/V at the blocks their tables name, and the output check refuses a contender that computed something else."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from hf_paged.bench import run_header
from hf_paged.bench._kernels import Row, check_outputs, paged_kv, report


@pytest.mark.parametrize("flat", [False, True])
def test_paged_kv_stores_each_sequence_at_the_blocks_of_its_table(flat: bool):
    batch, length, block_size = 3, 32, 8
    k, v = torch.randn(batch, length, 2, 4), torch.randn(batch, length, 2, 4)
    args = (k.flatten(0, 1), v.flatten(0, 1)) if flat else (k, v)
    k_cache, v_cache, tables = paged_kv(*args, batch, block_size, torch.Generator().manual_seed(0))
    assert tables.dtype == torch.int32 and tables.shape == (batch, length // block_size)
    assert sorted(tables.flatten().tolist()) == list(range(batch * length // block_size))  # a permutation
    for cache, logical in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache[tables.long()].reshape(batch, length, 2, 4), logical)


def test_check_outputs_notes_the_difference_and_refuses_a_wrong_contender():
    ref = torch.ones(4)
    rows = [Row(128, 1, 8, "ours-bs16", 1.0, 1.0, 1.0, "graph", "split_len=4"),
            Row(128, 1, 8, "ours-fp8-bs16", 1.0, 1.0, 1.0, "graph")]
    check_outputs(rows, {"ours-bs16": ref, "ours-fp8-bs16": ref * 1.1})  # within fp8's bound
    assert [r.note for r in rows] == ["split_len=4 diff=0.0e+00", "diff=1.0e-01"]
    with pytest.raises(RuntimeError, match="ours-bs256 disagrees with ours-bs16"):
        check_outputs([Row(128, 1, 8, "ours-bs256", 1.0, 1.0, 1.0, "graph")],
                      {"ours-bs16": ref, "ours-bs256": ref * 1.1})


def test_the_split_sweep_rows_pass_their_split_length(monkeypatch):
    """``splits`` adds ``ours-bs16-split<n>``: the block-size-16 decode with ``split_len=n``; ``ours-bs16`` keeps the
    heuristic's (no split_len). Each row reads the cache of its block size, ``ours-fp8-bs16`` the e4m3 copy with its
    scales."""
    from hf_paged import kernels
    from hf_paged.bench import _kernels as decode_bench

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    monkeypatch.setattr(decode_bench, "build_metadata", lambda **_: None)  # the torch row's metadata needs a GPU
    seen = []
    monkeypatch.setattr(kernels, "paged_decode", lambda *a, **k: seen.append(
        (k["k_cache"], k["v_cache"], k["block_tables"], k.get("split_len"), k.get("k_scale"), k.get("v_scale"))))
    s = {name: name for name in ("query", "k16", "v16", "k256", "v256", "t256", "k16_fp8", "v16_fp8", "k_scale",
                                 "v_scale")}
    s |= {"seq_lens": torch.ones(1, dtype=torch.int32), "t16": torch.zeros(1, 1, dtype=torch.int32)}
    rows = decode_bench.contenders([s], 8192, 128, splits=(64, 512))
    assert [name for name in rows if "split" in name] == ["ours-bs16-split64", "ours-bs16-split512"]
    for name in ("ours-bs16", "ours-bs16-split64", "ours-bs16-split512", "ours-bs256", "ours-fp8-bs16"):
        rows[name][0]()
    assert seen[1:3] == [("k16", "v16", s["t16"], split, None, None) for split in (64, 512)]
    assert seen[0] == ("k16", "v16", s["t16"], None, None, None)
    assert seen[3] == ("k256", "v256", "t256", None, None, None)
    assert seen[4] == ("k16_fp8", "v16_fp8", s["t16"], None, "k_scale", "v_scale")  # the e4m3 copy, with its scales


def test_report_writes_the_header_fields_and_rows_then_prints_the_table(tmp_path):
    rows = [Row(128, 1, 8, "ours-bs16", 2.0, 1.5, 50.0, "graph", "split_len=4")]
    printed = []
    result = report(rows, tmp_path / "r.json", printed.append, device="GPU", copy_tbps=3.0)
    header = run_header()
    assert list(result) == [*header, "device", "copy_tbps", "rows"]
    assert {k: result[k] for k in ("torch", "hf_paged_commit", "device", "copy_tbps")} == {
        "torch": header["torch"], "hf_paged_commit": header["hf_paged_commit"], "device": "GPU", "copy_tbps": 3.0}
    assert result["rows"] == [asdict(rows[0])] and printed == [result]
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert report(rows, None, printed.append)["rows"] == result["rows"] and len(printed) == 2  # no file asked for
