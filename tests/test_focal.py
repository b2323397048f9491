"""Focal attention (constant and per-query temperature) and the learned temperature.

Ground truth: jax.nn.dot_product_attention and focal_jax.attention.reference (naive, independent code).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focal_jax.attention import dot_product_attention, focal_attention, learned_temperature
from focal_jax.attention import reference
from focal_jax.attention.focal import einsum_f32

from helpers import assert_close, rand_qkv



def segment_mask(segment_ids):
    """[B, 1, T, T] bool mask for jax.nn.dot_product_attention: equal segment ids only."""
    seg = jnp.asarray(segment_ids)
    return (seg[:, :, None] == seg[:, None, :])[:, None]


# ------------------------------------------------------------------------------------------------------------
# Constant temperature.
# ------------------------------------------------------------------------------------------------------------

def test_temperature_one_equals_jax_dense():
    q, k, v = rand_qkv(0)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert_close(focal_attention(q, k, v, temperature=1.0), want)
    assert_close(dot_product_attention(q, k, v), want)
    assert_close(reference.attention(q, k, v), want)


def test_temperature_one_is_bitwise_dot_product_attention():
    q, k, v = rand_qkv(1)
    np.testing.assert_array_equal(np.asarray(focal_attention(q, k, v, temperature=1.0)),
                                  np.asarray(dot_product_attention(q, k, v)))


def test_non_causal_equals_jax_dense():
    q, k, v = rand_qkv(2, t=24)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=False)
    assert_close(focal_attention(q, k, v, causal=False), want)
    assert_close(dot_product_attention(q, k, v, causal=False), want)


@pytest.mark.parametrize("t_focal", [0.4, 2.5])
def test_temperature_equals_jax_with_folded_scale(t_focal):
    q, k, v = rand_qkv(3)
    d = q.shape[-1]
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=1.0 / (t_focal * np.sqrt(d)))
    got = focal_attention(q, k, v, temperature=t_focal)
    assert_close(got, want)
    # sharpening really changes the output (so this test can fail)
    assert float(jnp.max(jnp.abs(got - jax.nn.dot_product_attention(q, k, v, is_causal=True)))) > 1e-2


def test_explicit_scale_and_temperature_multiply():
    q, k, v = rand_qkv(4)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=0.3 / 0.6)
    assert_close(focal_attention(q, k, v, temperature=0.6, scale=0.3), want)


@pytest.mark.parametrize("window", [0, 5, 39, 100])
def test_window_equals_jax_local_window(window):
    q, k, v = rand_qkv(5)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window, 0))
    assert_close(dot_product_attention(q, k, v, window=window), want)
    want_t = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window, 0),
                                          scale=1.0 / (0.4 * np.sqrt(q.shape[-1])))
    assert_close(focal_attention(q, k, v, temperature=0.4, window=window), want_t)
    assert_close(reference.attention(q, k, v, window=window), want)


def test_window_zero_attends_to_self_only():
    q, k, v = rand_qkv(6)
    assert_close(dot_product_attention(q, k, v, window=0), v)


SEGMENTS = np.array([[0] * 25 + [1] * 15, [3] * 7 + [5] * 20 + [9] * 13], np.int32)


def test_segments_equal_reference_and_jax_masked():
    q, k, v = rand_qkv(7)
    seg = jnp.asarray(SEGMENTS)
    got = focal_attention(q, k, v, temperature=0.5, segment_ids=seg)
    assert_close(got, reference.attention(q, k, v, temperature=0.5, segment_ids=seg))
    want = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(seg), is_causal=True,
                                        scale=1.0 / (0.5 * np.sqrt(q.shape[-1])))
    assert_close(got, want)
    # with a window as well
    got_w = dot_product_attention(q, k, v, window=4, segment_ids=seg)
    want_w = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(seg), is_causal=True,
                                          local_window_size=(4, 0))
    assert_close(got_w, want_w)


def test_segments_block_cross_document_attention():
    q, k, v = rand_qkv(8, b=1)
    seg = jnp.asarray(SEGMENTS[:1])
    doc1 = slice(0, 25)
    doc2 = slice(25, 40)
    out = dot_product_attention(q, k, v, segment_ids=seg)
    key = jax.random.key(99)
    q2 = q.at[:, doc2].set(jax.random.normal(key, q[:, doc2].shape))
    k2 = k.at[:, doc2].set(jax.random.normal(jax.random.fold_in(key, 1), k[:, doc2].shape))
    v2 = v.at[:, doc2].set(jax.random.normal(jax.random.fold_in(key, 2), v[:, doc2].shape))
    out2 = dot_product_attention(q2, k2, v2, segment_ids=seg)
    np.testing.assert_array_equal(np.asarray(out[:, doc1]), np.asarray(out2[:, doc1]))
    assert float(jnp.max(jnp.abs(out[:, doc2] - out2[:, doc2]))) > 1e-2
    # doc 2 attends as if it were alone: its first token sees only itself
    assert_close(out[:, 25], v[:, 25])
    # the reverse direction (the one plain causal attention would leak): perturbing doc 1 must not move doc 2
    q3 = q.at[:, doc1].multiply(-1.0)
    v3 = v.at[:, doc1].add(1.0)
    out3 = dot_product_attention(q3, k, v3, segment_ids=seg)
    np.testing.assert_array_equal(np.asarray(out[:, doc2]), np.asarray(out3[:, doc2]))
    out3_noseg = dot_product_attention(q3, k, v3)
    out_noseg = dot_product_attention(q, k, v)
    assert float(jnp.max(jnp.abs(out3_noseg[:, doc2] - out_noseg[:, doc2]))) > 1e-2


@pytest.mark.parametrize("hk", [1, 2])
def test_gqa_equals_jax_and_reference(hk):
    q, k, v = rand_qkv(9, h=4, hk=hk)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=1.0 / (0.4 * np.sqrt(q.shape[-1])))
    got = focal_attention(q, k, v, temperature=0.4)
    assert_close(got, want)
    assert_close(reference.attention(q, k, v, temperature=0.4), want)
    # equals MHA with the kv heads repeated in order: query head h uses kv head h // (H // Hk)
    rep = 4 // hk
    assert_close(got, focal_attention(q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2), temperature=0.4))
    # a value head_dim different from the query/key head_dim (jax.nn does not allow it): reference only
    q, k, v = rand_qkv(9, h=4, hk=hk, dv=6)
    got = focal_attention(q, k, v, temperature=0.4)
    assert got.shape == (2, 40, 4, 6)
    assert_close(got, reference.attention(q, k, v, temperature=0.4))


def test_per_query_temperature_equals_reference():
    q, k, v = rand_qkv(10, h=4, hk=2)
    b, t, h, _ = q.shape
    temp = jax.random.uniform(jax.random.key(11), (b, t, h), minval=0.3, maxval=2.0)
    got = focal_attention(q, k, v, temperature=temp)
    assert_close(got, reference.attention(q, k, v, temperature=temp))
    # a constant array equals the scalar
    assert_close(focal_attention(q, k, v, temperature=jnp.full((b, t, h), 0.4)),
                 focal_attention(q, k, v, temperature=0.4))
    # broadcastable [B, T, 1] (learned tau shared by heads) with scale=1
    tau = jax.random.uniform(jax.random.key(12), (b, t), minval=2.0, maxval=4.0)
    got = focal_attention(q, k, v, scale=1.0, temperature=tau[:, :, None], segment_ids=jnp.asarray(SEGMENTS))
    want = reference.attention(q, k, v, scale=1.0, temperature=tau[:, :, None], segment_ids=jnp.asarray(SEGMENTS))
    assert_close(got, want)
    # and the row-wise check against jax.nn: query i with tau_i equals dense attention at scale 1/tau_i
    i = 17
    want_i = jax.nn.dot_product_attention(q[:1], k[:1], v[:1], is_causal=True, scale=float(1.0 / tau[0, i]),
                                          mask=segment_mask(SEGMENTS[:1]))[:, i]
    assert_close(got[:1, i], want_i)


@pytest.mark.parametrize("segmented", [False, True])
def test_softcap_equals_reference(segmented):
    q, k, v = rand_qkv(21, hk=2)
    seg = jnp.asarray([[0] * 25 + [1] * 15, [2] * 9 + [3] * 31], jnp.int32) if segmented else None
    kw = dict(temperature=0.4, window=11, segment_ids=seg)
    got = focal_attention(q, k, v, softcap=2.0, **kw)
    assert_close(got, reference.attention(q, k, v, softcap=2.0, **kw))
    assert float(jnp.max(jnp.abs(got - reference.attention(q, k, v, **kw)))) > 1e-2  # the cap acts


def test_per_query_temperature_costs_no_extra_logits_in_the_backward():
    """A per-query temperature scales q, so its gradient does not keep another float32 `[B, H, T, S]` array: the
    compiled gradient's temporary memory stays within a quarter of one such array of the constant temperature's."""
    b, t, h, d = 2, 512, 4, 32
    q = jnp.ones((b, t, h, d), jnp.bfloat16)

    def temporary_bytes(fn, *args):
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(range(len(args)))))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    constant = temporary_bytes(lambda q, k, v: focal_attention(q, k, v, temperature=0.5), q, q, q)
    per_query = temporary_bytes(lambda q, k, v, tau: focal_attention(q, k, v, scale=1.0, temperature=tau), q, q, q,
                                jnp.full((b, t, 1), 0.5))
    assert per_query < constant + b * h * t * t * 4 / 4


def test_bf16_inputs_follow_float32_reference():
    q, k, v = rand_qkv(13)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = focal_attention(qb, kb, vb, temperature=0.4)
    assert got.shape == q.shape
    want = reference.attention(qb, kb, vb, temperature=0.4)
    assert_close(got.astype(jnp.float32), want, atol=2e-2)
    scale = 1.0 / (0.4 * np.sqrt(q.shape[-1]))
    outside = jax.nn.dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, implementation="xla")
    assert got.dtype == outside.dtype == jnp.bfloat16
    assert_close(got.astype(jnp.float32), outside.astype(jnp.float32), atol=1e-2)


@pytest.mark.parametrize("impl", ["focal", "reference", "decomposed", "pallas"])
def test_a_concrete_0d_temperature_is_a_number(impl):
    """`temperature=jnp.float32(0.05)` was broadcast to a per-query array and folded into bf16 q: 0.12 off the
    float32 inputs' result where the float 0.05 is 0.012 off (`focal_attention`; 0.09 vs 0.012 reference, 0.09 vs
    0.008 decomposed; B = 2, T = 64, H = 4, D = 32). A concrete 0-d array (jax or numpy) is now the number it holds,
    bit for bit; a traced one still takes the per-query path, and differentiates. The pallas kernels multiply the
    float32 scores by either, so there the two paths agree bit for bit."""
    from focal_jax.attention import focus_sparse_attention, topk_membership
    q, k, v = (x.astype(jnp.bfloat16) for x in rand_qkv(21, 2, 64, 4, 4, 32))
    membership = topk_membership(jax.random.normal(jax.random.key(22), (2, 64, 4)), 1)
    attend = ((lambda t: focal_attention(q, k, v, temperature=t)) if impl == "focal" else
              lambda t: focus_sparse_attention(q, k, v, membership, window=4, temperature=t, impl=impl, block_size=16))
    number = attend(0.05)
    for zero_d in (jnp.float32(0.05), jnp.asarray(0.05, jnp.bfloat16).astype(jnp.float32), np.array(0.05)):
        np.testing.assert_array_equal(attend(zero_d), attend(float(zero_d)))
    np.testing.assert_array_equal(attend(jnp.float32(0.05)), number)
    folded = attend(jnp.full((2, 64, 1), 0.05))  # the per-query path, as before
    assert np.array_equal(folded, number) == (impl == "pallas")
    traced = jax.jit(attend)(jnp.float32(0.05))
    np.testing.assert_array_equal(traced, folded)
    if impl != "pallas":  # (interpret-mode kernels: slow to differentiate here; test_kernels covers them)
        grad = jax.grad(lambda t: jnp.sum(attend(t).astype(jnp.float32)))(jnp.float32(0.05))
        assert np.isfinite(grad) and grad != 0


def test_bf16_products_run_in_16_bits():
    """With bf16 inputs both forward products take bf16 operands, and so do the backward's four: the two with v and
    the output's cotangent, and dq and dk, whose float32 softmax gradient is rounded to bf16 first (`einsum_f32`;
    jax.nn's XLA path runs those two with a float32 operand)."""
    from focal_jax.bench import matmul_flops

    q, k, v = (x.astype(jnp.bfloat16) for x in rand_qkv(15, hk=2))
    forward = lambda q, k, v: focal_attention(q, k, v, temperature=0.4)
    total, low = matmul_flops(forward, q, k, v)
    assert low == total > 0
    total, low = matmul_flops(jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2)),
                              q, k, v)
    assert low == total > 0


