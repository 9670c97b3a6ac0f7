"""A package's exported names, each imported from its module on first use (PEP 562's module ``__getattr__``).

``import hf_paged`` and the command line's parsing then import no torch: ``hf-paged --help`` answers at once, and a
program pays for torch and transformers when it first touches a name that needs them. This is laziness for start-up
time, not a way around an import cycle: a package's table names modules of its own folder and the folders below it,
and ``tests/test_architecture.py`` reads each table (a module-level ``_LAZY`` dict literal, name -> module) as
imports.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose names ``table`` maps to the module defining each."""

    def __getattr__(name: str) -> object:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # found once: later lookups are plain attributes
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
