"""The attention sink of hard Focus (FOCUS_SPEC OQ-12): the first `sink` tokens of each segment are visible to every
later query of that segment.

Without segment ids a segment is the whole row, so the sink keys are positions `0 .. sink - 1`. With packed
documents each document has its own: key j is a sink key iff fewer than `sink` earlier tokens share its segment id.

The fast paths of `focus_sparse_attention` ('decomposed', 'pallas') compute the same-group pairs (set A) and the
cross-group local pairs (set B) in their own blocks; the pairs only the sink adds, *set C* (a sink key of the
query's segment, outside its window, sharing no group with it), number at most `sink` per query. `with_sink`
gathers them, computes them in plain XLA and merges them with the fast path's output by log-sum-exp; autodiff
carries the gradient through the merge into the fast path's own backward pass (which takes the log-sum-exp's
cotangent). A sink of up to `SINK_CHUNK` keys takes one step, memory O(B * T * sink * (Hk * D + H)); a longer one
takes steps of `SINK_CHUNK` keys (a `lax.scan`, each step recomputed in the backward pass), so that its memory stays
that of one step.
"""

import functools

import jax
import jax.numpy as jnp

from focal_jax.attention.segments import segment_prefix, segment_runs

SINK_CHUNK = 16  # the sink keys per query that one step of `sink_set` gathers; a longer sink takes several steps
NEG_INF = -1e30  # finite "minus infinity": a query without set-C pairs keeps finite (zero-weight) values


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


def segment_order(segment_ids):
    """`_first_of_segment` of each row of `segment_ids [B, T]` (two int `[B, T]`), or None without segment ids: what
    `sink_keys` needs, computed once for all of a sink's steps."""
    return None if segment_ids is None else jax.vmap(_first_of_segment)(jnp.asarray(segment_ids))


def sink_keys(segment_ids, order, offsets, sink, b, t):
    """The sink keys at places `offsets` (int `[n]`, 0 for a segment's first token) among the first `sink` tokens of
    each query's segment (of the row without segment ids): positions int `[B, T, n]` and bool `[B, T, n]` whether
    each exists (offset < min(sink, T), and a segment of fewer tokens has fewer; a missing key's position is a
    valid index, but meaningless). `order`: `segment_order(segment_ids)`."""
    offsets = jnp.asarray(offsets, jnp.int32)
    n = offsets.shape[0]
    if segment_ids is None:
        return (jnp.broadcast_to(jnp.minimum(offsets, t - 1), (b, t, n)),
                jnp.broadcast_to(offsets < min(sink, t), (b, t, n)))

    def one_row(ids, order, first):
        index = first[:, None] + offsets
        key = order[jnp.minimum(index, t - 1)].astype(jnp.int32)
        return key, (index < t) & (offsets < sink) & (ids[key] == ids[:, None])

    return jax.vmap(one_row)(jnp.asarray(segment_ids), *order)


def _rows_at_sink_keys(x, key, start, segment_ids):
    """The rows of `x [B, T, ...]` at each query's sink keys `key [B, T, n]`: `[B, T, n, ...]`, or without segment
    ids, where every query's keys are positions `start .. start + n - 1`, the slice `[B, 1, n, ...]` that einsum
    broadcasts over the queries (a gather of n rows per query is 5x slower on a CPU at T = 4096, forward and
    backward)."""
    if segment_ids is None:
        return jax.lax.dynamic_slice_in_dim(x, start, key.shape[-1], axis=1)[:, None]
    return jax.vmap(lambda x, key: x[key])(x, key)


