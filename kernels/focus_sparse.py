"""Block-sparse hard Focus attention as Pallas kernels, forward and backward, with the masks computed inside the
kernels from per-token ids.

The allowed pairs of `focal_jax.attention.focus_mask` split as in `focal_jax.attention.decomposed`:

  A. same-group causal pairs, each counted once in the lowest group the two tokens share, computed on the
     (group, position)-sorted *entries* (one per token and group it belongs to): query entry block `i` visits the
     contiguous key-block range `[first_key_block[i], i]` (the start of its first entry's group up to itself);
  B. cross-group local pairs (and, with a sink, cross-group pairs with the first `sink` keys), computed in token
     order: query block `i` visits the key blocks of `[i * block - window, (i + 1) * block)` plus the sink blocks.

Each kernel program owns one query block of one head, walks its key blocks with an online softmax and writes the
normalised output and the log-sum-exp of its rows; the two sets are merged per token by log-sum-exp. A key block
whose pairs are all allowed (*full*: one group, one segment, strictly earlier, no multi-group query) skips the
element mask. The backward pass (`jax.custom_vjp`) recomputes each block from the merged log-sum-exp: a dq kernel
per query block and a dk / dv kernel per key block (walking the query blocks that visit it). No `[T, T]` array
exists anywhere. Backends: Triton on GPU, Pallas interpret mode elsewhere (the TPU lowering is not written yet).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from focal_jax.attention.decomposed import _groups_below, _routing, _with_dummy_row

NEG_INF = -1e30  # finite "minus infinity" for masked logits (keeps exp / max free of NaN in fully masked rows)


class Plan(NamedTuple):
    """Per-sequence integer description of the work (from `plan`); no gradients flow through it.

    Entry arrays (set A) have `E` = a multiple of `block` rows, token arrays (set B) `Tp` = T rounded up to
    `band_block`.
    """
    entry_token: jax.Array   # [E] token of each entry, sorted by (group, position); T for padding
    entry_group: jax.Array   # [E] group of each entry; K for padding
    entry_segment: jax.Array  # [E] segment of the entry's token; -1 for padding
    entry_words: jax.Array   # [E, W] membership bitmask of the entry's token
    entry_lower: jax.Array   # [E, W] bitmask of the groups below the entry's group that its token belongs to
    first_key_block: jax.Array  # [E / block] first key block of each query entry block; > its index when empty
    block_info: jax.Array    # [E / block, 4] (uniform, group, segment, 0): uniform = one group, one segment, all
                             # real, all single-group tokens (4 columns: Triton wants power-of-two shapes)
    token_segment: jax.Array  # [Tp] segment per token; -1 for padding
    token_words: jax.Array   # [Tp, W]


def plan(membership, segment_ids, block: int, band_block: int) -> Plan:
    """The `Plan` of one sequence: membership bool `[T, K]`, segment ids int `[T]`; set A in blocks of `block`
    entries, set B in blocks of `band_block` tokens."""
    t, k = membership.shape
    routing = _routing(membership, segment_ids, block)
    routing = routing._replace(words=_pad_words(routing.words))
    n_words = routing.words.shape[1]
    e = routing.entry_token.shape[0]
    token = routing.entry_token
    group = routing.entry_group
    real = token < t
    words = routing.words[token]
    below = _groups_below(group, n_words)
    segment = jnp.where(real, routing.segment[token], -1)
    single = jnp.sum(jax.lax.population_count(words), axis=-1) <= 1
    n_blocks = e // block
    blocks = lambda x: x.reshape(n_blocks, block)
    uniform = (jnp.all(blocks(real), axis=1) & jnp.all(blocks(single), axis=1)
               & jnp.all(blocks(group) == blocks(group)[:, :1], axis=1)
               & jnp.all(blocks(segment) == blocks(segment)[:, :1], axis=1))
    block_index = jnp.arange(n_blocks)
    first_group = jnp.minimum(blocks(group)[:, 0], k - 1)
    first = routing.group_start[first_group] // block
    first = jnp.where(blocks(real)[:, 0], first, block_index + 1)  # empty (padding) blocks visit nothing
    tp = -(-t // band_block) * band_block
    return Plan(
        entry_token=token, entry_group=group, entry_segment=segment, entry_words=words,
        entry_lower=words & below, first_key_block=first.astype(jnp.int32),
        block_info=jnp.stack([uniform.astype(jnp.int32), blocks(group)[:, 0], blocks(segment)[:, 0],
                              jnp.zeros(n_blocks, jnp.int32)], axis=1),
        token_segment=jnp.pad(segment_ids.astype(jnp.int32), (0, tp - t), constant_values=-1),
        token_words=jnp.pad(routing.words[:t], ((0, tp - t), (0, 0))),
    )


def _pad_words(words):
    """Membership words `[T + 1, W]` padded with zero words to a power-of-two W (Triton's shapes)."""
    n_words = words.shape[1]
    return jnp.pad(words, ((0, 0), (0, pl.next_power_of_2(n_words) - n_words)))


def band_key_blocks(query_block, *, window: int, sink: int, block: int):
    """Set B's key blocks of query block `query_block`: `(sink_end, band_start, band_end)`, visiting sink blocks
    `[0, sink_end)` and band blocks `[band_start, band_end]` (`sink_end <= band_start`)."""
    band_start = jnp.maximum(query_block * block - window, 0) // block
    sink_end = jnp.minimum(-(-sink // block), band_start)
    return sink_end, band_start, query_block


# ------------------------------------------------------------------------------------------------ kernels


def _scores(q, k, softcap):
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _online(carry, s, v):
    """One online-softmax step: carry (acc [bq, Dv], m [bq], l [bq]), scores s [bq, bk] (masked = NEG_INF)."""
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    p = jnp.where(s > NEG_INF / 2, p, 0.0)
    correction = jnp.exp(m - m_new)
    acc = acc * correction[:, None] + jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                                          preferred_element_type=jnp.float32)
    return acc, m_new, l * correction + jnp.sum(p, axis=1)


def _finish(carry, o_ref, lse_ref):
    acc, m, l = carry
    empty = l == 0.0
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _shares(words_a, words_b):
    """[bq, W] x [bk, W] int bitmasks -> [bq, bk] bool: any common bit (a sum, not `any`: Triton has no
    reduce_or)."""
    common = ((words_a[:, None, :] & words_b[None, :, :]) != 0).astype(jnp.int32)
    return jnp.sum(common, axis=-1) > 0


def _group_ids(token_ref, group_ref, segment_ref, words_ref, lower_ref, rows):
    """The ids of the entries `rows` that set A's mask needs."""
    return token_ref[rows], group_ref[rows], segment_ref[rows], words_ref[rows, :], lower_ref[rows, :]


def _group_allowed(q_ids, k_ids):
    """Set A's mask `[bq, bk]`: same group, causal, same segment, real, no lower group shared."""
    q_token, q_group, q_segment, _, q_lower = q_ids
    k_token, k_group, k_segment, k_words, _ = k_ids
    return ((q_group[:, None] == k_group[None, :]) & (k_token[None, :] <= q_token[:, None])
            & (q_segment[:, None] == k_segment[None, :]) & (q_segment[:, None] >= 0) & ~_shares(q_lower, k_words))


def _is_full(info_ref, query_block, key_block):
    """Whether every pair of a set-A block is allowed: one group and one segment on both sides, strictly earlier
    keys, real single-group entries."""
    def field(block, column):
        return info_ref[block, column]

    return ((key_block < query_block) & (field(query_block, 0) == 1) & (field(key_block, 0) == 1)
            & (field(query_block, 1) == field(key_block, 1)) & (field(query_block, 2) == field(key_block, 2)))


def _group_scores(q, k, ids_refs, info_ref, query_block, key_block, block, softcap):
    """Set A's scores of one block pair, NEG_INF where not allowed (the element mask skipped for full blocks)."""
    s = _scores(q, k, softcap)

    def masked(s):
        q_ids = _group_ids(*ids_refs, pl.ds(query_block * block, block))
        k_ids = _group_ids(*ids_refs, pl.ds(key_block * block, block))
        return jnp.where(_group_allowed(q_ids, k_ids), s, NEG_INF)

    return jax.lax.cond(_is_full(info_ref, query_block, key_block), lambda s: s, masked, s)


def _band_scores(q, k, segment_ref, words_ref, query_block, key_block, block, window, sink, n_tokens, softcap):
    """Set B's scores of one block pair, NEG_INF where not allowed: causal, local or a sink key, real, same
    segment, no group shared."""
    rows, cols = pl.ds(query_block * block, block), pl.ds(key_block * block, block)
    q_pos = query_block * block + jnp.arange(block)
    k_pos = key_block * block + jnp.arange(block)
    distance = q_pos[:, None] - k_pos[None, :]
    allowed = ((distance >= 0) & ((distance <= window) | (k_pos[None, :] < sink))
               & (q_pos[:, None] < n_tokens) & (k_pos[None, :] < n_tokens)
               & (segment_ref[rows][:, None] == segment_ref[cols][None, :])
               & ~_shares(words_ref[rows, :], words_ref[cols, :]))
    return jnp.where(allowed, _scores(q, k, softcap), NEG_INF)


def _empty_carry(block, dv):
    return (jnp.zeros((block, dv), jnp.float32), jnp.full((block,), NEG_INF, jnp.float32),
            jnp.zeros((block,), jnp.float32))


def _group_kernel(first_ref, info_ref, token_ref, group_ref, segment_ref, words_ref, lower_ref, q_ref, k_ref, v_ref,
                  o_ref, lse_ref, *, block, softcap):
    """Set A forward for one query entry block of one head."""
    i = pl.program_id(2)
    q = q_ref[...]
    ids_refs = (token_ref, group_ref, segment_ref, words_ref, lower_ref)

    def step(key_block, carry):
        cols = pl.ds(key_block * block, block)
        s = _group_scores(q, k_ref[cols, :], ids_refs, info_ref, i, key_block, block, softcap)
        return _online(carry, s, v_ref[cols, :])

    _finish(jax.lax.fori_loop(first_ref[i], i + 1, step, _empty_carry(block, v_ref.shape[-1])), o_ref, lse_ref)


def _band_kernel(segment_ref, words_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block, window, sink, n_tokens,
                 softcap):
    """Set B forward for one query token block of one head."""
    i = pl.program_id(2)
    q = q_ref[...]

    def step(key_block, carry):
        cols = pl.ds(key_block * block, block)
        s = _band_scores(q, k_ref[cols, :], segment_ref, words_ref, i, key_block, block, window, sink, n_tokens,
                         softcap)
        return _online(carry, s, v_ref[cols, :])

    sink_end, band_start, band_end = band_key_blocks(i, window=window, sink=sink, block=block)
    carry = jax.lax.fori_loop(0, sink_end, step, _empty_carry(block, v_ref.shape[-1]))
    _finish(jax.lax.fori_loop(band_start, band_end + 1, step, carry), o_ref, lse_ref)


BACKENDS = ("interpret", "triton")


class Settings(NamedTuple):
    """Static settings of one call (hashable: the non-differentiable argument of the custom VJP)."""
    block: int       # set A's query and key blocks (entries)
    band_block: int  # set B's query and key blocks (tokens)
    window: int
    sink: int
    softcap: float | None
    n_tokens: int
    backend: str     # one of BACKENDS
    groups: bool = True  # compute set A (False when no token is in a group)
    band: bool = True    # compute set B (False when every token is in the one group)


def _spec(rows, tail=(), head=None, heads_per_kv=1, block=None):
    """BlockSpec over `[B, rows, (H,) *tail]` arrays for the grid (batch, query head, block):
    `block` rows of program `i` (else all rows); `head` 'q' picks the program's head, 'kv' its kv head."""
    size = block or rows
    zeros = (0,) * len(tail)

    def index(bi, hi, i):
        row = i if block else 0
        if head is None:
            return (bi, row) + zeros
        return (bi, row, hi if head == "q" else hi // heads_per_kv) + zeros

    shape = (None, size) + ((None,) if head else ()) + tail
    return pl.BlockSpec(shape, index)


def _lse_spec(rows, block=None):
    """BlockSpec over `[B, H, rows]` (log-sum-exp, delta)."""
    return pl.BlockSpec((None, None, block or rows), lambda bi, hi, i: (bi, hi, i if block else 0))


def _call(kernel, in_specs, out_specs, out_shape, grid, backend, name):
    # GPU: the Triton lowering (K / V stay in global memory and are read block by block; Mosaic GPU would stage the
    # whole per-head sequence in shared memory).
    params = plt.CompilerParams(num_warps=4, num_stages=2) if backend == "triton" else None
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=backend == "interpret", name=name, compiler_params=params)


def default_backend() -> str:
    """'triton' on GPUs, 'interpret' elsewhere (CPU; the TPU lowering is not written yet)."""
    return "triton" if jax.default_backend() == "gpu" else "interpret"


def _take_rows(x, index):
    """`x [B, T, ...]` at rows `index [B, E]`; index T reads a zero row."""
    return jax.vmap(lambda x, i: _with_dummy_row(x)[i])(x, index)


def _scatter_rows(x, index, t):
    """Sum of `x [B, E, ...]` into `[B, t, ...]` by `index [B, E]` (index t is dropped)."""
    return jax.vmap(lambda x, i: jax.ops.segment_sum(x, i, num_segments=t + 1)[:t])(x, index)


def _group_inputs(p: Plan):
    """The plan arrays set A's kernels read (all rows), with their specs."""
    e = p.entry_token.shape[1]
    n_words = p.entry_words.shape[-1]
    arrays = (p.block_info, p.entry_token, p.entry_group, p.entry_segment, p.entry_words, p.entry_lower)
    specs = [_spec(p.block_info.shape[1], (4,)), _spec(e), _spec(e), _spec(e),
             _spec(e, (n_words,)), _spec(e, (n_words,))]
    return arrays, specs


def _group_forward(q, k, v, p: Plan, settings):
    b, _, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    e, block = p.entry_token.shape[1], settings.block
    qa, ka, va = _take_rows(q, p.entry_token), _take_rows(k, p.entry_token), _take_rows(v, p.entry_token)
    arrays, specs = _group_inputs(p)
    kernel = functools.partial(_group_kernel, block=block, softcap=settings.softcap)
    in_specs = [_spec(e // block), *specs, _spec(e, (d,), "q", block=block), _spec(e, (d,), "kv", h // hk),
                _spec(e, (dv,), "kv", h // hk)]
    out_specs = [_spec(e, (dv,), "q", block=block), _lse_spec(e, block)]
    out_shape = [jax.ShapeDtypeStruct((b, e, h, dv), v.dtype), jax.ShapeDtypeStruct((b, h, e), jnp.float32)]
    return _call(kernel, in_specs, out_specs, out_shape, (b, h, e // block), settings.backend, "focus_group")(
        p.first_key_block, *arrays, qa, ka, va)


def _band_inputs(q, k, v, p: Plan):
    tp, t = p.token_segment.shape[1], q.shape[1]
    pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t)) + ((0, 0),) * (x.ndim - 2))
    return tp, pad, (pad(q), pad(k), pad(v))


def _band_forward(q, k, v, p: Plan, settings):
    b, _, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    tp, _, (qp, kp, vp) = _band_inputs(q, k, v, p)
    block, n_words = settings.band_block, p.token_words.shape[-1]
    kernel = functools.partial(_band_kernel, block=block, window=settings.window, sink=settings.sink,
                               n_tokens=settings.n_tokens, softcap=settings.softcap)
    in_specs = [_spec(tp), _spec(tp, (n_words,)), _spec(tp, (d,), "q", block=block), _spec(tp, (d,), "kv", h // hk),
                _spec(tp, (dv,), "kv", h // hk)]
    out_specs = [_spec(tp, (dv,), "q", block=block), _lse_spec(tp, block)]
    out_shape = [jax.ShapeDtypeStruct((b, tp, h, dv), v.dtype), jax.ShapeDtypeStruct((b, h, tp), jnp.float32)]
    return _call(kernel, in_specs, out_specs, out_shape, (b, h, tp // block), settings.backend, "focus_band")(
        p.token_segment, p.token_words, qp, kp, vp)


def _attention_fwd(q, k, v, p: Plan, settings):
    b, t, h = q.shape[:3]
    dv = v.shape[-1]
    e, tp = p.entry_token.shape[1], p.token_segment.shape[1]
    if settings.groups:
        out_a, lse_a = _group_forward(q, k, v, p, settings)
    else:
        out_a, lse_a = jnp.zeros((b, e, h, dv), v.dtype), jnp.full((b, h, e), -jnp.inf)
    if settings.band:
        out_b, lse_b = _band_forward(q, k, v, p, settings)
    else:
        out_b, lse_b = jnp.zeros((b, tp, h, dv), v.dtype), jnp.full((b, h, tp), -jnp.inf)
    out, lse = _merge(settings.n_tokens, p.entry_token, out_a, lse_a, out_b, lse_b)
    out = out.astype(v.dtype)
    return out, (q, k, v, p, out, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, p: Plan, settings: Settings):
    return _attention_fwd(q, k, v, p, settings)[0]


def _group_backward(q, k, v, p: Plan, do, lse, delta, settings):
    """Set A's dq, dk, dv in token space (float32)."""
    b, t, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    e, block = p.entry_token.shape[1], settings.block
    token = p.entry_token
    qa, ka, va, doa = (_take_rows(x, token) for x in (q, k, v, do))
    lse_a = _take_rows(lse, token).transpose(0, 2, 1)  # [B, H, E]
    delta_a = _take_rows(delta, token).transpose(0, 2, 1)
    arrays, specs = _group_inputs(p)
    grid, common = (b, h, e // block), dict(block=block, softcap=settings.softcap)
    dq = _call(functools.partial(_group_dq_kernel, **common),
               [_spec(e // block), *specs, _spec(e, (d,), "q", block=block), _spec(e, (d,), "kv", h // hk),
                _spec(e, (dv,), "kv", h // hk), _spec(e, (dv,), "q", block=block), _lse_spec(e, block),
                _lse_spec(e, block)],
               _spec(e, (d,), "q", block=block), jax.ShapeDtypeStruct((b, e, h, d), jnp.float32), grid,
               settings.backend, "focus_group_dq")(p.first_key_block, *arrays, qa, ka, va, doa, lse_a, delta_a)
    first = p.first_key_block
    n_blocks = first.shape[1]
    last = jax.vmap(lambda f: jnp.searchsorted(f, jnp.arange(n_blocks), side="right") - 1)(first).astype(jnp.int32)
    dk, dvv = _call(functools.partial(_group_dkv_kernel, **common),
                    [_spec(n_blocks), *specs, _spec(e, (d,), "q"), _spec(e, (d,), "kv", h // hk, block=block),
                     _spec(e, (dv,), "kv", h // hk, block=block), _spec(e, (dv,), "q"), _lse_spec(e), _lse_spec(e)],
                    [_spec(e, (d,), "q", block=block), _spec(e, (dv,), "q", block=block)],
                    [jax.ShapeDtypeStruct((b, e, h, d), jnp.float32), jax.ShapeDtypeStruct((b, e, h, dv), jnp.float32)],
                    grid, settings.backend, "focus_group_dkv")(last, *arrays, qa, ka, va, doa, lse_a, delta_a)
    per_kv = lambda x: x.reshape(b, t, hk, h // hk, x.shape[-1]).sum(axis=3)
    return (_scatter_rows(dq, token, t), per_kv(_scatter_rows(dk, token, t)), per_kv(_scatter_rows(dvv, token, t)))


def _band_backward(q, k, v, p: Plan, do, lse, delta, settings):
    """Set B's dq, dk, dv (float32)."""
    b, t, h, d = q.shape
    hk, dv = k.shape[2], v.shape[-1]
    tp, pad, (qp, kp, vp) = _band_inputs(q, k, v, p)
    dop = pad(do)
    lse_b, delta_b = pad(lse).transpose(0, 2, 1), pad(delta).transpose(0, 2, 1)
    block, n_words = settings.band_block, p.token_words.shape[-1]
    common = dict(block=block, window=settings.window, sink=settings.sink, n_tokens=settings.n_tokens,
                  softcap=settings.softcap)
    grid = (b, h, tp // block)
    ids = [_spec(tp), _spec(tp, (n_words,))]
    dq = _call(functools.partial(_band_dq_kernel, **common),
               [*ids, _spec(tp, (d,), "q", block=block), _spec(tp, (d,), "kv", h // hk), _spec(tp, (dv,), "kv", h // hk),
                _spec(tp, (dv,), "q", block=block), _lse_spec(tp, block), _lse_spec(tp, block)],
               _spec(tp, (d,), "q", block=block), jax.ShapeDtypeStruct((b, tp, h, d), jnp.float32), grid,
               settings.backend, "focus_band_dq")(p.token_segment, p.token_words, qp, kp, vp, dop, lse_b, delta_b)
    dk, dvv = _call(functools.partial(_band_dkv_kernel, **common),
                    [*ids, _spec(tp, (d,), "q"), _spec(tp, (d,), "kv", h // hk, block=block),
                     _spec(tp, (dv,), "kv", h // hk, block=block), _spec(tp, (dv,), "q"), _lse_spec(tp),
                     _lse_spec(tp)],
                    [_spec(tp, (d,), "q", block=block), _spec(tp, (dv,), "q", block=block)],
                    [jax.ShapeDtypeStruct((b, tp, h, d), jnp.float32), jax.ShapeDtypeStruct((b, tp, h, dv), jnp.float32)],
                    grid, settings.backend, "focus_band_dkv")(p.token_segment, p.token_words, qp, kp, vp, dop,
                                                                lse_b, delta_b)
    per_kv = lambda x: x[:, :t].reshape(b, t, hk, h // hk, x.shape[-1]).sum(axis=3)
    return dq[:, :t], per_kv(dk), per_kv(dvv)


def _attention_bwd(settings, residuals, d_out):
    q, k, v, p, out, lse = residuals
    do = d_out.astype(v.dtype)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, H]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    grads = []
    if settings.groups:
        grads.append(_group_backward(q, k, v, p, do, lse, delta, settings))
    if settings.band:
        grads.append(_band_backward(q, k, v, p, do, lse, delta, settings))
    dq, dk, dv = (sum(parts) for parts in zip(*grads))
    zero_plan = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), p)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_plan


_attention.defvjp(_attention_fwd, _attention_bwd)


def _merge(t, entry_token, out_a, lse_a, out_b, lse_b):
    """Per token: log-sum-exp merge of its entries' set-A results and its set-B result -> out `[B, T, H, Dv]`
    (float32) and lse `[B, T, H]`."""
    def one(entry_token, out_a, lse_a, out_b, lse_b):
        lse_a = lse_a.T  # [E, H]
        lse_b = lse_b.T[:t]
        m = jnp.maximum(jax.ops.segment_max(lse_a, entry_token, num_segments=t + 1)[:t], lse_b)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w_a = jnp.exp(lse_a - jnp.concatenate([m, jnp.zeros_like(m[:1])])[entry_token])  # [E, H]
        w_b = jnp.exp(lse_b - m)
        num = jax.ops.segment_sum(w_a[..., None] * out_a.astype(jnp.float32), entry_token, num_segments=t + 1)[:t]
        num = num + w_b[..., None] * out_b[:t].astype(jnp.float32)
        den = jax.ops.segment_sum(w_a, entry_token, num_segments=t + 1)[:t] + w_b
        safe = jnp.where(den > 0, den, 1.0)
        return num / safe[..., None], jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)
    return jax.vmap(one)(entry_token, out_a, lse_a, out_b, lse_b)


# ------------------------------------------------------------------------------------------------ backward


def _grad_scores(s, lse, do, v, delta, softcap):
    """Flash-attention backward of one block: p = exp(s - lse) on the allowed pairs; d(raw score) `[bq, bk]`."""
    allowed = s > NEG_INF / 2
    p = jnp.where(allowed, jnp.exp(s - lse[:, None]), 0.0)
    dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    if softcap is not None:
        ds = ds * jnp.where(allowed, 1.0 - (s / softcap) ** 2, 0.0)
    return p, ds


def _matmul(a, b, contract):
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _group_dq_kernel(first_ref, info_ref, token_ref, group_ref, segment_ref, words_ref, lower_ref, q_ref, k_ref,
                     v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, block, softcap):
    """Set A: dq of one query entry block of one head (keys as in the forward pass)."""
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    ids_refs = (token_ref, group_ref, segment_ref, words_ref, lower_ref)

    def step(key_block, dq):
        cols = pl.ds(key_block * block, block)
        k = k_ref[cols, :]
        s = _group_scores(q, k, ids_refs, info_ref, i, key_block, block, softcap)
        _, ds = _grad_scores(s, lse, do, v_ref[cols, :], delta, softcap)
        return dq + _matmul(ds.astype(k.dtype), k, ((1,), (0,)))

    dq_ref[...] = jax.lax.fori_loop(first_ref[i], i + 1, step, jnp.zeros(q.shape, jnp.float32))


def _group_dkv_kernel(last_ref, info_ref, token_ref, group_ref, segment_ref, words_ref, lower_ref, q_ref, k_ref,
                      v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, block, softcap):
    """Set A: dk, dv of one key entry block from one query head (the query blocks that visit it)."""
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    ids_refs = (token_ref, group_ref, segment_ref, words_ref, lower_ref)

    def step(query_block, carry):
        dk, dv = carry
        rows = pl.ds(query_block * block, block)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s = _group_scores(q, k, ids_refs, info_ref, query_block, j, block, softcap)
        p, ds = _grad_scores(s, lse_ref[rows], do, v, delta_ref[rows], softcap)
        return (dk + _matmul(ds.astype(q.dtype), q, ((0,), (0,))),
                dv + _matmul(p.astype(do.dtype), do, ((0,), (0,))))

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk_ref[...], dv_ref[...] = jax.lax.fori_loop(j, last_ref[j] + 1, step, zeros)


def _band_dq_kernel(segment_ref, words_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, block,
                    window, sink, n_tokens, softcap):
    """Set B: dq of one query token block of one head."""
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def step(key_block, dq):
        cols = pl.ds(key_block * block, block)
        k = k_ref[cols, :]
        s = _band_scores(q, k, segment_ref, words_ref, i, key_block, block, window, sink, n_tokens, softcap)
        _, ds = _grad_scores(s, lse, do, v_ref[cols, :], delta, softcap)
        return dq + _matmul(ds.astype(k.dtype), k, ((1,), (0,)))

    sink_end, band_start, band_end = band_key_blocks(i, window=window, sink=sink, block=block)
    dq = jax.lax.fori_loop(0, sink_end, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = jax.lax.fori_loop(band_start, band_end + 1, step, dq)


def band_query_blocks(key_block, n_blocks, *, window: int, sink: int, block: int):
    """The query blocks whose set-B pass visits `key_block`: `[key_block, last]` (the transpose of
    `band_key_blocks`; every query block from `key_block` on for a sink block)."""
    band_last = ((key_block + 1) * block + window - 1) // block
    is_sink = key_block < -(-sink // block)
    return key_block, jnp.where(is_sink, n_blocks - 1, jnp.minimum(band_last, n_blocks - 1))


def _band_dkv_kernel(segment_ref, words_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                     block, window, sink, n_tokens, softcap):
    """Set B: dk, dv of one key token block from one query head."""
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    n_blocks = segment_ref.shape[0] // block

    def step(query_block, carry):
        dk, dv = carry
        rows = pl.ds(query_block * block, block)
        q, do = q_ref[rows, :], do_ref[rows, :]
        s = _band_scores(q, k, segment_ref, words_ref, query_block, j, block, window, sink, n_tokens, softcap)
        p, ds = _grad_scores(s, lse_ref[rows], do, v, delta_ref[rows], softcap)
        return (dk + _matmul(ds.astype(q.dtype), q, ((0,), (0,))),
                dv + _matmul(p.astype(do.dtype), do, ((0,), (0,))))

    first, last = band_query_blocks(j, n_blocks, window=window, sink=sink, block=block)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk_ref[...], dv_ref[...] = jax.lax.fori_loop(first, last + 1, step, zeros)


def focus_sparse_pallas(q, k, v, membership, *, multiplier, window, segment_ids=None, sink=0, softcap=None,
                        block_size=128, band_block_size=32, backend=None, _sets=(True, True)):
    """Hard Focus attention through the Pallas kernels (inputs validated by `focus_sparse_attention`).

    q `[B, T, H, D]`, k `[B, T, Hk, D]`, v `[B, T, Hk, Dv]`, membership bool `[B, T, K]`, multiplier (scale /
    temperature) scalar or `[B, T, H]`, segment_ids int `[B, T]` or None -> `[B, T, H, Dv]` in v's dtype.
    Matmuls run in the inputs' dtype with float32 accumulation; differentiable in q, k, v and the multiplier.
    `block_size`: set A's tile (entries); `band_block_size`: set B's tile (tokens; small, because the band needs only
    `window + 1` keys per query and a tile of b queries reads `b + window` keys).
    `backend`: 'triton' (GPU) or 'interpret' (Pallas interpret mode, any device); default `default_backend()`.
    """
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    b, t = q.shape[:2]
    multiplier = jnp.asarray(multiplier, jnp.float32)
    if multiplier.ndim:
        multiplier = multiplier[..., None]
    q = (q.astype(jnp.float32) * multiplier).astype(q.dtype)
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)
    p = jax.vmap(lambda m, s: plan(m, s, block_size, band_block_size))(membership, segment_ids)
    return _attention(q, k, v, p, Settings(block_size, band_block_size, window, sink, softcap, t, backend, *_sets))


def dot_product_pallas(q, k, v, *, multiplier, window=None, segment_ids=None, softcap=None, block_size=128,
                       band_block_size=32, backend=None):
    """Causal dense or focal attention (no groups) through the same kernels: `window=None` puts every token in one
    group (set A only: every causal pair, full blocks without the element mask); a `window` w puts no token in any
    group (set B only: the local band `0 <= i - j <= w`). Shapes and arguments as `focus_sparse_pallas`."""
    b, t = q.shape[:2]
    membership = jnp.full((b, t, 1), window is None)
    return focus_sparse_pallas(q, k, v, membership, multiplier=multiplier, window=0 if window is None else window,
                               segment_ids=segment_ids, softcap=softcap, block_size=block_size,
                               band_block_size=band_block_size, backend=backend,
                               _sets=(window is None, window is not None))
