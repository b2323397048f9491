"""The attention sink of hard Focus (FOCUS_SPEC OQ-12): the first `sink` tokens of each segment are visible to every
later query of that segment.

Without segment ids a segment is the whole row, so the sink keys are positions `0 .. sink - 1`. With packed
documents each document has its own: key j is a sink key iff fewer than `sink` earlier tokens share its segment id.

The fast paths of `focus_sparse_attention` ('decomposed', 'pallas') compute the same-group pairs (set A) and the
cross-group local pairs (set B) in their own blocks; the pairs only the sink adds, *set C* (a sink key of the
query's segment, outside its window, sharing no group with it), number at most `sink` per query. `with_sink`
computes them in plain XLA and merges them with the fast path's output by log-sum-exp; autodiff carries the
gradient through the merge into the fast path's own backward pass (which takes the log-sum-exp's cotangent).

Set C reads its keys once per block of queries that share them. Without segment ids every query's sink keys are
the row's first ones, sliced once and broadcast. With segment ids the rows are stable-sorted by segment (each
segment one contiguous run) and cut into blocks of `SINK_CHUNK` queries: the queries of a block's first segment
share that segment's sink keys, at the start of its run, and any other segment of the block starts inside it, so
its causal sink keys are among the block's own (`_segment_sink_set`). A sink of up to `SINK_CHUNK` keys takes one
step, memory O(B * T * (SINK_CHUNK * (K + H) + (H + Hk) * D)) with the sorted copies of q, k and v; a longer one
takes steps of `SINK_CHUNK` keys (a `lax.scan`, each step recomputed in the backward pass), so that its memory stays
that of one step.
"""

import functools

import jax
import jax.numpy as jnp

from focal_jax.attention.segments import segment_prefix, segment_runs

SINK_CHUNK = 16  # the sink keys one step of `sink_set` takes (a longer sink takes several), and its query blocks
NEG_INF = -1e30  # finite "minus infinity": a query without set-C pairs keeps finite (zero-weight) values


def sink_key_mask(segment_ids, sink, b, t):
    """bool `[B, T]`: whether each token is a sink key, among the first `sink` tokens of its segment (of the row
    without segment ids)."""
    if segment_ids is None:
        return jnp.broadcast_to(jnp.arange(t) < sink, (b, t))
    place = jax.vmap(lambda ids: segment_prefix(jnp.ones(t, jnp.int32), ids, "sum"))  # 1-based, in its segment
    return place(jnp.asarray(segment_ids)) <= sink


