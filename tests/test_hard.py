"""Hard Focus attention (inference form): membership, mask, and the exact decomposed fast path.

Ground truth: focal_jax.attention.reference (dense masked, naive) and jax.nn.dot_product_attention.
"""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from focal_jax.attention import focus_mask, focus_sparse_attention, topk_membership
from focal_jax.attention import reference

from helpers import assert_close, rand_qkv

pytestmark = pytest.mark.usefixtures("fast_compiles")


# One compiled function per (shapes, window, impl, block_size); temperature/scale are traced when they are arrays.
sparse = jax.jit(focus_sparse_attention, static_argnames=("window", "sink", "softcap", "impl", "block_size"))
naive = jax.jit(reference.focus_hard_attention, static_argnames=("window", "sink", "softcap"))


def topk_numpy(scores, k):
    """Independent top-k membership: the k largest scores of each row (numpy argsort)."""
    scores = np.asarray(scores)
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    mem = np.zeros(scores.shape, bool)
    np.put_along_axis(mem, top, True, axis=-1)
    return mem


def make_membership(seed, b, t, n_groups, k, *, used_groups=None, bias=None, arbitrary=False):
    """bool [B, T, K]: top-k of random scores; `used_groups` leaves the other groups empty; `bias` skews sizes;
    `arbitrary`: independent random bits (rows with 0..K groups)."""
    rng = np.random.default_rng(seed)
    if arbitrary:
        return rng.random((b, t, n_groups)) < 0.35
    scores = rng.normal(size=(b, t, n_groups))
    if bias is not None:
        scores = scores + np.asarray(bias)
    if used_groups is not None:
        unused = np.setdiff1d(np.arange(n_groups), used_groups)
        scores[..., unused] = -np.inf
    mem = topk_numpy(scores, k)
    if used_groups is not None:
        assert not mem[..., unused].any()
    return mem


def packed_segments(b, t, seed):
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, t), np.int32)
    for bb in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=min(2, t - 1), replace=False))
        for c in cuts:
            seg[bb, c:] += 1
    return seg


# name: (b, t, h, hk, d, K, k, window, block_size, extra). Each entry costs a compile: features are combined.
CONFIGS = {
    "k1_T77_block16": (2, 77, 2, 2, 8, 4, 1, 8, 16, {}),
    "k2_T130_K5_block32": (1, 130, 2, 2, 8, 5, 2, 16, 32, {}),
    "K1": (2, 50, 2, 2, 8, 1, 1, 5, 16, {}),
    "K8_gt_T5_T_lt_block": (2, 5, 2, 2, 8, 8, 2, 1, 16, {}),
    "K40_gt_T20_two_bitmask_words": (1, 20, 2, 2, 8, 40, 3, 2, 8, {}),
    "empty_groups_unequal_k1_T130_K3": (1, 130, 2, 2, 8, 6, 1, 16, 32, dict(used_groups=[0, 3, 4],
                                                                         bias=[1.5, 0, 0, 0, -1.0, 0])),
    "empty_groups_k2": (1, 64, 2, 2, 8, 6, 2, 4, 16, dict(used_groups=[1, 2, 5])),
    "window0": (2, 60, 2, 2, 8, 3, 1, 0, 16, {}),
    "window_gt_T": (1, 60, 2, 2, 8, 3, 1, 200, 16, {}),
    "segments_k2": (2, 77, 2, 2, 8, 4, 2, 8, 16, dict(segments=True)),
    "gqa_4_1": (1, 70, 4, 1, 8, 4, 2, 6, 16, {}),
    "temperature_scalar_scale": (1, 70, 2, 2, 8, 4, 2, 6, 16, dict(temperature=0.4, scale=0.7)),
    "arbitrary_membership_segments_gqa_temperature_array": (2, 90, 4, 2, 8, 5, 0, 7, 16,
                                                            dict(arbitrary=True, segments=True, temp_array=True)),
    "default_block_T150": (1, 150, 2, 2, 8, 4, 1, 10, None, {}),
    "sink_segments_k1": (2, 77, 2, 2, 8, 4, 1, 8, 16, dict(sink=3, segments=True)),
    "sink_beyond_window_k2": (1, 130, 2, 2, 8, 5, 2, 4, 32, dict(sink=20)),
    "sink_interleaved_segments_gqa_temperature_array": (2, 70, 4, 2, 8, 3, 1, 2, 16,
                                                        dict(sink=4, interleaved=True, temp_array=True)),
    "sink_longer_than_documents_k2": (2, 77, 2, 2, 8, 4, 2, 3, 16, dict(sink=30, segments=True)),
    "sink_150_in_steps": (1, 200, 2, 2, 8, 4, 1, 4, 32, dict(sink=150)),
    "sink_100_in_steps_interleaved_segments_gqa": (2, 240, 4, 2, 8, 3, 1, 2, 32,
                                                       dict(sink=100, interleaved=True, temp_array=True)),
    "softcap_k2_sharp": (1, 90, 4, 2, 8, 4, 2, 6, 16, dict(softcap=1.5, temperature=0.3)),
}


