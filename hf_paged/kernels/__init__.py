"""hf_paged's own CUDA kernels, built just in time on first use (``_build.py``): the KV write and paged decode
(``_ops.py``, whose public names this package gives), paged prefill (``_prefill.py``) and the skinny linears
(``_skinny.py``).
"""

from __future__ import annotations

from hf_paged.kernels._ops import *  # noqa: F403  (the names its __all__ lists)
from hf_paged.kernels._ops import __all__  # noqa: F401
