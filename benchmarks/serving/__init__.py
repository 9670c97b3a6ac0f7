"""Serving: ``hf-paged serve`` against ``transformers serve`` under one streaming load, and the pieces they share."""
