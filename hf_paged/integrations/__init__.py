"""Adapters between hf_paged and frameworks other than transformers' model code (installed as
``hf_paged.integrations``). They import hf_paged; hf_paged never imports them."""
