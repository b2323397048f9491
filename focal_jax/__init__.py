"""focal_jax: Focal Attention and Focus in JAX.

The pure attention functions live in :mod:`focal_jax.attention`; see DESIGN.md for the layout.
"""

__version__ = "0.6.31"
