"""The transformers contract: the registered attention and mask functions, support checks, version adapter."""
