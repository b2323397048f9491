"""The exact fast path of hard Focus attention: group-sorted causal attention plus a cross-group local band.

The allowed pairs of `focus_mask` (j <= i, same segment, and local or sharing a group) split into two disjoint sets:

  A. same-group causal pairs, each counted once, in the lowest group the two tokens share. Every (token, group)
     membership becomes an *entry*; entries are sorted by (group, position), so the keys a query entry needs are the
     entries of its group before it: a contiguous run of key blocks ending at its own block.
  B. cross-group local pairs (`0 <= i - j <= window`, no shared group): a band of `block + window` keys per query
     block.

With an attention sink, the pairs it adds outside the window and the groups (at most `sink` per query) are computed
and merged by `focal_jax.attention.sink.with_sink`, which takes the log-sum-exp of sets A and B.

Both are computed blockwise with an online softmax and merged per query token by log-sum-exp, so memory grows as
O(T * block) (plus O(T * K) integers for the sort) and the result equals the dense masked reference. Gradients come
from a hand-written flash-style backward pass (`jax.custom_vjp`) that recomputes the blocks. Products run in the
inputs' dtype with float32 accumulation (bf16 inputs: probabilities and dS rounded to bf16 for their products, as
in flash attention); the softmax statistics, accumulators and gradient sums are float32.

Internally each token array gets one extra dummy row (index T): padding entries point at it, so gathers never go
out of bounds and whatever is scattered to it is dropped.
"""

import functools
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from focal_jax._axes import vary_like
from focal_jax.attention.sink import with_sink

BITS_PER_WORD = 31  # group-membership bits per int32 word (the sign bit is left unused)


class Routing(NamedTuple):
    """Integer description of one sequence's tokens and group entries (no gradients flow through it)."""
    segment: jax.Array      # [T + 1] segment id per token (dummy row last)
    words: jax.Array        # [T + 1, W] group-membership bitmask per token
    entry_token: jax.Array  # [E] token of each (token, group) entry, sorted by (group, position); T for padding
    entry_group: jax.Array  # [E] group of each entry; K for padding
    group_start: jax.Array  # [K + 1] index of each group's first entry; group_start[K] = number of real entries


