"""Shared pieces of experiment configs, installed as `focal_jax.configs`."""
