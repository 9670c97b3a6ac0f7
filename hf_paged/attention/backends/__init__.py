"""Attention backends, one per file; each registers itself on import (see ``base.py``)."""
