"""Just-in-time build of the CUDA kernels in ``hf_paged/csrc`` through ``torch.utils.cpp_extension`` (ninja).

The library is built for the present GPU's architecture only (on compute capability 9.0 its arch-specific target,
sm_90a, which the wgmma prefill needs) and kept under
``$HF_PAGED_CACHE`` (default ``~/.cache/hf_paged/kernels``) in a folder named by torch version, CUDA version, arch
and a hash of the sources, so a second run (or a second process) loads the library it finds there directly, without
the build tools. Without a CUDA GPU (or, where a build is needed, nvcc or ninja), :func:`load` fails with the reason,
and :func:`ensure_loaded` warns once and lets the torch backend serve.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import threading
from pathlib import Path

import torch

from hf_paged import envs

logger = logging.getLogger("hf_paged")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# Every C++ and CUDA file in csrc goes into the one library, in name order (paged_prefill_wgmma_*.cu compile to stubs
# unless built for sm_90a).
SOURCES = tuple(sorted(path.name for path in CSRC.iterdir() if path.suffix in (".cpp", ".cu")))
_LIB_NAME = "hf_paged_kernels"


class KernelsUnavailable(RuntimeError):
    """The CUDA kernels cannot be built or loaded here; the message says why and what to install."""


_lock = threading.Lock()
_failure: str | None = None
_folder: Path | None = None
_warned = False


def arch_of(major: int, minor: int, cuda: str | None = "12.0") -> str:
    """The nvcc arch a device of this compute capability is built for: Hopper (9.0) gets its arch-specific target
    "90a" (wgmma, setmaxnreg; the machine code runs on 9.0 devices only, as every build here is for one GPU) when
    the CUDA toolkit has it (12.0 on)."""
    has_90a = cuda is not None and int(cuda.split(".")[0]) >= 12
    return "90a" if (major, minor) == (9, 0) and has_90a else f"{major}{minor}"


#: ``HF_PAGED_KERNEL_TRACE=1`` (``hf_paged.envs``) when the kernels are first loaded in a process: a diagnostic build
#: (its own build folder) whose decode kernels can store per-CTA timestamps (``hf_paged.bench._decode_trace``); the
#: normal build's machine code holds no trace code.

def _host_flags() -> list[str]:
    return ["-O3"] + (["-DHF_PAGED_DECODE_TRACE"] if envs.kernel_trace() else [])


def _cuda_flags(arch: str) -> list[str]:
    # Naming the arch ourselves also stops torch from adding every arch of TORCH_CUDA_ARCH_LIST. The -gencode form:
    # nvcc 13.0's -arch=sm_90a shorthand also runs a plain sm_90 pass, which rejects wgmma.
    flags = ["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo"]
    if arch == "90a":
        flags.append("-DHF_PAGED_SM90A")  # compiles the wgmma kernels (paged_prefill_wgmma_*.cu)
    return flags + _host_flags()[1:]


def source_hash(arch: str) -> str:
    """Hash of every file in csrc and of the flags, so that any edit gets a fresh build folder."""
    digest = hashlib.sha256(" ".join(_cuda_flags(arch) + _host_flags()).encode())
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cu", ".cuh", ".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def build_dir(arch: str) -> Path:
    tag = f"torch{torch.__version__}-cu{torch.version.cuda}-sm{arch}-{source_hash(arch)}"
    return envs.kernel_cache_dir() / re.sub(r"[^A-Za-z0-9_.-]", "_", tag)


def missing_device() -> str | None:
    """Why no kernels can run here (None if a CUDA GPU is there)."""
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def missing_requirement() -> str | None:
    """Why the kernels cannot be built here (None if they can)."""
    if (reason := missing_device()) is not None:
        return reason
    from torch.utils import cpp_extension  # imports setuptools: only where a build may be needed

    home = cpp_extension.CUDA_HOME
    if not (home and (Path(home) / "bin" / "nvcc").exists()) and shutil.which("nvcc") is None:
        return "nvcc was not found (install the CUDA toolkit or set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def load(verbose: bool = False) -> Path:
    """Build (if needed) and load the kernels into this process; returns the build folder.

    Raises:
        KernelsUnavailable: with the reason, if there is no GPU, nvcc or ninja, or the build fails.
    """
    global _failure, _folder
    if _folder is not None:  # loaded: every layer calls this, so no probing or hashing past the first call
        return _folder
    with _lock:
        _failure = _failure or missing_device()
        if _failure is not None:
            raise KernelsUnavailable(_failure)
        arch = arch_of(*torch.cuda.get_device_capability(), cuda=torch.version.cuda)
        folder = build_dir(arch)
        _load_or_build(folder, arch, verbose)
        _folder = folder
        return folder


#: A file a build folder gets once its library was built and loaded. A later process loads that library itself
#: (``torch.ops.load_library``), without importing torch's extension builder (and setuptools with it) or running
#: ninja's up-to-date check. The folder's name holds the hash of the sources and flags and the torch, CUDA and arch
#: it is for, so a marked library is the one these sources make.
BUILT_MARKER = "built"


def _load_or_build(folder: Path, arch: str, verbose: bool) -> None:
    """Load the folder's library if a build marked it (no build tools needed); else (none, or it fails to load)
    build it there, load it and mark it."""
    global _failure
    library, marker = folder / f"{_LIB_NAME}.so", folder / BUILT_MARKER
    if marker.is_file() and library.is_file():
        try:
            torch.ops.load_library(str(library))
            return
        except OSError as exc:  # removed or damaged since
            logger.info("hf_paged: loading the built CUDA kernels failed (%s); building them again", exc)
            marker.unlink(missing_ok=True)
    if (_failure := missing_requirement()) is not None:
        raise KernelsUnavailable(_failure)
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    if not library.exists():
        logger.info("hf_paged: building CUDA kernels for sm_%s in %s (first use; about a minute)", arch, folder)
    try:
        cpp_extension.load(name=_LIB_NAME, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=_host_flags(),
                           extra_cuda_cflags=_cuda_flags(arch), extra_include_paths=[str(CSRC)],
                           build_directory=str(folder), is_python_module=False, verbose=verbose)
    except Exception as exc:  # compiler or loader failure: report it as the reason, keep serving via torch
        _failure = f"building the CUDA kernels failed ({type(exc).__name__}: {str(exc).strip()[-2000:]})"
        raise KernelsUnavailable(_failure) from exc
    marker.write_text(f"{torch.__version__} cuda {torch.version.cuda} sm_{arch}\n")


def is_loaded() -> bool:
    """Whether the kernels are loaded already (asks without building them)."""
    return _folder is not None


def ensure_loaded() -> str | None:
    """Load the kernels if possible; None on success, else the reason (warned about once, logger "hf_paged")."""
    global _warned
    try:
        load()
        return None
    except KernelsUnavailable as exc:
        if not _warned:
            _warned = True
            logger.warning("hf_paged: CUDA kernels unavailable (%s); the torch backend serves instead.", exc)
        return str(exc)