def test_einsum_f32_rounds_only_bf16_cotangents():
    """float32 and float16 inputs: exactly `jnp.einsum` and its gradients. bf16 inputs: a float32 result equal to
    the float32 product of the same values, and gradients within bf16 rounding of it, in bf16."""
    a, b = jax.random.normal(jax.random.key(0), (3, 5, 8)), jax.random.normal(jax.random.key(1), (6, 8))
    cotangent = jax.random.normal(jax.random.key(2), (3, 5, 6))
    spec = "btd,vd->btv"
    loss = lambda fn: lambda a, b: jnp.sum(fn(spec, a, b) * cotangent)
    plain = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    for dtype in (jnp.float32, jnp.float16):
        args = (a.astype(dtype), b.astype(dtype))
        assert jnp.array_equal(einsum_f32(spec, *args), plain(spec, *args))
        for got, want in zip(jax.grad(loss(einsum_f32), (0, 1))(*args), jax.grad(loss(plain), (0, 1))(*args)):
            assert jnp.array_equal(got, want)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    out = einsum_f32(spec, a16, b16)
    assert out.dtype == jnp.float32
    assert_close(out, plain(spec, a16.astype(jnp.float32), b16.astype(jnp.float32)), atol=1e-5, what="bf16 product")
    want = jax.grad(loss(plain), (0, 1))(a16.astype(jnp.float32), b16.astype(jnp.float32))
    for name, got, expected in zip("ab", jax.grad(loss(einsum_f32), (0, 1))(a16, b16), want):
        assert got.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(expected)))
        assert_close(got.astype(jnp.float32) / scale, expected / scale, atol=1e-2, what=f"d{name}")