def build_case(name, seed=0):
    b, t, h, hk, d, n_groups, topk, window, block, extra = CONFIGS[name]
    q, k, v = rand_qkv(seed, b, t, h, hk, d)
    mem = make_membership(seed + 1, b, t, n_groups, topk, used_groups=extra.get("used_groups"),
                          bias=extra.get("bias"), arbitrary=extra.get("arbitrary", False))
    seg = jnp.asarray(packed_segments(b, t, seed + 2)) if extra.get("segments") else None
    if extra.get("interleaved"):  # segments that are not contiguous: runs of 3 tokens alternate between 3 ids
        seg = jnp.broadcast_to((jnp.arange(t) // 3) % 3, (b, t))
    if extra.get("temp_array"):
        temperature = jax.random.uniform(jax.random.key(seed + 3), (b, t, h), minval=0.3, maxval=1.5)
    else:
        temperature = extra.get("temperature", 1.0)
    kw = dict(window=window, temperature=temperature, scale=extra.get("scale"), segment_ids=seg,
              sink=extra.get("sink", 0), softcap=extra.get("softcap"))
    return q, k, v, jnp.asarray(mem), kw, block


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decomposed_and_reference_impl_equal_naive_reference(name):
    q, k, v, mem, kw, block = build_case(name)
    want = naive(q, k, v, mem, **kw)
    got_dec = sparse(q, k, v, mem, impl="decomposed", block_size=block, **kw)
    assert got_dec.shape == want.shape and got_dec.dtype == jnp.float32
    assert_close(got_dec, want, what="decomposed")
    got_ref = sparse(q, k, v, mem, impl="reference", **kw)
    assert_close(got_ref, want, what="impl='reference'")


def test_the_cases_are_not_trivial():
    """Guard on the fixtures: the hard mask differs from the causal mask (and from the local band) where it should."""
    for name in ("k1_T77_block16", "k2_T130_K5_block32", "empty_groups_unequal_k1_T130_K3", "segments_k2",
                 "window0"):
        q, k, v, mem, kw, _ = build_case(name)
        mask = np.asarray(reference.focus_hard_mask(mem, window=kw["window"], segment_ids=kw["segment_ids"]))
        t = mask.shape[-1]
        causal = np.tril(np.ones((t, t), bool))
        band = causal & ~np.tril(np.ones((t, t), bool), -kw["window"] - 1)
        assert (mask != causal[None]).any(), name
        assert (mask & ~band[None]).any(), name
    # empty groups really are empty, and T = 130 really has unequal group sizes
    *_, mem, _, _ = build_case("empty_groups_unequal_k1_T130_K3")
    sizes = np.asarray(mem).sum(axis=(0, 1))
    assert np.all(sizes[[1, 2, 5]] == 0), sizes
    used = sizes[[0, 3, 4]]
    assert used.min() > 0 and used.max() - used.min() > 10, sizes


def test_topk_equal_to_K_is_dense_causal():
    b, t, h, hk, d, n_groups = 2, 77, 4, 2, 8, 4
    q, k, v = rand_qkv(5, b, t, h, hk, d)
    mem = jnp.ones((b, t, n_groups), bool)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert_close(sparse(q, k, v, mem, window=5, impl="decomposed", block_size=16), want, what="decomposed")
    assert_close(sparse(q, k, v, mem, window=5, impl="reference"), want, what="reference")
    # and with temperature: dense attention at the folded scale
    want_t = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=1 / (0.4 * np.sqrt(d)))
    assert_close(sparse(q, k, v, mem, window=5, temperature=0.4, impl="decomposed", block_size=16), want_t)


def test_window_covering_sequence_is_dense_causal_for_any_membership():
    b, t, h, d = 1, 40, 2, 8
    q, k, v = rand_qkv(6, b, t, h, h, d)
    mem = jnp.asarray(make_membership(7, b, t, 4, 1))
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert_close(sparse(q, k, v, mem, window=t - 1, impl="decomposed", block_size=16), want)


def test_disjoint_groups_window0_is_group_causal_attention():
    """k = 1, window 0: each token attends causally within its group only (an independent jax.nn mask)."""
    b, t, h, d = 2, 45, 2, 8
    q, k, v = rand_qkv(8, b, t, h, h, d)
    mem_np = make_membership(9, b, t, 3, 1)
    group = mem_np.argmax(-1)
    mask = jnp.asarray(group[:, :, None] == group[:, None, :])[:, None]
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
    assert_close(sparse(q, k, v, jnp.asarray(mem_np), window=0, impl="decomposed", block_size=16), want)


GRAD_CASES = ["k1_T77_block16", "arbitrary_membership_segments_gqa_temperature_array", "sink_beyond_window_k2",
              "sink_interleaved_segments_gqa_temperature_array", "softcap_k2_sharp", "sink_150_in_steps",
              "sink_100_in_steps_interleaved_segments_gqa"]


@pytest.mark.parametrize("name", GRAD_CASES)
def test_decomposed_gradients_equal_reference(name):
    q, k, v, mem, kw, block = build_case(name, seed=10)
    temperature = kw.pop("temperature")
    if not isinstance(temperature, jax.Array):
        temperature = jnp.full(q.shape[:3], 0.8)
    cot = jax.random.normal(jax.random.key(11), q.shape[:3] + v.shape[-1:])

    def loss(fn, q, k, v, temperature):
        return jnp.sum(fn(q, k, v, mem, temperature=temperature, **kw) * cot)

    dec = functools.partial(focus_sparse_attention, impl="decomposed", block_size=block)
    grads_dec = jax.jit(jax.grad(functools.partial(loss, dec), argnums=(0, 1, 2, 3)))(q, k, v, temperature)
    grads_ref = jax.jit(jax.grad(functools.partial(loss, reference.focus_hard_attention), argnums=(0, 1, 2, 3)))(
        q, k, v, temperature)
    for which, gd, gr in zip(("q", "k", "v", "temperature"), grads_dec, grads_ref):
        assert gd.shape == gr.shape
        assert float(jnp.max(jnp.abs(gr))) > 1e-3, which      # the reference gradient is not trivially zero
        assert_close(gd, gr, atol=1e-4, what=f"d/d{which}")


def test_decomposed_memory_is_blockwise():
    """No intermediate of the decomposed path (forward or backward) is as large as a [T, T] score matrix."""
    b, t, h, d, n_groups, block = 1, 512, 1, 8, 4, 32
    q, k, v = rand_qkv(12, b, t, h, h, d)
    mem = jnp.asarray(make_membership(13, b, t, n_groups, 1))

    def loss(q, k, v, impl):
        return jnp.sum(focus_sparse_attention(q, k, v, mem, window=16, impl=impl, block_size=block))

    def largest_intermediate(fn):
        jaxpr = jax.make_jaxpr(fn)(q, k, v).jaxpr
        sizes = []

        def walk(jx):
            for eqn in jx.eqns:
                for var in eqn.outvars:
                    shape = getattr(var.aval, "shape", ())
                    sizes.append(int(np.prod(shape)) if shape else 1)
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jaxpr)
        return max(sizes)

    limit = t * t // 4
    for fn in (lambda q, k, v: loss(q, k, v, "decomposed"),
               jax.grad(lambda q, k, v: loss(q, k, v, "decomposed"), argnums=(0, 1, 2))):
        assert largest_intermediate(fn) < limit
    # the dense reference does hold a [T, T] matrix, so the measure can fail
    assert largest_intermediate(lambda q, k, v: loss(q, k, v, "reference")) >= t * t


