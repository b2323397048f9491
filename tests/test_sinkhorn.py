"""Routing scores and Sinkhorn balancing, against the numpy float64 loop reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focal_jax.attention import routing_scores, sinkhorn
from focal_jax.attention import reference

from helpers import assert_close


def rand_router(seed, b=2, t=256, d=32, d_g=16, k=8):
    kh, kw, kc = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (b, t, d), jnp.float32)
    w_g = jax.random.normal(kw, (d, d_g), jnp.float32) / np.sqrt(d)
    c = jax.random.normal(kc, (k, d_g), jnp.float32)
    return h, w_g, c


def rand_scores(seed, b=2, t=24, k=4, spread=2.0):
    return spread * jax.random.normal(jax.random.key(seed), (b, t, k), jnp.float32)


# ------------------------------------------------------------------------------------------------------------
# routing_scores
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [True, False])
def test_routing_scores_match_reference(normalize):
    h, w_g, c = rand_router(0, t=20)
    got = routing_scores(h, w_g, c, tau=0.1, normalize=normalize)
    want = reference.routing_scores(h, w_g, c, tau=0.1, normalize=normalize)
    assert got.shape == (2, 20, 8)
    assert_close(got, want, atol=1e-4 if normalize else 1e-3)
    # a different tau only rescales
    assert_close(routing_scores(h, w_g, c, tau=0.5, normalize=normalize), want * 0.2,
                 atol=1e-4 if normalize else 1e-3)


def test_routing_scores_cosine_is_scale_free_and_bounded():
    h, w_g, c = rand_router(1, t=20)
    got = routing_scores(h, w_g, c, tau=0.1)
    assert float(jnp.max(jnp.abs(got))) <= 10.0 + 1e-4
    assert_close(routing_scores(3.0 * h, w_g, 0.5 * c, tau=0.1), got, atol=1e-4)
    # the raw dot product is not scale free
    raw = routing_scores(h, w_g, c, tau=0.1, normalize=False)
    assert float(jnp.max(jnp.abs(routing_scores(3.0 * h, w_g, c, tau=0.1, normalize=False) - 3.0 * raw))) < 1e-3
    assert float(jnp.max(jnp.abs(raw - got))) > 1.0


def test_routing_scores_shapes_gpt2_router():
    """GPT-2 124M router (d_model 768, d_g 16, K 4): [B, T, d] x [d, d_g] x [K, d_g] -> [B, T, K]."""
    h = jnp.ones((1, 5, 768))
    w_g = jnp.zeros((768, 16)).at[0, 0].set(1.0)
    c = jnp.eye(4, 16)
    s = routing_scores(h, w_g, c)
    assert s.shape == (1, 5, 4) and s.dtype == jnp.float32
    # h @ w_g = e_0, so the cosine with c_0 = e_0 is 1 and with the others 0
    assert_close(s, jnp.broadcast_to(jnp.array([10.0, 0.0, 0.0, 0.0]), (1, 5, 4)), atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# sinkhorn against the numpy reference
# ------------------------------------------------------------------------------------------------------------

SEG = np.array([[0] * 10 + [1] * 9 + [2] * 5, [4] * 24], np.int32)
VALID = np.array([[True] * 20 + [False] * 4, [True] * 5 + [False] * 2 + [True] * 15 + [False] * 2])


@pytest.mark.parametrize("segmented,padded,causal", [
    (False, False, False), (True, True, False), (False, False, True), (True, True, True)])
def test_sinkhorn_matches_reference(segmented, padded, causal):
    scores = rand_scores(2)
    seg = jnp.asarray(SEG) if segmented else None
    valid = jnp.asarray(VALID) if padded else None
    got = sinkhorn(scores, segment_ids=seg, valid=valid, causal=causal)
    want = reference.sinkhorn(scores, segment_ids=seg, valid=valid, causal=causal)
    assert got.dtype == jnp.float32 and got.shape == scores.shape
    rows = np.ones(VALID.shape, bool) if valid is None else VALID
    assert_close(np.asarray(got)[rows], want[rows])


def test_matches_the_papers_plain_domain_algorithm():
    """Focus Sec. 2 literally: Q = exp(S); N times: Q /= column sums; Q /= row sums (numpy float64, per row)."""
    scores = rand_scores(14, spread=2.0)
    got = np.asarray(sinkhorn(scores, n_iters=10))
    for bb in range(scores.shape[0]):
        q = np.exp(np.asarray(scores[bb], np.float64) - float(np.max(scores[bb])))
        for _ in range(10):
            q = q / q.sum(axis=0, keepdims=True)
            q = q / q.sum(axis=1, keepdims=True)
        assert_close(got[bb], q)


@pytest.mark.parametrize("causal", [False, True])
def test_scanned_iterations_give_the_same_values_and_gradients(causal):
    """`unroll=False` (the iterations as a `lax.scan`) against the default unrolled program, packed and padded
    rows."""
    scores, seg, valid = rand_scores(5), jnp.asarray(SEG), jnp.asarray(VALID)
    weights = jnp.arange(1.0, 5.0)

    def loss(unroll):
        return jax.jit(jax.value_and_grad(lambda s: jnp.sum(sinkhorn(s, segment_ids=seg, valid=valid, causal=causal,
                                                                     unroll=unroll) * weights)))

    (scanned, d_scanned), (unrolled, d_unrolled) = loss(False)(scores), loss(True)(scores)
    assert_close(unrolled, scanned, atol=1e-4)
    assert_close(d_unrolled, d_scanned, atol=1e-5)
    assert float(jnp.max(jnp.abs(d_scanned))) > 0.1  # a gradient to compare


@pytest.mark.parametrize("n_iters", [1, 3, np.int64(3)])  # a numpy integer, as read from a config array
def test_sinkhorn_n_iters_matches_reference(n_iters):
    scores = rand_scores(3, spread=4.0)
    assert_close(sinkhorn(scores, n_iters=n_iters), reference.sinkhorn(scores, n_iters=n_iters))


def test_rows_sum_to_one_and_columns_balance():
    h, w_g, c = rand_router(4)
    scores = reference.routing_scores(h, w_g, c, tau=0.1)
    g = sinkhorn(scores, n_iters=10)
    t, k = scores.shape[1], scores.shape[2]
    assert float(jnp.max(jnp.abs(jnp.sum(g, -1) - 1.0))) < 1e-5
    cols = np.asarray(jnp.sum(g, axis=1))
    assert np.all(np.abs(cols - t / k) < 0.1 * t / k), cols
    # the raw scores are far from balanced (so the check above can fail)
    raw = np.asarray(jnp.sum(jax.nn.softmax(scores, -1), axis=1))
    assert np.max(np.abs(raw - t / k)) > 0.1 * t / k
    assert_close(g, reference.sinkhorn(scores, n_iters=10))


def test_extreme_scores_stay_finite():
    signs = jax.random.rademacher(jax.random.key(5), (2, 32, 4)).astype(jnp.float32)
    for scale in (1e4, -1e4):
        g = sinkhorn(scale * signs)
        assert bool(jnp.all(jnp.isfinite(g)))
        assert float(jnp.max(jnp.abs(jnp.sum(g, -1) - 1.0))) < 1e-5
        # log-domain values near 1e4 carry float32 rounding of ~1e-3 (ulp(1e4) = 1e-3): a looser tolerance
        assert_close(g, reference.sinkhorn(scale * signs), atol=2e-3)
    g = sinkhorn(jnp.full((1, 8, 3), 1e4).at[0, 0, 0].set(-1e4), causal=True)
    assert bool(jnp.all(jnp.isfinite(g)))


def test_bf16_input_computes_in_float32():
    scores = rand_scores(6, t=64, k=8, spread=5.0).astype(jnp.bfloat16)
    g = sinkhorn(scores)
    assert g.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(g)))
    assert float(jnp.max(jnp.abs(jnp.sum(g, -1) - 1.0))) < 1e-5
    assert_close(g, reference.sinkhorn(scores), atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_are_assigned_as_if_alone(causal):
    scores = rand_scores(7, b=1, t=40, k=4)
    seg = jnp.asarray([[0] * 23 + [1] * 17], jnp.int32)
    packed = sinkhorn(scores, segment_ids=seg, causal=causal)
    alone1 = sinkhorn(scores[:, :23], causal=causal)
    alone2 = sinkhorn(scores[:, 23:], causal=causal)
    assert_close(packed[:, :23], alone1)
    assert_close(packed[:, 23:], alone2)
    # without segment ids they are not (so this test can fail)
    mixed = sinkhorn(scores, causal=causal)
    assert float(jnp.max(jnp.abs(mixed[:, 23:] - alone2))) > 1e-3


@pytest.mark.parametrize("i", [0, 11, 30])
def test_causal_sinkhorn_ignores_the_future(i):
    scores = rand_scores(8, b=2, t=32, k=4)
    noise = 5.0 * jax.random.normal(jax.random.key(9), scores.shape)
    future = jnp.arange(scores.shape[1])[None, :, None] > i
    changed = jnp.where(future, scores + noise, scores)
    g, g2 = sinkhorn(scores, causal=True), sinkhorn(changed, causal=True)
    assert_close(g[:, :i + 1], g2[:, :i + 1], atol=1e-6)
    # the paper's (non-causal) Sinkhorn does see the future: documents the leak
    f, f2 = sinkhorn(scores), sinkhorn(changed)
    assert float(jnp.max(jnp.abs(f[:, :i + 1] - f2[:, :i + 1]))) > 1e-3
    # the causal assignment of a prefix is the causal assignment of the prefix run alone
    assert_close(sinkhorn(scores[:, :i + 1], causal=True), g[:, :i + 1])


@pytest.mark.parametrize("causal", [False, True])
def test_padding_does_not_affect_valid_tokens(causal):
    scores = rand_scores(10, b=2, t=24, k=4)
    valid = jnp.asarray(VALID)
    g = sinkhorn(scores, valid=valid, causal=causal)
    junk = jnp.where(valid[..., None], scores, 1e3 * jax.random.normal(jax.random.key(11), scores.shape))
    g2 = sinkhorn(junk, valid=valid, causal=causal)
    assert_close(np.asarray(g)[VALID], np.asarray(g2)[VALID])
    assert bool(jnp.all(jnp.isfinite(g2)))
    # trailing padding: the valid prefix of row 0 is assigned as if the padding did not exist
    assert_close(g[:1, :20], sinkhorn(scores[:1, :20], causal=causal))
    # and without the valid mask the padding would matter
    g3 = sinkhorn(junk, causal=causal)
    assert float(np.max(np.abs(np.asarray(g3)[VALID] - np.asarray(g)[VALID]))) > 1e-3


def test_single_group_is_all_ones():
    g = sinkhorn(rand_scores(12, k=1))
    assert_close(g, jnp.ones_like(g))


def test_jit_matches_reference():
    scores = rand_scores(13)
    seg, valid = jnp.asarray(SEG), jnp.asarray(VALID)
    jitted = jax.jit(sinkhorn, static_argnames=("n_iters", "causal"))
    got = jitted(scores, segment_ids=seg, valid=valid, causal=True)
    want = reference.sinkhorn(scores, segment_ids=seg, valid=valid, causal=True)
    assert_close(np.asarray(got)[VALID], want[VALID])


# ------------------------------------------------------------------------------------------------------------
# Left padding and padding-only segments.
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_left_padding_rows_stay_finite_and_normalised(causal):
    """Padding before every valid token (left-padded batches): with causal=True no valid token precedes it, so its
    column sums are empty. Its own row is still normalised (finite, summing to 1), no gradient is NaN, and the
    valid tokens are assigned as if the padding did not exist (the numpy reference on the valid suffix)."""
    scores = rand_scores(20, b=1, t=16, k=4)
    valid = jnp.asarray([[False] * 4 + [True] * 12])
    g = sinkhorn(scores, valid=valid, causal=causal)
    assert bool(jnp.all(jnp.isfinite(g)))
    assert float(jnp.max(jnp.abs(jnp.sum(g, -1) - 1.0))) < 1e-5
    assert_close(g[:, 4:], reference.sinkhorn(scores[:, 4:], causal=causal))
    grad = jax.grad(lambda s: jnp.sum(sinkhorn(s, valid=valid, causal=causal) * jnp.arange(1.0, 5.0)))(scores)
    assert bool(jnp.all(jnp.isfinite(grad)))


@pytest.mark.parametrize("causal", [False, True])
def test_padding_in_a_segment_of_its_own(causal):
    """Packed rows often give the padding a segment id of its own (e.g. 0): that segment has no valid token, so
    every one of its column sums is empty. The valid tokens match the reference, and values and gradients are
    finite."""
    scores = rand_scores(21, b=1, t=20, k=4)
    seg = jnp.asarray([[1] * 8 + [2] * 7 + [0] * 5], jnp.int32)
    valid = jnp.asarray([[True] * 15 + [False] * 5])
    loss = lambda s: jnp.sum(sinkhorn(s, segment_ids=seg, valid=valid, causal=causal) * jnp.arange(1.0, 5.0))
    g = sinkhorn(scores, segment_ids=seg, valid=valid, causal=causal)
    assert bool(jnp.all(jnp.isfinite(g)))
    assert_close(np.asarray(g)[:, :15], reference.sinkhorn(scores, segment_ids=seg, valid=valid,
                                                            causal=causal)[:, :15])
    grad = jax.grad(loss)(scores)
    assert bool(jnp.all(jnp.isfinite(grad)))
    assert float(jnp.max(jnp.abs(grad[:, :15]))) > 1e-3


# ------------------------------------------------------------------------------------------------------------
# A token alone in its column sums: exactly uniform.
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k", [3, 4, 8])
def test_a_token_alone_in_its_columns_is_exactly_uniform(causal, k):
    """With causal=True the first valid token of each segment, with causal=False a segment of one valid token, is
    alone in its column sums: its row is uniform whatever its scores. Rounding used to leave it a few ulps off
    (0.24999997 beside 0.25 under jit), so its hard top-1 group changed with the compilation, and greedy decoding
    with causal hard Focus differed from the full forward. It is exactly 1/K, eager, jitted and scanned, with a
    zero gradient, and its top-k groups are the lowest indices; the other tokens are unchanged."""
    from focal_jax.attention import topk_membership
    t = 12
    scores = rand_scores(30 + k, b=2, t=t, k=k)
    if causal:  # first valid tokens at 0, 5 (a new segment) and 9 (after padding at 8, row 1)
        seg = jnp.asarray([[1] * 5 + [2] * 7, [1] * 5 + [2] * 3 + [3] * 4], jnp.int32)
        valid = jnp.asarray([[True] * t, [True] * 8 + [False] + [True] * 3])
        alone = [(0, 0), (0, 5), (1, 0), (1, 5), (1, 9)]
    else:  # one-token segments at 4, and at 11 beside padding of its own segment at 10 (row 1)
        seg = jnp.asarray([[1] * 4 + [2] + [3] * 7, [1] * 4 + [2] + [3] * 5 + [4] * 2], jnp.int32)
        valid = jnp.asarray([[True] * t, [True] * 10 + [False, True]])
        alone = [(0, 4), (1, 4), (1, 11)]
    forms = {"eager": lambda s: sinkhorn(s, segment_ids=seg, valid=valid, causal=causal),
             "jit": jax.jit(lambda s: sinkhorn(s, segment_ids=seg, valid=valid, causal=causal)),
             "scan": jax.jit(lambda s: sinkhorn(s, segment_ids=seg, valid=valid, causal=causal, unroll=False))}
    rows, cols = (np.array(x) for x in zip(*alone))
    for name, fn in forms.items():
        g = np.asarray(fn(scores))
        np.testing.assert_array_equal(g[rows, cols], np.full((len(alone), k), np.float32(1.0 / k)), err_msg=name)
        membership = np.asarray(topk_membership(jnp.asarray(g), 2))
        np.testing.assert_array_equal(membership[rows, cols], np.tile(np.arange(k) < 2, (len(alone), 1)), err_msg=name)
        others = np.asarray(valid).copy()
        others[rows, cols] = False
        assert_close(g[others], reference.sinkhorn(scores, segment_ids=seg, valid=valid, causal=causal)[others],
                     what=name)
    grad = jax.grad(lambda s: jnp.sum(forms["jit"](s)[rows, cols] * jnp.arange(1.0, k + 1.0)))(scores)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)  # their rows depend on no score
