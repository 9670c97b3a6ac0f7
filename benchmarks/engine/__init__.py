"""The engine's own costs: host time per step, its start in a fresh process, CUDA-graph capture."""
