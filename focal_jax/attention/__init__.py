"""Pure attention functions of Focal Attention and Focus: no Flax, no state.

Layout `[batch, seq, heads, head_dim]`; kv heads divide q heads (GQA); `scale` defaults to `1/sqrt(head_dim)`;
key j is local to query i iff `0 <= i - j <= window`; `segment_ids [batch, seq]` keep packed documents apart.
Array arguments are jax or numpy arrays (a Python list is refused by name: convert it with `jnp.asarray`); logits,
softmax and Sinkhorn run in float32, so float64 inputs (under `jax_enable_x64`) get float32 accuracy.
See DESIGN.md for the conventions and `reference.py` for the naive versions everything is tested against.
"""

from focal_jax.attention.focal import dot_product_attention, focal_attention, learned_temperature
from focal_jax.attention.focus import (focus_attention, focus_mask, focus_sparse_attention, routing_scores,
                                       topk_membership)
from focal_jax.attention.sinkhorn import sinkhorn

__all__ = [
    "dot_product_attention",
    "focal_attention",
    "learned_temperature",
    "routing_scores",
    "sinkhorn",
    "focus_attention",
    "topk_membership",
    "focus_mask",
    "focus_sparse_attention",
]
