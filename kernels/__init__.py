"""Pallas kernels, installed as ``focal_jax.kernels``.

The fused block-sparse Focus kernel belongs here (it is `focus_sparse_attention(..., impl='pallas')`);
it has not been written yet, so that impl raises a clear error.
"""
