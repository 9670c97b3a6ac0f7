"""Sphinx configuration of the API reference: the docstrings of ``hf_paged.__all__``, nothing else.

    python -m sphinx -W -b html docs/api build/api

``tests/test_api_reference.py`` builds it with warnings as errors, so the public docstrings stay valid
reStructuredText. No network is needed (no intersphinx).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # document this checkout, installed or not

project = "hf_paged"
author = "the hf_paged authors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options: dict = {}
autodoc_inherit_docstrings = False
html_theme = "alabaster"
html_static_path: list[str] = []
