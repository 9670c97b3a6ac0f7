"""Kernels: the skinny linear kernel and a decode step's matrix products against the card's roofline."""
