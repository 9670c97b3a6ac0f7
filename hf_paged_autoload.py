"""Make ``attn_implementation="hf_paged"`` known to transformers in programs that never ``import hf_paged``.

Tools that load a model by name, such as lm-evaluation-harness's ``hf`` model
(``lm_eval --model hf --model_args pretrained=DIR,attn_implementation=hf_paged``), cannot be told to import a plugin,
and neither transformers nor lm-eval discovers attention implementations by itself. So this one file, kept outside
the ``hf_paged`` package, can be run at Python's start by a ``.pth`` file in ``site-packages``, which only an
explicit command writes::

    python -m hf_paged_autoload enable     # writes hf_paged-autoload.pth into this environment's site-packages
    python -m hf_paged_autoload status
    python -m hf_paged_autoload disable    # removes it

At start it imports ``hf_paged``, which is light (a few milliseconds, no torch, no transformers): hf_paged's own
import hook (``hf_paged/hf/_autoregister.py``) registers the implementation once ``transformers.modeling_utils`` has
been imported (the first model class a program touches imports it). A program that never loads a transformers model
never imports torch because of it. Any failure here (hf_paged broken or uninstalled) is caught and reported as one
warning; Python's start never fails because of it.
"""

from __future__ import annotations

import sys

__all__ = ["PTH_NAME", "install"]

PTH_NAME = "hf_paged-autoload.pth"
# a no-op where hf_paged_autoload is gone (uninstalled without "disable"): pip does not know this file
_PTH_LINE = ('import importlib.util; importlib.util.find_spec("hf_paged_autoload") and '
             '__import__("hf_paged_autoload").install()\n')


def install() -> None:
    """Have attn_implementation="hf_paged" registered once transformers' model code is imported (at once if it
    already is): ``import hf_paged`` sets that up. Never raises."""
    try:
        import hf_paged  # noqa: F401  (light: registers with transformers through its import hook)
    except Exception as exc:  # noqa: BLE001  (runs at Python's start, which must not fail because of hf_paged)
        import warnings

        warnings.warn(f'hf_paged_autoload: importing hf_paged failed ({type(exc).__name__}: {exc}), so '
                      'attn_implementation="hf_paged" is not registered; fix the install, or run python -m '
                      "hf_paged_autoload disable", RuntimeWarning, stacklevel=2)


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
