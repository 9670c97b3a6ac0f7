"""hf_paged's benchmarks, one folder per thing measured:

- ``e2e``: whole ``generate_batch`` calls against transformers' continuous batching (throughput, cold start, A/B of
  two checkouts, the roofline of a decode step, fp8 KV quality).
- ``engine``: the engine's own host cost per step, its start in a fresh process, CUDA-graph capture.
- ``generate``: plain ``model.generate`` with each attention and cache setup, and its host time per step.
- ``serving``: ``hf-paged serve`` against ``transformers serve`` under the same streaming load.
- ``parallel``: tensor and data parallel, and the small all-reduces of a tensor-parallel step.
- ``kernels``: the skinny linear kernel and a decode step's matrix products against their roofline.

Each script runs from the repository's root as a module (``python -m benchmarks.e2e.throughput --smoke``);
docs/benchmarks.md gives the method, how to run each one and the newest tables. Timings use
``hf_paged.bench.time_calls``; result files carry ``hf_paged.bench.run_header``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout these benchmarks belong to: its folder holds ``benchmarks`` and ``hf_paged``."""


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs the benchmark ``module`` (``"benchmarks.e2e.cold_start"``) in a fresh Python."""
    return [sys.executable, "-m", module, *args]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's when None) with the checkout first on ``PYTHONPATH``: a child started in any folder
    imports these benchmarks and this checkout's ``hf_paged``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def comma_names(text: str, known: Collection[str], flag: str,
                error: Callable[[str], object] | None = None) -> list[str]:
    """The names of a comma list given to ``flag`` (``"--systems"``), each one of ``known``; an unknown one is
    refused through ``error`` (an argument parser's ``error``; by default ``SystemExit`` with the message)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        message = f"{flag}: unknown {unknown}; choose from {', '.join(known)}"
        if error is None:
            raise SystemExit(message)
        error(message)
    return names
