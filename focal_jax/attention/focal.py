"""Dense and temperature-scaled (Focal) attention, and the learned temperature of Focal Attention.

Conventions (DESIGN.md): q, k, v are `[batch, seq, heads, head_dim]`; kv heads divide q heads (GQA);
`scale` defaults to `1/sqrt(head_dim)`; key j is local to query i iff `0 <= i - j <= window`.
"""

import functools

import jax
import jax.numpy as jnp

from focal_jax._axes import explicit_as_auto, like_first
from focal_jax.attention import _validate
from focal_jax.attention.masks import attention_mask
from focal_jax.attention.segments import segment_prefix, segment_total


def _repeat_kv_heads(x, n_q_heads):
    """`[B, S, Hk, D]` -> `[B, S, H, D]`: query head h reads kv head h // (H / Hk). (Plain 4-d einsums are about
    1.6x faster on CPU than grouped 5-d ones, and the copy is small next to the `[T, S]` logits.)"""
    return jnp.repeat(x, n_q_heads // x.shape[2], axis=2)


def einsum_f32(spec, a, b):
    """`jnp.einsum(spec, a, b)` with a float32 result, for products whose result feeds float32 math (attention
    logits, LM-head logits).

    With bf16 `a` and `b` the product runs in bf16 with float32 accumulation, and so do the two products of its
    backward pass: the float32 cotangent is rounded to bf16 first (as flash attention rounds dS), where autodiff
    would run them with a float32 operand, off the matmul units' 16-bit rate. Other dtypes: a plain float32
    einsum (float16 included: its narrow exponent range would flush the small cotangents of a mean loss to zero).

    Example:
      >>> import jax.numpy as jnp
      >>> einsum_f32("td,vd->tv", jnp.ones((2, 4), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16)).dtype
      dtype('float32')
    """
    if a.dtype == b.dtype == jnp.bfloat16:
        return _einsum_bf16(spec, a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _einsum_bf16(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _einsum_bf16_fwd(spec, a, b):
    return _einsum_bf16(spec, a, b), (a, b)


def _einsum_bf16_bwd(spec, residuals, cotangent):
    a, b = residuals
    cotangent = cotangent.astype(a.dtype)
    product = lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=a.dtype)
    (da,) = jax.linear_transpose(lambda a: product(a, b), a)(cotangent)
    (db,) = jax.linear_transpose(lambda b: product(a, b), b)(cotangent)
    return da, db


_einsum_bf16.defvjp(_einsum_bf16_fwd, _einsum_bf16_bwd)


def attention_logits(q, k, multiplier, softcap=None):
    """Logits `q.k * multiplier` in float32, shaped `[B, H, T, S]`, then `softcap * tanh(logits / softcap)` if
    `softcap` is set (Gemma-2 style logit capping; after the temperature).

    q `[B, T, H, D]`, k `[B, S, Hk, D]`; `multiplier` is a scalar or `[B, T, H]` (scale / temperature, per query and
    head). A per-query multiplier scales q (in q's dtype) rather than the logits, so that its gradient needs q, not
    the `[B, H, T, S]` float32 logits before scaling.
    """
    if jnp.ndim(multiplier) > 0:
        q = (q.astype(jnp.float32) * multiplier[..., None]).astype(q.dtype)
    logits = einsum_f32("bthd,bshd->bhts", q, _repeat_kv_heads(k, q.shape[2]))
    if jnp.ndim(multiplier) == 0:
        logits = logits * multiplier
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def attend(logits, v, mask):
    """Masked softmax over keys, then the weighted sum of values.

    logits `[B, H, T, S]` float32, v `[B, S, Hk, Dv]`, mask bool `[B, T, S]` -> `[B, T, H, Dv]` in v's dtype.
    A query with no visible key gets zeros. The softmax is computed in float32. With float32 `v` the value product
    takes the unnormalised weights and the normalisation is applied after it, on `[T, Dv]` rather than `[T, S]`.
    With 16-bit `v` (bf16, fp16) the probabilities are cast to v's dtype for the value product, as in
    `jax.nn.dot_product_attention`'s XLA path: that product and its two backward products run in 16 bits (the
    matmul units' rate on a GPU or TPU), and the `[B, H, T, S]` probabilities kept for the backward pass take half
    the memory.
    """
    logits = jnp.where(mask[:, None], logits, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    denom = jnp.sum(weights, axis=-1)
    denom = jnp.where(denom > 0, denom, 1.0)[..., None]
    values = _repeat_kv_heads(v, logits.shape[1])
    if jnp.dtype(v.dtype).itemsize < 4:
        out = jnp.einsum("bhts,bshd->bhtd", (weights / denom).astype(v.dtype), values)
    else:
        out = jnp.einsum("bhts,bshd->bhtd", weights, values.astype(jnp.float32)) / denom
    return jnp.transpose(out, (0, 2, 1, 3)).astype(v.dtype)


@explicit_as_auto(like_first(3, 4))
def focal_attention(q, k, v, *, temperature=1.0, scale=None, causal=True, window=None, segment_ids=None,
                    softcap=None):
    """Temperature-scaled attention (Focal Attention, Eq. 5): `softmax(q.k * scale / temperature) v`.

    Args:
      q: `[B, T, H, D]`; k: `[B, S, Hk, D]`; v: `[B, S, Hk, Dv]`, with Hk dividing H (GQA).
      temperature: a float > 0 (or a concrete 0-d array, taken as the float it holds), or an array broadcastable
        to `[B, T, H]` (one per query and head; a 2-D array is refused as ambiguous: give `[B, T, 1]`); an array
        or traced one scales q in q's dtype, a float the float32 logits. `t < 1` sharpens (the paper's best is
        0.4); `t = 1` is exactly `dot_product_attention`. For the learned temperature pass `scale=1.0,
        temperature=tau[:, :, None]`, so tau replaces `sqrt(D)`.
      scale: logit scale, default `1/sqrt(D)`.
      causal: key j visible to query i only if j <= i.
      window: if set, key j is visible only if `0 <= i - j <= window` (`|i - j| <= window` when not causal).
      segment_ids: int `[B, T]`; tokens attend only within their own segment (packed documents). The v of
        padding must be finite, as with `jax.nn.dot_product_attention`: a NaN or inf in any v reaches every
        output through `0 * NaN` in the value product, masked or not.
      softcap: None, or cap the scaled logits as `softcap * tanh(logits / softcap)` (Gemma-2 style).

    Returns:
      `[B, T, H, Dv]` in v's dtype (logits and softmax in float32; float64 inputs under `jax_enable_x64` are
      computed at float32 accuracy and returned as float64). With bf16 inputs the products keep bf16
      operands through a `jax.custom_vjp` (see `einsum_f32`): `jax.grad` works, forward mode (`jax.jvp`) does
      not; cast to float32 for it.

    Raises:
      ValueError naming the argument: q, k or v not an array (a list: convert it with `jnp.asarray`) or of
      mismatched shapes, a temperature or scale that is not a number or array or not > 0, a bad window or
      segment_ids.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
      >>> focal_attention(q, k, v, temperature=0.4).shape
      (1, 8, 2, 4)
    """
    b, t, h, _ = _validate.check_qkv(q, k, v)
    _validate.check_bool("causal", causal)
    _validate.check_window(window)
    if causal or window is not None or segment_ids is not None:
        _validate.check_self_attention(q, k)
    _validate.check_segment_ids(segment_ids, b, t)
    multiplier = _validate.logit_multiplier(q, scale, temperature)
    _validate.check_softcap(softcap)
    s = k.shape[1]
    if causal or window is not None or segment_ids is not None:
        mask = attention_mask(t, batch=b, causal=causal, window=window, segment_ids=segment_ids)
    else:
        mask = jnp.ones((b, t, s), bool)
    return attend(attention_logits(q, k, multiplier, softcap), v, mask)


@explicit_as_auto(like_first(3, 4))
def dot_product_attention(q, k, v, *, scale=None, causal=True, window=None, segment_ids=None, softcap=None):
    """Standard softmax attention, `softmax(q.k * scale) v`, the `temperature=1` case of `focal_attention`.

    Equals `jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=(window, 0))` for causal
    attention.

    Args:
      q: `[B, T, H, D]`; k: `[B, S, Hk, D]`; v: `[B, S, Hk, Dv]`, with Hk dividing H (GQA); arrays (jax or numpy).
      scale: logit scale > 0, default `1/sqrt(D)`.
      causal: key j visible to query i only if j <= i.
      window: if set, key j is visible only if `0 <= i - j <= window` (`|i - j| <= window` when not causal).
      segment_ids: int `[B, T]`; tokens attend only within their own segment (packed documents). Causal, windowed
        and segmented attention need `S == T`.
      softcap: None, or cap the scaled logits as `softcap * tanh(logits / softcap)` (Gemma-2 style).

    Returns:
      `[B, T, H, Dv]` in v's dtype (logits and softmax in float32; float64 inputs under `jax_enable_x64` are
      computed at float32 accuracy and returned as float64).

    Raises:
      ValueError naming the argument, as `focal_attention`.

    Example:
      >>> import jax
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
      >>> dot_product_attention(q, k, v, window=3).shape
      (1, 8, 2, 4)
    """
    return focal_attention(q, k, v, temperature=1.0, scale=scale, causal=causal, window=window,
                           segment_ids=segment_ids, softcap=softcap)


def clip_tau(z, tau_min, tau_max, clip):
    """`z` (float32) clipped to `[tau_min, tau_max]` as `learned_temperature`'s `clip` says: 'hard',
    'straight_through' or 'smooth'."""
    if clip == "hard":
        return jnp.clip(z, tau_min, tau_max)
    if clip == "straight_through":
        return z + jax.lax.stop_gradient(jnp.clip(z, tau_min, tau_max) - z)
    width = tau_max - tau_min
    midpoint = (tau_min + tau_max) / 2
    return tau_min + width * jax.nn.sigmoid(4.0 * (z - midpoint) / width)


TAU_MODES = ("prefix", "sequence", "token")


@explicit_as_auto(like_first(2, 2))
def learned_temperature(x, w_tau, *, tau_min, tau_max, mode="prefix", clip="hard", bias=0.0, segment_ids=None):
    """Focal Attention's learned temperature (Eq. 6): `tau = clip(mean(x @ w_tau) + bias, tau_min, tau_max)`.

    Args:
      x: `[B, T, d_model]`, the attention input (after the pre-norm).
      w_tau: `[d_model]`, one per layer (the paper's: one tau per token, shared by the heads), or `[d_model, H]`,
        one column per head (FOCAL_SPEC OQ-F1's per-head extension: one tau per token and head).
      tau_min, tau_max: clip range (paper: 5 and 10 at head_dim 128), `0 < tau_min < tau_max`: numbers, or 0-d
        arrays (traced ones too, e.g. `jax.jit` arguments: their values are then not checked).
      mode: `'prefix'` (default, causal): the running mean over tokens <= i, so tau_i never sees the future;
        `'sequence'`: the paper's literal mean over all tokens of the row (tau_i depends on later tokens);
        `'token'`: no mean, tau_i from x_i alone (FOCAL_SPEC OQ-F2). The means reset at segment boundaries
        when `segment_ids` is given. Padding is a token like any other: right padding changes no real token's
        `'prefix'` tau, but enters the `'sequence'` mean unless its segment id differs from its row's tokens'
        (`focal_jax.data` gives padding segment id 0).
      clip: `'hard'` (the paper's clip; zero gradient outside the range), `'smooth'`
        (`tau_min + (tau_max - tau_min) * sigmoid(4 (z - mid) / (tau_max - tau_min))`: slope 1 at the midpoint,
        never flat), or `'straight_through'` (clipped forward, identity gradient).
      bias: an offset added to the mean (our addition, not in the paper): a number or 0-d array, or `[H]` with a
        per-head `w_tau`. Initialise it inside `(tau_min, tau_max)`, e.g. at the midpoint, with `w_tau = 0`: a
        hard clip passes no gradient to a tau that starts outside the range.
      segment_ids: optional int `[B, T]`; the mean runs over the tokens of the token's own segment.

    Returns:
      tau `[B, T]` (`[B, T, H]` for a per-head `w_tau`) in float32 (float64 inputs under `jax_enable_x64` too).
      Use it as `focal_attention(q, k, v, scale=1.0, temperature=tau[:, :, None])` (per head: `temperature=tau`).

    Example:
      >>> import jax.numpy as jnp
      >>> tau = learned_temperature(jnp.ones((1, 4, 8)), jnp.zeros(8), tau_min=5., tau_max=10., bias=7.5)
      >>> tau.tolist()
      [[7.5, 7.5, 7.5, 7.5]]
    """
    _validate.check_array("x", x, "[batch, seq, d_model]")
    if x.ndim != 3:
        raise ValueError(f"x must have shape [batch, seq, d_model], got shape {x.shape}")
    d_model = x.shape[-1]
    _validate.check_array("w_tau", w_tau, f"[d_model] = ({d_model},) or [d_model, heads]")
    if w_tau.ndim not in (1, 2) or w_tau.shape[0] != d_model:
        raise ValueError(f"w_tau must have shape [d_model] = ({d_model},) or [d_model, heads] = ({d_model}, H), got "
                         f"shape {w_tau.shape}")
    _validate.check_scalar("tau_min", tau_min)
    _validate.check_scalar("tau_max", tau_max)
    _check_bias(bias, w_tau)
    _validate.check_positive("tau_min", tau_min)  # tau divides the logits
    if _validate.is_concrete(tau_min) and _validate.is_concrete(tau_max) and not tau_min < tau_max:
        raise ValueError(f"tau_min must be < tau_max, got tau_min={tau_min}, tau_max={tau_max}")
    _validate.check_choice("mode", mode, TAU_MODES)
    _validate.check_choice("clip", clip, ("hard", "smooth", "straight_through"))
    if clip == "smooth":  # its width and midpoint need a finite range (tau_max = inf: every tau NaN)
        _validate.check_finite("tau_max", tau_max)
    b, t, _ = x.shape
    _validate.check_segment_ids(segment_ids, b, t)
    z = tau_logits(x, w_tau)
    if mode == "token":
        mean = z
    elif segment_ids is None:
        if mode == "sequence":
            mean = jnp.broadcast_to(jnp.mean(z, axis=1, keepdims=True), z.shape)
        else:
            mean = jnp.cumsum(z, axis=1) / jnp.arange(1, t + 1).reshape((t,) + (1,) * (z.ndim - 2))
    else:
        reduce = segment_prefix if mode == "prefix" else segment_total
        per_row = jax.vmap(lambda values, ids: reduce(values, ids, "sum"))
        mean = per_row(z, segment_ids) / per_row(jnp.ones_like(z), segment_ids)
    return clip_tau(mean + bias, tau_min, tau_max, clip)


def tau_logits(x, w_tau):
    """`x @ w_tau` in float32: `[B, T, d_model] x [d_model]` -> `[B, T]`, or `x [d_model, H]` -> `[B, T, H]`."""
    return jnp.tensordot(x.astype(jnp.float32), w_tau.astype(jnp.float32), axes=1)


def _check_bias(bias, w_tau):
    """`learned_temperature`'s bias: a scalar, or `[H]` with a per-head `w_tau [d_model, H]`."""
    if w_tau.ndim == 2 and _validate.is_array(bias) and bias.ndim == 1:
        if bias.shape != w_tau.shape[1:]:
            raise ValueError(f"bias must be a number or [heads] = ({w_tau.shape[1]},) like w_tau {w_tau.shape}, got "
                             f"shape {bias.shape}")
        return
    _validate.check_scalar("bias", bias)  # (a [seq] array was added per position)
