"""``CompileArtifacts``: the compiled code of a model's engine (or ``optimize_generate``), kept across processes.

torch keeps what it compiles in its own on-disk caches (inductor's FX graph cache, the AOTAutograd cache, autotuning
results) under a temporary directory, keyed by the graphs' content; a second process on the same machine loads from
them instead of compiling. Those caches go with the temporary directory (a new container, a cleaned ``/tmp``), so
hf_paged also keeps them as torch's portable bundle of cache artifacts (``torch.compiler.save_cache_artifacts``, the
"mega-cache") in one file per model and setting, under ``$XDG_CACHE_HOME/hf_paged/compile``
(``envs.compile_cache_dir``), and hands the bundle back to torch (``load_cache_artifacts``) before the next process
compiles: then it finds what it needs in its own caches.

The file's name is a hash of everything that decides the compiled code: the model's config and dtype, the device,
the engine's shapes (block size, step budget, sequences, KV dtype, tensor-parallel rank and size), the compile's
passes and options, and the versions of hf_paged, torch, triton, transformers and Python; torch checks each
artifact's own key again when it uses it. With torch's caches switched off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES``)
nothing is loaded or saved. A file that cannot be read or written is skipped with a debug log line: the cache only
ever saves time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import transformers

from hf_paged import _compat, envs
from hf_paged._version import __version__

logger = logging.getLogger("hf_paged")


def artifact_key(model: torch.nn.Module, settings: dict) -> str:
    """The hash naming a model's artifacts under ``settings`` (the engine's shapes and the compile's options, as
    plain values or strings)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    parts = {
        "versions": [__version__, torch.__version__, transformers.__version__, _triton_version(),
                     list(sys.version_info[:2])],
        "device": _device_name(device),
        "model": [type(model).__name__, model.config.to_json_string(use_diff=False), str(model.dtype)],
        "settings": settings,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


class CompileArtifacts:
    """torch's cache artifacts of one key: :meth:`load` before compiling, :meth:`save` after (and at exit)."""

    def __init__(self, key: str, directory: Path | None = None):
        self.key = key
        self.path = (directory or envs.compile_cache_dir()) / f"{key}.bin"
        self.loaded = False  # whether a bundle was handed to torch
        self._known: set[tuple[str, str]] = set()  # the artifacts loaded or saved: (kind, torch's key)
        self._lock = threading.Lock()

    def load(self) -> bool:
        """Hand the saved bundle (if any) to torch's caches; whether one was loaded."""
        if _compat.compile_caches_disabled() or not self.path.is_file():
            return False
        began = time.perf_counter()
        try:
            data = self.path.read_bytes()
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as exc:  # noqa: BLE001 - a stale or broken bundle costs a compile, never a failure
            logger.debug("hf_paged: not loading compile artifacts %s (%s: %s)", self.path, type(exc).__name__, exc)
            return False
        if info is None:  # torch found nothing it could use in the file (it says why in its own log)
            return False
        self._known |= _keys(info)
        self.loaded = True
        logger.info("hf_paged: loaded compile artifacts %s (%.1f MiB) in %.2f s", self.path.name, len(data) / 2**20,
                    time.perf_counter() - began)
        return True

    def save(self) -> bool:
        """Write torch's artifacts of this process (everything it compiled or found in torch's caches so far) when
        they hold one that was not in the last load or save; whether a file was written."""
        if _compat.compile_caches_disabled():
            return False
        with self._lock:
            try:
                bundle = torch.compiler.save_cache_artifacts()
            except Exception as exc:  # noqa: BLE001
                logger.debug("hf_paged: torch gave no compile artifacts (%s: %s)", type(exc).__name__, exc)
                return False
            if bundle is None or not bundle[0]:
                return False
            data, keys = bundle[0], _keys(bundle[1])
            if keys <= self._known:  # nothing new since the last load or save (the bytes differ from run to run)
                return False
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=self.key, delete=False) as tmp:
                    tmp.write(data)
                os.replace(tmp.name, self.path)  # whole or not at all, whichever process writes last
            except OSError as exc:
                logger.debug("hf_paged: not saving compile artifacts to %s (%s)", self.path, exc)
                return False
            self._known |= keys
            return True


def _keys(info) -> set[tuple[str, str]]:
    """The artifacts a ``CacheInfo`` (of a load or a save) names: (kind, key); none when torch says nothing."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {(kind, str(key)) for kind, keys in artifacts.items() for key in keys}


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)  # (a device without an index: the current one)
    return f"{props.name} sm_{props.major}{props.minor}"


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
