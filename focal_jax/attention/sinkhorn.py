"""Log-domain Sinkhorn balancing of token-to-group scores (Focus, Sec. 2), segment-, padding- and causality-aware."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from focal_jax._axes import explicit_as_auto, like_first
from focal_jax.attention import _validate
from focal_jax.attention.segments import prefix_over_runs, segment_labels, segment_runs, total_over_labels


def _column_logsumexp(segment_ids, causal):
    """The function `log_q [B, T, K]` -> per token, the log-sum-exp of each group's column over the tokens it is
    normalised against (`[B, T, K]`), with what depends on the segments computed once for every iteration.

    `segment_ids [B, T]` or None (one segment per row, the common fast case).
    """
    if segment_ids is None:
        if causal:
            return lambda log_q: jax.lax.associative_scan(jnp.logaddexp, log_q, axis=1)  # faster than cumlogsumexp
        return lambda log_q: jnp.broadcast_to(jax.nn.logsumexp(log_q, axis=1, keepdims=True), log_q.shape)
    if causal:
        order, starts = jax.vmap(segment_runs)(segment_ids)
        per_row = jax.vmap(lambda x, order, starts: prefix_over_runs(x, order, starts, "logsumexp"))
        return lambda log_q: per_row(log_q, order, starts)
    labels = jax.vmap(segment_labels)(segment_ids)
    per_row = jax.vmap(lambda x, labels: total_over_labels(x, labels, "logsumexp"))
    return lambda log_q: per_row(log_q, labels)


@explicit_as_auto(like_first(2, 3))
def sinkhorn(scores, *, n_iters=10, segment_ids=None, valid=None, causal=False, unroll=True):
    """Balanced soft assignment of tokens to groups by Sinkhorn iterations in the log domain.

    Starting from `log Q = scores`, each iteration subtracts the log-sum-exp over tokens (each group's column,
    taken within the token's segment and over valid tokens only), then over groups (each token's row). The last
    step is the row step, so every row of the result sums to 1. Computed in float32 whatever the input dtype.

    Args:
      scores: `[B, T, K]`, already divided by the routing temperature (see `routing_scores`).
      n_iters: number of iterations (paper: 10).
      segment_ids: optional int `[B, T]`; tokens of different segments never share a column sum, so packed
        documents are assigned as if each ran alone.
      valid: optional bool `[B, T]`; False marks padding, which is left out of every column sum (its own row is
        still normalised).
      causal: if True each column sum runs over tokens j <= i only, so token i's assignment does not depend on
        later tokens (defined for KV-cache decoding). The paper's form is `causal=False`.
      unroll: True (default) unrolls the iterations into one program; False runs them as a `lax.scan`, whose one
        body compiles 1.6-3x faster but runs up to 1.5x slower on CPU (`python -m focal_jax.bench sinkhorn`).

    Returns:
      g: float32 `[B, T, K]`, rows summing to 1. A valid token alone in its column sums (the first token of its
      segment when `causal`, a one-token segment otherwise) gets exactly `1/K` in every group: its ties, for
      `topk_membership`, go to the lower group index whatever the compilation's rounding.

    Example:
      >>> import jax
      >>> g = sinkhorn(jax.random.normal(jax.random.key(0), (1, 16, 4)) / 0.1)
      >>> g.shape, bool(abs(g.sum(-1) - 1).max() < 1e-5)
      ((1, 16, 4), True)
    """
    _validate.check_array("scores", scores, "[batch, seq, groups]")
    if scores.ndim != 3:
        raise ValueError(f"scores must have shape [batch, seq, groups], got shape {scores.shape}")
    b, t, k = scores.shape
    if k < 1:
        raise ValueError(f"scores must have at least one group (K >= 1), got K={k}")
    if isinstance(n_iters, bool) or not isinstance(n_iters, (int, np.integer)) or n_iters < 1:
        raise ValueError(f"n_iters must be an integer >= 1, got n_iters={n_iters!r}"
                         f"{_validate.static_hint('n_iters', n_iters)}")
    _validate.check_bool("unroll", unroll)
    _validate.check_bool("causal", causal)
    _validate.check_segment_ids(segment_ids, b, t)
    _validate.check_valid(valid, b, t)
    valid = jnp.ones((b, t), bool) if valid is None else valid.astype(bool)
    return _balanced(scores, segment_ids, valid, n_iters=int(n_iters), causal=bool(causal), unroll=bool(unroll))


# Jitted as a whole: called eagerly (a notebook, a KV-cache decode step), the scan over a new `iteration` closure
# compiled afresh at every call (0.9 s at T = 256 on CPU, 4 s causal).
@functools.partial(jax.jit, static_argnames=("n_iters", "causal", "unroll"))
def _balanced(scores, segment_ids, valid, *, n_iters, causal, unroll):
    """`sinkhorn`'s computation, on validated inputs (`valid` bool `[B, T]`)."""
    k = scores.shape[-1]
    column_logsumexp = _column_logsumexp(segment_ids, causal)

    def iteration(log_q, _):
        counted = jnp.where(valid[..., None], log_q, -jnp.inf)
        log_q = log_q - jnp.where(valid[..., None], column_logsumexp(counted), 0.0)
        return log_q - jax.nn.logsumexp(log_q, axis=-1, keepdims=True), None

    log_q, _ = jax.lax.scan(iteration, scores.astype(jnp.float32), None, length=n_iters, unroll=unroll)
    # Such a token's row is uniform whatever its scores, but rounding left it a few ulps off, differently from one
    # compilation to the next, and its top-k groups with it.
    log_count = column_logsumexp(jnp.where(valid, 0.0, -jnp.inf)[..., None])[..., 0]
    alone = valid & (log_count < 0.5 * np.log(2.0))
    return jnp.where(alone[..., None], jnp.float32(1.0 / k), jnp.exp(log_q))
