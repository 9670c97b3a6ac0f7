"""Parallel: tensor and data parallel over the GPUs of one host, and the all-reduces of a tensor-parallel step."""