def test_pallas_impl_needs_power_of_two_blocks():
    q, k, v = rand_qkv(14, 1, 8, 2, 2, 4)
    mem = jnp.ones((1, 8, 2), bool)
    with pytest.raises(ValueError, match="power-of-two block_size, got block_size=24"):
        focus_sparse_attention(q, k, v, mem, window=2, impl="pallas", block_size=24)


@pytest.mark.parametrize("impl", ["decomposed", "pallas"])
@pytest.mark.parametrize("n_groups,k", [(5, 1), (6, 2), (3, 3)])
def test_max_groups_sizes_the_entries_and_keeps_the_result(impl, n_groups, k):
    """`max_groups=k` (the model's top-k): the plan holds k * T entries instead of K * T, and outputs and gradients
    equal the reference and the default (`max_groups=None`)."""
    from focal_jax.kernels.focus_sparse import plan

    b, t, block = 2, 45, 16
    q, key, v = rand_qkv(30 + k, b, t, 4, 2, 8)
    mem = jnp.asarray(make_membership(31, b, t, n_groups, k))
    segments = jnp.asarray(packed_segments(b, t, 32))
    assert plan(mem[0], segments[0], block, 8, max_groups=k).entry_token.shape == (-(-k * t // block) * block,)
    assert plan(mem[0], segments[0], block, 8).entry_token.shape == (-(-n_groups * t // block) * block,)

    def run(max_groups):
        return lambda q, key, v: focus_sparse_attention(q, key, v, mem, window=3, segment_ids=segments, impl=impl,
                                                        block_size=block, max_groups=max_groups)

    expected = lambda q, key, v: reference.focus_hard_attention(q, key, v, mem, window=3, segment_ids=segments)
    got = jax.jit(run(k))(q, key, v)
    assert_close(got, jax.jit(expected)(q, key, v), atol=1e-5, what=f"{impl} max_groups={k}")
    assert_close(got, jax.jit(run(None))(q, key, v), atol=1e-5, what=f"{impl} max_groups={k} vs None")
    loss = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2)))(q, key, v)
    for name, got, want in zip("qkv", loss(run(k)), loss(expected)):
        assert_close(got, want, atol=1e-5, what=f"{impl} max_groups={k} d{name}")


def test_a_token_in_more_groups_than_max_groups_is_an_error_or_nan():
    t = 20
    q, key, v = rand_qkv(33, 2, t, 2, 2, 8)
    mem = jnp.asarray(make_membership(34, 2, t, 4, 1)).at[0, 7].set(True)  # token 7 of row 0 in all 4 groups
    with pytest.raises(ValueError, match="max_groups=1 but a token of membership is in 4 groups"):
        focus_sparse_attention(q, key, v, mem, window=2, impl="decomposed", max_groups=1)
    with pytest.raises(ValueError, match="max_groups=1 but a token of membership is in 4 groups"):  # closed over
        jax.jit(lambda q, key, v: focus_sparse_attention(q, key, v, mem, window=2, max_groups=1))(q, key, v)
    with pytest.raises(ValueError, match="max_groups must be None or an integer >= 1, got max_groups=0"):
        focus_sparse_attention(q, key, v, mem, window=2, max_groups=0)
    expected = reference.focus_hard_attention(q, key, v, mem, window=2)
    for impl in ("reference", "decomposed", "pallas"):
        out = jax.jit(lambda q, key, v, mem: focus_sparse_attention(q, key, v, mem, window=2, impl=impl,
                                                                    block_size=16, max_groups=1))(q, key, v, mem)
        assert bool(jnp.isnan(out[0]).all()), impl  # its whole sequence, never silently wrong
        assert_close(out[1], expected[1], atol=1e-5, what=impl)  # the other sequence is unaffected


# ------------------------------------------------------------------------------------------------------------
# membership and mask
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_groups,k", [(1, 1), (5, 1), (5, 2), (5, 5), (40, 7)])
def test_topk_membership(n_groups, k):
    g = jax.random.normal(jax.random.key(15), (2, 33, n_groups))
    mem = np.asarray(topk_membership(g, k))
    assert mem.dtype == bool and mem.shape == g.shape
    assert np.all(mem.sum(-1) == k)
    gn = np.asarray(g)
    np.testing.assert_array_equal(mem, topk_numpy(gn, k))
    smallest_in = np.where(mem, gn, np.inf).min(-1)
    largest_out = np.where(mem, -np.inf, gn).max(-1)
    assert np.all(smallest_in > largest_out)
    if k == 1:
        np.testing.assert_array_equal(mem.argmax(-1), gn.argmax(-1))


def test_topk_membership_ties_go_to_the_lower_group():
    g = jnp.array([[[0.0, -0.0, 0.0, -1.0], [0.5, 0.5, 0.5, 0.5]]])  # -0.0 == 0.0: a tie, as any other
    for fn in (topk_membership, jax.jit(topk_membership, static_argnums=1)):
        assert np.asarray(fn(g, 2)).tolist() == [[[True, True, False, False], [True, True, False, False]]]


def test_topk_membership_on_sinkhorn_like_rows():
    g = jax.nn.softmax(5 * jax.random.normal(jax.random.key(16), (1, 20, 4)), -1)
    mem = np.asarray(topk_membership(g, 1))
    np.testing.assert_array_equal(np.nonzero(mem)[-1], np.asarray(g).argmax(-1).ravel())


@pytest.mark.parametrize("window", [0, 3, 100])
@pytest.mark.parametrize("segmented", [False, True])
def test_focus_mask_equals_reference(window, segmented):
    b, t, n_groups = 2, 37, 5
    mem = jnp.asarray(make_membership(17, b, t, n_groups, 0, arbitrary=True))
    seg = jnp.asarray(packed_segments(b, t, 18)) if segmented else None
    got = focus_mask(mem, window=window, segment_ids=seg)
    assert got.dtype == jnp.bool_ and got.shape == (b, t, t)
    want = reference.focus_hard_mask(mem, window=window, segment_ids=seg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # spot check one pair by the definition, independently of both
    mem_np, i, j = np.asarray(mem), 30, 2
    same_seg = True if seg is None else bool(np.asarray(seg)[0, i] == np.asarray(seg)[0, j])
    expected = same_seg and (i - j <= window or bool((mem_np[0, i] & mem_np[0, j]).any()))
    assert bool(got[0, i, j]) == expected
    assert not bool(jnp.any(got & ~jnp.tril(jnp.ones((t, t), bool))[None]))


# ------------------------------------------------------------------------------------------------------------
# property test over random shapes
# ------------------------------------------------------------------------------------------------------------

@st.composite
def hard_cases(draw):
    b = draw(st.integers(1, 2))
    t = draw(st.integers(1, 70))
    hk = draw(st.sampled_from([1, 2]))
    h = hk * draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from([4, 8]))
    n_groups = draw(st.integers(1, 6))
    k = draw(st.integers(1, n_groups))
    window = draw(st.integers(0, t + 2))
    block = draw(st.sampled_from([8, 16, 32]))
    segmented = draw(st.booleans()) and t >= 3
    seed = draw(st.integers(0, 2**16))
    return b, t, h, hk, d, n_groups, k, window, block, segmented, seed


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(hard_cases())
def test_property_decomposed_equals_reference(case):
    b, t, h, hk, d, n_groups, k, window, block, segmented, seed = case
    q, kk, v = rand_qkv(seed, b, t, h, hk, d)
    mem = jnp.asarray(make_membership(seed + 1, b, t, n_groups, k))
    seg = jnp.asarray(packed_segments(b, t, seed + 2)) if segmented else None
    got = sparse(q, kk, v, mem, window=window, segment_ids=seg, impl="decomposed", block_size=block)
    want = naive(q, kk, v, mem, window=window, segment_ids=seg)
    assert_close(got, want, what=str(case))


def test_sink_keys_are_visible_to_every_query():
    """With a sink, the mask gains exactly the causal pairs with the first `sink` keys (independent numpy mask)."""
    b, t, n_groups, window, sink = 1, 50, 4, 3, 2
    mem = jnp.asarray(make_membership(12, b, t, n_groups, 1))
    without = np.asarray(focus_mask(mem, window=window))
    with_sink = np.asarray(focus_mask(mem, window=window, sink=sink))
    i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
    np.testing.assert_array_equal(with_sink, without | ((j < sink) & (j <= i))[None])
    assert (with_sink != without).any()


@pytest.mark.parametrize("interleaved", [False, True])
def test_each_segment_has_its_own_sink(interleaved):
    """With segment ids the sink keys are the first `sink` tokens of each segment, contiguous or not (a loop over
    the tokens counts them): the mask and both reference masks gain exactly the later same-segment pairs with them."""
    b, t, n_groups, window, sink = 2, 60, 4, 2, 3
    mem = jnp.asarray(make_membership(14, b, t, n_groups, 1))
    seg = (np.broadcast_to((np.arange(t) // 4) % 3, (b, t)) if interleaved
           else np.asarray(packed_segments(b, t, 15)))
    is_sink = np.zeros((b, t), bool)
    for row in range(b):
        seen = {}
        for j in range(t):
            seen[seg[row, j]] = seen.get(seg[row, j], 0) + 1
            is_sink[row, j] = seen[seg[row, j]] <= sink
    i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
    gained = is_sink[:, None, :] & (j <= i)[None] & (seg[:, :, None] == seg[:, None, :])
    without = np.asarray(focus_mask(mem, window=window, segment_ids=jnp.asarray(seg)))
    for mask in (focus_mask(mem, window=window, segment_ids=jnp.asarray(seg), sink=sink),
                 reference.focus_hard_mask(mem, window=window, segment_ids=seg, sink=sink)):
        np.testing.assert_array_equal(np.asarray(mask), without | gained)
    later_segment_key = (seg != seg[:, :1])[:, None, :]  # keys outside the row's first segment
    assert (gained & ~without & later_segment_key).sum() > 20  # the row-prefix sink would add none of these


def test_a_sink_of_each_document_in_hand_checked_rows():
    """Two documents [0, 0, 0, 1, 1, 1, 1], one group each token, window 0, sink 1: each token sees itself and its
    document's first token."""
    mem = jnp.eye(7, dtype=bool)[None]  # 7 groups, one token each: no pair shares a group
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 1]])
    want = np.eye(7, dtype=int)
    want[1:3, 0] = want[4:, 3] = 1
    np.testing.assert_array_equal(np.asarray(focus_mask(mem, window=0, segment_ids=seg, sink=1)).astype(int)[0],
                                  want)


