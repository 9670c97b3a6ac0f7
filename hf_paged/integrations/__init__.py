"""Adapters between hf_paged and frameworks other than transformers' model code (accelerate: ``device_map``
placement and data parallel). They import hf_paged; hf_paged never imports them, so ``import hf_paged`` stays free
of their optional dependencies."""