def _merge(out_a, lse_a, out_b, lse_b):
    """Two attentions over disjoint key sets (outputs `[B, T, H, Dv]`, log-sum-exps `[B, T, H]` float32) as the
    one over their union: (out float32, lse)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    out = (jnp.exp(lse_a - lse)[..., None] * out_a.astype(jnp.float32)
           + jnp.exp(lse_b - lse)[..., None] * out_b.astype(jnp.float32))
    return out, lse


def _scores(q, keys, multiplier, softcap):
    """Logits of queries `q [B, N, Q, H, D]` against keys `[B, N, S, Hk, D]` (N blocks of Q queries sharing S keys;
    S = 1 block broadcasts one key set over all queries), float32 `[B, N, Q, H, S]`, scaled by `multiplier` (a
    number or `[B, N, Q, H]`) and soft-capped."""
    b, n, nq, h, d = q.shape
    hk = keys.shape[3]
    grouped = q.reshape(b, n, nq, hk, h // hk, d)
    scores = jnp.einsum("bnqkgd,bnskd->bnqkgs", grouped, keys, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, n, nq, h, -1) * jnp.asarray(multiplier, jnp.float32)[..., None]
    return scores if softcap is None else softcap * jnp.tanh(scores / softcap)


def _attend(scores, allowed, values):
    """Softmax of `scores [B, N, Q, H, S]` over the `allowed [B, N, Q, S]` keys, applied to `values [B, N, S, Hk,
    Dv]` -> (out `[B, N, Q, H, Dv]` float32, lse `[B, N, Q, H]`)."""
    b, n, nq, h, _ = scores.shape
    hk = values.shape[3]
    scores = jnp.where(allowed[:, :, :, None, :], scores, NEG_INF)
    lse = jax.nn.logsumexp(scores, axis=-1)
    weights = jnp.exp(scores - lse[..., None]).reshape(b, n, nq, hk, h // hk, -1)
    out = jnp.einsum("bnqkgs,bnskd->bnqkgd", weights, values.astype(jnp.float32))
    return out.reshape(b, n, nq, h, -1), lse


def _steps(step, s, out_shape):
    """Set C as `step(start, first, n)` over the sink places `0 .. s - 1` (`s` of a segment's first tokens): one
    step of all of them when `s <= SINK_CHUNK`, else a `lax.scan` of rematerialised steps of `SINK_CHUNK` places,
    merged by log-sum-exp. `step` returns (out, lse) of shapes `out_shape`, `out_shape[:-1]`; places before `first`
    are left out (an earlier step's)."""
    if s <= SINK_CHUNK:
        return step(0, 0, s)

    @jax.checkpoint
    def chunk(first):  # the last chunk starts early, so as to stay inside the sink; it leaves out what it repeats
        return step(jnp.minimum(first, s - SINK_CHUNK), first, SINK_CHUNK)

    def merged(carry, first):
        return _merge(*carry, *chunk(first)), None

    empty = (jnp.zeros(out_shape, jnp.float32), jnp.full(out_shape[:-1], NEG_INF, jnp.float32))
    (out, lse), _ = jax.lax.scan(merged, empty, jnp.arange(0, s, SINK_CHUNK, dtype=jnp.int32))
    return out, lse


def _row_sink_set(q, k, v, membership, multiplier, *, window, s, softcap):
    """`sink_set` without segment ids: every query's sink keys are positions `0 .. s - 1`, sliced once per step and
    broadcast over the queries."""
    b, t, h, _ = q.shape
    query = jnp.arange(t, dtype=jnp.int32)[:, None]

    def step(start, first, n):
        keys = start + jnp.arange(n, dtype=jnp.int32)
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)[:, None]  # [B, 1, n, ...]
        shares = jnp.any(membership[:, :, None, :] & rows(membership), axis=-1)[:, None]
        allowed = (keys >= first) & (keys <= query) & (query - keys > window) & ~shares  # [B, 1, T, n]
        out, lse = _attend(_scores(q[:, None], rows(k), multiplier[:, None], softcap), allowed, rows(v))
        return out[:, 0], lse[:, 0]

    return _steps(step, s, (b, t, h, v.shape[-1]))


def _segment_sink_set(q, k, v, membership, multiplier, *, window, segment_ids, s, softcap):
    """`sink_set` with segment ids, in blocks of `SINK_CHUNK` queries of the rows stable-sorted by segment, where
    each segment is one contiguous run. A query whose segment is its block's first finds its sink keys at the start
    of that run, which every such query of the block shares: one slice of `SINK_CHUNK` keys per block and step
    (part 1). A query whose segment starts inside its block finds its causal sink keys inside the block (part 2).
    Keys are thus read once per block of queries, rather than gathered for each query."""
    b, t, h, _ = q.shape
    nb = -(-t // SINK_CHUNK)
    length = nb * SINK_CHUNK
    order, starts = jax.vmap(segment_runs)(jnp.asarray(segment_ids))
    place = jnp.arange(length, dtype=jnp.int32)

    def sort(x):  # the rows of x [B, T, ...] in segment order, zero-padded to `length`
        x = jax.vmap(lambda x, order: x[order])(x, order)
        return jnp.pad(x, [(0, 0), (0, length - t)] + [(0, 0)] * (x.ndim - 2))

    run_start = jnp.pad(jax.lax.cummax(jnp.where(starts, place[:t], 0), axis=1), [(0, 0), (0, length - t)])
    position = jnp.pad(order.astype(jnp.int32), [(0, 0), (0, length - t)])  # each sorted token's original index
    keys = {"segment": sort(jnp.asarray(segment_ids)), "position": position, "membership": sort(membership),
            "exists": jnp.broadcast_to(place < t, (b, length)),
            "place": place - run_start, "k": sort(k), "v": sort(v)}  # place: in its segment, 0 for the first
    by_block = lambda x: x.reshape(b, nb, SINK_CHUNK, *x.shape[2:])
    queries = {name: by_block(keys[name]) for name in ("segment", "position", "membership")}
    block_segment = queries["segment"][:, :, :1]  # [B, nb, 1]: the segment of each block's first query
    scores_of = functools.partial(_scores, by_block(sort(q)), multiplier=by_block(sort(multiplier)),
                                  softcap=softcap)

    def attend(key, first_segment):  # key: {name: [B, nb, S, ...]}, the block's candidate keys
        allowed = (key["exists"][:, :, None, :] & (key["place"] < s)[:, :, None, :]
                   & (key["segment"][:, :, None, :] == queries["segment"][..., None])
                   & (key["position"][:, :, None, :] <= queries["position"][..., None])
                   & (queries["position"][..., None] - key["position"][:, :, None, :] > window)
                   & ~jnp.any(queries["membership"][:, :, :, None, :] & key["membership"][:, :, None, :, :], axis=-1)
                   & ((queries["segment"] == block_segment) == first_segment)[..., None])
        return _attend(scores_of(key["k"]), allowed, key["v"])

    inside = attend({name: by_block(x) for name, x in keys.items()}, first_segment=False)  # part 2
    first_of_run = run_start[:, ::SINK_CHUNK]  # [B, nb]: where each block's first segment starts

    def step(start, first, n):  # part 1: places start .. start + n - 1 of the block's first segment
        offsets = start + jnp.arange(n, dtype=jnp.int32)
        # past the row, an index is clipped onto padding, or onto the last sorted token, which only it could see
        # (the last of its segment), and it within its window
        index = jnp.minimum(first_of_run[..., None] + offsets, length - 1)  # [B, nb, n]
        key = {name: jax.vmap(lambda x, index: x[index])(x, index) for name, x in keys.items()}
        key["exists"] = key["exists"] & (offsets >= first)
        return attend(key, first_segment=True)

    out, lse = _merge(*inside, *_steps(step, s, (b, nb, SINK_CHUNK, h, v.shape[-1])))
    inverse = jax.vmap(lambda order: jnp.zeros_like(order).at[order].set(jnp.arange(t, dtype=order.dtype)))(order)
    unsort = lambda x: jax.vmap(lambda x, inverse: x[inverse])(x.reshape(b, length, *x.shape[3:]), inverse)
    return unsort(out), unsort(lse)


def sink_set(q, k, v, membership, *, multiplier, window, segment_ids, sink, softcap):
    """Set C's attention: the pairs the sink adds to sets A and B (a sink key of the query's segment, causal,
    outside its window, sharing no group with it).

    q `[B, T, H, D]`, k `[B, T, Hk, D]`, v `[B, T, Hk, Dv]`, membership bool `[B, T, K]`, multiplier a number or an
    array broadcastable to `[B, T, H]` -> (out `[B, T, H, Dv]` float32, lse `[B, T, H]` float32; about -1e30 for a
    query without such pairs, whose `out` is then meaningless and merged with weight 0).

    A sink longer than `SINK_CHUNK` keys (after clamping to T) takes steps of `SINK_CHUNK` (a `lax.scan` of
    rematerialised steps merged by log-sum-exp), so that its memory stays that of one step.
    """
    b, t, h, _ = q.shape
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    q, k = q.astype(dtype), k.astype(dtype)
    multiplier = jnp.broadcast_to(jnp.asarray(multiplier, jnp.float32), (b, t, h))
    settings = dict(window=window, s=min(sink, t), softcap=softcap)
    if segment_ids is None:
        return _row_sink_set(q, k, v, membership, multiplier, **settings)
    return _segment_sink_set(q, k, v, membership, multiplier, segment_ids=segment_ids, **settings)


def with_sink(out, lse, q, k, v, membership, *, multiplier, window, segment_ids, sink, softcap):
    """A fast path's output over sets A and B (`out [B, T, H, Dv]`, its log-sum-exp `lse [B, T, H]` float32)
    merged with set C's (`sink_set`, same arguments) -> `[B, T, H, Dv]` in out's dtype."""
    out_c, lse_c = sink_set(q, k, v, membership, multiplier=multiplier, window=window, segment_ids=segment_ids,
                            sink=sink, softcap=softcap)
    return _merge(out, lse, out_c, lse_c)[0].astype(out.dtype)
