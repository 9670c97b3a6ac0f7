"""Run an action once transformers' model code is imported, without importing transformers (nor torch) first.

``import hf_paged`` makes ``attn_implementation="hf_paged"`` known to transformers through this hook: at once where
``transformers.modeling_utils`` is already imported, else right after it is (every model class imports it before a
``from_pretrained`` can ask for an implementation), or, where one of hf_paged's own modules imported it, once that
module's import has finished. So ``import hf_paged`` stays light, and a program that never
loads a transformers model never imports torch because of it. The opt-in start-up file (``hf_paged_autoload``)
imports ``hf_paged`` and so uses the same hook. This module imports only the standard library.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

TRIGGER = "transformers.modeling_utils"


class _AfterImport:
    """A meta-path finder that finds nothing itself: it lets the other finders locate ``TRIGGER`` and hf_paged's own
    modules, and wraps their loaders so that ``action`` runs right after ``TRIGGER`` has been imported, once no
    hf_paged module is half-imported (the action imports hf_paged's modules, and the one that imported transformers
    may be among them: ``hf_paged.Engine`` first touched before any model). It then leaves ``sys.meta_path``."""

    def __init__(self, action: Callable[[], None]):
        self.action = action
        self.loading = 0  # hf_paged modules whose code is running now
        self.triggered = False

    def find_spec(self, name, path=None, target=None):
        ours = name.startswith("hf_paged.")
        if name != TRIGGER and not ours:
            return None
        spec = None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_act(module):
            self.loading += ours
            try:
                exec_module(module)
            finally:
                self.loading -= ours
            self.triggered |= name == TRIGGER
            if self.triggered and not self.loading and self in sys.meta_path:
                sys.meta_path.remove(self)
                try:  # its failure one warning: raising here would fail the program's own import of transformers
                    self.action()
                except Exception as exc:  # noqa: BLE001
                    warnings.warn(f'hf_paged: registering attn_implementation="hf_paged" with transformers failed '
                                  f"({type(exc).__name__}: {exc}); check that this transformers release is one "
                                  "hf_paged supports", RuntimeWarning, stacklevel=2)

        spec.loader.exec_module = exec_then_act
        return spec


def when_transformers_models_load(action: Callable[[], None]) -> None:
    """Run ``action`` once ``transformers.modeling_utils`` is imported: now if it is (its errors then raise), else
    right after its import (its errors then one warning). A second call while the hook waits adds nothing."""
    if TRIGGER in sys.modules:
        action()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(action))