@pytest.mark.parametrize("segmented", [False, True])
def test_bf16_gradients_follow_float32_reference(segmented):
    """The 16-bit value product (probabilities cast to bf16, as jax.nn's XLA path) keeps the gradients within bf16
    rounding of the float32 reference's."""
    q, k, v = rand_qkv(14, hk=2)
    seg = jnp.asarray([[0] * 25 + [1] * 15, [2] * 9 + [3] * 31], jnp.int32) if segmented else None
    cotangent = jax.random.normal(jax.random.key(3), q.shape[:3] + v.shape[-1:])
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cotangent)
    ours = jax.grad(loss(lambda q, k, v: focal_attention(q, k, v, temperature=0.4, window=11, segment_ids=seg)),
                    argnums=(0, 1, 2))(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    want = jax.grad(loss(lambda q, k, v: reference.attention(q, k, v, temperature=0.4, window=11, segment_ids=seg)),
                    argnums=(0, 1, 2))(q, k, v)
    for name, got, expected in zip("qkv", ours, want):
        assert got.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(expected)))
        assert_close(got.astype(jnp.float32) / scale, expected / scale, atol=3e-2, what=f"d{name}")


# ------------------------------------------------------------------------------------------------------------
# Learned temperature.
# ------------------------------------------------------------------------------------------------------------

