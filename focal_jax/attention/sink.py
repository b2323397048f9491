"""The attention sink of hard Focus (FOCUS_SPEC OQ-12): the first `sink` tokens of each segment are visible to every
later query of that segment.

Without segment ids a segment is the whole row, so the sink keys are positions `0 .. sink - 1`. With packed
documents each document has its own: key j is a sink key iff fewer than `sink` earlier tokens share its segment id.

The fast paths of `focus_sparse_attention` ('decomposed', 'pallas') compute the same-group pairs (set A) and the
cross-group local pairs (set B) in their own blocks; the pairs only the sink adds, *set C* (a sink key of the
query's segment, outside its window, sharing no group with it), number at most `sink` per query. `with_sink`
gathers them, computes them in plain XLA and merges them with the fast path's output by log-sum-exp; autodiff
carries the gradient through the merge into the fast path's own backward pass (which takes the log-sum-exp's
cotangent). Memory O(B * T * sink * (Hk * D + H)), hence `MAX_FAST_SINK`.
"""

import jax
import jax.numpy as jnp

from focal_jax.attention.segments import segment_prefix, segment_runs

MAX_FAST_SINK = 64  # the largest sink (after clamping to T) of the fast paths; 'reference' takes any
NEG_INF = -1e30  # finite "minus infinity": a query without set-C pairs keeps finite (zero-weight) values


def check_fast_sink(sink, t, impl):
    """Raises ValueError unless `min(sink, t) <= MAX_FAST_SINK`, the largest sink `impl` (a fast path) takes."""
    if min(sink, t) > MAX_FAST_SINK:
        raise ValueError(f"impl={impl!r} takes sink <= {MAX_FAST_SINK} (it gathers each query's sink keys), got "
                         f"sink={sink} for T={t}; use impl='reference'")


def _first_of_segment(segment_ids):
    """`segment_ids [T]` -> (order `[T]`, first `[T]`): the stable sort by segment, and for each token the index in
    it of its segment's first token."""
    order, starts = segment_runs(segment_ids)
    slot = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
    run_start = jax.lax.cummax(jnp.where(starts, slot, 0))
    return order, jnp.zeros_like(slot).at[order].set(run_start)


def sink_key_mask(segment_ids, sink, b, t):
    """bool `[B, T]`: whether each token is a sink key, among the first `sink` tokens of its segment (of the row
    without segment ids)."""
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(t) < sink, (b, t))
    place = jax.vmap(lambda ids: segment_prefix(jnp.ones(t, jnp.int32), ids, "sum"))  # 1-based, in its segment
    return place(jnp.asarray(segment_ids)) <= sink


def sink_keys(segment_ids, sink, b, t):
    """The sink keys of each query's segment: positions int `[B, T, S]` (S = min(sink, T)) and bool `[B, T, S]`
    whether each exists (a segment of fewer than S tokens has fewer)."""
    s = min(sink, t)
    if segment_ids is None:
        return (jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, t, s)), jnp.ones((b, t, s), bool))

    def one_row(ids):
        order, first = _first_of_segment(ids)
        index = first[:, None] + jnp.arange(s, dtype=jnp.int32)
        key = order[jnp.minimum(index, t - 1)].astype(jnp.int32)
        return key, (index < t) & (ids[key] == ids[:, None])

    return jax.vmap(one_row)(jnp.asarray(segment_ids))


def _rows_at_sink_keys(x, key, segment_ids):
    """The rows of `x [B, T, ...]` at each query's sink keys `key [B, T, S]`: `[B, T, S, ...]`, or without segment
    ids, where every query's keys are positions `0 .. S - 1`, the slice `[B, 1, S, ...]` that einsum broadcasts
    over the queries (a gather of S rows per query is 5x slower on a CPU at T = 4096, forward and backward)."""
    if segment_ids is None:
        return x[:, None, :key.shape[-1]]
    return jax.vmap(lambda x, key: x[key])(x, key)


def sink_set(q, k, v, membership, *, multiplier, window, segment_ids, sink, softcap):
    """Set C's attention: the pairs the sink adds to sets A and B (a sink key of the query's segment, causal,
    outside its window, sharing no group with it).

    q `[B, T, H, D]`, k `[B, T, Hk, D]`, v `[B, T, Hk, Dv]`, membership bool `[B, T, K]`, multiplier a number or an
    array broadcastable to `[B, T, H]` -> (out `[B, T, H, Dv]` float32, lse `[B, T, H]` float32; about -1e30 for a
    query without such pairs, whose `out` is then meaningless and merged with weight 0).
    """
    b, t, h, d = q.shape
    hk = k.shape[2]
    key, exists = sink_keys(segment_ids, sink, b, t)
    query = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    shares = jnp.any(membership[:, :, None, :] & _rows_at_sink_keys(membership, key, segment_ids), axis=-1)
    allowed = exists & (key <= query) & (query - key > window) & ~shares  # [B, T, S]
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    grouped_q = q.astype(dtype).reshape(b, t, hk, h // hk, d)
    scores = jnp.einsum("btkgd,btskd->btkgs", grouped_q, _rows_at_sink_keys(k.astype(dtype), key, segment_ids),
                        preferred_element_type=jnp.float32).reshape(b, t, h, -1)
    scores = scores * jnp.broadcast_to(jnp.asarray(multiplier, jnp.float32), (b, t, h))[..., None]
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(allowed[:, :, None, :], scores, NEG_INF)
    lse = jax.nn.logsumexp(scores, axis=-1)
    weights = jnp.exp(scores - lse[..., None]).reshape(b, t, hk, h // hk, -1)
    out = jnp.einsum("btkgs,btskd->btkgd", weights, _rows_at_sink_keys(v, key, segment_ids).astype(jnp.float32))
    return out.reshape(b, t, h, -1), lse


def with_sink(out, lse, q, k, v, membership, *, multiplier, window, segment_ids, sink, softcap):
    """A fast path's output over sets A and B (`out [B, T, H, Dv]`, its log-sum-exp `lse [B, T, H]` float32)
    merged with set C's (`sink_set`, same arguments) -> `[B, T, H, Dv]` in out's dtype."""
    out_c, lse_c = sink_set(q, k, v, membership, multiplier=multiplier, window=window, segment_ids=segment_ids,
                            sink=sink, softcap=softcap)
    total = jnp.logaddexp(lse, lse_c)
    merged = (jnp.exp(lse - total)[..., None] * out.astype(jnp.float32)
              + jnp.exp(lse_c - total)[..., None] * out_c)
    return merged.astype(out.dtype)
