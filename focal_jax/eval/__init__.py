"""Evaluation: perplexity (soft and hard top-k, with the pairs retained), the long-context recall suite, group
diagnostics, and an lm-evaluation-harness adapter. Each module has a command line: `python -m focal_jax.eval.<module>`.
"""