def rand_x(seed, b=2, t=40, d=16, w_scale=0.3):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (b, t, d), jnp.float32)
    w = w_scale * jax.random.normal(kw, (d,), jnp.float32)
    return x, w


TAU_RANGE = dict(tau_min=1.0, tau_max=14.0)


@pytest.mark.parametrize("mode", ["prefix", "sequence"])
@pytest.mark.parametrize("segmented", [False, True])
@pytest.mark.parametrize("clip", ["hard", "straight_through"])
def test_learned_temperature_matches_reference(mode, segmented, clip):
    x, w = rand_x(20, w_scale=1.5)   # large enough that some tau hit both clip bounds
    seg = jnp.asarray(SEGMENTS) if segmented else None
    got = learned_temperature(x, w, tau_min=5.0, tau_max=10.0, mode=mode, clip=clip, bias=7.5, segment_ids=seg)
    want = reference.learned_temperature(x, w, tau_min=5.0, tau_max=10.0, mode=mode, bias=7.5, segment_ids=seg)
    assert got.shape == x.shape[:2]
    assert_close(got, want)
    if mode == "prefix":  # the reference itself exercises both bounds and the interior here
        assert np.any(want == 5.0) and np.any(want == 10.0) and np.any((want > 5.0) & (want < 10.0))