def test_a_long_sink_runs_in_steps_of_16_keys():
    """A sink longer than `SINK_CHUNK` (16) keys per query is gathered 16 keys at a time (`lax.scan` of
    rematerialised steps): no intermediate of the decomposed path, forward or backward, holds more than 16 sink keys
    per query (sink 150 at T = 200: below B * T * 17 * Hk * D elements), and a larger sink on a shorter row is
    clamped to T (values equal the reference; `CONFIGS` has the long-sink cases with segments and gradients)."""
    from focal_jax.attention.sink import SINK_CHUNK

    b, t, h, d, sink = 1, 200, 2, 8, 150
    q, k, v = rand_qkv(16, b, t, h, h, d)
    mem = jnp.asarray(make_membership(17, b, t, 3, 1))
    segment_ids = jnp.asarray(packed_segments(b, t, 18))

    def sizes(fn):
        found = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                found.extend(int(np.prod(getattr(var.aval, "shape", ()))) for var in eqn.outvars)
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)

        walk(jax.make_jaxpr(fn)(q, k, v).jaxpr)
        return max(found)

    limit = b * t * (SINK_CHUNK + 1) * h * d
    for segments in (None, segment_ids):
        loss = lambda q, k, v: jnp.sum(focus_sparse_attention(q, k, v, mem, window=2, sink=sink, impl="decomposed",
                                                              segment_ids=segments, block_size=32) ** 2)
        assert sizes(loss) < limit and sizes(jax.grad(loss, argnums=(0, 1, 2))) < limit
    # in one step of all 150 sink keys (and, with segment ids, blocks of 256 queries) the measure fails
    from focal_jax.attention import sink as sink_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sink_module, "SINK_CHUNK", 256)
        for segments in (None, segment_ids):
            one_step = lambda q, k, v: sink_module.sink_set(q, k, v, mem, multiplier=1.0, window=2,
                                                            segment_ids=segments, sink=sink, softcap=None)[0]
            assert sizes(one_step) >= limit
    short = slice(0, 40)
    assert_close(sparse(q[:, short], k[:, short], v[:, short], mem[:, short], window=2, sink=100,
                        impl="decomposed", block_size=16),
                 naive(q[:, short], k[:, short], v[:, short], mem[:, short], window=2, sink=100))


