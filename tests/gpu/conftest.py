"""The GPU tests, run as a set on a machine with an NVIDIA GPU (``python -m pytest tests/gpu``): a folder per package
of hf_paged, as on the CPU side, and beside the folders the modules they share (no tests in those).

What every file here would otherwise repeat:

- Without CUDA each test file is reported as one skipped module and never imported, so the files need no guard of
  their own and the CPU-only helper modules here are never loaded.
- With CUDA every test here carries the ``cuda`` marker (``-m "not cuda"`` leaves them out).
- ``hf_paged_kernels``: the test runs only where hf_paged's CUDA kernels build (the first use builds them, once per
  session); elsewhere it is skipped with the reason. A file that needs the kernels says so with
  ``pytestmark = pytest.mark.usefixtures("hf_paged_kernels")``.

What is a file's own stays in it: a compute capability, a second GPU, flash-attn or triton.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the helper modules beside the folders


class _WithoutCuda(pytest.Module):
    """A GPU test file where CUDA is not available: one skip, the file not imported."""

    def collect(self):
        pytest.skip("needs an NVIDIA GPU (CUDA)")


def pytest_pycollect_makemodule(module_path, parent):
    if not torch.cuda.is_available():
        return _WithoutCuda.from_parent(parent, path=module_path)
    module = pytest.Module.from_parent(parent, path=module_path)
    module.add_marker(pytest.mark.cuda)
    return module


@pytest.fixture(scope="session")
def hf_paged_kernels() -> None:
    """Skips the test unless hf_paged's CUDA kernels are loaded here (building them on first use)."""
    from hf_paged import kernels

    reason = kernels.unavailable_reason()
    if reason is not None:
        pytest.skip(f"hf_paged kernels unavailable: {reason}")