@pytest.mark.parametrize("mode", ["prefix", "sequence", "token"])
@pytest.mark.parametrize("segmented", [False, True])
def test_per_head_and_per_token_temperatures_match_reference(mode, segmented):
    """FOCAL_SPEC OQ-F1 (`w_tau [d_model, H]`, one tau per head, `bias [H]`) and OQ-F2's 'token' mode (no mean)."""
    x, _ = rand_x(21)
    w = 1.5 * jax.random.normal(jax.random.key(5), (x.shape[-1], 3), jnp.float32)
    bias = jnp.array([7.5, 6.0, 9.0])
    seg = jnp.asarray(SEGMENTS) if segmented else None
    got = learned_temperature(x, w, tau_min=5.0, tau_max=10.0, mode=mode, bias=bias, segment_ids=seg)
    want = reference.learned_temperature(x, w, tau_min=5.0, tau_max=10.0, mode=mode, bias=np.asarray(bias),
                                         segment_ids=seg)
    assert got.shape == x.shape[:2] + (3,)
    assert_close(got, want)
    if mode != "sequence":  # (one tau per row and head there) both bounds and the interior are exercised
        assert np.any(want == 5.0) and np.any(want == 10.0) and np.any((want > 5.0) & (want < 10.0))
    for head in range(3):  # each head is the per-layer temperature of its column
        assert_close(got[..., head], learned_temperature(x, w[:, head], tau_min=5.0, tau_max=10.0, mode=mode,
                                                         bias=bias[head], segment_ids=seg))
    if mode == "token":  # each token's own: the same whatever the other tokens and segments
        assert_close(got, learned_temperature(x, w, tau_min=5.0, tau_max=10.0, mode=mode, bias=bias))


