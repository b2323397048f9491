"""Block-sparse hard Focus attention as Pallas kernels, forward and backward, with the masks computed inside the
kernels from per-token ids.

The allowed pairs of `focal_jax.attention.focus_mask` split as in `focal_jax.attention.decomposed`:

  A. same-group causal pairs, each counted once in the lowest group the two tokens share, computed on the
     (group, position)-sorted *entries* (one per token and group it belongs to): query entry block `i` visits the
     contiguous key-block range `[first_key_block[i], i]` (the start of its first entry's group up to itself);
  B. cross-group local pairs, computed in token order: query block `i` visits the key blocks of
     `[i * block - window, (i + 1) * block)`.

With an attention sink, the pairs it adds outside the window and the groups (at most `sink` per query) are computed
by `focal_jax.attention.sink.with_sink` in XLA and merged with the kernels' output by its log-sum-exp.

Each kernel program owns one block of one head and walks the blocks it pairs with, with an online softmax in the
forward pass; the two sets are merged per token by log-sum-exp (on GPUs with one entry per token inside set B's
forward kernel, `_in_token_order`). A key block whose pairs are all allowed (*full*: one group, one segment,
strictly earlier, no multi-group query) skips the element mask. The backward pass
(`jax.custom_vjp`) recomputes each block from the merged log-sum-exp: a dq kernel per query block and a dk / dv
kernel per key block (walking the query blocks that visit it, its scores transposed, `[keys, queries]`), each
accumulating in float32 and writing its block in the inputs' dtype; a token's parts (its entries, gathered by
`Plan.token_entries`, set B, the query heads that share a kv head) are summed in float32. On GPUs with one entry
per token (`max_groups=1`) set A's dq / dk / dv kernels store each entry's row at its token instead, and set B's
add their own to those rows in place (`_in_token_order`). No `[T, T]` array exists anywhere, and nothing is
scatter-added. The logits' multiplier (scale / temperature) multiplies each block's float32 scores inside the
kernels, and dq and dk: a number as a setting, a per-query array `[B, T, H]` as a per-row operand like the
log-sum-exp, whose gradient the dq kernels compute.

Layouts: activations stay row-major `[B, rows, H, C]` on GPUs (a program's block `[rows, C]` is a strided slice,
so no transposed copy exists) and are head-major `[B, H, rows, C]` on TPUs, whose blocks must tile or span their
last two dimensions (`_activation`). On GPUs set A's kernels read q, k, v and dO in token order and gather their
entries' rows themselves (`_Rows`, `_entry_rows`), so no copy of them in entry order exists; the TPU kernels, which
copy contiguous blocks by DMA, read copies gathered into entry order (for dense attention, whose entries are the
tokens in order, both read contiguous blocks). Every mask is a broadcast of the program's own block's per-token
ids, as columns `[block, 1]`, against the walked block's, as rows `[1, block]` (`_Vectors`): walked ids come as
rows `[B, C, rows]`; own ids as columns `[B, rows, C]` on GPUs, and as rows transposed once inside the kernel on
TPUs, whose (8, 128) tiles would pad a last dimension of C to 128. Likewise the per-row float32 statistics
(log-sum-exp, the backward's delta) are rows `[B, H, 1, rows]` where walked and on TPUs (turned into columns inside
the kernels, `_stat_column`), columns `[B, H, rows, 1]` for a GPU program's own block.

Backends (`BACKENDS`): 'triton' (GPU: Pallas's Triton lowering; a program reads the blocks it walks straight from
global memory), 'mosaic' (TPU: each walked block is copied from HBM into VMEM by DMA, double-buffered so that
the next block's copy overlaps this block's compute; blocks must be multiples of 128), and the interpret modes of
both, which run anywhere: 'interpret' (the GPU form) and 'mosaic_interpret' (the TPU form, its DMAs and semaphores
simulated).
"""

import contextlib
import contextvars
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

from focal_jax._axes import shape_like, vary_like, varying_axes
from focal_jax.attention import _validate
from focal_jax.attention.decomposed import _entry_slots, _groups_below, _routing
from focal_jax.attention.sink import with_sink
from focal_jax.kernels.partition import per_shard

NEG_INF = -1e30  # finite "minus infinity" for masked logits (keeps exp / max free of NaN in fully masked rows)
TOKEN, GROUP, SEGMENT = 0, 1, 2  # columns of set A's ids
UNIFORM = 0  # row of `Plan.block_info` (then GROUP, SEGMENT)


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
    last_query_block: jax.Array  # [E / block] last query block that visits each key entry block
    block_info: jax.Array    # [4, E / block] rows (uniform, group, segment, 0): uniform = one group, one segment,
                             # all real, all single-group tokens (4 rows: Triton wants power-of-two shapes)
    token_segment: jax.Array  # [Tp] segment per token; -1 for padding
    token_words: jax.Array   # [Tp, W]
    token_entries: jax.Array  # [T, S] entries of each token (S = entry slots per token), in group order; E for none


def plan(membership, segment_ids, block: int, band_block: int, max_groups: int | None = None) -> Plan:
    """The `Plan` of one sequence: membership bool `[T, K]`, segment ids int `[T]`; set A in blocks of `block`
    entries (`max_groups` entries per token, default K), set B in blocks of `band_block` tokens."""
    t, k = membership.shape
    # Each id as its rank among the sequence's ids, in [0, T): equal ids share one, and padding entries are segment
    # -1 below (subtracting the smallest id wrapped around for ids further apart than int32's largest).
    segment_ids = jnp.searchsorted(jnp.sort(segment_ids), segment_ids).astype(jnp.int32)
    routing = _routing(membership, segment_ids, block, max_groups)
    routing = routing._replace(words=_pad_words(routing.words))
    n_words = routing.words.shape[1]
    e = routing.entry_token.shape[0]
    token = routing.entry_token
    group = routing.entry_group
    real = token < t
    words = routing.words[token]
    lower = words & _groups_below(group, n_words)  # the entry token's groups below the entry's group
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
    first = jnp.where(blocks(real)[:, 0], first, block_index + 1).astype(jnp.int32)  # padding blocks visit nothing
    last = jnp.searchsorted(first, block_index, side="right") - 1  # `first` is non-decreasing
    tp = -(-t // band_block) * band_block
    rank = jnp.sum(jax.lax.population_count(lower), axis=-1)  # of the entry among its token's entries
    token_entries = jnp.full((t, _entry_slots(k, max_groups)), e, jnp.int32).at[token, rank].set(
        jnp.arange(e, dtype=jnp.int32), mode="drop")  # padding entries (token t) are dropped
    return Plan(
        entry_token=token, entry_group=group, entry_segment=segment, entry_words=words,
        entry_lower=lower, first_key_block=first, last_query_block=last.astype(jnp.int32),
        block_info=jnp.stack([uniform.astype(jnp.int32), blocks(group)[:, 0], blocks(segment)[:, 0],
                              jnp.zeros(n_blocks, jnp.int32)]),
        token_segment=jnp.pad(segment_ids, (0, tp - t), constant_values=-1),
        token_words=jnp.pad(routing.words[:t], ((0, tp - t), (0, 0))),
        token_entries=token_entries,
    )


def _pad_words(words):
    """Membership words `[T + 1, W]` padded with zero words to a power-of-two W (Triton's shapes)."""
    n_words = words.shape[1]
    return jnp.pad(words, ((0, 0), (0, pl.next_power_of_2(n_words) - n_words)))


def _div(a, b):
    """`a // b` for non-negative integers (truncating division: Mosaic's floor division needs the TPU's
    generation)."""
    return jax.lax.div(jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32))


def band_key_blocks(query_block, *, window: int, block: int):
    """Set B's key blocks of query block `query_block`: `(band_start, band_end)`, visiting `[band_start,
    band_end]`."""
    return _div(jnp.maximum(query_block * block - window, 0), block), query_block


def band_query_blocks(key_block, n_blocks, *, window: int, block: int):
    """The query blocks whose set-B pass visits `key_block`: `[key_block, last]` (the transpose of
    `band_key_blocks`)."""
    return key_block, jnp.minimum(_div((key_block + 1) * block + window - 1, block), n_blocks - 1)


# ------------------------------------------------------------------------------------------------ kernel pieces


class _Vectors:
    """A block's per-token ids as a sequence of broadcastable vectors, `ids[c]` the ids of column c: `[n, 1]` for
    a program's own block, `[1, n]` for a walked block, so that every mask is an outer comparison `[own, walked]`
    whichever side the queries are on."""

    def __init__(self, read, count):
        self.read, self.count = read, count

    def __getitem__(self, c):
        return self.read(c)

    def __len__(self):
        return self.count


def _walked_vectors(ref):
    """A walked block of ids `[C, n]` (rows), read as needed: `[1, n]` each."""
    return _Vectors(lambda c: ref[pl.ds(c, 1), :], ref.shape[0])


