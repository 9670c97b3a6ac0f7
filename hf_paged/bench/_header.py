"""The header every benchmark result carries: the card, the host's CPU, the versions, hf_paged's own commit and the
date. The host's CPU too: on two H100 hosts one rollout benchmark gave transformers' own batching 6.65 and 8.5 s
per call and hf_paged 2.66 and 2.70 s, so a result names the host it ran on.

The commit is read by git in the folder of the imported ``hf_paged`` source, not in the current folder: a benchmark
run from another repository (or an A/B run's other checkout) still names the code it measured. Where the source is
not a git checkout (an installed wheel, a tree copied without its history) the commit is None, unless
``HF_PAGED_COMMIT`` names it.
"""

from __future__ import annotations

import datetime
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from hf_paged import envs
from hf_paged._version import __version__

_SOURCE = Path(__file__).resolve().parents[1]


def run_header(device: str | torch.device | None = None) -> dict:
    """``card``, ``host_cpu``, ``torch``, ``transformers``, ``hf_paged``, ``hf_paged_commit``, ``flash_attn``,
    ``python`` and ``date`` (ISO) of a run on ``device`` (default: the current CUDA device where there is one, else
    the CPU)."""
    import transformers

    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    return {"card": card, "host_cpu": host_cpu(), "torch": torch.__version__, "transformers": transformers.__version__,
            "hf_paged": __version__, "hf_paged_commit": source_commit(), "flash_attn": _installed("flash_attn"),
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def host_cpu() -> str:
    """The host CPU's model name (Linux's ``/proc/cpuinfo``), else what ``platform`` says, else ``"unknown"``."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown"


def source_commit(source: Path = _SOURCE) -> str | None:
    """The short commit of the git checkout that holds ``source`` (hf_paged's folder) as a tracked folder, with
    ``+dirty`` where its files differ from that commit; ``HF_PAGED_COMMIT`` where set; else None."""
    if envs.commit():
        return envs.commit()

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    # not tracked (an installed copy inside some other repository), or no commit to name
    if not git("ls-files", "--", "__init__.py") or not (commit := git("rev-parse", "--short", "HEAD")):
        return None
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".") else "")


def _installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None