def test_learned_temperature_refuses_bad_weights_by_shape():
    x, w = rand_x(22)
    d = x.shape[-1]
    with pytest.raises(ValueError, match=rf"w_tau must have shape \[d_model\] = \({d},\) or \[d_model, heads\] "
                                         rf"= \({d}, H\), got shape \({d + 1}, 2\)"):
        learned_temperature(x, jnp.zeros((d + 1, 2)), **TAU_RANGE)
    with pytest.raises(ValueError, match=r"bias must be a number or \[heads\] = \(2,\) like w_tau .*got shape "
                                         r"\(3,\)"):
        learned_temperature(x, jnp.zeros((d, 2)), bias=jnp.ones(3), **TAU_RANGE)
    with pytest.raises(ValueError, match="bias must be a number"):  # a per-head bias needs per-head weights
        learned_temperature(x, w, bias=jnp.ones(2), **TAU_RANGE)
    with pytest.raises(ValueError, match=r"mode must be one of \('prefix', 'sequence', 'token'\)"):
        learned_temperature(x, w, mode="window", **TAU_RANGE)


def test_prefix_last_token_equals_sequence():
    x, w = rand_x(21)
    pre = learned_temperature(x, w, mode="prefix", bias=7.5, **TAU_RANGE)
    seq = learned_temperature(x, w, mode="sequence", bias=7.5, **TAU_RANGE)
    assert_close(pre[:, -1], seq[:, -1])
    assert_close(seq, jnp.broadcast_to(seq[:, -1:], seq.shape))
    # with segments: at the last token of each segment
    seg = jnp.asarray(SEGMENTS)
    pre = learned_temperature(x, w, mode="prefix", bias=7.5, segment_ids=seg, **TAU_RANGE)
    seq = learned_temperature(x, w, mode="sequence", bias=7.5, segment_ids=seg, **TAU_RANGE)
    for bb in range(seg.shape[0]):
        ids = np.asarray(seg[bb])
        last = [i for i in range(len(ids)) if i == len(ids) - 1 or ids[i + 1] != ids[i]]
        assert_close(pre[bb, last], seq[bb, last])


@pytest.mark.parametrize("i", [0, 13, 38])
def test_prefix_ignores_future_sequence_leaks(i):
    x, w = rand_x(22)
    x2 = x.at[:, i + 1:].add(3.0 * jax.random.normal(jax.random.key(23), x[:, i + 1:].shape))
    pre, pre2 = (learned_temperature(xx, w, mode="prefix", bias=7.5, **TAU_RANGE) for xx in (x, x2))
    np.testing.assert_array_equal(np.asarray(pre[:, :i + 1]), np.asarray(pre2[:, :i + 1]))
    assert float(jnp.max(jnp.abs(pre[:, i + 1:] - pre2[:, i + 1:]))) > 1e-3
    # 'sequence' (the paper's literal mean) does see the future: documents the leak
    seq, seq2 = (learned_temperature(xx, w, mode="sequence", bias=7.5, **TAU_RANGE) for xx in (x, x2))
    assert float(jnp.max(jnp.abs(seq[:, :i + 1] - seq2[:, :i + 1]))) > 1e-3


def test_right_padding_enters_the_sequence_mean_unless_its_segment_id_differs():
    """As the docstring says: padding is a token like any other, so padding with the row's segment id (or with no
    segment ids) moves the 'sequence' tau of real tokens, and the padding segment id 0 of packed rows does not."""
    x, w = rand_x(26, w_scale=0.5)
    real = x.shape[1] - 5
    alone = learned_temperature(x[:, :real], w, mode="sequence", bias=7.5, **TAU_RANGE)
    segments = jnp.broadcast_to(jnp.arange(x.shape[1]) < real, x.shape[:2]).astype(jnp.int32)
    padded = learned_temperature(x, w, mode="sequence", bias=7.5, segment_ids=segments, **TAU_RANGE)
    assert_close(padded[:, :real], alone)
    unmarked = learned_temperature(x, w, mode="sequence", bias=7.5, **TAU_RANGE)
    assert float(jnp.max(jnp.abs(unmarked[:, :real] - alone))) > 1e-3
    prefix = learned_temperature(x, w, mode="prefix", bias=7.5, **TAU_RANGE)
    assert_close(prefix[:, :real], learned_temperature(x[:, :real], w, mode="prefix", bias=7.5, **TAU_RANGE))


