"""Focus soft-gated attention (training form), against the naive reference and jax.nn.dot_product_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from focal_jax.attention import focus_attention, routing_scores, sinkhorn
from focal_jax.attention import reference

from helpers import assert_close, rand_qkv

pytestmark = pytest.mark.usefixtures("fast_compiles")


def rand_g(seed, b=2, t=40, k=4, sharpness=3.0):
    """Soft assignments: rows on the probability simplex."""
    return jax.nn.softmax(sharpness * jax.random.normal(jax.random.key(seed), (b, t, k)), axis=-1)


SEG = jnp.asarray([[0] * 25 + [1] * 15, [2] * 9 + [3] * 31], jnp.int32)

CASES = {
    "plain": dict(),
    "gqa_temp_array_segments": dict(hk=2, temp_array=True, segmented=True),
    "scalar_temp_scale_lam": dict(temperature=0.4, scale=0.5, lam=3.0),
    "sink_segments": dict(sink=3, segmented=True),
    "softcap": dict(softcap=1.5, temperature=0.5),
}


@pytest.mark.parametrize("gate", ["paper", "log"])
@pytest.mark.parametrize("case", list(CASES))
def test_soft_equals_reference(gate, case):
    cfg = CASES[case]
    q, k, v = rand_qkv(0, hk=cfg.get("hk"))
    g = rand_g(1)
    b, t, h, _ = q.shape
    if cfg.get("temp_array"):
        temperature = jax.random.uniform(jax.random.key(2), (b, t, h), minval=0.3, maxval=1.5)
    else:
        temperature = cfg.get("temperature", 1.0)
    kw = dict(window=5, gate=gate, lam=cfg.get("lam", 10.0), temperature=temperature, scale=cfg.get("scale"),
              segment_ids=SEG if cfg.get("segmented") else None, sink=cfg.get("sink", 0),
              softcap=cfg.get("softcap"))
    got = focus_attention(q, k, v, g, **kw)
    want = reference.focus_soft_attention(q, k, v, g, **kw)
    assert got.shape == q.shape
    assert_close(got, want)
    # the gate acts (so this test can fail): the soft form is not plain causal attention
    dense = reference.attention(q, k, v, temperature=temperature, scale=cfg.get("scale"),
                                segment_ids=kw["segment_ids"])
    assert float(jnp.max(jnp.abs(want - dense))) > 1e-2


def test_defaults_are_the_papers_window_gate_and_lambda():
    """DESIGN.md: by default the window is 128 and the gate the paper's Eq. 2 with lam = 10."""
    q, k, v = rand_qkv(4, b=1, t=160)
    g = rand_g(5, b=1, t=160)
    soft = lambda window, lam: reference.focus_soft_attention(q, k, v, g, window=window, gate="paper", lam=lam)
    assert_close(focus_attention(q, k, v, g), soft(128, 10.0))
    assert_close(focus_attention(q, k, v, g, window=5), soft(5, 10.0))
    # another window or lam changes the result here (so this test can fail)
    assert float(jnp.max(jnp.abs(soft(128, 10.0) - soft(64, 10.0)))) > 1e-2
    assert float(jnp.max(jnp.abs(soft(5, 10.0) - soft(5, 1.0)))) > 1e-2


@pytest.mark.parametrize("gate", ["paper", "log"])
def test_window_covering_sequence_is_dense_causal(gate):
    """All pairs local: nothing is gated, whatever g, so the result is dense causal attention."""
    q, k, v = rand_qkv(3, t=24)
    g = rand_g(4, t=24)
    for window in (23, 200):
        got = focus_attention(q, k, v, g, window=window, gate=gate, lam=10.0)
        assert_close(got, jax.nn.dot_product_attention(q, k, v, is_causal=True))
    got = focus_attention(q, k, v, g, window=23, gate=gate, temperature=0.4)
    assert_close(got, jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=1 / (0.4 * np.sqrt(8))))


@pytest.mark.parametrize("gate", ["paper", "log"])
def test_local_pairs_are_ungated(gate):
    """Queries i <= w see only local keys, so their outputs equal dense causal attention for any g."""
    q, k, v = rand_qkv(5)
    g = rand_g(6)
    w = 9
    got = focus_attention(q, k, v, g, window=w, gate=gate, lam=10.0)
    dense = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert_close(got[:, :w + 1], dense[:, :w + 1])
    assert float(jnp.max(jnp.abs(got[:, w + 1:] - dense[:, w + 1:]))) > 1e-2


def test_log_gate_limits_are_local_window_and_dense():
    """'log' gate, lam large: affinity 0 prunes distant pairs (local-window attention); affinity 1 keeps them."""
    t = 24
    q, k, v = rand_qkv(7, t=t)
    w = 4
    orthogonal = jnp.broadcast_to(jnp.eye(t), (2, t, t))          # K = T, a_ij = 0 for i != j
    got = focus_attention(q, k, v, orthogonal, window=w, gate="log", lam=1e4)
    assert_close(got, jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(w, 0)))
    same = jnp.zeros((2, t, 3)).at[:, :, 1].set(1.0)             # one group for everyone, a_ij = 1
    got = focus_attention(q, k, v, same, window=w, gate="log", lam=100.0)
    assert_close(got, jax.nn.dot_product_attention(q, k, v, is_causal=True))


