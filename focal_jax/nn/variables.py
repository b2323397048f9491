"""Parameter types that a retrofit trains, so that trainable selection works by type (`nnx.All`, `nnx.Not`).

A Focus retrofit trains only `Centroid`s (and `Temperature`s when a learned Focal temperature is added), the LoRA
baseline only `LoRA`s; full fine-tuning trains every `nnx.Param`. All are subclasses of
`nnx.Param`, so `nnx.Param` filters still see them.
"""

from flax import nnx


class Centroid(nnx.Param):
    """Focus routing parameters of one layer: the projection `w_g [d_model, d_g]` and the centroids `[K, d_g]`,
    shared by all heads, no bias. A Focus retrofit adds these to a pretrained model and trains only them."""


class Temperature(nnx.Param):
    """Focal Attention's learned-temperature parameters of one layer: `w_tau [d_model]` and the scalar offset
    `tau_bias` (initialised at the middle of `(tau_min, tau_max)`); `[d_model, n_heads]` and `[n_heads]` with one
    tau per head, and no `tau_bias` in the literal form (`AttentionConfig.tau_granularity`, `tau_bias`). Trained by
    a learned-Focal retrofit."""


class LoRA(nnx.Param):
    """Low-rank update of one attention projection (`focal_jax.nn.lora`, the LoRA baseline retrofit): `lora_a
    [in, rank]` (random) and `lora_b [rank, out]` (zeros, so the model starts unchanged), added to the frozen
    projection as `(alpha / rank) * x @ lora_a @ lora_b`. A LoRA retrofit trains only these."""