def _own_vectors(ref, layout):
    """A program's own block of ids as columns `[n, 1]`: read as needed from a column block `[n, C]` (GPU), or
    transposed once from a row block `[C, n]` (TPU, whose (8, 128) tiles would pad a column array's last
    dimension C to 128)."""
    if layout == "column":
        return _Vectors(lambda c: ref[:, pl.ds(c, 1)], ref.shape[1])
    columns = tuple(_transposed(ref[pl.ds(c, 1), :]) for c in range(ref.shape[0]))
    return _Vectors(columns.__getitem__, len(columns))


def _positions(block_index, block, own):
    """Token positions of a block: a column `[block, 1]` for a program's own block, a row `[1, block]` for a
    walked one."""
    shape, axis = ((block, 1), 0) if own else ((1, block), 1)
    return block_index * block + jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _matmul(a, b, contract):
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _scaled(x, scale):
    """`x * scale`: `scale` a number (the multiplier of every logit) or a per-query column / row."""
    return x if isinstance(scale, float) and scale == 1.0 else x * scale


def _own_scale(scale):
    """The multiplier of a program's own queries: a number, or from its per-query block (a ref) the column
    `[n, 1]`."""
    return scale if isinstance(scale, float) else _stat_column(scale[...])


def _number(scale):
    """The multiplier if it is a number, else 1.0 (per query: applied inside each step)."""
    return scale if isinstance(scale, float) else 1.0


def _scores(q, k, scale, softcap):
    s = _scaled(_matmul(q, k, ((1,), (1,))), scale)
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _shares(query_words, key_words):
    """Query-side and key-side bitmask `_Vectors` (W words each) -> bool, true where the two share a bit."""
    common = None
    for w in range(len(query_words)):
        word = (query_words[w] & key_words[w]) != 0
        common = word if common is None else common | word
    return common


def _group_allowed(query_ids, query_lower, key_ids, key_words):
    """Set A's mask (`_Vectors` in, `[own, walked]` out): same group, causal, same segment, real, no lower group
    shared."""
    query_segment = query_ids[SEGMENT]
    return ((query_ids[GROUP] == key_ids[GROUP]) & (key_ids[TOKEN] <= query_ids[TOKEN])
            & (query_segment == key_ids[SEGMENT]) & (query_segment >= 0) & ~_shares(query_lower, key_words))


def _is_full(info, query_block, key_block):
    """Whether every pair of a set-A block is allowed: one group and one segment on both sides, strictly earlier
    keys, real single-group entries."""
    return ((key_block < query_block) & (info[UNIFORM, query_block] == 1) & (info[UNIFORM, key_block] == 1)
            & (info[GROUP, query_block] == info[GROUP, key_block])
            & (info[SEGMENT, query_block] == info[SEGMENT, key_block]))


def _group_masked(s, query_side, key_side, info, query_block, key_block):
    """Set A's scores `s` of one block pair, NEG_INF where not allowed (the element mask skipped for full blocks);
    `query_side` = (ids, lower) and `key_side` = (ids, words) `_Vectors` of the two blocks, `s` `[bq, bk]` or,
    with the keys own, `[bk, bq]`."""
    masked = lambda s: jnp.where(_group_allowed(*query_side, *key_side), s, NEG_INF)
    return jax.lax.cond(_is_full(info, query_block, key_block), lambda s: s, masked, s)


def _band_masked(s, query_side, key_side, query_pos, key_pos, window, n_tokens):
    """Set B's scores `s` of one block pair, NEG_INF where not allowed: causal, local, real, same segment, no group
    shared; `query_side` and `key_side` = (segment, words) `_Vectors`, positions from `_positions` (either
    orientation, as `_group_masked`)."""
    (query_segment, query_words), (key_segment, key_words) = query_side, key_side
    distance = query_pos - key_pos
    allowed = ((distance >= 0) & (distance <= window) & (query_pos < n_tokens)
               & (key_pos < n_tokens) & (query_segment[0] == key_segment[0]) & ~_shares(query_words, key_words))
    return jnp.where(allowed, s, NEG_INF)


def _online(carry, s, v):
    """One online-softmax step: carry (acc [bq, Dv], m [bq, 1], l [bq, 1]), scores s [bq, bk] (masked =
    NEG_INF)."""
    acc, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(s > NEG_INF / 2, jnp.exp(s - m_new), 0.0)
    correction = jnp.exp(m - m_new)
    acc = acc * correction + _matmul(p.astype(v.dtype), v, ((1,), (0,)))
    return acc, m_new, l * correction + jnp.sum(p, axis=1, keepdims=True)


def _empty_carry(rows, dv):
    return (jnp.zeros((rows, dv), jnp.float32), jnp.full((rows, 1), NEG_INF, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))


def _transposed(vector):
    """A row `[1, n]` as the column `[n, 1]`, or a column as the row, through the transpose of its `[n, n]`
    broadcast (Mosaic transposes whole tiles)."""
    rows, columns = vector.shape
    n = max(rows, columns)
    return jnp.broadcast_to(vector, (n, n)).T[:columns, :rows]


def _stat_column(stat):
    """A block of a per-row statistic as the column `[n, 1]` that scores `[n, bk]` broadcast against; on TPUs the
    block is the row `[1, n]`."""
    return _transposed(stat) if stat.shape[0] == 1 else stat


def _store_stat(ref, column):
    """Writes the column `[n, 1]` to a statistic block `ref`: `[n, 1]`, or on TPUs the row `[1, n]`."""
    ref[...] = _transposed(column) if ref.shape[0] == 1 else column


def _finish(carry, o_ref, lse_ref):
    acc, m, l = carry
    empty = l == 0.0
    safe = jnp.where(empty, 1.0, l)
    o_ref[...] = jnp.where(empty, 0.0, acc / safe).astype(o_ref.dtype)
    _store_stat(lse_ref, jnp.where(empty, -jnp.inf, m + jnp.log(safe)))


def _grad_scores(s, lse, dp, delta, softcap):
    """Flash-attention backward of one block: p = exp(s - lse) on the allowed pairs and d(raw score), from the
    scores `s`, dp = dO . v per pair and the queries' lse and delta, in one orientation: s, dp `[bq, bk]` with lse,
    delta `[bq, 1]`, or all transposed (`[bk, bq]`, `[1, bq]`)."""
    allowed = s > NEG_INF / 2
    p = jnp.where(allowed, jnp.exp(s - lse), 0.0)
    ds = p * (dp - delta)
    if softcap is not None:
        ds = ds * jnp.where(allowed, 1.0 - (s / softcap) ** 2, 0.0)
    return p, ds


def _store_gradients(acc, q_block, scale, d_scale):
    """A dq kernel's float32 sum `acc [n, D]` of dS . k over its walk, times the queries' multiplier `scale` (a
    number or the column `[n, 1]`): dq. With a per-query multiplier (`d_scale`, its output block) that
    multiplier's gradient `q . acc` per query is stored too."""
    if d_scale is not None:
        _store_stat(d_scale, jnp.sum(acc * q_block.astype(jnp.float32), axis=1, keepdims=True))
    return _scaled(acc, scale)


def _walked_scale(scale):
    """The walked operands that a dk / dv kernel's multiplier adds: none for a number, else its per-query rows."""
    return () if isinstance(scale, float) else (scale,)


# ------------------------------------------------------------------------------------------------ kernels
# Arguments: the program's own blocks are refs; the operands it walks are `_Walked`, and `_walk` hands the step
# function their block-j refs.


def _group_kernel(first, info, q_ids, q_lower, q, k, v, k_ids, k_words, o, lse, *, scale, softcap):
    """Set A forward for one query entry block of one head."""
    i = pl.program_id(2)
    q_block, scale = q[...], _own_scale(scale)

    def step(j, blocks, carry):
        k_j, v_j, k_ids_j, k_words_j = blocks
        key_side = (_walked_vectors(k_ids_j), _walked_vectors(k_words_j))
        s = _group_masked(_scores(q_block, k_j[...], scale, softcap), (q_ids, q_lower), key_side, info, i, j)
        return _online(carry, s, v_j[...])

    _finish(_walk(first[i], i + 1, step, _empty_carry(*o.shape), (k, v, k_ids, k_words)), o, lse)


def _band_kernel(q_segment, q_words, q, k, v, k_segment, k_words, o, lse, *, block, window, n_tokens,
                 scale, softcap, set_a=()):
    """Set B forward for one query token block of one head; with `set_a` (`_after_set_a`) merged with set A's
    results of the same tokens (`_with_entries`)."""
    i = pl.program_id(2)
    q_block, q_pos, scale = q[...], _positions(i, block, own=True), _own_scale(scale)

    def step(j, blocks, carry):
        k_j, v_j, k_segment_j, k_words_j = blocks
        key_side = (_walked_vectors(k_segment_j), _walked_vectors(k_words_j))
        s = _band_masked(_scores(q_block, k_j[...], scale, softcap), (q_segment, q_words), key_side, q_pos,
                         _positions(j, block, own=False), window, n_tokens)
        return _online(carry, s, v_j[...])

    band_start, band_end = band_key_blocks(i, window=window, block=block)
    carry = _walk(band_start, band_end + 1, step, _empty_carry(*o.shape), (k, v, k_segment, k_words))
    _finish(_with_entries(carry, *set_a) if set_a else carry, o, lse)