def test_log_gate_limit_with_a_sink_is_the_window_plus_each_documents_first_tokens():
    """'log' gate, lam large, affinity 0: with a sink of 2 and two documents, each query sees its window and the
    first 2 tokens of its own document, ungated (jax.nn.dot_product_attention with that mask)."""
    t, w, sink = 24, 3, 2
    q, k, v = rand_qkv(9, t=t)
    seg = jnp.asarray([[0] * 10 + [1] * 14, [4] * 7 + [2] * 17], jnp.int32)
    orthogonal = jnp.broadcast_to(jnp.eye(t), (2, t, t))
    got = focus_attention(q, k, v, orthogonal, window=w, gate="log", lam=1e4, segment_ids=seg, sink=sink)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    starts = np.array([[0] * 10 + [10] * 14, [0] * 7 + [7] * 17])  # each token's document start
    first_tokens = (np.arange(t) - starts < sink)[:, None, :]  # key j among its document's first `sink` tokens
    same = np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :]
    mask = same & (j <= i) & ((i - j <= w) | first_tokens)
    want = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)[:, None], is_causal=True)
    assert_close(got, want)


def test_paper_gate_with_zero_affinity_halves_distant_logits():
    """Eq. 2 literally: a_ij = 0 gives sigmoid(0) = 1/2 on distant logits, written here as an explicit bias."""
    t = 24
    q, k, v = rand_qkv(8, t=t, b=1, h=1)
    w = 4
    orthogonal = jnp.eye(t)[None]
    got = focus_attention(q, k, v, orthogonal, window=w, gate="paper", lam=10.0)
    scale = 1 / np.sqrt(q.shape[-1])
    logits = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    distant = jnp.asarray((i - j > w)[None, None])
    bias = jnp.where(distant, -0.5 * logits, 0.0)                 # logit + bias = logit / 2 on distant pairs
    want = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True, scale=scale)
    assert_close(got, want)


@pytest.mark.parametrize("gate", ["paper", "log"])
def test_gradients_through_routing_sinkhorn_and_gate(gate):
    """check_grads (reverse mode) through routing_scores -> sinkhorn -> focus_attention w.r.t. centroids and W_g."""
    b, t, h, d, d_model, d_g, n_groups = 1, 12, 2, 4, 6, 4, 3
    keys = jax.random.split(jax.random.key(9), 6)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k = jax.random.normal(keys[1], (b, t, h, d))
    v = jax.random.normal(keys[2], (b, t, h, d))
    x = jax.random.normal(keys[3], (b, t, d_model))
    w_g = jax.random.normal(keys[4], (d_model, d_g)) / np.sqrt(d_model)
    centroids = jax.random.normal(keys[5], (n_groups, d_g))

    def f(centroids, w_g):
        g = sinkhorn(routing_scores(x, w_g, centroids, tau=0.5), n_iters=10)
        return focus_attention(q, k, v, g, window=2, gate=gate, lam=4.0)

    check_grads(f, (centroids, w_g), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3)
    # the gradient really flows to both (check_grads would also pass for a function that ignores them)
    cot = jax.random.normal(jax.random.key(10), q.shape)
    gc, gw = jax.grad(lambda c, w: jnp.sum(f(c, w) * cot), argnums=(0, 1))(centroids, w_g)
    assert float(jnp.linalg.norm(gc)) > 1e-3 and float(jnp.linalg.norm(gw)) > 1e-3
    assert bool(jnp.all(jnp.isfinite(gc))) and bool(jnp.all(jnp.isfinite(gw)))


def test_zero_rows_keep_the_routing_gradient_finite():
    """A zero hidden state (a padding embedding) or an unused zero centroid scores 0 and, through the norm's
    gradient at zero, used to fill the whole gradient of W_g and the centroids with NaN."""
    keys = jax.random.split(jax.random.key(11), 3)
    x = jax.random.normal(keys[0], (1, 6, 5)).at[0, 2].set(0.0)
    w_g = jax.random.normal(keys[1], (5, 4))
    centroids = jax.random.normal(keys[2], (3, 4)).at[1].set(0.0)
    cot = jax.random.normal(jax.random.key(12), (1, 6, 3))

    def loss(w_g, centroids):
        return jnp.sum(routing_scores(x, w_g, centroids, tau=0.5) * cot)

    gw, gc = jax.grad(loss, argnums=(0, 1))(w_g, centroids)
    assert bool(jnp.all(jnp.isfinite(gw))) and bool(jnp.all(jnp.isfinite(gc)))
    # the zero rows score 0 and add nothing: the gradient of W_g is the reference's without them
    rows, groups = np.array([0, 1, 3, 4, 5]), np.array([0, 2])
    want = jax.grad(lambda w: jnp.sum(reference.routing_scores(x[:, rows], w, centroids[groups], tau=0.5)
                                      * cot[:, rows][:, :, groups]))(w_g)
    assert_close(gw, want, atol=1e-5)
    assert_close(gc[groups], jax.grad(lambda c: jnp.sum(reference.routing_scores(x[:, rows], w_g, c, tau=0.5)
                                                        * cot[:, rows][:, :, groups]))(centroids[groups]), atol=1e-5)