@pytest.mark.parametrize("layout", ["short documents and padding", "random ids"])
def test_a_sink_of_each_segment_across_query_blocks(layout):
    """Set C with segment ids works in blocks of `SINK_CHUNK` queries of the rows sorted by segment: the block's
    first segment reads its sink keys at the start of its run, the segments that start inside the block read them
    among the block's own keys. Against the naive reference, values and gradients (q, k, v, per-query temperature):
    many documents shorter than the sink and than a block, a document spanning several blocks, padding (id 0) at
    the end, T not a multiple of 16; or ids drawn at random per token (every segment scattered over the row)."""
    b, t, h, hk, d, sink = 2, 83, 4, 2, 8, 20
    rng = np.random.default_rng(21)
    if layout == "random ids":
        seg = rng.integers(1, 5, size=(b, t))
    else:
        lengths = [[1, 2, 3, 1, 5, 2, 9, 1, 30, 4, 2, 1, 6], [40, 1, 1, 2, 7, 3, 3, 11, 1, 2]]
        seg = np.zeros((b, t), np.int32)
        for row, row_lengths in enumerate(lengths):
            seg[row, :sum(row_lengths)] = np.repeat(np.arange(1, len(row_lengths) + 1), row_lengths)
    seg = jnp.asarray(seg)
    q, k, v = rand_qkv(22, b, t, h, hk, d)
    mem = jnp.asarray(make_membership(23, b, t, 3, 1))
    temperature = jax.random.uniform(jax.random.key(24), (b, t, h), minval=0.3, maxval=1.5)
    cot = jax.random.normal(jax.random.key(25), q.shape)

    def loss(fn, q, k, v, temperature):
        return jnp.sum(fn(q, k, v, mem, window=1, segment_ids=seg, sink=sink, temperature=temperature) * cot)

    decomposed = functools.partial(focus_sparse_attention, impl="decomposed", block_size=16)
    args = (q, k, v, temperature)
    assert_close(decomposed(q, k, v, mem, window=1, segment_ids=seg, sink=sink, temperature=temperature),
                 naive(q, k, v, mem, window=1, segment_ids=seg, sink=sink, temperature=temperature))
    got = jax.jit(jax.grad(functools.partial(loss, decomposed), argnums=(0, 1, 2, 3)))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, reference.focus_hard_attention), argnums=(0, 1, 2, 3)))(*args)
    for which, g, w in zip(("q", "k", "v", "temperature"), got, want):
        assert_close(g, w, atol=1e-4, what=f"d/d{which}")
    # the sink adds pairs here: without it the values differ
    no_sink = naive(q, k, v, mem, window=1, segment_ids=seg, temperature=temperature)
    assert float(jnp.max(jnp.abs(no_sink - naive(q, k, v, mem, window=1, segment_ids=seg, sink=sink,
                                                 temperature=temperature)))) > 0.1