def membership_words(membership):
    """bool `[..., K]` -> int32 `[..., ceil(K / 31)]`, bit j of word w set iff the token is in group 31 w + j."""
    k = membership.shape[-1]
    n_words = -(-k // BITS_PER_WORD)
    padded = jnp.zeros(membership.shape[:-1] + (n_words * BITS_PER_WORD,), jnp.int32)
    padded = padded.at[..., :k].set(membership.astype(jnp.int32))
    bits = padded.reshape(membership.shape[:-1] + (n_words, BITS_PER_WORD))
    return jnp.sum(bits << jnp.arange(BITS_PER_WORD, dtype=jnp.int32), axis=-1, dtype=jnp.int32)


def _groups_below(group, n_words):
    """Bitmask words `[..., W]` of the groups with index < group."""
    count = jnp.clip(group[..., None] - BITS_PER_WORD * jnp.arange(n_words), 0, BITS_PER_WORD)
    return jnp.where(count >= BITS_PER_WORD, 0x7FFFFFFF, (1 << count) - 1).astype(jnp.int32)


def _entry_slots(k, max_groups):
    """Entry slots per token: `max_groups`, at most K (default K)."""
    return k if max_groups is None else min(max_groups, k)


def _routing(membership, segment_ids, block, max_groups=None):
    """Builds the `Routing` of one sequence: membership bool `[T, K]`, segment ids int `[T]`. Each token gets
    `max_groups` entry slots (default K), so E = `max_groups * T` rounded up to a block; a token in more groups than
    that keeps its `max_groups` lowest ones."""
    t, k = membership.shape
    slots = _entry_slots(k, max_groups)
    if slots == k:
        is_member, group = membership, jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (t, k))
    else:
        rank, group = jax.lax.top_k(membership.astype(jnp.int32), slots)  # ties: lower group first
        is_member = rank > 0
    token = jnp.arange(t, dtype=jnp.int32)[:, None]
    unused = k * t + jnp.arange(t * slots, dtype=jnp.int32).reshape(t, slots)  # sorts after every member
    order = jnp.sort(jnp.where(is_member, group * t + token, unused).reshape(-1))  # (group, position) order
    is_entry = order < k * t
    n_entries = -(-(slots * t) // block) * block
    pad = n_entries - slots * t
    entry_token = jnp.pad(jnp.where(is_entry, order % t, t), (0, pad), constant_values=t)
    entry_group = jnp.pad(jnp.where(is_entry, order // t, k), (0, pad), constant_values=k)
    counts = jnp.sum(membership, axis=0, dtype=jnp.int32)
    group_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    words = membership_words(membership)
    return Routing(
        segment=jnp.concatenate([segment_ids.astype(jnp.int32), jnp.full((1,), -1, jnp.int32)]),
        words=jnp.concatenate([words, jnp.zeros((1, words.shape[1]), jnp.int32)]),
        entry_token=entry_token.astype(jnp.int32),
        entry_group=entry_group.astype(jnp.int32),
        group_start=group_start,
    )


def _with_dummy_row(x):
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])


# ----------------------------------------------------------------------------------------------------------------
# Blocks: which queries and keys a block pairs up, and which of those pairs it may compute.
# ----------------------------------------------------------------------------------------------------------------

class Tile(NamedTuple):
    """One block of query tokens against one block of key tokens, with the pairs allowed between them."""
    query_token: jax.Array  # [bq]
    key_token: jax.Array    # [bk]
    mask: jax.Array         # [bq, bk] bool


def _band_tile(routing, block_index, t, window, block):
    """Set B for query tokens [block_index * block, + block): the keys from `window` tokens before the block to its
    end, allowed if local, same segment and sharing no group."""
    reach = min(window, t - 1)
    query_token = block_index * block + jnp.arange(block)
    key_token = block_index * block - reach + jnp.arange(block + reach)
    query_token = jnp.where(query_token < t, query_token, t)
    key_token = jnp.where((key_token >= 0) & (key_token < t), key_token, t)
    distance = query_token[:, None] - key_token[None, :]
    is_local = (distance >= 0) & (distance <= window)
    shared = jnp.any((routing.words[query_token][:, None] & routing.words[key_token][None]) != 0, axis=-1)
    mask = ((query_token[:, None] < t) & (key_token[None, :] < t)
            & is_local
            & (routing.segment[query_token][:, None] == routing.segment[key_token][None, :]) & ~shared)
    return Tile(query_token, key_token, mask)


def _group_tile(routing, query_block, key_block, t, block):
    """Set A between entry blocks: same group, causal, same segment, and no lower group shared (each pair is
    counted only in the lowest group the two tokens share)."""
    query_slice = jax.lax.dynamic_slice_in_dim(routing.entry_token, query_block * block, block)
    query_group = jax.lax.dynamic_slice_in_dim(routing.entry_group, query_block * block, block)
    key_token = jax.lax.dynamic_slice_in_dim(routing.entry_token, key_block * block, block)
    key_group = jax.lax.dynamic_slice_in_dim(routing.entry_group, key_block * block, block)
    lower = routing.words[query_slice] & _groups_below(query_group, routing.words.shape[1])
    shared_lower = jnp.any((lower[:, None] & routing.words[key_token][None]) != 0, axis=-1)
    mask = ((query_slice[:, None] < t) & (key_token[None, :] < t)
            & (query_group[:, None] == key_group[None, :])
            & (key_token[None, :] <= query_slice[:, None])
            & (routing.segment[query_slice][:, None] == routing.segment[key_token][None, :])
            & ~shared_lower)
    return Tile(query_slice, key_token, mask)


def _first_key_block(routing, query_block, block):
    """The first key block a query entry block needs: the start of the group of its first entry."""
    first_group = routing.entry_group[query_block * block]
    return routing.group_start[first_group] // block


def _n_entry_blocks(routing, block):
    return -(-routing.group_start[-1] // block)


class Settings(NamedTuple):
    """The static settings of one call (hashable: the non-differentiable argument of the custom VJP)."""
    window: int
    softcap: float | None
    block: int
    scale: float | None  # a numeric multiplier of the float32 logits; None: an array one, already in q


def _product(spec, a, b):
    """`einsum(spec, a, b)` in b's dtype (a is cast to it: probabilities, dS) with a float32 result."""
    return jnp.einsum(spec, a.astype(b.dtype), b, preferred_element_type=jnp.float32)


def _raw_scores(q_block, k_block, scale):
    """q_block `[bq, Hk, G, D]`, k_block `[bk, Hk, D]` -> `scale * q.k` `[bq, Hk, G, bk]` float32 (scale None: q
    already carries the multiplier)."""
    raw = _product("qhgd,khd->qhgk", q_block, k_block)
    return raw if scale is None else raw * scale


def _scores(raw, mask, softcap):
    """Logits from raw `q.k`: soft-capped if `softcap` is set, -inf where mask `[bq, bk]` is False."""
    s = raw if softcap is None else softcap * jnp.tanh(raw / softcap)
    return jnp.where(mask[:, None, None, :], s, -jnp.inf)


# ----------------------------------------------------------------------------------------------------------------
# Forward: online softmax per query block, merged into per-token accumulators.
# ----------------------------------------------------------------------------------------------------------------

def _finite(m):
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _online_update(state, s, v_block):
    """Adds the keys of one tile to a running (max, sum, weighted values) of shapes [bq,Hk,G], [bq,Hk,G],
    [bq,Hk,G,Dv]."""
    m, l, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - _finite(m_new)[..., None])
    alpha = jnp.exp(m - _finite(m_new))
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + _product("qhgk,khd->qhgd", p, v_block)
    return m_new, l, acc


def _merge_into_tokens(totals, tokens, state):
    """Merges per-entry partial softmax states into per-token totals by log-sum-exp.

    Two entries of one block may belong to the same token (a token in two small groups): the rescale is written with
    `set` (both writers compute the same value) and the contributions with `add`, so collisions are exact.
    """
    m_tok, l_tok, acc_tok = totals
    m, l, acc = state
    m_old = m_tok[tokens]
    m_tok = m_tok.at[tokens].max(m)
    m_new = _finite(m_tok[tokens])
    rescale = jnp.exp(m_old - m_new)
    l_tok = l_tok.at[tokens].set(l_tok[tokens] * rescale)
    acc_tok = acc_tok.at[tokens].set(acc_tok[tokens] * rescale[..., None])
    weight = jnp.exp(m - m_new)
    l_tok = l_tok.at[tokens].add(weight * l)
    acc_tok = acc_tok.at[tokens].add(weight[..., None] * acc)
    return m_tok, l_tok, acc_tok


def _forward(q, k, v, routing, settings):
    """q `[T, Hk, G, D]` (already scaled), k `[T, Hk, D]`, v `[T, Hk, Dv]` (one dtype) -> out `[T, Hk, G, Dv]`, lse
    `[T, Hk, G]`, float32."""
    window, block = settings.window, settings.block
    t, hk, g, _ = q.shape
    dv = v.shape[-1]
    q, k, v = _with_dummy_row(q), _with_dummy_row(k), _with_dummy_row(v)
    inputs = (q, k, v, *jax.tree.leaves(routing))
    totals = vary_like((jnp.full((t + 1, hk, g), -jnp.inf), jnp.zeros((t + 1, hk, g)), jnp.zeros((t + 1, hk, g, dv))),
                       *inputs)

    def band_block(block_index, totals):
        tile = _band_tile(routing, block_index, t, window, block)
        empty = (jnp.full((block, hk, g), -jnp.inf), jnp.zeros((block, hk, g)), jnp.zeros((block, hk, g, dv)))
        s = _scores(_raw_scores(q[tile.query_token], k[tile.key_token], settings.scale), tile.mask, settings.softcap)
        state = _online_update(empty, s, v[tile.key_token])
        return _merge_into_tokens(totals, tile.query_token, state)

    totals = jax.lax.fori_loop(0, -(-t // block), band_block, totals)

    def group_block(query_block, totals):
        tokens = jax.lax.dynamic_slice_in_dim(routing.entry_token, query_block * block, block)
        q_block = q[tokens]

        def key_step(carry):
            key_block, state = carry
            tile = _group_tile(routing, query_block, key_block, t, block)
            s = _scores(_raw_scores(q_block, k[tile.key_token], settings.scale), tile.mask, settings.softcap)
            return key_block + 1, _online_update(state, s, v[tile.key_token])

        empty = (jnp.full((block, hk, g), -jnp.inf), jnp.zeros((block, hk, g)), jnp.zeros((block, hk, g, dv)))
        empty = vary_like(empty, *inputs)
        first = _first_key_block(routing, query_block, block)
        _, state = jax.lax.while_loop(lambda c: c[0] <= query_block, key_step, (first, empty))
        return _merge_into_tokens(totals, tokens, state)

    m, l, acc = jax.lax.fori_loop(0, _n_entry_blocks(routing, block), group_block, totals)
    out = acc[:t] / l[:t, ..., None]
    return out, m[:t] + jnp.log(l[:t])


# ----------------------------------------------------------------------------------------------------------------
# Backward: recompute each tile's probabilities from the saved log-sum-exp (flash-attention style).
# ----------------------------------------------------------------------------------------------------------------

class QueryBlock(NamedTuple):
    """What the backward pass needs of a block of queries, gathered once: q, dO `[bq, Hk, G, D|Dv]`, and the
    saved log-sum-exp and rowsum(dO * O) `[bq, Hk, G]` (float32); dO in v's dtype."""
    q: jax.Array
    d_out: jax.Array
    lse: jax.Array
    delta: jax.Array


def _tile_grads(query, k_block, v_block, mask, softcap, scale):
    """Gradient contributions of one tile: dq `[bq,Hk,G,D]`, dk `[bk,Hk,D]`, dv `[bk,Hk,Dv]`."""
    raw = _raw_scores(query.q, k_block, scale)
    p = jnp.exp(_scores(raw, mask, softcap) - query.lse[..., None])
    dp = _product("qhgd,khd->qhgk", query.d_out, v_block)
    ds = p * (dp - query.delta[..., None])
    if softcap is not None:
        ds = ds * (1.0 - jnp.tanh(raw / softcap) ** 2)
    if scale is not None:
        ds = ds * scale
    dq = _product("qhgk,khd->qhgd", ds, k_block)
    dk = _product("qhgk,qhgd->khd", ds, query.q)
    dv = _product("qhgk,qhgd->khd", p, query.d_out)
    return dq, dk, dv


def _backward(q, k, v, routing, out, lse, d_out, d_lse, settings):
    """dq, dk, dv (float32) from the cotangents of out and of the log-sum-exp (`d_lse`, nonzero when a sink's
    pairs were merged by it): `dS = P (dP - delta)` with `delta = rowsum(dO * O) - d_lse`."""
    window, block = settings.window, settings.block
    t = q.shape[0]
    delta = jnp.sum(d_out * out, axis=-1) - d_lse
    q, k, v = _with_dummy_row(q), _with_dummy_row(k), _with_dummy_row(v)
    lse, d_out, delta = _with_dummy_row(lse), _with_dummy_row(d_out.astype(v.dtype)), _with_dummy_row(delta)
    inputs = (q, k, v, lse, d_out, delta, *jax.tree.leaves(routing))

    def gather_queries(tokens):
        return QueryBlock(q[tokens], d_out[tokens], lse[tokens], delta[tokens])

    def add_tile(query, key_tokens, mask, dq_block, dk, dv):
        tile_dq, tile_dk, tile_dv = _tile_grads(query, k[key_tokens], v[key_tokens], mask, settings.softcap,
                                                settings.scale)
        return dq_block + tile_dq, dk.at[key_tokens].add(tile_dk), dv.at[key_tokens].add(tile_dv)

    def band_block(block_index, grads):
        dq, dk, dv = grads
        tile = _band_tile(routing, block_index, t, window, block)
        query = gather_queries(tile.query_token)
        dq_block, dk, dv = add_tile(query, tile.key_token, tile.mask, _zeros(query.q), dk, dv)
        return dq.at[tile.query_token].add(dq_block), dk, dv

    grads = vary_like((_zeros(q), _zeros(k), _zeros(v)), *inputs)
    grads = jax.lax.fori_loop(0, -(-t // block), band_block, grads)

    def group_block(query_block, grads):
        dq, dk, dv = grads
        tokens = jax.lax.dynamic_slice_in_dim(routing.entry_token, query_block * block, block)
        query = gather_queries(tokens)

        def key_step(carry):
            key_block, dq_block, dk, dv = carry
            tile = _group_tile(routing, query_block, key_block, t, block)
            return (key_block + 1,) + add_tile(query, tile.key_token, tile.mask, dq_block, dk, dv)

        first = _first_key_block(routing, query_block, block)
        _, dq_block, dk, dv = jax.lax.while_loop(
            lambda c: c[0] <= query_block, key_step, (first, vary_like(_zeros(query.q), *inputs), dk, dv))
        return dq.at[tokens].add(dq_block), dk, dv

    dq, dk, dv = jax.lax.fori_loop(0, _n_entry_blocks(routing, block), group_block, grads)
    return dq[:t], dk[:t], dv[:t]  # float32


def _zeros(x):
    return jnp.zeros(x.shape, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sequence_attention(q, k, v, routing, settings):
    """One sequence's sets A and B -> (out `[T, Hk, G, Dv]`, lse `[T, Hk, G]`), float32."""
    return _forward(q, k, v, routing, settings)


def _sequence_attention_fwd(q, k, v, routing, settings):
    out, lse = _forward(q, k, v, routing, settings)
    return (out, lse), (q, k, v, routing, out, lse)


def _sequence_attention_bwd(settings, residuals, cotangents):
    q, k, v, routing, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(q, k, v, routing, out, lse, d_out, d_lse, settings)
    zero_routing = jax.tree.map(lambda x: jnp.zeros(x.shape, jax.dtypes.float0), routing)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_routing


_sequence_attention.defvjp(_sequence_attention_fwd, _sequence_attention_bwd)


def decomposed_attention(q, k, v, membership, *, multiplier, window, segment_ids=None, sink=0, softcap=None,
                         block_size=128, max_groups=None):
    """Hard Focus attention by the exact decomposition (inputs already validated by `focus_sparse_attention`).

    Args:
      q: `[B, T, H, D]`; k: `[B, T, Hk, D]`; v: `[B, T, Hk, Dv]`.
      membership: bool `[B, T, K]`.
      multiplier: scale / temperature: a number, applied to the float32 logits, or an array, scalar or
        `[B, T, H]` (it may be traced: a learned temperature), which scales q in q's dtype before the products.
      window: int >= 0. segment_ids: int `[B, T]` or None. sink: the first `sink` tokens of each segment are
        visible to every later query of it (`focal_jax.attention.sink`).
      softcap: None or the logit cap (`softcap * tanh(logits / softcap)`).
      block_size: tile size.
      max_groups: at most this many groups per token (entry arrays of `max_groups * T` rows); None: K.

    Returns:
      `[B, T, H, Dv]` in v's dtype. Products run in the dtype q, k and v promote to, with float32 accumulation;
      the softmax in float32.
    """
    dtype, out_dtype = jnp.result_type(q.dtype, k.dtype, v.dtype), v.dtype
    if isinstance(multiplier, numbers.Real):
        scale, per_query = float(multiplier), None
    else:
        scale, per_query = None, jnp.asarray(multiplier, jnp.float32)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    out, lse = _decomposed(q, k, v, per_query, membership, segment_ids, window=window, softcap=softcap,
                           block_size=block_size, max_groups=max_groups, scale=scale)
    if sink:
        out = with_sink(out, lse, q, k, v, membership, multiplier=multiplier, window=window,
                        segment_ids=segment_ids, sink=sink, softcap=softcap)
    return out.astype(out_dtype)


# Jitted as a whole: called eagerly, its loops over new closures compiled afresh at every call (0.8 s at T = 256).
@functools.partial(jax.jit, static_argnames=("window", "softcap", "block_size", "max_groups", "scale"))
def _decomposed(q, k, v, per_query, membership, segment_ids, *, window, softcap, block_size, max_groups, scale):
    """Sets A and B of `decomposed_attention` on one dtype, with a numeric multiplier as `scale` or an array one
    as `per_query` -> (out `[B, T, H, Dv]`, lse `[B, T, H]`), float32."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    if per_query is not None:
        q = (q.astype(jnp.float32) * (per_query[..., None] if per_query.ndim else per_query)).astype(q.dtype)
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)
    elif jnp.dtype(segment_ids.dtype).itemsize > 4:
        # 64-bit ids (x64): rank them per row, as the Pallas plan does, so that the int32 routing keeps ids that differ
        # only above bit 31 apart (a plain cast merges those documents)
        segment_ids = jax.vmap(lambda s: jnp.searchsorted(jnp.sort(s), s))(segment_ids)
    routing = jax.vmap(lambda m, s: _routing(m, s, block_size, max_groups))(membership, segment_ids)

    def one_sequence(args):
        return _sequence_attention(*args, Settings(window, softcap, block_size, scale))

    out, lse = jax.lax.map(one_sequence, (q.reshape(b, t, hk, h // hk, d), k, v, routing))
    return out.reshape(b, t, h, v.shape[-1]), lse.reshape(b, t, h)
