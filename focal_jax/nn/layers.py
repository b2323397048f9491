"""Building blocks of the LLaMA-family decoder: RMSNorm, rotary embeddings (pure functions), SwiGLU MLP, embedding
lookup; the checks of a dtype and of an `rngs` argument that model builders share."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focal_jax._axes import leading_spec
from focal_jax.attention.segments import segment_labels


class RMSNorm(nnx.Module):
    """`x / sqrt(mean(x^2) + eps) * scale` over the last axis, computed in float32 (as OLMo-2 / Qwen3 / LLaMA in
    Hugging Face), returned in x's dtype. `scale [dim]` starts at ones."""

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs | None = None):
        del rngs  # deterministic init; the argument keeps the usual module signature
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
        if x.shape[-1] != self.scale.shape[0]:
            raise ValueError(f"RMSNorm expects last axis {self.scale.shape[0]}, got x of shape {x.shape}")
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta, *, linear_factor: float | None = None, llama3=None):
    """The `head_dim / 2` rotary frequencies `1 / theta^(2i / head_dim)` (float32), rescaled as Hugging Face's
    'linear' rope type (`linear_factor`: every frequency divided by it, i.e. positions compressed by it) or 'llama3'
    type (`llama3 = (factor, low_freq_factor, high_freq_factor, original_len)`: wavelengths longer than
    `original_len / low_freq_factor` are stretched by `factor`, those shorter than `original_len /
    high_freq_factor` kept, the ones between interpolated). `theta` is a number, or an array (e.g. `[B, T]`: then
    `[B, T, head_dim / 2]`).

    Example:
      >>> [round(float(f), 6) for f in rope_inverse_frequencies(4, 100.0, linear_factor=2.0)]
      [0.5, 0.05]
    """
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got head_dim={head_dim}")
    theta = jnp.asarray(theta, jnp.float32)[..., None]  # a number, or one per token (`dynamic_ntk_theta`)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if linear_factor is not None:
        inv_freq = inv_freq / linear_factor
    if llama3 is not None:
        factor, low_freq_factor, high_freq_factor, original_len = llama3
        wavelength = 2 * jnp.pi / inv_freq
        smooth = (original_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = jnp.where(wavelength > original_len / low_freq_factor, inv_freq / factor,
                             jnp.where(wavelength < original_len / high_freq_factor, inv_freq, interpolated))
    return inv_freq


def rope_frequencies(positions, head_dim: int, theta, **scaling):
    """cos, sin `[B, T, head_dim]` (float32) in the Hugging Face "rotate_half" layout: frequency i of
    `rope_inverse_frequencies(head_dim, theta, **scaling)` sits at both i and i + head_dim / 2."""
    inv_freq = rope_inverse_frequencies(head_dim, theta, **scaling)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x):
    """`[x1, x2] -> [-x2, x1]` on the last axis (halves, not interleaved pairs)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def dynamic_ntk_theta(theta, positions, head_dim: int, *, factor: float, trained_len: int, segment_ids=None):
    """Dynamic NTK RoPE base for evaluation past the trained length (FOCAL_SPEC OQ-F10, as Hugging Face's
    'dynamic' rope type), per token: with L the length of the token's sequence (1 + the largest position in its
    segment of `segment_ids [B, T]`, or in its row without them), `theta * (factor * L / trained_len - (factor -
    1)) ** (head_dim / (head_dim - 2))` when L > trained_len, else `theta` unchanged. Hugging Face takes L from the
    whole batch; here a sequence gets the same base alone, in a padded batch or packed with others.

    Returns float32 `[B, T]`.

    Example:
      >>> import jax.numpy as jnp
      >>> positions = jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
      >>> dynamic_ntk_theta(100.0, positions, 4, factor=2.0, trained_len=4).tolist()  # L = 5: (2 * 5 / 4 - 1)^2
      [[225.0, 225.0, 225.0, 225.0, 225.0, 225.0, 225.0, 225.0]]
      >>> dynamic_ntk_theta(100.0, positions, 4, factor=2.0, trained_len=4,
      ...                   segment_ids=jnp.array([[1, 1, 1, 2, 2, 2, 2, 2]])).tolist()  # L = 3, then 5
      [[100.0, 100.0, 100.0, 225.0, 225.0, 225.0, 225.0, 225.0]]
    """
    positions = jnp.asarray(positions)
    if segment_ids is None:
        longest = jnp.broadcast_to(jnp.max(positions, axis=-1, keepdims=True), positions.shape)
    else:
        def per_row(row_positions, row_segments):
            labels = segment_labels(row_segments)
            return jax.ops.segment_max(row_positions, labels, num_segments=labels.shape[0])[labels]
        longest = jax.vmap(per_row)(positions, jnp.asarray(segment_ids))
    length = jnp.maximum(longest.astype(jnp.float32) + 1.0, float(trained_len))
    return theta * (factor * length / trained_len - (factor - 1.0)) ** (head_dim / (head_dim - 2))


def rope(x, positions, theta: float = 10000.0, **scaling):
    """Rotary position embedding of `x [B, T, H, D]` at integer `positions [B, T]`, Hugging Face layout:
    `x * cos + rotate_half(x) * sin` (the layout HF LLaMA / Mistral / Qwen / OLMo checkpoints store q and k in,
    so their weights load without a permutation). Computed in float32, returned in x's dtype. `theta` may be a
    traced scalar (see `dynamic_ntk_theta`); `scaling`: `linear_factor` or `llama3` of `rope_inverse_frequencies`.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> bool(jnp.allclose(rope(x, jnp.zeros((1, 3), int)), x))
      True
    """
    if x.ndim != 4:
        raise ValueError(f"x must have shape [batch, seq, heads, head_dim], got shape {x.shape}")
    if tuple(positions.shape) != x.shape[:2]:
        raise ValueError(f"positions must have shape [batch, seq] = {x.shape[:2]}, got shape {positions.shape}")
    cos, sin = rope_frequencies(positions, x.shape[-1], theta, **scaling)
    x32 = x.astype(jnp.float32)
    out = x32 * cos[:, :, None] + rotate_half(x32) * sin[:, :, None]
    return out.astype(x.dtype)


class SwiGLU(nnx.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))`, no biases (LLaMA / Mistral / Qwen / OLMo-2)."""

    def __init__(self, d_model: int, intermediate: int, *, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(d_model, intermediate, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(d_model, intermediate, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(intermediate, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


def float_dtype(dtype, name: str = "dtype"):
    """`dtype` (e.g. `jnp.bfloat16`, `'float32'`) as a numpy dtype; ValueError naming `name` unless it is a
    floating-point type (an integer dtype would truncate every weight)."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        raise ValueError(f"{name} must be a floating-point dtype (e.g. jnp.float32, jnp.bfloat16), got "
                         f"{name}={dtype!r}")
    return resolved


def as_rngs(rngs, name: str = "rngs") -> nnx.Rngs:
    """`nnx.Rngs` from `rngs`: an `nnx.Rngs` as it is, an integer seed, or None (seed 0); ValueError otherwise."""
    if isinstance(rngs, nnx.Rngs):
        return rngs
    if rngs is None or (isinstance(rngs, (int, np.integer)) and not isinstance(rngs, bool)):
        return nnx.Rngs(params=0 if rngs is None else int(rngs))
    raise ValueError(f"{name} must be an nnx.Rngs, an integer seed or None, got {name}={rngs!r}")


def check_ids(ids: np.ndarray, n: int, what: str):
    """ValueError naming `what` unless every id of `ids` (a numpy array) is in `[0, n)`."""
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise ValueError(f"{what} must be in [0, {n}), got values from {ids.min()} to {ids.max()}")


def embed(table: nnx.Embed, ids, *, what: str = "tokens"):
    """Rows `ids [...]` of `table`'s embedding `[N, d]` -> `[..., d]`, in the dtype the embedding has now. (Calling
    `nnx.Embed` promotes to the dtype it was built with, so a table cast to bf16 for the forward pass, as the
    trainer's `compute_dtype` does, would give float32 activations, and every layer after it would compute in
    float32.)

    An id outside `[0, N)` is a ValueError naming `what` when `ids` is concrete; under a transformation its row is
    NaN (a negative id does not wrap around to the end of the table)."""
    n = table.embedding.shape[0]
    if not isinstance(ids, jax.core.Tracer):
        check_ids(np.asarray(ids), n, what)
    return jnp.take(table.embedding[...], jnp.where(ids < 0, n, ids), axis=0, mode="fill")


def apply_block(block, x, *, positions, segment_ids=None, remat: bool = False):
    """`block(x, positions=..., segment_ids=...)`, rematerialised in the backward pass when `remat` (activation
    checkpointing: only the block's input is kept; its inside is recomputed during differentiation)."""
    def call(block, x, positions, segment_ids):
        return block(x, positions=positions, segment_ids=segment_ids)
    return nnx.remat(call)(block, x, positions, segment_ids) if remat else call(block, x, positions, segment_ids)


def rows_at(x, logits_at):
    """`x [B, T, d]` at the sequence indices `logits_at [B, P]` (integers in [0, T): a ValueError when concrete, else
    clipped) -> `[B, P, d]`; `x` itself when `logits_at` is None. The models project only these rows onto the
    vocabulary, so a long prompt's prefill need not hold `[B, T, vocab]` logits."""
    if logits_at is None:
        return x
    logits_at = jnp.asarray(logits_at)
    if logits_at.ndim != 2 or logits_at.shape[0] != x.shape[0] or not jnp.issubdtype(logits_at.dtype, jnp.integer):
        raise ValueError(f"logits_at must be integer indices [batch, n] with batch {x.shape[0]}, got shape "
                         f"{logits_at.shape} dtype {logits_at.dtype}")
    if not isinstance(logits_at, jax.core.Tracer):
        concrete = np.asarray(logits_at)
        if concrete.size and (concrete.min() < 0 or concrete.max() >= x.shape[1]):
            raise ValueError(f"logits_at must be sequence indices in [0, {x.shape[1]}), got values from "
                             f"{concrete.min()} to {concrete.max()}")
    return jnp.take_along_axis(x, logits_at[:, :, None], axis=1, mode="clip")


def model_output_spec(model, tokens, positions=None, segment_ids=None, cache=None, logits_at=None):
    """The sharding of `model(tokens, ...)`'s output under a mesh with Explicit axes (`explicit_as_auto`): logits
    `[B, T, V]` split over the batch as `tokens` is; with a `cache`, the new cache as the given one."""
    logits = leading_spec(tokens, 1, 3)
    if cache is None:
        return logits
    return logits, jax.tree.map(lambda x: leading_spec(x, jnp.ndim(x), jnp.ndim(x)), cache)