@pytest.mark.parametrize("segments", [True, False])
@pytest.mark.parametrize("impl", ["decomposed", "pallas"])
def test_a_sink_with_bf16_inputs_follows_float32_reference(impl, segments):
    """bf16 inputs with a sink (set C merged outside the fast path; its keys gathered per query with segment ids, a
    slice of the row without): output in bf16 and gradients within bf16 rounding of the float32 reference."""
    q, k, v, mem, kw, block = build_case("sink_longer_than_documents_k2", seed=20)
    kw["sink"] = 5
    if not segments:
        kw["segment_ids"] = None
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    attend = lambda q, k, v: focus_sparse_attention(q, k, v, mem, impl=impl, block_size=block, **kw)
    got = attend(*bf16)
    assert got.dtype == jnp.bfloat16
    assert_close(got, naive(*bf16, mem, **kw), atol=2e-2, what=f"bf16 {impl}")
    cotangent = jax.random.normal(jax.random.key(21), got.shape)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent)
    grads = jax.grad(loss(attend), argnums=(0, 1, 2))(*bf16)
    expected = jax.grad(loss(lambda q, k, v: naive(q, k, v, mem, **kw)), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in bf16))
    for name, g, e in zip("qkv", grads, expected):
        scale = float(jnp.max(jnp.abs(e)))
        assert_close(g.astype(jnp.float32) / scale, e / scale, atol=3e-2, what=f"bf16 {impl} d{name}")