def _after_set_a(kernel, n, has_entry, *refs, **settings):
    """Runs a set-B `kernel` on `refs[n:]` with `set_a=(has_entry, *refs[:n])`: set A's results for its program's
    own tokens, read where `has_entry` (`_own_vectors`, a column [n, 1]: in the backward nonzero where the token has
    a set-A entry, and set A's gradients in token order, which the kernel adds to its own before writing them; in
    the forward the token's entry, E for none, and set A's out and lse gathered by it, `_with_entries`)."""
    return kernel(*refs[n:], set_a=(has_entry, *refs[:n]), **settings)


def _with_entries(carry, entry, out, lse):
    """The forward's online-softmax carry of a block of tokens (set B) merged with set A's results for their
    entries: `entry` (`_own_vectors`: a column `[n, 1]`, E for none), `out [n, Dv]` and `lse [n, 1]` read at
    those entries (`_Rows`; a token without one reads the last row, a padding entry whenever some token lacks an
    entry, and is masked all the same)."""
    acc, m, l = carry
    has_entry = entry[0] < out.ref.shape[0]
    lse_a = jnp.where(has_entry, lse[...], NEG_INF)
    m_new = jnp.maximum(m, lse_a)
    correction, weight = jnp.exp(m - m_new), jnp.where(has_entry, jnp.exp(lse_a - m_new), 0.0)
    out_a = jnp.where(has_entry, out[...].astype(jnp.float32), 0.0)
    return acc * correction + weight * out_a, m_new, l * correction + weight


def _plus(acc, has_entry, part):
    """`acc [n, C]` (float32) plus set A's part for the same tokens (`part [n, C]`, read where `has_entry`)."""
    return acc + jnp.where(has_entry[0] != 0, part[...].astype(jnp.float32), 0.0)


def _dq_step(q_block, do_block, lse_block, delta_block, k_j, v_j, masked, scale, softcap, acc):
    """The dq kernels' step for the walked key block (`masked(scores)` applies its mask): `acc + dS . k` (dq is
    `scale` times the sum)."""
    k_block = k_j[...]
    s = masked(_scores(q_block, k_block, scale, softcap))
    _, ds = _grad_scores(s, lse_block, _matmul(do_block, v_j[...], ((1,), (1,))), delta_block, softcap)
    return acc + _matmul(ds.astype(k_block.dtype), k_block, ((1,), (0,)))


def _dkv_step(k_block, v_block, q_i, do_i, lse_i, delta_i, scale_i, masked, softcap, carry):
    """The dk / dv kernels' step for the walked query block: scores transposed, `[bk, bq]`, so that the queries'
    ids and statistics are read as rows (`masked(scores)` applies the mask); returns (dk, dv) + this block's.
    `scale_i`: the walked queries' multipliers, a row `[1, bq]` applied here, or a number (dk is then that number
    times the sum, `_number`)."""
    q_block, do_block = q_i[...], do_i[...]
    s = masked(_scores(k_block, q_block, scale_i, softcap))
    dp = _matmul(v_block, do_block, ((1,), (1,)))
    p, ds = _grad_scores(s, lse_i[...], dp, delta_i[...], softcap)
    ds = ds if isinstance(scale_i, float) else ds * scale_i
    return (carry[0] + _matmul(ds.astype(q_block.dtype), q_block, ((1,), (0,))),
            carry[1] + _matmul(p.astype(do_block.dtype), do_block, ((1,), (0,))))


def _group_dq_kernel(first, info, q_ids, q_lower, q, do, lse, delta, k, v, k_ids, k_words, dq, *, scale, softcap,
                     d_scale=None):
    """Set A: dq of one query entry block of one head (keys as in the forward pass); with a per-query multiplier
    also its gradient (`d_scale`, `_store_gradients`)."""
    i = pl.program_id(2)
    q_block, do_block, lse_block, delta_block = q[...], do[...], _stat_column(lse[...]), _stat_column(delta[...])
    scale = _own_scale(scale)

    def step(j, blocks, acc):
        k_j, v_j, k_ids_j, k_words_j = blocks
        key_side = (_walked_vectors(k_ids_j), _walked_vectors(k_words_j))
        masked = lambda s: _group_masked(s, (q_ids, q_lower), key_side, info, i, j)
        return _dq_step(q_block, do_block, lse_block, delta_block, k_j, v_j, masked, scale, softcap, acc)

    acc = _walk(first[i], i + 1, step, jnp.zeros(dq.shape, jnp.float32), (k, v, k_ids, k_words))
    dq[...] = _store_gradients(acc, q_block, scale, d_scale).astype(dq.dtype)


def _group_dkv_kernel(last, info, k_ids, k_words, k, v, q, do, lse, delta, q_ids, q_lower, dk, dv, *, scale,
                      softcap):
    """Set A: dk, dv of one key entry block from one query head (the query blocks that visit it)."""
    j = pl.program_id(2)
    k_block, v_block = k[...], v[...]

    def step(i, blocks, carry):
        q_i, do_i, lse_i, delta_i, q_ids_i, q_lower_i, *scale_i = blocks
        query_side = (_walked_vectors(q_ids_i), _walked_vectors(q_lower_i))
        masked = lambda s: _group_masked(s, query_side, (k_ids, k_words), info, i, j)
        return _dkv_step(k_block, v_block, q_i, do_i, lse_i, delta_i, scale_i[0][...] if scale_i else scale, masked,
                         softcap, carry)

    zeros = (jnp.zeros(dk.shape, jnp.float32), jnp.zeros(dv.shape, jnp.float32))
    dk_block, dv_block = _walk(j, last[j] + 1, step, zeros, (q, do, lse, delta, q_ids, q_lower, *_walked_scale(scale)))
    dk[...], dv[...] = _scaled(dk_block, _number(scale)).astype(dk.dtype), dv_block.astype(dv.dtype)


def _band_dq_kernel(q_segment, q_words, q, do, lse, delta, k, v, k_segment, k_words, dq, *, block, window, n_tokens,
                    scale, softcap, set_a=(), d_scale=None):
    """Set B: dq of one query token block of one head; with `set_a` (`_after_set_a`) plus set A's; with a
    per-query multiplier also its gradient (of set B's pairs, `d_scale`)."""
    i = pl.program_id(2)
    q_block, do_block, lse_block, delta_block = q[...], do[...], _stat_column(lse[...]), _stat_column(delta[...])
    q_pos, scale = _positions(i, block, own=True), _own_scale(scale)

    def step(j, blocks, acc):
        k_j, v_j, k_segment_j, k_words_j = blocks
        key_side = (_walked_vectors(k_segment_j), _walked_vectors(k_words_j))
        masked = lambda s: _band_masked(s, (q_segment, q_words), key_side, q_pos, _positions(j, block, own=False),
                                        window, n_tokens)
        return _dq_step(q_block, do_block, lse_block, delta_block, k_j, v_j, masked, scale, softcap, acc)

    band_start, band_end = band_key_blocks(i, window=window, block=block)
    acc = _walk(band_start, band_end + 1, step, jnp.zeros(dq.shape, jnp.float32), (k, v, k_segment, k_words))
    acc = _store_gradients(acc, q_block, scale, d_scale)
    dq[...] = (_plus(acc, *set_a) if set_a else acc).astype(dq.dtype)


def _band_dkv_kernel(k_segment, k_words, k, v, q, do, lse, delta, q_segment, q_words, dk, dv, *, block, window,
                     n_tokens, n_blocks, scale, softcap, set_a=()):
    """Set B: dk, dv of one key token block from one query head; with `set_a` (`_after_set_a`) plus set A's."""
    j = pl.program_id(2)
    k_block, v_block, k_pos = k[...], v[...], _positions(j, block, own=True)

    def step(i, blocks, carry):
        q_i, do_i, lse_i, delta_i, q_segment_i, q_words_i, *scale_i = blocks
        query_side = (_walked_vectors(q_segment_i), _walked_vectors(q_words_i))
        masked = lambda s: _band_masked(s, query_side, (k_segment, k_words), _positions(i, block, own=False), k_pos,
                                        window, n_tokens)
        return _dkv_step(k_block, v_block, q_i, do_i, lse_i, delta_i, scale_i[0][...] if scale_i else scale, masked,
                         softcap, carry)

    first, last = band_query_blocks(j, n_blocks, window=window, block=block)
    zeros = (jnp.zeros(dk.shape, jnp.float32), jnp.zeros(dv.shape, jnp.float32))
    walked = (q, do, lse, delta, q_segment, q_words, *_walked_scale(scale))
    dk_block, dv_block = _walk(first, last + 1, step, zeros, walked)
    dk_block = _scaled(dk_block, _number(scale))
    if set_a:
        has_entry, dk_a, dv_a = set_a
        dk_block, dv_block = _plus(dk_block, has_entry, dk_a), _plus(dv_block, has_entry, dv_a)
    dk[...], dv[...] = dk_block.astype(dk.dtype), dv_block.astype(dv.dtype)


# ------------------------------------------------------------------------------------------------ calling them


BACKENDS = ("interpret", "triton", "mosaic", "mosaic_interpret")
TPU_BACKENDS = ("mosaic", "mosaic_interpret")
ROW_LAYOUTS = ("row", "head_row")


