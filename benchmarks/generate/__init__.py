"""Plain ``model.generate``: ms per decode step by attention and cache setup, and where a step's host time goes."""