def test_decomposed_bf16_follows_float32_reference():
    """bf16 inputs: output and gradients within bf16 rounding of the float32 reference, and every product of the
    forward and backward pass in bf16 (float32 accumulation); it computed all in float32 before 0.6.2."""
    from focal_jax.bench import matmul_flops

    q, k, v, mem, kw, block = build_case("k2_T130_K5_block32")
    want = naive(q, k, v, mem, **kw)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    decomposed = lambda q, k, v: sparse(q, k, v, mem, impl="decomposed", block_size=block, **kw)
    got = decomposed(*bf16)
    assert got.dtype == jnp.bfloat16
    assert_close(got, want, atol=2e-2, what="bf16 decomposed")
    cotangent = jax.random.normal(jax.random.key(5), want.shape)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent)
    grads = jax.grad(loss(decomposed), argnums=(0, 1, 2))(*bf16)
    expected = jax.grad(loss(lambda q, k, v: naive(q, k, v, mem, **kw)), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in bf16))
    for name, g, e in zip("qkv", grads, expected):
        assert g.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(e)))
        assert_close(g.astype(jnp.float32) / scale, e / scale, atol=3e-2, what=f"bf16 decomposed d{name}")
    total, low = matmul_flops(jax.grad(loss(decomposed), argnums=(0, 1, 2)), *bf16)
    assert low == total > 0


