"""End to end: whole ``generate_batch`` calls, cold starts and A/B runs of two checkouts."""
