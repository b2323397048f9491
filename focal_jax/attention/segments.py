"""Reductions over the tokens of one segment (tokens with equal segment id), in full or over a causal prefix.

Shared by Sinkhorn (column sums per segment) and the learned temperature (mean per segment). Segments are defined
by equal ids, as in the attention masks, whether or not their tokens are contiguous.
"""

import jax
import jax.numpy as jnp


def segment_labels(segment_ids):
    """Renumbers segment ids `[T]` to labels in [0, T) (equal ids, equal labels), for `jax.ops.segment_*`."""
    t = segment_ids.shape[0]
    return jnp.unique(segment_ids, size=t, fill_value=segment_ids[0], return_inverse=True)[1].reshape(t)


def segment_total(x, segment_ids, combine):
    """Per token, `combine`-reduction (`'sum'` or `'logsumexp'`) of `x [T, ...]` over its segment -> `[T, ...]`."""
    return total_over_labels(x, segment_labels(segment_ids), combine)


def total_over_labels(x, labels, combine):
    """`segment_total` of `x [T, ...]` -> `[T, ...]`, with the segments given as `labels [T]` from
    `segment_labels(segment_ids)`: computed once where several reductions share the segments (Sinkhorn's
    iterations)."""
    t = x.shape[0]
    if combine == "sum":
        return jax.ops.segment_sum(x, labels, num_segments=t)[labels]
    peak = jax.ops.segment_max(x, labels, num_segments=t)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)[labels]
    return jnp.log(jax.ops.segment_sum(jnp.exp(x - peak), labels, num_segments=t)[labels]) + peak


def segment_prefix(x, segment_ids, combine):
    """Per token i, `combine`-reduction (`'sum'` or `'logsumexp'`) of `x [T, ...]` over tokens j <= i of the same
    segment -> `[T, ...]`. Stable-sorts by segment so each segment is a contiguous run, scans, unsorts."""
    return prefix_over_runs(x, *segment_runs(segment_ids), combine)


def segment_runs(segment_ids):
    """`segment_ids [T]` -> (order `[T]`, starts `[T]` bool): the stable sort by segment, which makes each segment a
    contiguous run, and where each run starts in it."""
    order = jnp.argsort(segment_ids, stable=True)
    sorted_ids = segment_ids[order]
    return order, jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])


def prefix_over_runs(x, order, starts, combine):
    """`segment_prefix` of `x [T, ...]` -> `[T, ...]`, with the segments given as `(order [T], starts [T])` from
    `segment_runs(segment_ids)`: computed once where several reductions share the segments (Sinkhorn's
    iterations)."""
    binary = jnp.add if combine == "sum" else jnp.logaddexp
    starts = starts.reshape(starts.shape + (1,) * (x.ndim - 1))

    def segmented(left, right):
        left_start, left_value = left
        right_start, right_value = right
        return left_start | right_start, jnp.where(right_start, right_value, binary(left_value, right_value))

    _, prefix = jax.lax.associative_scan(segmented, (starts, x[order]))
    return jnp.zeros_like(prefix).at[order].set(prefix)