def test_decomposed_promotes_mixed_dtypes_and_scales_the_float32_logits():
    """As the reference and the Pallas kernels: q, k and v of different dtypes promote (float32 q with bf16 k was
    rounded to bf16: error 4.5e-3), and a numeric temperature multiplies the float32 logits, not bf16 q (at t = 0.05
    its rounding moved the output by 7.6e-2); gradients too. (A temperature traced by an outer jit is an array:
    it still scales q.)"""
    q, k, v, mem, kw, block = build_case("k2_T130_K5_block32")
    decomposed = lambda q, k, v, **extra: focus_sparse_attention(q, k, v, mem, impl="decomposed", block_size=block,
                                                                 **kw, **extra)
    mixed = (q, k.astype(jnp.bfloat16), v)
    want = naive(*(x.astype(jnp.float32) for x in mixed), mem, **kw)
    assert_close(decomposed(*mixed), want, atol=1e-5, what="float32 q, bf16 k")
    grads = jax.grad(lambda *a: jnp.sum(jnp.sin(decomposed(*a))), argnums=(0, 2))(*mixed)
    expected = jax.grad(lambda *a: jnp.sum(jnp.sin(naive(*a, mem, **kw))), argnums=(0, 2))(
        *(x.astype(jnp.float32) for x in mixed))
    for name, g, e in zip("qv", grads, expected):
        assert_close(g, e, atol=1e-4, what=f"float32 q, bf16 k: d{name}")

    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    sharp = dict(kw, temperature=0.05)
    want = naive(*(x.astype(jnp.float32) for x in bf16), mem, **sharp)
    got = focus_sparse_attention(*bf16, mem, impl="decomposed", block_size=block, **sharp)
    assert_close(got, want, atol=2e-2, what="bf16 at temperature 0.05")
    cotangent = jax.random.normal(jax.random.key(6), want.shape)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * cotangent)
    grads = jax.grad(loss(lambda *a: focus_sparse_attention(*a, mem, impl="decomposed", block_size=block, **sharp)),
                     argnums=(0, 1, 2))(*bf16)
    expected = jax.grad(loss(lambda *a: naive(*a, mem, **sharp)), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in bf16))
    for name, g, e in zip("qkv", grads, expected):
        scale = float(jnp.max(jnp.abs(e)))
        assert_close(g.astype(jnp.float32) / scale, e / scale, atol=3e-2, what=f"bf16 at t = 0.05: d{name}")


@pytest.mark.parametrize("dtypes", [("float32", "float32", "bfloat16"), ("bfloat16", "float32", "float32"),
                                    ("bfloat16", "bfloat16", "float32")])
def test_every_impl_returns_the_dtype_of_v(dtypes):
    """The decomposed path returned the promoted dtype (float32 for float32 q and k with bf16 v) where the
    reference and the Pallas kernel return v's, as the docstring says; code that switched impl got another dtype."""
    q, k, v, mem, kw, block = build_case("k2_T130_K5_block32")
    args = [x.astype(d) for x, d in zip((q, k, v), dtypes)]
    want = naive(*(x.astype(jnp.float32) for x in args), mem, **kw)
    for impl in ("reference", "decomposed", "pallas"):
        got = focus_sparse_attention(*args, mem, impl=impl, block_size=block, **kw)
        assert got.dtype == jnp.dtype(dtypes[2]), (impl, got.dtype)
        assert_close(got.astype(jnp.float32), want, atol=2e-2, what=f"{impl} {dtypes}")


def test_softcap_caps_the_logits():
    """The softcap case is not trivially uncapped: its output differs from the same attention without the cap."""
    q, k, v, mem, kw, block = build_case("softcap_k2_sharp")
    capped = sparse(q, k, v, mem, impl="decomposed", block_size=block, **kw)
    uncapped = sparse(q, k, v, mem, impl="decomposed", block_size=block, **{**kw, "softcap": None})
    assert float(jnp.max(jnp.abs(capped - uncapped))) > 1e-2


def test_64_bit_segment_ids_that_differ_above_bit_31_stay_apart():
    """With x64, int64 segment ids (e.g. hashed document ids) 7 and 7 + 2**32 are two documents for every impl (the
    decomposed path cast them to int32, which merged them)."""
    with jax.enable_x64(True):
        q, k, v = rand_qkv(30, 1, 8, 2, 2, 4)
        mem = jnp.asarray(make_membership(31, 1, 8, 2, 1))
        seg = jnp.array([[7] * 4 + [7 + 2 ** 32] * 4], jnp.int64)
        want = reference.focus_hard_attention(q, k, v, mem, window=1, segment_ids=seg)
        got = focus_sparse_attention(q, k, v, mem, window=1, segment_ids=seg, impl="decomposed", block_size=4)
        assert_close(got, want, what="decomposed, int64 segment ids")
        as_small_ids = focus_sparse_attention(q, k, v, mem, window=1, segment_ids=jnp.array([[0] * 4 + [1] * 4]),
                                              impl="decomposed", block_size=4)
        assert_close(got, as_small_ids, what="the same documents as ids 0, 1")
