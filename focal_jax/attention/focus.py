"""Focus: routing scores, the soft-gated training form, hard top-k membership and hard sparse attention.

Tokens are routed to K groups by learned centroids (`routing_scores` then `sinkhorn`). In training every token
attends to its local window at full strength and to distant tokens through a gate on their group affinity
(`focus_attention`). At inference the groups become a hard mask: query i sees key j iff j <= i and (j is local or
they share a group) (`topk_membership`, `focus_mask`, `focus_sparse_attention`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from focal_jax._axes import explicit_as_auto, like_first
from focal_jax.attention import _validate
from focal_jax.attention.decomposed import decomposed_attention
from focal_jax.attention.focal import attend, attention_logits
from focal_jax.attention.masks import causal_mask, group_mask, local_mask, segment_mask
from focal_jax.attention.sink import sink_key_mask

GATES = ("paper", "log")
IMPLS = ("reference", "decomposed", "pallas")


def routing_scores(h, w_g, centroids, *, tau=0.1, normalize=True):
    """Token-to-group scores: `cos(h @ w_g, centroids[k]) / tau` (Focus Eq. 1, cosine form).

    Args:
      h: `[B, T, d_model]`, the attention input of the layer (after the pre-norm).
      w_g: `[d_model, d_g]` routing projection, one per layer, shared by all heads.
      centroids: `[K, d_g]`.
      tau: routing temperature (paper: 0.1), applied once here; `sinkhorn` takes the result as is.
      normalize: True for cosine similarity (the default, as in SwAV); False for the raw dot product / tau.

    Returns:
      float32 `[B, T, K]`.

    Example:
      >>> import jax.numpy as jnp
      >>> scores = routing_scores(jnp.ones((1, 3, 8)), jnp.ones((8, 2)), jnp.array([[1., 1.], [1., -1.]]))
      >>> scores.shape, [s + 0.0 for s in jnp.round(scores[0, 0], 4).tolist()]  # + 0.0: zero's sign varies
      ((1, 3, 2), [10.0, 0.0])
    """
    _validate.check_array("h", h, "[batch, seq, d_model]")
    _validate.check_array("w_g", w_g, "[d_model, d_g]")
    _validate.check_array("centroids", centroids, "[K, d_g]")
    if h.ndim != 3:
        raise ValueError(f"h must have shape [batch, seq, d_model], got shape {h.shape}")
    if w_g.ndim != 2 or w_g.shape[0] != h.shape[-1]:
        raise ValueError(f"w_g must have shape [d_model={h.shape[-1]}, d_g], got shape {w_g.shape}")
    if centroids.ndim != 2 or centroids.shape[1] != w_g.shape[1]:
        raise ValueError(f"centroids must have shape [K, d_g={w_g.shape[1]}], got shape {centroids.shape}")
    if centroids.shape[0] < 1:
        raise ValueError(f"centroids must hold at least one group (K >= 1), got K={centroids.shape[0]}")
    _validate.check_scalar("tau", tau)
    _validate.check_positive("tau", tau)
    _validate.check_bool("normalize", normalize)
    projected = h.astype(jnp.float32) @ w_g.astype(jnp.float32)
    centroids = centroids.astype(jnp.float32)
    if normalize:
        projected, centroids = unit_rows(projected), unit_rows(centroids)
    return projected @ centroids.T / tau


def unit_rows(x):
    """`x / max(|x|, 1e-6)` row-wise (`[..., d]` -> `[..., d]`), with a finite gradient at a zero row (that of
    `jnp.linalg.norm` is NaN there, and a zero input row or centroid would fill the whole router's gradient with
    NaN)."""
    return x / jnp.sqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), 1e-12))


def _visible(b, t, window, segment_ids, sink):
    """Causal (and same-segment) pairs, and among them those always visible (local, or a sink key: one of the first
    `sink` tokens of its segment): two bool `[B, T, T]`."""
    pos = jnp.arange(t)
    causal = jnp.broadcast_to(causal_mask(pos, pos), (b, t, t))
    if segment_ids is not None:
        causal = causal & segment_mask(segment_ids, segment_ids)
    always = causal & (local_mask(pos, pos, window) | sink_key_mask(segment_ids, sink, b, t)[:, None, :])
    return causal, always


@explicit_as_auto(like_first(3, 4))
def focus_attention(q, k, v, g, *, window=128, gate="paper", lam=10.0, temperature=1.0, scale=None,
                    segment_ids=None, sink=0, softcap=None):
    """Focus soft-gated attention, the training form (dense, O(T^2)).

    Logits `l_ij = q_i.k_j * scale / temperature` (the Focal temperature applies first); affinity
    `a_ij = g_i . g_j`; local pairs (`0 <= i - j <= window`) are never gated; distant causal pairs are gated:
      - `gate='paper'` (Eq. 2 literally): `l_ij * sigmoid(lam * a_ij)`;
      - `gate='log'`: `l_ij + log sigmoid(lam * (a_ij - 1/2))`, which tends to the hard mask as lam grows.
    Then the causal (same-segment) softmax.

    Args:
      q: `[B, T, H, D]`; k, v: `[B, T, Hk, D]` / `[B, T, Hk, Dv]` (Hk divides H).
      g: `[B, T, K]` soft group assignments (rows of `sinkhorn`), shared by all heads.
      window: local window w >= 0 (paper: 128). lam: gate steepness (not given by the paper; default 10).
      temperature, scale, segment_ids: as in `focal_attention`.
      sink: the first `sink` tokens of each segment (of the row without segment ids) are ungated for every later
        query of that segment, like local keys (an attention sink, FOCUS_SPEC OQ-12; off by default, not in the
        paper).
      softcap: None, or `softcap * tanh(logits / softcap)` before the gate (FOCUS_SPEC OQ-13).

    Returns:
      `[B, T, H, Dv]` in v's dtype (logits and softmax in float32; float64 inputs under `jax_enable_x64` are
      computed at float32 accuracy and returned as float64).

    Raises:
      ValueError naming the argument: q, k, v or g not an array (a list: convert it with `jnp.asarray`) or of
      mismatched shapes, and the checks of `focal_attention`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
      >>> g = jnp.full((1, 8, 2), 0.5)
      >>> focus_attention(q, k, v, g, window=2).shape
      (1, 8, 2, 4)
    """
    b, t = _validate.check_focus_inputs(q, k, v, g, "g", window, segment_ids, sink)
    _validate.check_choice("gate", gate, GATES)
    _validate.check_scalar("lam", lam)
    _validate.check_positive("lam", lam)  # (lam < 0 would gate the pairs of shared groups most)
    _validate.check_finite("lam", lam)  # (lam = inf: inf * 0 = NaN logits wherever the affinity is 0, or 1/2)
    multiplier = _validate.logit_multiplier(q, scale, temperature)
    _validate.check_softcap(softcap)
    logits = attention_logits(q, k, multiplier, softcap)
    affinity = jnp.einsum("btk,bsk->bts", g.astype(jnp.float32), g.astype(jnp.float32))[:, None]
    if gate == "paper":
        gated = logits * jax.nn.sigmoid(lam * affinity)
    else:
        gated = logits + jax.nn.log_sigmoid(lam * (affinity - 0.5))
    causal, ungated = _visible(b, t, window, segment_ids, sink)
    logits = jnp.where(ungated[:, None], logits, gated)
    return attend(logits, v, causal)


def topk_membership(g, k):
    """Hard membership in the k largest groups of each token.

    Args:
      g: `[B, T, K]` group scores or assignments. k: 1 <= k <= K.

    Returns:
      bool `[B, T, K]` with exactly k True per token (ties go to the lower group index).

    Example:
      >>> import jax.numpy as jnp
      >>> topk_membership(jnp.array([[[0.1, 0.7, 0.2]]]), 2).tolist()
      [[[False, True, True]]]
    """
    _validate.check_array("g", g, "[batch, seq, K]")
    if g.ndim != 3:
        raise ValueError(f"g must have shape [batch, seq, K], got shape {g.shape}")
    n_groups = g.shape[-1]
    if n_groups < 1:
        raise ValueError(f"g must have at least one group (K >= 1), got K={n_groups}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n_groups:
        raise ValueError(f"k must be an integer with 1 <= k <= K={n_groups}, got k={k!r}")
    g = jnp.where(g == 0, jnp.zeros_like(g), g)  # top_k ranks -0.0 below +0.0; they tie
    _, top = jax.lax.top_k(g, k)
    return jnp.any(jax.nn.one_hot(top, n_groups, dtype=jnp.int32) > 0, axis=-2)


@explicit_as_auto(like_first(2, 3))
def focus_mask(membership, *, window, segment_ids=None, sink=0):
    """The hard Focus mask: query i sees key j iff `j <= i`, same segment, and (`i - j <= window` or they share a
    group or j is a sink key, one of the first `sink` tokens of its segment).

    Args:
      membership: bool `[B, T, K]` (e.g. from `topk_membership`). window: int >= 0.
      segment_ids: optional int `[B, T]`.
      sink: the first `sink` tokens of each segment (of the row without segment ids) are visible to every later
        query of that segment (an attention sink, FOCUS_SPEC OQ-12); default 0 (off).

    Returns:
      bool `[B, T, T]`.

    Example:
      >>> import jax.numpy as jnp
      >>> m = jnp.array([[[True, False], [False, True], [True, False]]])
      >>> focus_mask(m, window=0).astype(int).tolist()
      [[[1, 0, 0], [0, 1, 0], [1, 0, 1]]]
    """
    _validate.check_array("membership", membership, "[batch, seq, K]")
    if membership.ndim != 3:
        raise ValueError(f"membership must have shape [batch, seq, K], got shape {membership.shape}")
    _validate.check_membership_dtype(membership)
    _validate.check_window(window, allow_none=False)
    _validate.check_sink(sink)
    b, t, _ = membership.shape
    _validate.check_segment_ids(segment_ids, b, t)
    causal, always = _visible(b, t, window, segment_ids, sink)
    membership = membership.astype(bool)
    return causal & (always | group_mask(membership, membership))


@explicit_as_auto(like_first(3, 4))
def focus_sparse_attention(q, k, v, membership, *, window=128, temperature=1.0, scale=None, segment_ids=None,
                           sink=0, softcap=None, impl="reference", block_size=None, max_groups=None):
    """Hard Focus attention at inference: plain (scaled) logits under `focus_mask`, no gate values.

    Args:
      q: `[B, T, H, D]`; k, v: `[B, T, Hk, D]` / `[B, T, Hk, Dv]` (Hk divides H).
      membership: bool `[B, T, K]`, the groups of each token (`topk_membership(g, k)`); any number per token.
      window: local window w >= 0. temperature, scale, segment_ids: as in `focal_attention`. `'decomposed'` and
        `'pallas'` compile a numeric temperature or scale into their program, so each new value compiles again
        (seconds); to sweep values, pass the temperature as an argument of your own `jax.jit` (traced: one
        compilation).
      sink: the first `sink` tokens of each segment are visible to every later query of it (see `focus_mask`);
        default 0 (off). `'decomposed'` and `'pallas'` add the sink's pairs outside the window and the groups (at
        most `sink` per query, gathered 16 keys at a time) in plain XLA and merge them by log-sum-exp
        (`focal_jax.attention.sink`).
      softcap: None, or `softcap * tanh(logits / softcap)` on the scaled logits.
      impl: `'reference'` (dense masked, O(T^2) memory), `'decomposed'` (the exact blockwise fast path:
        same-group causal pairs on group-sorted tokens plus cross-group local pairs, merged by log-sum-exp;
        O(T * block) memory), or `'pallas'` (the same two sets as block-sparse Pallas kernels with
        the masks computed inside from token ids, forward and backward; Triton on GPU, Mosaic on TPU, interpret
        mode on CPU; see `focal_jax.kernels.focus_sparse`). Under a `jax.set_mesh(mesh)` context the kernels run
        per shard (`shard_map`: batch over the mesh's 'data' / 'fsdp' axes, heads over 'tensor'); without one,
        as they are. `'decomposed'` and `'pallas'` define their own backward pass (`jax.custom_vjp`): `jax.grad`
        works, forward mode (`jax.jvp`, `jax.hessian`) and second derivatives do not; use `'reference'` for those.
      block_size: tile size of `'decomposed'` (default 128) and of `'pallas'`'s group set (a power of two; default
        64, and 128 on TPU, where it must be a multiple of 128).
      max_groups: `'decomposed'` and `'pallas'`: at most this many groups per token (the k of `topk_membership`),
        so their sorted entry arrays hold `max_groups * T` rows instead of `K * T` (K / k times less gathering and
        sorting). Default None: K. A token in more groups is an error: raised when `membership` is concrete;
        under `jax.jit` (every impl) the output of that token's sequence is NaN.

    Returns:
      `[B, T, H, Dv]` in v's dtype. Every impl multiplies in the dtype q, k and v promote to (bf16: the
      probabilities and dS rounded to bf16 for their products, as in flash attention) with float32 accumulation
      and a float32 softmax; float64 inputs under `jax_enable_x64` are computed at float32 accuracy and returned as
      float64. A numeric temperature (and scale: a number, or a concrete 0-d array) multiplies the float32
      logits; in `'reference'` and `'decomposed'` an array one (per query, or a 0-d one traced by an outer
      `jax.jit` or `jax.grad`) scales q before the products, in q's dtype: with bf16 q the multiplier is rounded
      with it (relative 2^-8). `'pallas'` multiplies each block's float32 scores by either.

    Raises:
      ValueError naming the argument: q, k, v or membership not an array (a list: convert it with `jnp.asarray`)
      or of mismatched shapes, a floating-point membership, and the checks of `focal_attention`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 8, 2, 4))
      >>> m = topk_membership(jax.random.normal(jax.random.key(1), (1, 8, 3)), 1)
      >>> a = focus_sparse_attention(q, k, v, m, window=2)
      >>> b = focus_sparse_attention(q, k, v, m, window=2, impl='decomposed', block_size=4)
      >>> bool(jnp.abs(a - b).max() < 1e-5)
      True
    """
    _validate.check_focus_inputs(q, k, v, membership, "membership", window, segment_ids, sink)
    _validate.check_membership_dtype(membership)
    _validate.check_choice("impl", impl, IMPLS)
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer))
                                   or block_size < 1):
        raise ValueError(f"block_size must be an integer >= 1, got block_size={block_size!r}"
                         f"{_validate.static_hint('block_size', block_size)}")
    multiplier = _validate.logit_multiplier(q, scale, temperature)
    _validate.check_softcap(softcap)
    membership = membership.astype(bool)
    _validate.check_max_groups(membership, max_groups)
    if impl == "reference":
        mask = focus_mask(membership, window=window, segment_ids=segment_ids, sink=sink)
        out = attend(attention_logits(q, k, multiplier, softcap), v, mask)
    elif impl == "pallas":
        from focal_jax.kernels.focus_sparse import focus_sparse_pallas  # kernels build on attention, not back

        if block_size is not None and block_size & (block_size - 1):
            raise ValueError(f"impl='pallas' needs a power-of-two block_size, got block_size={block_size}")
        out = focus_sparse_pallas(q, k, v, membership, multiplier=multiplier, window=window,
                                  segment_ids=segment_ids, sink=sink, softcap=softcap, block_size=block_size,
                                  max_groups=max_groups)
    else:  # 'decomposed'
        out = decomposed_attention(q, k, v, membership, multiplier=multiplier, window=window,
                                   segment_ids=segment_ids, sink=sink, softcap=softcap,
                                   block_size=block_size or 128, max_groups=max_groups)
    if max_groups is None:
        return out
    too_many = jnp.any(jnp.sum(membership, axis=-1) > max_groups, axis=1)  # [B]
    return jnp.where(too_many[:, None, None, None], jnp.nan, out).astype(out.dtype)