def test_gradient_reaches_w_tau_at_initialisation():
    """w_tau = 0 and bias at mid-range: tau starts inside the clip range, so the hard clip passes gradient."""
    q, k, v = rand_qkv(24, t=24)
    x, _ = rand_x(25, t=24)
    tau_min, tau_max = 5.0, 10.0
    cot = jax.random.normal(jax.random.key(26), q.shape)

    def loss(w_tau, clip):
        tau = learned_temperature(x, w_tau, tau_min=tau_min, tau_max=tau_max, clip=clip,
                                  bias=(tau_min + tau_max) / 2)
        return jnp.sum(focal_attention(q, k, v, scale=1.0, temperature=tau[:, :, None]) * cot)

    w0 = jnp.zeros(x.shape[-1])
    for clip in ("hard", "smooth", "straight_through"):
        tau0 = learned_temperature(x, w0, tau_min=tau_min, tau_max=tau_max, clip=clip, bias=7.5)
        assert_close(tau0, jnp.full(tau0.shape, 7.5))
        grad = jax.grad(loss)(w0, clip)
        assert bool(jnp.all(jnp.isfinite(grad)))
        assert float(jnp.linalg.norm(grad)) > 1e-4, (clip, grad)


def test_clip_dead_zone():
    """w_tau = 0, bias = 0: tau starts below tau_min. Hard clip: zero gradient; smooth / straight-through: not."""
    x, _ = rand_x(27)
    cot = jax.random.normal(jax.random.key(28), x.shape[:2])
    w0 = jnp.zeros(x.shape[-1])

    def loss(w_tau, clip, mode):
        return jnp.sum(learned_temperature(x, w_tau, tau_min=5.0, tau_max=10.0, mode=mode, clip=clip) * cot)

    for mode in ("prefix", "sequence"):
        np.testing.assert_array_equal(np.asarray(jax.grad(loss)(w0, "hard", mode)), 0.0)
        for clip in ("smooth", "straight_through"):
            grad = jax.grad(loss)(w0, clip, mode)
            assert bool(jnp.all(jnp.isfinite(grad)))
            assert float(jnp.max(jnp.abs(grad))) > 1e-6, (clip, mode)
    # straight-through: clipped forward, identity backward (d tau / d bias = 1 per token)
    st = learned_temperature(x, w0, tau_min=5.0, tau_max=10.0, clip="straight_through")
    assert_close(st, jnp.full(st.shape, 5.0))
    g_bias = jax.grad(lambda bias: jnp.sum(learned_temperature(
        x, w0, tau_min=5.0, tau_max=10.0, clip="straight_through", bias=bias)))(0.0)
    assert abs(float(g_bias) - x.shape[0] * x.shape[1]) < 1e-3


def test_smooth_clip_stays_in_range_and_is_monotone():
    x, w = rand_x(29, w_scale=5.0)
    tau = learned_temperature(x, w, tau_min=5.0, tau_max=10.0, clip="smooth")
    assert bool(jnp.all((tau >= 5.0) & (tau <= 10.0)))
    biases = jnp.linspace(-50.0, 50.0, 21)
    x1 = jnp.ones((1, 3, 4))
    vals = np.array([float(learned_temperature(x1, jnp.zeros(4), tau_min=5.0, tau_max=10.0, clip="smooth",
                                               bias=bias)[0, 0]) for bias in biases])
    assert np.all(np.diff(vals) >= 0) and vals[0] < 5.5 and vals[-1] > 9.5


