"""Make ``attn_implementation="hf_paged"`` known to transformers in programs that never ``import hf_paged``.

Tools that load a model by name, such as lm-evaluation-harness's ``hf`` model
(``lm_eval --model hf --model_args pretrained=DIR,attn_implementation=hf_paged``), cannot be told to import a plugin,
and neither transformers nor lm-eval discovers attention implementations by itself. So this one file, kept outside
the ``hf_paged`` package (importing that package imports torch and transformers), can be run at Python's start by a
``.pth`` file in ``site-packages``, which only an explicit command writes::

    python -m hf_paged_autoload enable     # writes hf_paged-autoload.pth into this environment's site-packages
    python -m hf_paged_autoload status
    python -m hf_paged_autoload disable    # removes it

At start it imports nothing heavy: it adds an import hook that, once ``transformers.modeling_utils`` has been
imported (the first model class a program touches imports it), imports ``hf_paged``, which registers the
implementation. A program that never loads a transformers model never imports hf_paged. Any failure here (hf_paged
broken or uninstalled) is caught and reported as one warning; Python's start never fails because of it.
"""

from __future__ import annotations

import sys

__all__ = ["PTH_NAME", "install"]

PTH_NAME = "hf_paged-autoload.pth"
# a no-op where hf_paged_autoload is gone (uninstalled without "disable"): pip does not know this file
_PTH_LINE = ('import importlib.util; importlib.util.find_spec("hf_paged_autoload") and '
             '__import__("hf_paged_autoload").install()\n')
_TRIGGER = "transformers.modeling_utils"


def _warn(message: str) -> None:
    import warnings

    warnings.warn(f"hf_paged_autoload: {message}", RuntimeWarning, stacklevel=2)


def _register() -> None:
    try:
        import hf_paged  # noqa: F401  (registers "hf_paged" with transformers)
    except Exception as exc:  # noqa: BLE001  (a broken install must not break the program importing transformers)
        _warn(f'importing hf_paged failed ({type(exc).__name__}: {exc}), so attn_implementation="hf_paged" is not '
              "registered; fix the install, or run python -m hf_paged_autoload disable")


class _AfterModelingUtils:
    """A meta-path finder that finds nothing itself: it lets the other finders locate ``transformers.modeling_utils``
    and has its loader import hf_paged right after the module's own code has run. It then leaves ``sys.meta_path``."""

    def find_spec(self, name, path=None, target=None):
        if name != _TRIGGER:
            return None
        self.remove()
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install() -> None:
    """Import hf_paged once transformers' model code is imported (at once if it already is). Never raises."""
    try:
        if _TRIGGER in sys.modules:
            _register()
        elif not any(isinstance(f, _AfterModelingUtils) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterModelingUtils())
    except Exception as exc:  # noqa: BLE001  (runs at Python's start)
        _warn(f"could not install the import hook ({type(exc).__name__}: {exc})")


def _pth_path() -> str:
    import os
    import sysconfig

    return os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m hf_paged_autoload", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["enable", "disable", "status"])
    action = parser.parse_args(argv).action
    path = _pth_path()
    if action == "enable":
        with open(path, "w", encoding="utf-8") as f:
            f.write(_PTH_LINE)
        print(f"enabled: {path}")
    elif action == "disable":
        if os.path.exists(path):
            os.remove(path)
        print(f"disabled: {path} removed" if not os.path.exists(path) else f"could not remove {path}")
    else:
        print(f"{'enabled' if os.path.exists(path) else 'disabled'}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
