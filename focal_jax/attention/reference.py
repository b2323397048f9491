"""Naive O(T^2) references for every attention function: the ground truth the tests compare against.

Written independently of the fast code: this module imports nothing from focal_jax and shares no helper with it.
Everything is spelled out: per-pair masks built by broadcasting token positions, an explicit softmax, and
(for Sinkhorn and the learned temperature) plain numpy float64 loops. Slow on purpose; use only for small T.

Conventions (DESIGN.md): q, k, v are `[B, T, H, D]`; GQA: query head h uses kv head `h // (H // Hk)`;
`scale` defaults to `1/sqrt(D)`; key j is local to query i iff `0 <= i - j <= window`;
`segment_ids [B, T]` (int): only tokens with equal ids may attend to each other.
"""

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "attention",
    "learned_temperature",
    "sinkhorn",
    "routing_scores",
    "focus_soft_attention",
    "focus_hard_mask",
    "focus_hard_attention",
]


# ----------------------------------------------------------------------------------------------------------------
# Small building blocks (private to this module).
# ----------------------------------------------------------------------------------------------------------------

def _expand_kv_heads(x, num_q_heads):
    """`[B, S, Hk, D]` -> `[B, S, H, D]`: query head h reads kv head `h // (H // Hk)`."""
    hk = x.shape[2]
    assert num_q_heads % hk == 0, (num_q_heads, hk)
    group = num_q_heads // hk
    kv_head_of = np.arange(num_q_heads) // group           # [H]
    return x[:, :, kv_head_of, :]


def _per_query_factor(temperature, b, t, h):
    """`1 / temperature` as a float32 array broadcast to `[B, T, H]` (temperature scalar or broadcastable)."""
    temp = jnp.asarray(temperature, jnp.float32)
    return jnp.broadcast_to(1.0 / temp, (b, t, h))


def _raw_logits(q, k, scale, temperature):
    """`logits[b, h, i, j] = (q[b, i, h] . k[b, j, kv(h)]) * scale / temperature[b, i, h]`, float32."""
    b, t, h, d = q.shape
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    k_full = _expand_kv_heads(k, h).astype(jnp.float32)
    qk = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), k_full,
                    precision=jax.lax.Precision.HIGHEST)
    inv_t = _per_query_factor(temperature, b, t, h)                 # [B, T, H]
    return qk * scale * jnp.transpose(inv_t, (0, 2, 1))[:, :, :, None]


def _soft_cap(logits, softcap):
    """`softcap * tanh(logits / softcap)`, or the logits unchanged when softcap is None."""
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


def _pair_positions(t):
    """Query positions i `[T, 1]` and key positions j `[1, T]`."""
    pos = jnp.arange(t)
    return pos[:, None], pos[None, :]


def _same_segment(segment_ids, b, t):
    """bool `[B, T, T]`: `segment_ids[b, i] == segment_ids[b, j]` (all True without segment ids)."""
    if segment_ids is None:
        return jnp.ones((b, t, t), bool)
    seg = jnp.asarray(segment_ids)
    return seg[:, :, None] == seg[:, None, :]


def _sink_keys(segment_ids, b, t, sink):
    """bool `[B, 1, T]`: key j is a sink key, one of the first `sink` tokens of its segment (counted with an
    explicit `[T, T]` comparison: the tokens before j with j's segment id)."""
    i, j = _pair_positions(t)
    earlier_same = _same_segment(segment_ids, b, t) & (j < i)          # [B, T, T]: token i, earlier token j
    return (jnp.sum(earlier_same, axis=-1) < sink)[:, None, :]


