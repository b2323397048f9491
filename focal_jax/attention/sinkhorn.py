"""Log-domain Sinkhorn balancing of token-to-group scores (Focus, Sec. 2), segment-, padding- and causality-aware."""

import jax
import jax.numpy as jnp

from focal_jax.attention import _validate
from focal_jax.attention.segments import segment_prefix, segment_total


def _column_logsumexp(log_q, segment_ids, causal):
    """Per token, the log-sum-exp of each group's column over the tokens it is normalised against: `[B, T, K]`.

    `segment_ids [B, T]` or None (one segment per row, the common fast case).
    """
    if segment_ids is None:
        if causal:
            return jax.lax.associative_scan(jnp.logaddexp, log_q, axis=1)  # faster than cumlogsumexp on CPU
        return jnp.broadcast_to(jax.nn.logsumexp(log_q, axis=1, keepdims=True), log_q.shape)
    per_row = segment_prefix if causal else segment_total
    return jax.vmap(lambda x, ids: per_row(x, ids, "logsumexp"))(log_q, segment_ids)


def sinkhorn(scores, *, n_iters=10, segment_ids=None, valid=None, causal=False):
    """Balanced soft assignment of tokens to groups by Sinkhorn iterations in the log domain.

    Starting from `log Q = scores`, each iteration subtracts the log-sum-exp over tokens (each group's column,
    taken within the token's segment and over valid tokens only), then over groups (each token's row). The last
    step is the row step, so every row of the result sums to 1. Computed in float32 whatever the input dtype.

    Args:
      scores: `[B, T, K]`, already divided by the routing temperature (see `routing_scores`).
      n_iters: number of iterations (paper: 10), unrolled.
      segment_ids: optional int `[B, T]`; tokens of different segments never share a column sum, so packed
        documents are assigned as if each ran alone.
      valid: optional bool `[B, T]`; False marks padding, which is left out of every column sum (its own row is
        still normalised).
      causal: if True each column sum runs over tokens j <= i only, so token i's assignment does not depend on
        later tokens (defined for KV-cache decoding). The paper's form is `causal=False`.

    Returns:
      g: float32 `[B, T, K]`, rows summing to 1.

    Example:
      >>> import jax
      >>> g = sinkhorn(jax.random.normal(jax.random.key(0), (1, 16, 4)) / 0.1)
      >>> g.shape, bool(abs(g.sum(-1) - 1).max() < 1e-5)
      ((1, 16, 4), True)
    """
    if scores.ndim != 3:
        raise ValueError(f"scores must have shape [batch, seq, groups], got shape {scores.shape}")
    b, t, k = scores.shape
    if k < 1:
        raise ValueError(f"scores must have at least one group (K >= 1), got K={k}")
    if isinstance(n_iters, bool) or not isinstance(n_iters, int) or n_iters < 1:
        raise ValueError(f"n_iters must be an integer >= 1, got n_iters={n_iters!r}")
    _validate.check_segment_ids(segment_ids, b, t)
    if valid is not None and tuple(valid.shape) != (b, t):
        raise ValueError(f"valid must have shape [batch, seq] = {(b, t)}, got shape {valid.shape}")
    valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)

    log_q = scores.astype(jnp.float32)
    for _ in range(n_iters):
        counted = jnp.where(valid[..., None], log_q, -jnp.inf)
        log_q = log_q - jnp.where(valid[..., None], _column_logsumexp(counted, segment_ids, causal), 0.0)
        log_q = log_q - jax.nn.logsumexp(log_q, axis=-1, keepdims=True)
    return jnp.exp(log_q)
