"""The ``transformers_box`` system: transformers' ``generate_batch`` under the release that the imported one shadows.

Two transformers releases cannot live in one process. When the imported transformers comes from a ``PYTHONPATH``
entry (``HF_TRANSFORMERS=newest`` puts 5.24 there, ahead of the box's 5.17), the benchmark runs itself again in a
subprocess whose ``PYTHONPATH`` lacks that entry, with ``--systems transformers``, and takes its rows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import transformers

from benchmarks import child_env, module_command
from benchmarks.e2e.report import make_row, read_rows

SYSTEM = "transformers_box"


def shadowed_transformers_env() -> tuple[dict | None, str]:
    """The environment without the imported transformers' ``PYTHONPATH`` entry and the release it imports there;
    or None and the reason there is no other release."""
    here = Path(transformers.__file__).resolve().parents[1]
    entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    kept = [e for e in entries if Path(e).resolve() != here]
    if len(kept) == len(entries):
        return None, (f"transformers {transformers.__version__} is not imported from a PYTHONPATH entry, so no "
                      "other release is shadowed (on the GPU box: start with HF_TRANSFORMERS=newest)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(kept)}
    probe = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, (f"no transformers importable once the PYTHONPATH entry of {transformers.__version__} is "
                      f"dropped: {last}")
    version = probe.stdout.strip()
    if version == transformers.__version__:
        return None, f"the shadowed transformers is the same release ({version})"
    return env, version


def run_other_transformers(module: str, child_args: list[str], workloads: list[str],
                           log: Callable[[str], None]) -> list[dict]:
    """Run ``python -m module child_args --json <tmp>`` under the shadowed release; its rows, relabelled
    ``transformers_box``, and a failed row for each workload it did not report."""
    env, version = shadowed_transformers_env()
    rows: list[dict] = []
    returncode = None
    if env is not None:
        log(f"{SYSTEM}: transformers {version} in a subprocess")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            returncode = subprocess.run(module_command(module, *child_args, "--json", out),
                                        env=child_env(env)).returncode
            rows = read_rows([out]) if os.path.exists(out) else []
    for row in rows:
        row["system"] = SYSTEM
    reported = {row["workload"] for row in rows}
    reason = version if env is None else f"the subprocess (transformers {version}) exited with {returncode}"
    label = f"transformers {version}" if env is not None else SYSTEM
    status = "skipped" if env is None else "failed"
    rows += [make_row(SYSTEM, label, name, error=reason, status=status) for name in workloads if name not in reported]
    if env is None:
        log(f"{SYSTEM}: not run: {reason}")
    return rows
