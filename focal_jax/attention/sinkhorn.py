"""Log-domain Sinkhorn balancing of token-to-group scores (Focus, Sec. 2), segment-, padding- and causality-aware."""

import jax
import jax.numpy as jnp

from focal_jax.attention import _validate


def _segment_logsumexp(x, labels):
    """Log-sum-exp of `x [T, K]` over the tokens of each label, returned per token `[T, K]`.

    `labels [T]` are in [0, T) (from `jnp.unique(..., size=T)`).
    """
    t = x.shape[0]
    peak = jax.ops.segment_max(x, labels, num_segments=t)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    total = jax.ops.segment_sum(jnp.exp(x - peak[labels]), labels, num_segments=t)
    return jnp.log(total)[labels] + peak[labels]


def _prefix_logsumexp(x, labels):
    """Log-sum-exp of `x [T, K]` over tokens j <= i with the same label, per token i `[T, K]`."""
    order = jnp.argsort(labels, stable=True)
    sorted_labels = labels[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_labels[1:] != sorted_labels[:-1]])

    def combine(left, right):
        left_start, left_value = left
        right_start, right_value = right
        value = jnp.where(right_start[:, None], right_value, jnp.logaddexp(left_value, right_value))
        return left_start | right_start, value

    _, prefix = jax.lax.associative_scan(combine, (starts, x[order]))
    return jnp.zeros_like(prefix).at[order].set(prefix)


def _column_logsumexp(log_q, labels, causal):
    """Per token, the log-sum-exp of each group's column over the tokens it is normalised against: `[B, T, K]`.

    `labels [B, T]` number the segments (None: one segment per row, the common fast case).
    """
    if labels is None:
        if causal:
            return jax.lax.associative_scan(jnp.logaddexp, log_q, axis=1)  # faster than cumlogsumexp on CPU
        return jnp.broadcast_to(jax.nn.logsumexp(log_q, axis=1, keepdims=True), log_q.shape)
    per_row = _prefix_logsumexp if causal else _segment_logsumexp
    return jax.vmap(per_row)(log_q, labels)


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
    labels = None
    if segment_ids is not None:
        labels = jax.vmap(lambda s: jnp.unique(s, size=t, fill_value=0, return_inverse=True)[1].reshape(t))(
            segment_ids)
    valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)

    log_q = scores.astype(jnp.float32)
    for _ in range(n_iters):
        counted = jnp.where(valid[..., None], log_q, -jnp.inf)
        log_q = log_q - jnp.where(valid[..., None], _column_logsumexp(counted, labels, causal), 0.0)
        log_q = log_q - jax.nn.logsumexp(log_q, axis=-1, keepdims=True)
    return jnp.exp(log_q)