# ------------------------------------------------------------------------------------------------------------
# Non-causal masks, the smooth clip's formula, the learned temperature's defaults.
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [0, 3])
def test_non_causal_window_is_symmetric_and_equals_jax(window):
    """causal=False with a window: key j visible iff |i - j| <= window (jax.nn's local_window_size=(w, w))."""
    q, k, v = rand_qkv(30, t=24)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=False, local_window_size=(window, window))
    assert_close(focal_attention(q, k, v, causal=False, window=window), want)
    assert_close(reference.attention(q, k, v, causal=False, window=window), want)
    # the window acts (so this test can fail)
    assert float(jnp.max(jnp.abs(want - jax.nn.dot_product_attention(q, k, v, is_causal=False)))) > 1e-2


def test_non_causal_segments_equal_jax_masked():
    """causal=False with segment ids (packed bidirectional documents): no attention across documents."""
    q, k, v = rand_qkv(31)
    seg = jnp.asarray(SEGMENTS)
    want = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(seg), is_causal=False,
                                        scale=1.0 / (0.5 * np.sqrt(q.shape[-1])))
    assert_close(focal_attention(q, k, v, temperature=0.5, causal=False, segment_ids=seg), want)
    assert_close(reference.attention(q, k, v, temperature=0.5, causal=False, segment_ids=seg), want)
    assert float(jnp.max(jnp.abs(want - focal_attention(q, k, v, temperature=0.5, causal=False)))) > 1e-2


@pytest.mark.parametrize("mode", ["prefix", "sequence"])
def test_smooth_clip_equals_its_formula(mode):
    """clip='smooth' is `tau_min + width * sigmoid(4 (z - mid) / width)` of the reference mean (numpy float64),
    and its slope at the midpoint is 1."""
    x, w = rand_x(32, w_scale=1.5)
    seg = jnp.asarray(SEGMENTS)
    tau_min, tau_max, bias = 5.0, 10.0, 7.5
    got = learned_temperature(x, w, tau_min=tau_min, tau_max=tau_max, mode=mode, clip="smooth", bias=bias,
                              segment_ids=seg)
    z = reference.learned_temperature(x, w, tau_min=-1e9, tau_max=1e9, mode=mode, bias=bias,
                                      segment_ids=seg).astype(np.float64)  # the unclipped mean + bias
    width, mid = tau_max - tau_min, (tau_min + tau_max) / 2
    want = tau_min + width / (1.0 + np.exp(-4.0 * (z - mid) / width))
    assert_close(got, want, atol=1e-4)
    assert np.any((z < tau_min) | (z > tau_max)) and np.any((z > tau_min) & (z < tau_max))  # tails and middle
    slope = jax.grad(lambda b: learned_temperature(jnp.ones((1, 2, 4)), jnp.zeros(4), tau_min=tau_min,
                                                   tau_max=tau_max, clip="smooth", bias=b)[0, 0])(mid)
    assert abs(float(slope) - 1.0) < 1e-5


def test_learned_temperature_defaults_are_prefix_mode_and_hard_clip():
    """DESIGN.md: the causal form (mode='prefix') is the default, and the default clip is the paper's hard clip."""
    x, w = rand_x(33, w_scale=1.5)
    got = learned_temperature(x, w, tau_min=5.0, tau_max=10.0, bias=7.5)
    assert_close(got, reference.learned_temperature(x, w, tau_min=5.0, tau_max=10.0, mode="prefix", bias=7.5))
    # hard clip: no gradient reaches a tau clipped at either bound, full gradient inside
    tau = np.asarray(got)
    grad = np.asarray(jax.jacrev(lambda bias: learned_temperature(x, w, tau_min=5.0, tau_max=10.0, bias=bias))(7.5))
    clipped = (tau == 5.0) | (tau == 10.0)
    assert clipped.any() and (~clipped).any()
    np.testing.assert_array_equal(grad[clipped], 0.0)
    assert_close(grad[~clipped], np.ones(int((~clipped).sum())))