def _merge(out_a, lse_a, out_b, lse_b):
    """Two attentions over disjoint key sets (outputs `[B, T, H, Dv]`, log-sum-exps `[B, T, H]` float32) as the
    one over their union: (out float32, lse)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    out = (jnp.exp(lse_a - lse)[..., None] * out_a.astype(jnp.float32)
           + jnp.exp(lse_b - lse)[..., None] * out_b.astype(jnp.float32))
    return out, lse


def _sink_step(q, k, v, membership, start, first, n, *, multiplier, window, segment_ids, order, sink, softcap):
    """Set C's attention (`sink_set`) over the sink keys at places `start .. start + n - 1` of each segment, those
    before place `first` left out (an earlier step's): (out `[B, T, H, Dv]` float32, lse `[B, T, H]` float32)."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    offsets = start + jnp.arange(n, dtype=jnp.int32)
    key, exists = sink_keys(segment_ids, order, offsets, sink, b, t)
    rows = lambda x: _rows_at_sink_keys(x, key, start, segment_ids)
    query = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    shares = jnp.any(membership[:, :, None, :] & rows(membership), axis=-1)
    allowed = exists & (offsets >= first) & (key <= query) & (query - key > window) & ~shares  # [B, T, n]
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    grouped_q = q.astype(dtype).reshape(b, t, hk, h // hk, d)
    scores = jnp.einsum("btkgd,btskd->btkgs", grouped_q, rows(k.astype(dtype)),
                        preferred_element_type=jnp.float32).reshape(b, t, h, -1)
    scores = scores * jnp.broadcast_to(jnp.asarray(multiplier, jnp.float32), (b, t, h))[..., None]
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(allowed[:, :, None, :], scores, NEG_INF)
    lse = jax.nn.logsumexp(scores, axis=-1)
    weights = jnp.exp(scores - lse[..., None]).reshape(b, t, hk, h // hk, -1)
    out = jnp.einsum("btkgs,btskd->btkgd", weights, rows(v).astype(jnp.float32))
    return out.reshape(b, t, h, -1), lse


def sink_set(q, k, v, membership, *, multiplier, window, segment_ids, sink, softcap):
    """Set C's attention: the pairs the sink adds to sets A and B (a sink key of the query's segment, causal,
    outside its window, sharing no group with it).

    q `[B, T, H, D]`, k `[B, T, Hk, D]`, v `[B, T, Hk, Dv]`, membership bool `[B, T, K]`, multiplier a number or an
    array broadcastable to `[B, T, H]` -> (out `[B, T, H, Dv]` float32, lse `[B, T, H]` float32; about -1e30 for a
    query without such pairs, whose `out` is then meaningless and merged with weight 0).

    The sink keys are gathered `SINK_CHUNK` at a time: a longer sink (after clamping to T) is a `lax.scan` of
    rematerialised steps merged by log-sum-exp.
    """
    s = min(sink, q.shape[1])
    step = functools.partial(_sink_step, q, k, v, membership, multiplier=multiplier, window=window,
                             segment_ids=segment_ids, order=segment_order(segment_ids), sink=sink, softcap=softcap)
    if s <= SINK_CHUNK:
        return step(0, 0, s)

    @jax.checkpoint
    def chunk(first):  # the last chunk starts early, so as to stay inside the sink; it leaves out what it repeats
        return step(jnp.minimum(first, s - SINK_CHUNK), first, SINK_CHUNK)

    def merged(carry, first):
        return _merge(*carry, *chunk(first)), None

    b, t, h, _ = q.shape
    empty = (jnp.zeros((b, t, h, v.shape[-1]), jnp.float32), jnp.full((b, t, h), NEG_INF, jnp.float32))
    (out, lse), _ = jax.lax.scan(merged, empty, jnp.arange(0, s, SINK_CHUNK, dtype=jnp.int32))
    return out, lse


def with_sink(out, lse, q, k, v, membership, *, multiplier, window, segment_ids, sink, softcap):
    """A fast path's output over sets A and B (`out [B, T, H, Dv]`, its log-sum-exp `lse [B, T, H]` float32)
    merged with set C's (`sink_set`, same arguments) -> `[B, T, H, Dv]` in out's dtype."""
    out_c, lse_c = sink_set(q, k, v, membership, multiplier=multiplier, window=window, segment_ids=segment_ids,
                            sink=sink, softcap=softcap)
    return _merge(out, lse, out_c, lse_c)[0].astype(out.dtype)
