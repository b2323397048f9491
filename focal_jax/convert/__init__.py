"""Hugging Face import and export: `from focal_jax.convert.hf import from_hf, to_hf`."""
