"""The version of hf_paged (``hf_paged.__version__``)."""

__version__ = "0.1.0"