class Settings(NamedTuple):
    """Static settings of one call (hashable: the non-differentiable argument of the custom VJP)."""
    block: int       # set A's query and key blocks (entries)
    band_block: int  # set B's query and key blocks (tokens)
    window: int
    softcap: float | None
    scale: float | None  # the multiplier of every logit when it is a number; None: per query and head, an operand
    n_tokens: int
    backend: str     # one of BACKENDS
    num_warps: int   # Triton: warps per program
    num_stages: int  # Triton: software-pipelining stages of the walks
    groups: bool     # compute set A (False when no token is in a group)
    band: bool       # compute set B (False when every token is in the one group)
    in_order: bool   # set A's entries are the tokens in order (dense attention: one group of every token), so
                     # the gathers by entry and by token are a pad and a slice


class _Operand(NamedTuple):
    """A kernel input or output and how a program (batch b, head h, block i) sees it."""
    array: Any       # a jax.Array (input) or jax.ShapeDtypeStruct (output)
    layout: str      # 'token' [B, rows, H or Hk, C] (GPU); 'head' [B, H or Hk, rows, C]; 'head_row' [B, H, C,
                     # rows]; 'column' [B, rows, C]; 'row' [B, C, rows]; 'table' [B, ...] (small integers, read as
                     # scalars)
    block: int | None = None  # the program's own block of rows (i); None: walked block by block in the kernel
    heads_per_kv: int = 1     # 'token' or 'head' with Hk heads: query head h reads head h // heads_per_kv
    entries: str | None = None  # GPU, 'token' [B, T, H or Hk, C] in token order: set A's rows, gathered inside the
                                # kernel by their entries' tokens, for the program's own block ('own') or walked


class _Walked(NamedTuple):
    """An operand a kernel walks block by block (blocks of `rows` rows; of `rows` columns in the row layout)."""
    ref: Any
    layout: str
    rows: int
    buffers: Any = None     # TPU: VMEM `[2, ...block]`, the two slots blocks are copied into
    semaphores: Any = None  # TPU: DMA semaphores `[2]`, one per slot
    index: tuple = ()       # TPU: the program's leading indices into the whole HBM array
    tokens: Any = None      # GPU, set A's rows in token order: the walked ids `[C, E]`, row TOKEN their tokens

    def span(self, j):
        """Block j's rows (its columns in the row layout)."""
        return pl.ds(pl.multiple_of(j * self.rows, self.rows), self.rows)

    def window(self, j):
        if self.layout in ROW_LAYOUTS:
            return slice(None), self.span(j)
        return self.span(j), slice(None)

    def block(self, j):
        """GPU: block j, a view of the whole array, or for set A's rows in token order the rows of its entries'
        tokens. (Walked q and dO load the same token row: Triton's compiler keeps one load, as their PTX shows.)"""
        if self.tokens is None:
            return _Block(self.ref, self.window(j))
        tokens = self.tokens[TOKEN, self.span(j)]
        return _Rows(self.ref, lambda: tokens, self.rows)

    def copy(self, j, slot):
        """TPU: the DMA of block j into buffer `slot`."""
        return pltpu.make_async_copy(self.ref.at[self.index + self.window(j)], self.buffers.at[slot],
                                     self.semaphores.at[slot])


class _Block:
    """A block of a whole 2-D ref, read with one combined indexer (Triton's lowering takes no chained `.at`)."""

    def __init__(self, ref, window):
        self.ref, self.window = ref, window
        self.shape = tuple(ref.shape[axis] if w == slice(None) else w.size for axis, w in enumerate(window))

    def __getitem__(self, index):
        if index is Ellipsis:
            return self.ref[self.window]
        return self.ref[tuple(w if i == slice(None) else i for w, i in zip(self.window, index))]


class _Rows:
    """The rows `tokens [n]` of a whole token-order ref `[R, C]` (R >= T), gathered or scattered inside the kernel
    (GPU): set A's entries read straight from the activations in token order (a padding entry, token T, reads row
    R - 1, which its mask, segment -1, keeps out of every result), or their results written in token order (a
    store masked to rows < R: when R = T padding entries write nothing). `read_tokens()` gives the tokens when
    the rows are read or written: a program's own are loaded only then, so that an output's take no registers
    during the walk."""

    def __init__(self, ref, read_tokens, n):
        self.ref, self.read_tokens = ref, read_tokens
        self.shape, self.dtype = (n,) + tuple(ref.shape[1:]), ref.dtype

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise NotImplementedError("set A's gathered rows are read whole")
        return self.ref[jnp.minimum(self.read_tokens(), self.ref.shape[0] - 1), :]

    def __setitem__(self, index, value):
        if index is not Ellipsis:
            raise NotImplementedError("set A's scattered rows are written whole")
        rows, columns = self.read_tokens()[:, None], jnp.arange(self.shape[1])[None, :]
        plt.store(self.ref.at[rows, columns], value, mask=rows < self.ref.shape[0])


class _OneRow:
    """A table block `[1, n]` read as the `[n]` row it holds."""

    def __init__(self, ref):
        self.ref = ref

    def __getitem__(self, index):
        return self.ref[0, index]


def _walk(start, stop, step, carry, walked):
    """`carry = step(j, blocks, carry)` for j in `[start, stop)`, `blocks` the block-j refs of the `walked` operands.
    GPU: views of the whole arrays. TPU: double buffering, block j + 1's copies start before block j is used."""
    if walked[0].buffers is None:
        return jax.lax.fori_loop(start, stop, lambda j, c: step(j, [w.block(j) for w in walked], c), carry)

    @pl.when(start < stop)
    def _():
        for w in walked:
            w.copy(start, 0).start()

    def body(j, carry):
        slot = jax.lax.rem(j - start, 2)

        @pl.when(j + 1 < stop)
        def _():
            for w in walked:
                w.copy(j + 1, 1 - slot).start()

        for w in walked:
            w.copy(j, slot).wait()
        return step(j, [w.buffers.at[slot] for w in walked], carry)

    return jax.lax.fori_loop(start, stop, body, carry)


def _spec(operand: _Operand, tpu: bool):
    shape, block = operand.array.shape, operand.block
    if operand.layout == "table":
        zeros = (0,) * (len(shape) - 1)
        return pl.BlockSpec((None,) + shape[1:], lambda b, h, i: (b,) + zeros,
                            memory_space=pltpu.SMEM if tpu else None)
    if tpu and block is None:
        return pl.BlockSpec(memory_space=pl.ANY)
    row = (lambda i: i) if block else (lambda i: 0)
    g = operand.heads_per_kv
    if operand.layout == "token":
        return pl.BlockSpec((None, block or shape[1], None, shape[3]), lambda b, h, i: (b, row(i), _div(h, g), 0))
    if operand.layout == "head":
        return pl.BlockSpec((None, None, block or shape[2], shape[3]), lambda b, h, i: (b, _div(h, g), row(i), 0))
    if operand.layout == "head_row":
        return pl.BlockSpec((None, None, shape[2], block or shape[3]), lambda b, h, i: (b, h, 0, row(i)))
    if operand.layout == "column":
        return pl.BlockSpec((None, block or shape[1], shape[2]), lambda b, h, i: (b, row(i), 0))
    return pl.BlockSpec((None, shape[1], block or shape[2]), lambda b, h, i: (b, 0, row(i)))