def _masked_softmax_attend(logits, mask, v, num_q_heads):
    """Explicit softmax of `logits [B, H, T, T]` over keys where `mask [B, T, T]` is True; then `@ v`.

    Returns `[B, T, H, Dv]` float32. Every query must see at least one key (true for causal masks with self).
    """
    m = mask[:, None, :, :]
    neg = jnp.finfo(jnp.float32).min
    masked = jnp.where(m, logits, neg)
    row_max = jnp.max(masked, axis=-1, keepdims=True)
    e = jnp.where(m, jnp.exp(masked - row_max), 0.0)
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    v_full = _expand_kv_heads(v, num_q_heads).astype(jnp.float32)
    return jnp.einsum("bhij,bjhd->bihd", p, v_full, precision=jax.lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------------------------------------------
# Dense / focal attention.
# ----------------------------------------------------------------------------------------------------------------

def attention(q, k, v, *, scale=None, temperature=1.0, causal=True, window=None, segment_ids=None, softcap=None):
    """Naive (focal) attention: `softmax(q.k * scale / temperature) v` under an explicit pair mask.

    Args:
      q `[B, T, H, D]`, k `[B, T, Hk, D]`, v `[B, T, Hk, Dv]` (Hk divides H).
      scale: default `1/sqrt(D)`. temperature: scalar or broadcastable to `[B, T, H]`.
      causal: j <= i. window: w -> key j local to query i iff `0 <= i - j <= w` (with causal=False: `|i - j| <= w`).
      segment_ids: int `[B, T]`; only equal ids attend. softcap: None or `softcap * tanh(logits / softcap)`.

    Returns:
      `[B, T, H, Dv]` float32.
    """
    b, t, h, _ = q.shape
    logits = _soft_cap(_raw_logits(q, k, scale, temperature), softcap)
    i, j = _pair_positions(t)
    allowed = jnp.ones((t, t), bool)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (jnp.abs(i - j) <= window)
    mask = allowed[None] & _same_segment(segment_ids, b, t)
    return _masked_softmax_attend(logits, mask, v, h)


# ----------------------------------------------------------------------------------------------------------------
# Learned temperature (Focal Attention, Eq. 6), numpy float64 loops.
# ----------------------------------------------------------------------------------------------------------------

def learned_temperature(x, w_tau, *, tau_min, tau_max, mode="prefix", bias=0.0, segment_ids=None):
    """`tau = clip(mean(x @ w_tau) + bias, tau_min, tau_max)` with a hard clip, by explicit loops (float64).

    Args:
      x `[B, T, d]`, w_tau `[d]` (one tau per token) or `[d, H]` (one per token and head; bias a number or `[H]`).
      mode: 'sequence': mean over all tokens of the row (of the token's segment when segment_ids is given);
        'prefix': running mean over tokens j <= i (of the same segment); 'token': no mean (the token's own).
      segment_ids: optional int `[B, T]`.

    Returns:
      tau `[B, T]` (or `[B, T, H]`) float32 (a numpy array).
    """
    x = np.asarray(x, np.float64)
    w = np.asarray(w_tau, np.float64)
    per_head = w.ndim == 2
    w = w if per_head else w[:, None]
    bias = np.broadcast_to(np.asarray(bias, np.float64), (w.shape[1],))
    b, t, _ = x.shape
    seg = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
    tau = np.zeros((b, t, w.shape[1]))
    for head in range(w.shape[1]):
        z = np.zeros((b, t))
        for bb in range(b):
            for i in range(t):
                z[bb, i] = float(np.dot(x[bb, i], w[:, head]))
        for bb in range(b):
            for i in range(t):
                if mode == "sequence":
                    members = [j for j in range(t) if seg[bb, j] == seg[bb, i]]
                elif mode == "prefix":
                    members = [j for j in range(i + 1) if seg[bb, j] == seg[bb, i]]
                elif mode == "token":
                    members = [i]
                else:
                    raise ValueError(f"unknown mode={mode!r}")
                mean = sum(z[bb, j] for j in members) / len(members)
                tau[bb, i, head] = min(max(mean + bias[head], tau_min), tau_max)
    return (tau if per_head else tau[:, :, 0]).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Routing: scores and Sinkhorn.
# ----------------------------------------------------------------------------------------------------------------

def routing_scores(h, w_g, centroids, *, tau=0.1, normalize=True):
    """`cos(h @ w_g, centroids[k]) / tau` (normalize=False: `(h @ w_g) . centroids[k] / tau`).

    h `[B, T, d]`, w_g `[d, d_g]`, centroids `[K, d_g]` -> `[B, T, K]` float32.
    """
    hi = jax.lax.Precision.HIGHEST
    z = jnp.einsum("btd,de->bte", jnp.asarray(h, jnp.float32), jnp.asarray(w_g, jnp.float32), precision=hi)
    c = jnp.asarray(centroids, jnp.float32)
    dots = jnp.einsum("bte,ke->btk", z, c, precision=hi)
    if normalize:
        z_norm = jnp.sqrt(jnp.sum(z * z, axis=-1))                  # [B, T]
        c_norm = jnp.sqrt(jnp.sum(c * c, axis=-1))                  # [K]
        dots = dots / (z_norm[:, :, None] * c_norm[None, None, :])
    return dots / tau


def _logsumexp(values):
    values = np.asarray(values, np.float64)
    m = np.max(values)
    return m + np.log(np.sum(np.exp(values - m)))


def sinkhorn(scores, *, n_iters=10, segment_ids=None, valid=None, causal=False):
    """Sinkhorn balanced assignment by explicit numpy float64 loops (log domain, so +-1e4 scores stay finite).

    Q = exp(scores - max); then `n_iters` times: divide each column k of token i by the sum of that column over
    the tokens j that count for i (same segment, valid, and j <= i when causal), using the values from before
    this step; then divide each row by its sum.

    Args:
      scores `[B, T, K]` (already divided by the routing temperature), any float dtype.
      segment_ids: optional int `[B, T]`. valid: optional bool `[B, T]` (padding = False).

    Returns:
      g `[B, T, K]` float32 numpy array. Rows of valid tokens sum to 1. Rows of padding tokens are
      not specified by the API; here they are normalised with the column sums of the valid tokens of their
      segment (uniform 1/K when there are none). Compare only valid rows.
    """
    s = np.asarray(np.asarray(scores, np.float32), np.float64)
    b, t, kk = s.shape
    seg = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
    ok = np.ones((b, t), bool) if valid is None else np.asarray(valid, bool)
    log_q = s - s.max()
    for bb in range(b):
        counts = []                     # counts[i]: the tokens whose mass normalises token i's columns
        for i in range(t):
            limit = i + 1 if causal else t
            counts.append([j for j in range(limit) if seg[bb, j] == seg[bb, i] and ok[bb, j]])
        lq = log_q[bb].copy()
        for _ in range(n_iters):
            new = np.empty_like(lq)
            for i in range(t):
                for c in range(kk):
                    if counts[i]:
                        new[i, c] = lq[i, c] - _logsumexp(lq[counts[i], c])
                    else:
                        new[i, c] = 0.0
            for i in range(t):
                new[i] -= _logsumexp(new[i])
            lq = new
        log_q[bb] = lq
    return np.exp(log_q).astype(np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Focus: soft-gated (training form) and hard (inference form) attention.
# ----------------------------------------------------------------------------------------------------------------

def focus_soft_attention(q, k, v, g, *, window=128, gate="paper", lam=10.0, temperature=1.0, scale=None,
                         segment_ids=None, sink=0, softcap=None):
    """Focus training form: gated logits, then causal (+segment) softmax.

    logits = q.k * scale / temperature; affinity `a_ij = g_i . g_j`; local pairs (`0 <= i - j <= window`)
    ungated; distant causal pairs gated: 'paper' `logit * sigmoid(lam * a)` (Eq. 2 literally),
    'log' `logit + log(sigmoid(lam * (a - 1/2)))`. Sink keys (the first `sink` tokens of each segment) are ungated
    like local ones.

    q `[B, T, H, D]`, k/v `[B, T, Hk, D/Dv]`, g `[B, T, K]` -> `[B, T, H, Dv]` float32.
    """
    b, t, h, _ = q.shape
    logits = _soft_cap(_raw_logits(q, k, scale, temperature), softcap)   # [B, H, T, T], capped before the gate
    gf = jnp.asarray(g, jnp.float32)
    affinity = jnp.einsum("bik,bjk->bij", gf, gf, precision=jax.lax.Precision.HIGHEST)[:, None]
    i, j = _pair_positions(t)
    local = ((i - j >= 0) & (i - j <= window))[None] | _sink_keys(segment_ids, b, t, sink)   # [B, T, T]
    if gate == "paper":
        gated = logits * jax.nn.sigmoid(lam * affinity)
    elif gate == "log":
        gated = logits + jnp.log(jax.nn.sigmoid(lam * (affinity - 0.5)))
    else:
        raise ValueError(f"unknown gate={gate!r}")
    final = jnp.where(local[:, None], logits, gated)
    mask = (j <= i)[None] & _same_segment(segment_ids, b, t)
    return _masked_softmax_attend(final, mask, v, h)


def focus_hard_mask(membership, *, window, segment_ids=None, sink=0):
    """bool `[B, T, T]`: `j <= i` and same segment and (`0 <= i - j <= window` or i and j share a group or
    j is one of the first `sink` tokens of its segment).

    membership: bool `[B, T, K]`.
    """
    mem = jnp.asarray(membership, bool)
    b, t, _ = mem.shape
    share = jnp.any(mem[:, :, None, :] & mem[:, None, :, :], axis=-1)   # [B, T, T]
    i, j = _pair_positions(t)
    causal = j <= i
    local = (i - j >= 0) & (i - j <= window)
    visible = local[None] | share | _sink_keys(segment_ids, b, t, sink)
    return causal[None] & _same_segment(segment_ids, b, t) & visible


def focus_hard_attention(q, k, v, membership, *, window=128, temperature=1.0, scale=None, segment_ids=None,
                         sink=0, softcap=None):
    """Focus inference form: plain logits `q.k * scale / temperature` under `focus_hard_mask`, softmax, `@ v`.

    q `[B, T, H, D]`, k/v `[B, T, Hk, D/Dv]`, membership bool `[B, T, K]` -> `[B, T, H, Dv]` float32.
    """
    h = q.shape[2]
    logits = _soft_cap(_raw_logits(q, k, scale, temperature), softcap)
    mask = focus_hard_mask(membership, window=window, segment_ids=segment_ids, sink=sink)
    return _masked_softmax_attend(logits, mask, v, h)
