"""Flax NNX modules built on `focal_jax.attention`: layers, the pluggable `Attention` module, model families."""