def _call(body, inputs, outputs, grid, settings, name, walk_rows, aliases=None):
    """Runs `body(*inputs, *outputs)` on `grid` (batch, query head, block) as `settings` say; the inputs without
    a `block` reach it as `_Walked` with blocks of `walk_rows`, a program's own block of ids as `_own_vectors`.
    Set A's rows in token order (`entries`, GPU) are gathered by the tokens of the first ids on their side: the
    program's own block of the first 'column' input, or the walked block of the first walked 'row' input (set A's
    ids, `_group_ids`); so are the rows of outputs with `entries` (scattered to token order). `aliases`: {input
    index: output index} of inputs that the kernel overwrites (`pl.pallas_call`'s `input_output_aliases`). Returns
    the outputs."""
    backend = settings.backend
    tpu = backend in TPU_BACKENDS
    walked = [op.block is None and op.layout != "table" and op.entries != "own" for op in inputs]
    if tpu and any(op.entries for op in inputs + outputs):
        raise ValueError("the TPU kernels copy blocks by DMA: set A's rows must come gathered into entry order")
    # Mosaic wants a block's last two dimensions tiled by (8, 128) or spanning the array: a per-row table [B, n]
    # (whose block is one row) travels as [B, 1, n], and the kernel reads it through `_OneRow`.
    one_row = [tpu and op.layout == "table" and op.array.ndim == 2 for op in inputs]
    inputs = [op._replace(array=op.array[:, None]) if r else op for op, r in zip(inputs, one_row)]
    scratch = []
    if tpu:
        blocks = [(op.array.shape[-2], walk_rows) if op.layout in ROW_LAYOUTS else (walk_rows, op.array.shape[-1])
                  for op, w in zip(inputs, walked) if w]
        scratch = ([pltpu.VMEM((2,) + shape, op.array.dtype)
                    for shape, op in zip(blocks, [op for op, w in zip(inputs, walked) if w])]
                   + [pltpu.SemaphoreType.DMA((2,)) for _ in blocks])

    def kernel(*refs):
        in_refs, out_refs = refs[:len(inputs)], refs[len(inputs):len(inputs) + len(outputs)]
        scratch_refs = refs[len(inputs) + len(outputs):]
        n_walked = len(scratch_refs) // 2
        buffers, semaphores = iter(scratch_refs[:n_walked]), iter(scratch_refs[n_walked:])
        b, h = pl.program_id(0), pl.program_id(1)
        first_ids = lambda layout, side: next(ref for op, ref, w in zip(inputs, in_refs, walked)
                                              if op.layout == layout and w == side)

        def own_rows(ref):
            ids = first_ids("column", False)
            return _Rows(ref, lambda: ids[:, TOKEN], ids.shape[0])

        args = []
        for op, ref, w, r in zip(inputs, in_refs, walked, one_row):
            if op.entries == "own":
                args.append(own_rows(ref))
            elif op.layout in ("column", "row") and not w:
                args.append(_own_vectors(ref, op.layout))
            elif not w:
                args.append(_OneRow(ref) if r else ref)
            elif not tpu:
                tokens = first_ids("row", True) if op.entries == "walked" else None
                args.append(_Walked(ref, op.layout, walk_rows, tokens=tokens))
            else:
                index = (b, _div(h, op.heads_per_kv)) if op.layout.startswith("head") else (b,)
                args.append(_Walked(ref, op.layout, walk_rows, next(buffers), next(semaphores), index))
        body(*args, *(own_rows(ref) if op.entries == "own" else ref for op, ref in zip(outputs, out_refs)))

    if backend == "triton":
        params = plt.CompilerParams(num_warps=settings.num_warps, num_stages=settings.num_stages)
    elif tpu:
        params = pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid))
    else:
        params = None
    # The TPU simulation runs each DMA as soon as it starts, so a copy into a buffer still being read would show.
    interpret = {"interpret": True,
                 "mosaic_interpret": pltpu.InterpretParams(dma_execution_mode="eager")}.get(backend, False)
    arrays = vary_like([op.array for op in inputs], *(op.array for op in inputs))  # inside a user's shard_map
    return pl.pallas_call(kernel, grid=grid, in_specs=[_spec(op, tpu) for op in inputs],
                          out_specs=[_spec(op, tpu) for op in outputs],
                          out_shape=[shape_like(op.array, arrays[0]) for op in outputs],
                          scratch_shapes=scratch, interpret=interpret, name=name, compiler_params=params,
                          input_output_aliases=aliases or {})(*arrays)


def triton_launch(dtype) -> tuple[int, int]:
    """The Triton kernels' default `(num_warps, num_stages)` for inputs of `dtype`, chosen by compiling them for an
    H200 without one (`python -m focal_jax.bench compile`, BENCHMARKS.md): with the default 64-entry blocks, 8 warps
    and 2 pipeline stages assemble without register spills in about 100 KiB of shared memory for bf16 at head_dim
    128; float32 blocks take twice the bytes, and one stage keeps them within the H200's 227 KiB."""
    return (8, 1) if jnp.dtype(dtype).itemsize >= 4 else (8, 2)


_TARGET_PLATFORM = contextvars.ContextVar("target_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str):
    """Within this context `default_backend()` is that of `platform` ('gpu', 'tpu' or 'cpu') instead of this
    process's default: for lowering or compiling for a device the process does not have, e.g.

        with target_platform('gpu'):
            lowered = jax.jit(f).trace(*args).lower(lowering_platforms=('cuda',))

    (`compile_only.compile_for` does so). jax's caches of traced functions are cleared on entering and leaving it:
    the backend is chosen at trace time, which they do not key on, so a function traced before would keep the
    kernels of the other platform."""
    jax.clear_caches()
    token = _TARGET_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)
        jax.clear_caches()


def platform() -> str:
    """The platform being compiled for: `target_platform`'s inside one, else `jax.default_backend()`."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


def default_backend() -> str:
    """'triton' on GPUs, 'mosaic' on TPUs, 'interpret' elsewhere (CPU), for the platform of `platform()`."""
    return {"gpu": "triton", "tpu": "mosaic"}.get(platform(), "interpret")


def _rows(x, index, fill=0):
    """`x [B, R, ...]` at rows `index [B, ...]`; an index past the last row reads `fill`."""
    return jax.vmap(lambda x, i: jnp.take(x, i, axis=0, mode="fill", fill_value=fill))(x, index)


def _by_entry(x, p: Plan, s: Settings):
    """`x [B, T, ...]` at set A's entries -> `[B, E, ...]` (zeros for padding entries)."""
    if s.in_order:
        return _pad_rows(x, p.entry_token.shape[1])
    return _rows(x, p.entry_token)


def _by_token(x, p: Plan, s: Settings, fill=0):
    """Each token's entries' rows of `x [B, E, ...]` -> `[B, T, S, ...]` (`fill` for an empty slot)."""
    if s.in_order:
        return x[:, :s.n_tokens, None]
    return _rows(x, p.token_entries, fill)


def _token_major(x, p: Plan, s: Settings):
    """Per token, the float32 sum of its entries' rows of `x [B, E, H, C]` -> `[B, T, H, C]`, gathered (a
    scatter-add by `entry_token` would hold a float32 `[B, T + 1, H, C]`)."""
    return _by_token(x, p, s).astype(jnp.float32).sum(axis=2)


def _activation(x, s: Settings, block=None, heads_per_kv=1):
    """A row-major activation `x [B, rows, H, C]` (or an output's `jax.ShapeDtypeStruct`) as a kernel operand: as
    it is on GPUs (layout 'token', no copy); head-major `[B, H, rows, C]` on TPUs ('head'), whose blocks must tile
    or span their last two dimensions."""
    if s.backend not in TPU_BACKENDS:
        return _Operand(x, "token", block, heads_per_kv)
    if isinstance(x, jax.ShapeDtypeStruct):
        b, rows, h, c = x.shape
        return _Operand(jax.ShapeDtypeStruct((b, h, rows, c), x.dtype), "head", block, heads_per_kv)
    return _Operand(x.transpose(0, 2, 1, 3), "head", block, heads_per_kv)


def _entry_rows(x, p: Plan, s: Settings, block=None, heads_per_kv=1):
    """Set A's rows of an activation `x [B, T, H, C]` as a kernel operand, a program's own block (`block`) or
    walked: on GPUs `x` itself, whose rows the kernel gathers by its entries' tokens (`_Rows`: no copy in entry
    order exists, with `max_groups` entries per token as without); on TPUs, whose kernels copy contiguous blocks
    by DMA, a copy gathered into entry order (`_by_entry`), head-major. Entries in token order (dense attention)
    are read as contiguous blocks of `x` padded to E rows, as FlashAttention reads them."""
    if s.backend in TPU_BACKENDS or s.in_order:
        return _activation(_by_entry(x, p, s), s, block, heads_per_kv)
    return _Operand(x, "token", None, heads_per_kv, "own" if block else "walked")


def _row_major(x, s: Settings):
    """A kernel's activation output (`_activation`'s layout) as `[B, rows, H, C]`."""
    return x.transpose(0, 2, 1, 3) if s.backend in TPU_BACKENDS else x


