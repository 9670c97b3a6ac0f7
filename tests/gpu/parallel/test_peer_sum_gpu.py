"""hf_paged's one-shot sum over two GPUs (``torch.ops.hf_paged.peer_sum``, ``csrc/peer_sum.cu``).

Runs ``python -m benchmarks.parallel.all_reduce_latency --check`` under ``torchrun --nproc-per-node 2`` and reads its JSON: for
bf16 sizes from 16 bytes to 1 MiB, fp16 and fp32, peer_sum must equal the float32 sum of the gathered inputs in rank
order bit for bit, over consecutive eager calls with changing inputs (both data halves), a call that one rank reaches
~25 ms late, and CUDA graph replays that read a new input. Its fused forms (plus a residual, then an RMSNorm of each
row) must give the unfused rounding of the residual add bit for bit and the norm within two units in the last place
of a float64 norm, at widths of 2048 to 16384 and 1 to 128 rows. Skipped without two CUDA devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

ROOT = Path(__file__).resolve().parents[3]


def test_peer_sum_is_the_rank_order_sum_bit_for_bit(tmp_path):
    out = tmp_path / "checks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--module", "benchmarks.parallel.all_reduce_latency", "--check", "--sizes", "8,512,1024", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_PAGED_TP_TIMEOUT_S": "60"}
    proc = subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=240)
    assert out.exists(), f"no result; torchrun said:\n{(proc.stdout + proc.stderr)[-4000:]}"
    checks = [r for r in json.loads(out.read_text())["checks"] if r["method"] == "hf_paged"]
    assert {(r["bytes"], r["dtype"]) for r in checks} == {
        (8 << 10, "bfloat16"), (512 << 10, "bfloat16"), (1 << 20, "bfloat16"), (8192, "float16"),
        (8192, "float32"), (16, "bfloat16")}
    assert all(r["bit_identical"] for r in checks), checks
    fused = json.loads(out.read_text())["fused_checks"]  # peer_sum_add / peer_sum_add_rms_norm
    assert {(r["rows"], r["hidden"], r["dtype"]) for r in fused} == {
        (64, 4096, "bfloat16"), (1, 4096, "bfloat16"), (128, 4096, "bfloat16"), (3, 8192, "float16"),
        (5, 2048, "float32"), (2, 16384, "bfloat16")}
    assert all(r["sum_bit_identical"] and r["norm_within_two_ulps"] for r in fused), fused
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