def _per_kv_head(x, kv_heads):
    """`[B, T, H, C]` gradients per query head -> `[B, T, Hk, C]` summed over each kv head's query heads."""
    b, t, h, c = x.shape
    return x.reshape(b, t, kv_heads, h // kv_heads, c).sum(axis=3)


def _stat_operand(x, s: Settings, block=None):
    """A per-row float32 statistic (log-sum-exp, delta) `x [B, H, R]` as a kernel operand: the row `[B, H, 1, R]`
    when walked (the dk / dv kernels read it as a row `[1, n]`) and on TPUs, whose tiles would pad a column 128
    times; else (a program's own block on GPUs) the column `[B, H, R, 1]`. `x` may be a `jax.ShapeDtypeStruct`
    (an output)."""
    b, h, rows = x.shape
    row = s.backend in TPU_BACKENDS or block is None
    shape = (b, h, 1, rows) if row else (b, h, rows, 1)
    array = jax.ShapeDtypeStruct(shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.reshape(shape)
    return _Operand(array, "head_row" if row else "head", block)


def _own_ids(x, s: Settings, block):
    """Per-token ids `x [B, rows, C]` as the operand of a program's own block (`_own_vectors`): these columns on
    GPUs; on TPUs the rows `[B, C, rows]`, since their (8, 128) tiles would pad C to 128."""
    if s.backend in TPU_BACKENDS:
        return _Operand(x.transpose(0, 2, 1), "row", block)
    return _Operand(x, "column", block)


def _walked_ids(x):
    """Per-token ids `x [B, rows, C]` as a walked operand: the rows `[B, C, rows]` (`_walked_vectors`)."""
    return _Operand(x.transpose(0, 2, 1), "row")


def _group_ids(p: Plan):
    """Set A's per-entry ids: `[B, E, 4]` (token, group, segment, 0), and the bitmasks `[B, E, W]` of the groups
    below the entry's own that its token is in (query side) and of all its token's groups (key side)."""
    ids = jnp.stack([p.entry_token, p.entry_group, p.entry_segment, jnp.zeros_like(p.entry_token)], axis=-1)
    return ids, p.entry_lower, p.entry_words


def _band_ids(p: Plan):
    """Set B's per-token ids: segment `[B, Tp, 1]` and group bitmask `[B, Tp, W]`, the same on both sides."""
    return p.token_segment[..., None], p.token_words


def _pad_rows(x, tp):
    """`x [B, T, ...]` padded with zeros to `tp` rows."""
    return jnp.pad(x, [(0, 0), (0, tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _logit_kwargs(s: Settings):
    """The kernels' logit settings: the softcap and, when it is a number, the multiplier."""
    return dict(softcap=s.softcap) if s.scale is None else dict(scale=s.scale, softcap=s.softcap)


def _with_multiplier(kernel, n_inputs, n_outputs, *refs, **settings):
    """Runs `kernel` on `refs` whose input `n_inputs`, after the kernel's own inputs, is the per-query multiplier
    (passed as `scale`) and whose outputs past the kernel's `n_outputs` are its gradient (as `d_scale`)."""
    inputs, scale, outputs = refs[:n_inputs], refs[n_inputs], refs[n_inputs + 1:]
    gradient = dict(d_scale=outputs[n_outputs]) if len(outputs) > n_outputs else {}
    return kernel(*inputs, *outputs[:n_outputs], scale=scale, **gradient, **settings)


def _multiplied(kernel, inputs, outputs, scale, d_scale=None):
    """A kernel call's kernel, inputs and outputs given the per-query multiplier `scale` (an `_Operand`; None when
    it is a number, a setting of the kernel) and for the dq kernels the output of its gradient `d_scale`."""
    if scale is None:
        return kernel, inputs, outputs
    return (functools.partial(_with_multiplier, kernel, len(inputs), len(outputs)), [*inputs, scale],
            [*outputs, *([] if d_scale is None else [d_scale])])


def _per_row(m, p: Plan, s: Settings, entries: bool):
    """The per-query multiplier `m [B, T, H]` at set A's entries (`entries`) or set B's padded tokens, as the
    per-row statistic `[B, H, rows]`; None (a number, a setting of the kernels) stays None."""
    if m is None:
        return None
    return (_by_entry(m, p, s) if entries else _pad_rows(m, p.token_segment.shape[1])).transpose(0, 2, 1)


def _multiplier_operand(m_rows, s: Settings, block=None):
    """The per-query multiplier `m_rows [B, H, rows]` (`_per_row`) as a kernel operand, a program's own block or
    walked (`_stat_operand`); None stays None."""
    return None if m_rows is None else _stat_operand(m_rows, s, block)


def _gradient_output(operand):
    """A dq kernel's output for the gradient of its own block's multiplier `operand`: float32, laid out alike;
    None stays None."""
    if operand is None:
        return None
    return operand._replace(array=jax.ShapeDtypeStruct(operand.array.shape, jnp.float32))


def _group_forward(q, k, v, m, p: Plan, s: Settings):
    """Set A: out `[B, E, H, Dv]`, lse `[B, H, E]` per entry (`m`: the per-query multiplier `[B, T, H]` or None)."""
    b, _, h, _ = q.shape
    g, dv, e = h // k.shape[2], v.shape[-1], p.entry_token.shape[1]
    ids, lower, words = _group_ids(p)
    inputs = [_Operand(p.first_key_block, "table"), _Operand(p.block_info, "table"),
              _own_ids(ids, s, s.block), _own_ids(lower, s, s.block), _entry_rows(q, p, s, s.block),
              _entry_rows(k, p, s, heads_per_kv=g), _entry_rows(v, p, s, heads_per_kv=g),
              _walked_ids(ids), _walked_ids(words)]
    outputs = [_activation(jax.ShapeDtypeStruct((b, e, h, dv), v.dtype), s, s.block),
               _stat_operand(jax.ShapeDtypeStruct((b, h, e), jnp.float32), s, s.block)]
    scale = _multiplier_operand(_per_row(m, p, s, entries=True), s, s.block)
    kernel, inputs, outputs = _multiplied(functools.partial(_group_kernel, **_logit_kwargs(s)), inputs, outputs, scale)
    out, lse = _call(kernel, inputs, outputs, (b, h, e // s.block), s, "focus_group", s.block)
    return _row_major(out, s), lse.reshape(b, h, e)


def _band_kwargs(s: Settings):
    return dict(block=s.band_block, window=s.window, n_tokens=s.n_tokens, **_logit_kwargs(s))


def _band_forward(q, k, v, m, p: Plan, s: Settings, set_a=()):
    """Set B: out `[B, Tp, H, Dv]`, lse `[B, H, Tp]` per token (`m` as `_group_forward`'s); with `set_a`, set A's
    results `(out [B, E, H, Dv], lse [B, H, E])` (`_in_token_order`), merged with them inside the kernel."""
    b, _, h, _ = q.shape
    g, dv, tp = h // k.shape[2], v.shape[-1], p.token_segment.shape[1]
    qp, kp, vp = (_pad_rows(x, tp) for x in (q, k, v))
    segment, words = _band_ids(p)
    inputs = [_own_ids(segment, s, s.band_block), _own_ids(words, s, s.band_block),
              _activation(qp, s, s.band_block), _activation(kp, s, heads_per_kv=g),
              _activation(vp, s, heads_per_kv=g), _walked_ids(segment), _walked_ids(words)]
    outputs = [_activation(jax.ShapeDtypeStruct((b, tp, h, dv), v.dtype), s, s.band_block),
               _stat_operand(jax.ShapeDtypeStruct((b, h, tp), jnp.float32), s, s.band_block)]
    scale = _multiplier_operand(_per_row(m, p, s, entries=False), s, s.band_block)
    kernel, inputs, outputs = _multiplied(functools.partial(_band_kernel, **_band_kwargs(s)), inputs, outputs, scale)
    if set_a:
        out_a, lse_a = set_a
        entry = jnp.pad(p.token_entries[..., :1], ((0, 0), (0, tp - s.n_tokens), (0, 0)),
                        constant_values=p.entry_token.shape[1])
        inputs = [_own_ids(entry, s, s.band_block), _Operand(out_a, "token", entries="own"),
                  _Operand(lse_a[..., None], "head", entries="own"), *inputs]
        kernel = functools.partial(_after_set_a, kernel, 2)
    out, lse = _call(kernel, inputs, outputs, (b, h, tp // s.band_block), s, "focus_band", s.band_block)
    return _row_major(out, s), lse.reshape(b, h, tp)


def _merge(p: Plan, s: Settings, out_a, lse_a, out_b, lse_b):
    """Per token: log-sum-exp merge of its entries' set-A results (`[B, E, H, Dv]`, `[B, H, E]`) and its set-B
    result (`[B, Tp, H, Dv]`, `[B, H, Tp]`) -> out `[B, T, H, Dv]` (float32) and lse `[B, T, H]`."""
    t = s.n_tokens
    lse_a = _by_token(lse_a.transpose(0, 2, 1), p, s, -jnp.inf)  # [B, T, S, H]
    out_a = _by_token(out_a, p, s).astype(jnp.float32)  # [B, T, S, H, Dv]
    lse_b, out_b = lse_b.transpose(0, 2, 1)[:, :t], out_b[:, :t].astype(jnp.float32)
    m = jnp.maximum(jnp.max(lse_a, axis=2), lse_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a, w_b = jnp.exp(lse_a - m[:, :, None]), jnp.exp(lse_b - m)
    num = jnp.sum(w_a[..., None] * out_a, axis=2) + w_b[..., None] * out_b
    den = jnp.sum(w_a, axis=2) + w_b
    safe = jnp.where(den > 0, den, 1.0)
    return num / safe[..., None], jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)


def _attention_fwd(q, k, v, m, p: Plan, s: Settings):
    b, t, h = q.shape[:3]
    if _in_token_order(p, s):
        out, lse = _band_forward(q, k, v, m, p, s, set_a=_group_forward(q, k, v, m, p, s))
        out, lse = out[:, :t], lse.transpose(0, 2, 1)[:, :t]
    else:
        dv, e, tp = v.shape[-1], p.entry_token.shape[1], p.token_segment.shape[1]
        empty = lambda rows: (jnp.zeros((b, rows, h, dv), v.dtype), jnp.full((b, h, rows), -jnp.inf))
        out_a, lse_a = _group_forward(q, k, v, m, p, s) if s.groups else empty(e)
        out_b, lse_b = _band_forward(q, k, v, m, p, s) if s.band else empty(tp)
        out, lse = _merge(p, s, out_a, lse_a, out_b, lse_b)
        out = out.astype(v.dtype)
    return (out, lse), (q, k, v, m, p, out, lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, m, p: Plan, settings: Settings):
    """Attention of the plan `p` -> (out `[B, T, H, Dv]`, its log-sum-exp `[B, T, H]` float32); `m`: the
    multiplier per query and head `[B, T, H]` (float32), or None when `settings.scale` holds it."""
    return _attention_fwd(q, k, v, m, p, settings)[0]


def _in_token_order(p: Plan, s: Settings) -> bool:
    """Whether the two sets meet inside set B's kernels (GPUs, one entry per token, both sets): set B's forward
    kernel reads set A's output and log-sum-exp at its tokens' entries and merges them with its own, and set A's
    backward kernels write their gradients in token order, which set B's add to theirs; no merge, return to token
    order or sum outside the kernels. Else set A's results and gradients are per entry, merged and summed by XLA.
    (Set A's forward results stay per entry: scattering them to token order cost its kernel the registers of a
    second program per SM, `BENCHMARKS.md`.)"""
    return s.backend not in TPU_BACKENDS and p.token_entries.shape[-1] == 1 and s.groups and s.band


def _with_set_a(inputs, kernel, p: Plan, s: Settings, set_a):
    """A set-B backward call's inputs, kernel and aliases, given set A's gradients in token order (`set_a`:
    `_Operand`s of `_group_backward`'s, or none: unchanged): the tokens' has-an-entry flags and those arrays come
    first, each written over by the kernel's output of the same place (`_after_set_a`)."""
    if not set_a:
        return inputs, kernel, None
    has_entry = _pad_rows((p.token_entries[..., :1] < p.entry_token.shape[1]).astype(jnp.int32),
                          p.token_segment.shape[1])
    results = [op._replace(block=s.band_block) for op in set_a]
    return ([_own_ids(has_entry, s, s.band_block), *results, *inputs],
            functools.partial(_after_set_a, kernel, len(set_a)), {1 + i: i for i in range(len(set_a))})


def _group_backward(q, k, v, m, p: Plan, do, lse, delta, s: Settings, token_order=False):
    """Set A's dq, dk, dv in token space (float32); with `token_order` (`_in_token_order`) the kernels' own, `[B,
    Tp, H, C]` per query head, whose rows they scatter by their entries' tokens (those of tokens in no group, and
    of padding past T, left unwritten). Then the gradient of set A's pairs for the per-query multiplier `m [B, T,
    H]`, `[B, T, H]` (float32; 0.0 when `m` is None)."""
    b, _, h, d = q.shape
    hk, dv, e, tp = k.shape[2], v.shape[-1], p.entry_token.shape[1], p.token_segment.shape[1]
    g, block = h // hk, s.block
    lse_a, delta_a = (_by_entry(x, p, s).transpose(0, 2, 1) for x in (lse, delta))  # [B, H, E]
    ids, lower, words = _group_ids(p)
    info, grid = _Operand(p.block_info, "table"), (b, h, e // block)
    gradient = lambda c, dtype: (_Operand(jax.ShapeDtypeStruct((b, tp, h, c), dtype), "token", entries="own")
                                 if token_order else _activation(jax.ShapeDtypeStruct((b, e, h, c), dtype), s, block))
    m_a = _per_row(m, p, s, entries=True)
    scale = _multiplier_operand(m_a, s, block)
    query_blocks = [_own_ids(x, s, block) for x in (ids, lower)] + [
        _entry_rows(x, p, s, block) for x in (q, do)] + [_stat_operand(x, s, block) for x in (lse_a, delta_a)]
    kernel, inputs, outputs = _multiplied(
        functools.partial(_group_dq_kernel, **_logit_kwargs(s)),
        [_Operand(p.first_key_block, "table"), info, *query_blocks, _entry_rows(k, p, s, heads_per_kv=g),
         _entry_rows(v, p, s, heads_per_kv=g), _walked_ids(ids), _walked_ids(words)], [gradient(d, q.dtype)],
        scale, _gradient_output(scale))
    dq, *d_scale = _call(kernel, inputs, outputs, grid, s, "focus_group_dq", block)
    walked_queries = [_entry_rows(x, p, s) for x in (q, do)] + [_stat_operand(x, s) for x in (lse_a, delta_a)] + [
        _walked_ids(x) for x in (ids, lower)]
    kernel, inputs, outputs = _multiplied(
        functools.partial(_group_dkv_kernel, **_logit_kwargs(s)),
        [_Operand(p.last_query_block, "table"), info, _own_ids(ids, s, block), _own_ids(words, s, block),
         _entry_rows(k, p, s, block, g), _entry_rows(v, p, s, block, g), *walked_queries],
        [gradient(d, k.dtype), gradient(dv, v.dtype)], _multiplier_operand(m_a, s))
    dk, dvv = _call(kernel, inputs, outputs, grid, s, "focus_group_dkv", block)
    d_scale = _token_major(d_scale[0].reshape(b, h, e).transpose(0, 2, 1), p, s) if d_scale else 0.0
    if token_order:
        return dq, dk, dvv, d_scale
    token_major = lambda x: _token_major(_row_major(x, s), p, s)
    return token_major(dq), _per_kv_head(token_major(dk), hk), _per_kv_head(token_major(dvv), hk), d_scale


def _band_backward(q, k, v, m, p: Plan, do, lse, delta, s: Settings, set_a=()):
    """Set B's dq, dk, dv (float32); with `set_a` (set A's, `_group_backward`'s in token order) their sums. Then
    the gradient of set B's pairs for the per-query multiplier `m [B, T, H]` (as `_group_backward`'s)."""
    b, t, h, d = q.shape
    hk, dv, tp, block = k.shape[2], v.shape[-1], p.token_segment.shape[1], s.band_block
    g = h // hk
    qp, kp, vp, dop = (_pad_rows(x, tp) for x in (q, k, v, do))
    lse_b, delta_b = (_pad_rows(x, tp).transpose(0, 2, 1) for x in (lse, delta))  # [B, H, Tp]
    ids = _band_ids(p)
    grid = (b, h, tp // block)
    gradient = lambda c, dtype: _activation(jax.ShapeDtypeStruct((b, tp, h, c), dtype), s, block)
    own_ids = [_own_ids(x, s, block) for x in ids]
    set_a_dq, set_a_dkv = ([_Operand(x, "token") for x in parts] for parts in (set_a[:1], set_a[1:]))
    query_blocks = own_ids + [_activation(x, s, block) for x in (qp, dop)] + [
        _stat_operand(x, s, block) for x in (lse_b, delta_b)]
    m_b = _per_row(m, p, s, entries=False)
    scale = _multiplier_operand(m_b, s, block)
    kernel, inputs, outputs = _multiplied(
        functools.partial(_band_dq_kernel, **_band_kwargs(s)),
        [*query_blocks, _activation(kp, s, heads_per_kv=g), _activation(vp, s, heads_per_kv=g),
         *(_walked_ids(x) for x in ids)], [gradient(d, q.dtype)], scale, _gradient_output(scale))
    inputs, kernel, aliases = _with_set_a(inputs, kernel, p, s, set_a_dq)
    dq, *d_scale = _call(kernel, inputs, outputs, grid, s, "focus_band_dq", block, aliases)
    walked_queries = [_activation(x, s) for x in (qp, dop)] + [_stat_operand(x, s) for x in (lse_b, delta_b)] + [
        _walked_ids(x) for x in ids]
    kernel, inputs, outputs = _multiplied(
        functools.partial(_band_dkv_kernel, n_blocks=tp // block, **_band_kwargs(s)),
        [*own_ids, _activation(kp, s, block, g), _activation(vp, s, block, g), *walked_queries],
        [gradient(d, k.dtype), gradient(dv, v.dtype)], _multiplier_operand(m_b, s))
    inputs, kernel, aliases = _with_set_a(inputs, kernel, p, s, set_a_dkv)
    dk, dvv = _call(kernel, inputs, outputs, grid, s, "focus_band_dkv", block, aliases)
    token_major = lambda x: _row_major(x, s)[:, :t].astype(jnp.float32)
    d_scale = d_scale[0].reshape(b, h, tp).transpose(0, 2, 1)[:, :t] if d_scale else 0.0
    return token_major(dq), _per_kv_head(token_major(dk), hk), _per_kv_head(token_major(dvv), hk), d_scale


def _attention_bwd(settings, residuals, cotangents):
    """Gradients from the cotangents of out and of the log-sum-exp (nonzero when a sink's pairs were merged by it):
    `dS = P (dP - delta)` with `delta = rowsum(dO * O) - d_lse`."""
    q, k, v, m, p, out, lse = residuals
    d_out, d_lse = cotangents
    do = d_out.astype(v.dtype)
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse  # [B, T, H]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    args = (q, k, v, m, p, do, lse, delta, settings)
    if _in_token_order(p, settings):
        *set_a, d_scale_a = _group_backward(*args, token_order=True)
        dq, dk, dv, d_scale_b = _band_backward(*args, set_a)
        grads = [(dq, dk, dv, d_scale_a + d_scale_b)]
    else:
        grads = ([_group_backward(*args)] if settings.groups else []) + (
            [_band_backward(*args)] if settings.band else [])
    dq, dk, dv, d_scale = (sum(parts) for parts in zip(*grads))
    zero_plan = jax.tree.map(lambda x: np.zeros(x.shape, jax.dtypes.float0), p)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None if m is None else d_scale,
            zero_plan)


_attention.defvjp(_attention_fwd, _attention_bwd)


def block_sizes(backend: str, block_size: int | None = None, band_block_size: int | None = None) -> tuple[int, int]:
    """`(block_size, band_block_size)` of `focus_sparse_pallas` on `backend`, the defaults filled in."""
    if block_size is None:
        block_size = 128 if backend in TPU_BACKENDS else 64
    if band_block_size is None:
        band_block_size = max(128, block_size) if backend in TPU_BACKENDS else min(32, block_size)
    return block_size, band_block_size


def focus_sparse_pallas(q, k, v, membership, *, multiplier, window, segment_ids=None, sink=0, softcap=None,
                        block_size=None, band_block_size=None, backend=None, mesh=None, max_groups=None,
                        num_warps=None, num_stages=None, _sets=(True, True, False)):
    """Hard Focus attention through the Pallas kernels (what `focus_sparse_attention(impl='pallas')` calls).

    q `[B, T, H, D]`, k `[B, T, Hk, D]`, v `[B, T, Hk, Dv]`, membership bool `[B, T, K]`, multiplier (scale /
    temperature) a number or an array, scalar or `[B, T, H]`, segment_ids int `[B, T]` or None -> `[B, T, H, Dv]`
    in v's dtype. The multiplier, a number or an array (which may be traced: a learned temperature), multiplies
    each row of the float32 scores inside the kernels (and dq, dk there); an array's gradient is computed there too.
    Matmuls run in the inputs' dtype with float32 accumulation; differentiable in q, k, v and an array multiplier. For
    float32 inputs they follow jax's default matmul precision, as XLA's own products do: TF32 on a recent GPU unless
    `jax.default_matmul_precision('float32')` asks for full float32.
    `backend`'s default is chosen when the call is traced, from this process's platform: to lower for a platform it
    does not have (`jax.jit(f).trace(...).lower(lowering_platforms=('cuda',))`), trace inside
    `target_platform('gpu')` (or 'tpu'), or the program lowered holds the CPU interpreter's kernels.
    `block_size`: set A's tile (entries; default 64, 128 on TPU, whose tiles are 128 wide); `band_block_size`: set
    B's tile (tokens; default 32, small because the band needs only `window + 1` keys per query and a tile of b
    queries reads `b + window` keys; 128 on TPU). `backend`: one of `BACKENDS`; default `default_backend()`.
    `max_groups`: at most this many groups per token (set A then has `max_groups * T` entry rows instead of
    `K * T`); None: K. `num_warps`, `num_stages`: the Triton launch (default `triton_launch(q.dtype)`).
    `sink`: the first `sink` tokens of each segment are visible to every later query of it; the pairs this adds
    outside the window and the groups are computed and merged outside the kernels, by
    `focal_jax.attention.sink.with_sink`.

    Multi-device: under a mesh (`mesh`, or by default the one of a `jax.set_mesh(mesh)` context), the kernels run
    per shard through `shard_map`, the batch split over the mesh's 'data' / 'fsdp' axes and the heads over
    'tensor' (a `pallas_call` is opaque to XLA's partitioner, which would otherwise gather the operands and run
    the whole batch on every device). An axis that does not divide its dimension is not split: heads that the
    'tensor' size does not divide are replicated over it. See `focal_jax.kernels.partition`. Without a mesh
    (or with all axes of size 1) nothing changes. Inside a user's `jax.shard_map` the kernels run on the shard they
    are given, and their outputs vary over the mesh axes their inputs vary over (as `check_vma=True` checks);
    `backend='interpret'` runs there only with `check_vma=False` (jax's Pallas interpreter; a ValueError says so).

    Raises ValueError naming the argument: the checks of `focus_sparse_attention` (shapes, window, sink,
    segment_ids, softcap, a floating-point membership, a token in more than `max_groups` groups when membership is
    concrete) and of the settings above.
    """
    _validate.check_focus_inputs(q, k, v, membership, "membership", window, segment_ids, sink)
    _validate.check_membership_dtype(membership)
    _validate.check_softcap(softcap)
    _validate.check_positive("multiplier", multiplier)
    _validate.check_finite("multiplier", multiplier)
    _validate.check_max_groups(membership, max_groups)
    backend = default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "interpret" and varying_axes(q, k, v, membership):
        raise ValueError(f"backend='interpret' (the default off GPUs and TPUs) cannot run inside a jax.shard_map that "
                         f"checks varying axes (check_vma=True, its default; the inputs vary over "
                         f"{sorted(varying_axes(q, k, v, membership))}): jax's Pallas interpreter slices them with "
                         f"indices that do not vary. Use impl='decomposed', focus_sparse_pallas(..., "
                         f"backend='mosaic_interpret') (focal_jax.kernels.focus_sparse), or jax.shard_map(..., "
                         f"check_vma=False)")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got num_warps={num_warps!r}")
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages must be an integer >= 1, got num_stages={num_stages!r}")
    for name, size in (("block_size", block_size), ("band_block_size", band_block_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1):
            raise ValueError(f"{name} must be None or an integer >= 1, got {name}={size!r}")
    block_size, band_block_size = block_sizes(backend, block_size, band_block_size)
    if backend == "mosaic" and (block_size % 128 or band_block_size % 128):
        raise ValueError(f"backend='mosaic' (TPU) needs block sizes that are multiples of 128, got "
                         f"block_size={block_size}, band_block_size={band_block_size}")
    b, t = q.shape[:2]
    h = q.shape[2]
    if backend == "triton":  # Pallas's Triton lowering takes power-of-two array shapes only
        for name, size in (("head_dim", q.shape[-1]), ("v head_dim", v.shape[-1]), ("block_size", block_size),
                           ("band_block_size", band_block_size)):
            if size & (size - 1):
                raise ValueError(f"backend='triton' (GPU) needs a power-of-two {name}, got {name}={size} (Pallas's "
                                 f"Triton lowering takes power-of-two block shapes only); use impl='decomposed' or "
                                 f"pad the heads")
    if isinstance(multiplier, (int, float, np.floating, np.integer)):
        scale, per_query = float(multiplier), ()
    else:  # an array, which may be traced (a learned temperature): per query and head, an operand of the kernels
        multiplier = jnp.asarray(multiplier, jnp.float32)
        try:
            if multiplier.ndim == 2:  # [B, T] would broadcast against [T, H]
                raise ValueError
            scale, per_query = None, (jnp.broadcast_to(multiplier, (b, t, h)),)
        except ValueError:
            raise ValueError(f"multiplier must be a number or broadcastable to [batch, seq, heads] = {(b, t, h)}, "
                             f"got shape {multiplier.shape}") from None
    default_warps, default_stages = triton_launch(q.dtype)
    # A window past the sequence changes nothing; clamped, block bounds computed from it stay in int32.
    settings = Settings(block_size, band_block_size, min(window, t), softcap, scale, t, backend,
                        num_warps or default_warps, num_stages or default_stages, *_sets)
    plan_segments = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
    out, lse = _planned_attention(q, k, v, per_query, membership, plan_segments, settings=settings,
                                  max_groups=max_groups, mesh=mesh)
    if not sink:
        return out
    return with_sink(out, lse, q, k, v, membership.astype(bool), multiplier=multiplier, window=window,
                     segment_ids=segment_ids, sink=sink, softcap=softcap)


# Jitted as a whole: called eagerly, the kernels of a new closure compiled afresh at every call (1 s at T = 256 in
# interpret mode).
@functools.partial(jax.jit, static_argnames=("settings", "max_groups", "mesh"))
def _planned_attention(q, k, v, per_query, membership, segment_ids, *, settings: Settings, max_groups, mesh):
    """The plan of each row, then the kernels, per shard of `mesh` (`focus_sparse_pallas`, after its checks)."""

    def kernel(q, k, v, *arrays):
        *m, membership, segment_ids = arrays
        p = jax.vmap(lambda m, s: plan(m, s, settings.block, settings.band_block, max_groups))(membership,
                                                                                               segment_ids)
        return _attention(q, k, v, m[0] if m else None, p, settings)

    return per_shard(kernel, q, k, v, (membership, segment_ids), head_arrays=per_query, mesh=mesh)


def dot_product_pallas(q, k, v, *, multiplier, window=None, segment_ids=None, softcap=None, block_size=None,
                       band_block_size=None, backend=None, mesh=None, num_warps=None, num_stages=None):
    """Causal dense or focal attention (no groups) through the same kernels: `window=None` puts every token in one
    group (set A only: every causal pair, full blocks without the element mask); a `window` w puts no token in any
    group (set B only: the local band `0 <= i - j <= w`). Shapes and arguments as `focus_sparse_pallas`."""
    b, t, _, _ = _validate.check_qkv(q, k, v)
    _validate.check_window(window)  # (None here; the rest is checked by focus_sparse_pallas)
    membership = jnp.full((b, t, 1), window is None)
    return focus_sparse_pallas(q, k, v, membership, multiplier=multiplier, window=0 if window is None else window,
                               segment_ids=segment_ids, softcap=softcap, block_size=block_size,
                               band_block_size=band_block_size, backend=backend, mesh=mesh, num_warps=num_warps,
                               num_stages=num_stages, _sets=(window is None, window is not None, window is None))
