"""Bad input raises ValueError whose message names the argument (and, for settings, the bad value)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focal_jax._validation import check_distinct, check_int, is_integer
from focal_jax.attention import (dot_product_attention, focal_attention, focus_attention, focus_mask,
                                 focus_sparse_attention, learned_temperature, routing_scores, sinkhorn,
                                 topk_membership)

B, T, H, D, K = 1, 8, 2, 4, 3


def ones(*shape):
    return jnp.ones(shape, jnp.float32)


Q, KK, V = ones(B, T, H, D), ones(B, T, H, D), ones(B, T, H, D)
G = jnp.full((B, T, K), 1.0 / K)
MEM = jnp.ones((B, T, K), bool)


def check_raises(fn, name, value=None):
    """fn() raises ValueError; the message names `name` (as a word) and contains `value` if given."""
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    assert re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", msg), f"{name!r} not named in: {msg}"
    if value is not None:
        assert str(value) in msg, f"value {value!r} not in: {msg}"


# Every function that takes q, k, v, called with everything else valid.
ATTENTION_FNS = {
    "dot_product_attention": lambda q, k, v, **kw: dot_product_attention(q, k, v, **kw),
    "focal_attention": lambda q, k, v, **kw: focal_attention(q, k, v, **kw),
    "focus_attention": lambda q, k, v, **kw: focus_attention(q, k, v, G, **kw),
    "focus_sparse_attention_reference": lambda q, k, v, **kw: focus_sparse_attention(q, k, v, MEM, **kw),
    "focus_sparse_attention_decomposed": lambda q, k, v, **kw: focus_sparse_attention(
        q, k, v, MEM, impl="decomposed", block_size=4, **kw),
}


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
def test_mismatched_shapes(fn):
    f = ATTENTION_FNS[fn]
    # the argument named, and its shape (a one-letter name alone matched anywhere in any message)
    check_raises(lambda: f(Q, ones(B, T, H, D + 1), V), "k", (B, T, H, D + 1))    # head_dim of k differs from q
    check_raises(lambda: f(Q, KK, ones(B, T + 1, H, D)), "v", (B, T + 1, H, D))   # sequence of v differs from k
    check_raises(lambda: f(ones(B, T, H), KK, V), "q", (B, T, H))                 # q is not 4-d
    check_raises(lambda: f(Q, KK, ones(B + 1, T, H, D)), "v", (B + 1, T, H, D))   # batch of v differs


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
def test_kv_heads_must_divide_q_heads(fn):
    f = ATTENTION_FNS[fn]
    with pytest.raises(ValueError) as info:
        f(ones(B, T, 4, D), ones(B, T, 3, D), ones(B, T, 3, D))
    msg = str(info.value)
    assert re.search(r"\bk\b|\bkv\b", msg) and "3" in msg and "4" in msg, msg


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
def test_negative_window(fn):
    check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, window=-1), "window", -1)
    check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, window=2 ** 31), "window", 2 ** 31)  # an OverflowError before


@pytest.mark.parametrize("fn", ["focal_attention", "focus_attention", "focus_sparse_attention_reference",
                                "focus_sparse_attention_decomposed"])
@pytest.mark.parametrize("bad", [0.0, -0.5])
def test_non_positive_temperature(fn, bad):
    check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, temperature=bad), "temperature", bad)


@pytest.mark.parametrize("fn", ["focal_attention", "focus_attention", "focus_sparse_attention_reference",
                                "focus_sparse_attention_decomposed"])
@pytest.mark.parametrize("transform", [jax.jit, jax.checkpoint])
def test_a_temperature_array_captured_by_a_transformation_is_checked_not_traced(fn, transform):
    """A concrete per-query temperature array that a jitted or checkpointed function closes over: its values are
    checked as in eager mode (a ConcretizationTypeError before), a good one gives the eager output, a bad one the
    named error."""
    f = ATTENTION_FNS[fn]
    q = jax.random.normal(jax.random.key(0), (B, T, H, D))
    good = jnp.linspace(0.5, 2.0, B * T * H).reshape(B, T, H)
    np.testing.assert_allclose(transform(lambda: f(q, q, q, temperature=good))(), f(q, q, q, temperature=good),
                               rtol=1e-5, atol=1e-6)
    for bad in (good.at[0, 3, 1].set(0.0), good.at[0, 3, 1].set(-1.0)):
        check_raises(transform(lambda: f(q, q, q, temperature=bad)), "temperature")


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
@pytest.mark.parametrize("bad", [0.0, float("inf")])
def test_non_positive_or_infinite_scale(fn, bad):
    check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, scale=bad), "scale", bad)  # inf: every output NaN


def test_temperature_array_checks():
    check_raises(lambda: focal_attention(Q, KK, V, temperature=jnp.full((B, T, H), 0.5).at[0, 3, 1].set(0.0)),
                 "temperature")
    check_raises(lambda: focal_attention(Q, KK, V, temperature=jnp.ones((B, T + 1, H))), "temperature")
    # [B, T] (what learned_temperature returns) would silently broadcast against [T, H] when B = T and T = H
    check_raises(lambda: focal_attention(Q, KK, V, temperature=jnp.ones((B, T))), "temperature")
    check_raises(lambda: focal_attention(ones(T, T, T, D), ones(T, T, T, D), ones(T, T, T, D),
                                         temperature=jnp.ones((T, T))), "temperature")


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_integer_inputs_are_refused(fn, which):
    qkv = {"q": Q, "k": KK, "v": V}
    qkv[which] = qkv[which].astype(jnp.int32)
    check_raises(lambda: ATTENTION_FNS[fn](qkv["q"], qkv["k"], qkv["v"]), which, "int32")


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_list_inputs_are_refused_by_name(fn, which):
    """A Python list raised a bare AttributeError ('list' object has no attribute 'ndim'); lists are refused by
    name, as JAX's own functions refuse them (convert with jnp.asarray)."""
    qkv = {"q": Q, "k": KK, "v": V}
    qkv[which] = qkv[which].tolist()
    check_raises(lambda: ATTENTION_FNS[fn](qkv["q"], qkv["k"], qkv["v"]), which, "list")
    qkv[which] = np.asarray(qkv[which], np.float32)  # numpy arrays are taken
    assert ATTENTION_FNS[fn](qkv["q"], qkv["k"], qkv["v"]).shape == (B, T, H, D)


def test_list_group_inputs_are_refused_by_name():
    """g, membership, the routing and Sinkhorn inputs, x and w_tau as Python lists: AttributeError before."""
    for fn, name in [
        (lambda: focus_attention(Q, KK, V, G.tolist(), window=2), "g"),
        (lambda: focus_sparse_attention(Q, KK, V, MEM.tolist(), window=2), "membership"),
        (lambda: focus_sparse_attention(Q, KK, V, MEM.tolist(), window=2, impl="decomposed"), "membership"),
        (lambda: focus_mask(MEM.tolist(), window=2), "membership"),
        (lambda: topk_membership(G.tolist(), 1), "g"),
        (lambda: routing_scores(HID.tolist(), W_G, ones(K, 4)), "h"),
        (lambda: routing_scores(HID, W_G.tolist(), ones(K, 4)), "w_g"),
        (lambda: routing_scores(HID, W_G, ones(K, 4).tolist()), "centroids"),
        (lambda: sinkhorn(G.tolist()), "scores"),
        (lambda: sinkhorn(G, valid=[[True] * T] * B), "valid"),
        (lambda: learned_temperature(X.tolist(), W_TAU, tau_min=1.0, tau_max=2.0), "x"),
        (lambda: learned_temperature(X, W_TAU.tolist(), tau_min=1.0, tau_max=2.0), "w_tau"),
    ]:
        check_raises(fn, name, "list")


@pytest.mark.parametrize("fn", ["focal_attention", "focus_attention", "focus_sparse_attention_reference",
                                "focus_sparse_attention_decomposed"])
@pytest.mark.parametrize("bad", ["0.5", [0.5], None])
def test_temperature_and_scale_that_are_not_numbers_or_arrays(fn, bad):
    """A string (or a list, or None) temperature raised jnp's bare TypeError ('Error interpreting argument to
    <function _reduce_min ...>'); it is a ValueError naming the argument and the value."""
    check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, temperature=bad), "temperature", repr(bad))
    if bad is not None:  # (scale=None is the default, 1/sqrt(D))
        check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, scale=bad), "scale", repr(bad))


def test_segment_ids_shape():
    check_raises(lambda: focal_attention(Q, KK, V, segment_ids=jnp.zeros((B, T + 1), jnp.int32)), "segment_ids")
    check_raises(lambda: sinkhorn(G, segment_ids=jnp.zeros((B, T - 1), jnp.int32)), "segment_ids")
    check_raises(lambda: focus_mask(MEM, window=2, segment_ids=jnp.zeros((B + 1, T), jnp.int32)), "segment_ids")
    as_list = [[0] * T] * B  # (a bare AttributeError before)
    check_raises(lambda: focal_attention(Q, KK, V, segment_ids=as_list), "segment_ids", "list")
    check_raises(lambda: focus_sparse_attention(Q, KK, V, MEM, window=2, segment_ids=as_list, impl="decomposed"),
                 "segment_ids", "list")


# ------------------------------------------------------------------------------------------------------------
# learned temperature
# ------------------------------------------------------------------------------------------------------------

X = ones(B, T, 6)
W_TAU = jnp.zeros(6)


@pytest.mark.parametrize("tau_min,tau_max", [(10.0, 5.0), (5.0, 5.0)])
def test_tau_min_must_be_below_tau_max(tau_min, tau_max):
    check_raises(lambda: learned_temperature(X, W_TAU, tau_min=tau_min, tau_max=tau_max), "tau_min", tau_min)


@pytest.mark.parametrize("tau_min", [0.0, -1.0])
def test_tau_min_must_be_positive(tau_min):
    check_raises(lambda: learned_temperature(X, W_TAU, tau_min=tau_min, tau_max=2.0), "tau_min", tau_min)


def test_traced_tau_min_and_tau_max_are_taken():
    """tau_min / tau_max given as jax.jit arguments raised TracerBoolConversionError (the `tau_min < tau_max`
    check); they are computed with, their values checked only when concrete."""
    x, w = jax.random.normal(jax.random.key(0), (B, T, 6)), jax.random.normal(jax.random.key(1), (6,))
    for clip in ("hard", "smooth", "straight_through"):
        eager = learned_temperature(x, w, tau_min=5.0, tau_max=10.0, bias=7.0, clip=clip)
        traced = jax.jit(lambda lo, hi: learned_temperature(x, w, tau_min=lo, tau_max=hi, bias=7.0, clip=clip))
        np.testing.assert_allclose(traced(5.0, 10.0), eager, rtol=1e-6)
    # 0-d arrays are numbers too, and are checked when concrete
    check_raises(lambda: learned_temperature(X, W_TAU, tau_min=jnp.float32(3.0), tau_max=jnp.array(2.0)), "tau_min")


@pytest.mark.parametrize("name", ["tau_min", "tau_max"])
@pytest.mark.parametrize("bad", ["5", None, True, [5.0]])
def test_tau_min_and_tau_max_must_be_numbers(name, bad):
    """A string tau_max raised a bare TypeError ("'<' not supported between ..."), a list one an AttributeError."""
    bounds = {"tau_min": 1.0, "tau_max": 2.0, name: bad}
    check_raises(lambda: learned_temperature(X, W_TAU, **bounds), name, repr(bad))
    bounds[name] = jnp.ones(2)  # not 0-d
    check_raises(lambda: learned_temperature(X, W_TAU, **bounds), name, "shape (2,)")


def test_unknown_mode_and_clip():
    check_raises(lambda: learned_temperature(X, W_TAU, tau_min=1.0, tau_max=2.0, mode="causal_ish"),
                 "mode", "causal_ish")
    check_raises(lambda: learned_temperature(X, W_TAU, tau_min=1.0, tau_max=2.0, clip="soft_ish"),
                 "clip", "soft_ish")


def test_learned_temperature_shapes():
    check_raises(lambda: learned_temperature(X, jnp.zeros(5), tau_min=1.0, tau_max=2.0), "w_tau")
    check_raises(lambda: learned_temperature(ones(T, 6), W_TAU, tau_min=1.0, tau_max=2.0), "x")


# ------------------------------------------------------------------------------------------------------------
# routing, sinkhorn, membership
# ------------------------------------------------------------------------------------------------------------

HID = ones(B, T, 6)
W_G = ones(6, 4)


def test_routing_scores_errors():
    check_raises(lambda: routing_scores(HID, W_G, ones(0, 4)), "centroids")          # K < 1
    check_raises(lambda: routing_scores(HID, W_G, ones(K, 5)), "centroids")          # d_g mismatch
    check_raises(lambda: routing_scores(HID, ones(7, 4), ones(K, 4)), "w_g")         # d_model mismatch
    check_raises(lambda: routing_scores(HID, W_G, ones(K, 4), tau=0.0), "tau", 0.0)
    # a [K] tau was read as one temperature per group, a [2] one failed in a broadcast naming nothing
    check_raises(lambda: routing_scores(HID, W_G, ones(K, 4), tau=jnp.full(K, 0.1)), "tau", (K,))
    check_raises(lambda: routing_scores(HID, W_G, ones(K, 4), tau=jnp.full(2, 0.1)), "tau", (2,))
    # 'False' was read by its truth value: cosine scores
    check_raises(lambda: routing_scores(HID, W_G, ones(K, 4), normalize="False"), "normalize", "'False'")


def test_sinkhorn_errors():
    check_raises(lambda: sinkhorn(ones(B, T, 0)), "scores")                          # K < 1
    check_raises(lambda: sinkhorn(ones(B, T)), "scores")
    check_raises(lambda: sinkhorn(G, n_iters=0), "n_iters", 0)
    check_raises(lambda: sinkhorn(G, n_iters=2.0), "n_iters", 2.0)
    check_raises(lambda: sinkhorn(G, unroll=2), "unroll", 2)
    check_raises(lambda: sinkhorn(G, valid=jnp.ones((B, T + 2), bool)), "valid")
    # a float mask was cast to bool: 0.5 counted as valid
    check_raises(lambda: sinkhorn(G, valid=jnp.full((B, T), 0.5)), "valid", "float32")
    assert np.array_equal(sinkhorn(G, valid=jnp.ones((B, T), jnp.int32).at[:, -1].set(0)),
                          sinkhorn(G, valid=jnp.ones((B, T), bool).at[:, -1].set(False)))


@pytest.mark.parametrize("bad_k", [0, K + 1, -1])
def test_topk_membership_k_out_of_range(bad_k):
    check_raises(lambda: topk_membership(G, bad_k), "k", bad_k)


def test_topk_membership_needs_groups():
    check_raises(lambda: topk_membership(ones(B, T, 0), 1), "g")


def test_focus_errors():
    check_raises(lambda: focus_attention(Q, KK, V, G, gate="multiplicative"), "gate", "multiplicative")
    check_raises(lambda: focus_attention(Q, KK, V, G, lam=-10.0), "lam", -10.0)
    check_raises(lambda: focus_attention(Q, KK, V, G, lam=0), "lam", 0)
    # an array lam: [B, T, 1] failed in XLA's broadcast naming nothing, [T] became a per-key steepness
    check_raises(lambda: focus_attention(Q, KK, V, G, lam=jnp.full((B, T, 1), 10.0)), "lam", (B, T, 1))
    check_raises(lambda: focus_attention(Q, KK, V, G, lam=jnp.full(T, 10.0)), "lam", (T,))
    check_raises(lambda: focus_attention(Q, KK, V, ones(B, T + 1, K)), "g")
    check_raises(lambda: focus_attention(Q, KK, V, ones(B, T, 0)), "g")              # K < 1
    check_raises(lambda: focus_sparse_attention(Q, KK, V, MEM, impl="triton"), "impl", "triton")
    check_raises(lambda: focus_sparse_attention(Q, KK, V, jnp.ones((B, T, 0), bool)), "membership")
    check_raises(lambda: focus_sparse_attention(Q, KK, V, MEM[:, :-1]), "membership")
    check_raises(lambda: focus_sparse_attention(Q, KK, V, MEM, impl="decomposed", block_size=0), "block_size", 0)
    check_raises(lambda: focus_mask(MEM, window=-3), "window", -3)
    check_raises(lambda: focus_mask(MEM[0], window=1), "membership")
    # the soft assignment g instead of topk_membership(g, k): every nonzero score would count as membership
    check_raises(lambda: focus_sparse_attention(Q, KK, V, G, window=2), "membership", "float32")
    check_raises(lambda: focus_sparse_attention(Q, KK, V, G, window=2, impl="decomposed"), "membership", "float32")
    check_raises(lambda: focus_mask(G, window=2), "membership", "float32")


@pytest.mark.parametrize("bad", [-1, 1.5, True, 2 ** 31])
def test_bad_sink(bad):
    check_raises(lambda: focus_sparse_attention(Q, KK, V, MEM, window=2, sink=bad), "sink", bad)
    check_raises(lambda: focus_mask(MEM, window=2, sink=bad), "sink", bad)
    check_raises(lambda: focus_attention(Q, KK, V, G, window=2, sink=bad), "sink", bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, True, "2", float("inf"), float("nan")])
def test_bad_softcap(bad):
    check_raises(lambda: focal_attention(Q, KK, V, softcap=bad), "softcap", bad)
    check_raises(lambda: focus_attention(Q, KK, V, G, window=2, softcap=bad), "softcap", bad)
    check_raises(lambda: focus_sparse_attention(Q, KK, V, MEM, window=2, softcap=bad, impl="decomposed"),
                 "softcap", bad)


@pytest.mark.parametrize("gate", ["paper", "log"])
def test_infinite_lam_is_refused(gate):
    # lam = inf: inf * 0 = NaN logits wherever the affinity is 0 ('paper') or 1/2 ('log', as with this uniform G)
    check_raises(lambda: focus_attention(Q, KK, V, G, gate=gate, lam=float("inf")), "lam", "inf")


def test_smooth_clip_needs_a_finite_tau_max():
    x = jnp.ones((B, T, 4))
    check_raises(lambda: learned_temperature(x, jnp.zeros(4), tau_min=1.0, tau_max=float("inf"), clip="smooth"),
                 "tau_max", "inf")
    learned_temperature(x, jnp.zeros(4), tau_min=1.0, tau_max=float("inf"), clip="hard")  # no upper clip: fine


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
def test_infinite_array_scale_is_refused(fn):
    check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, scale=jnp.float32(jnp.inf)), "scale", "inf")


# ------------------------------------------------------------------------------------------------------------
# The integer settings of nn/, data/, train/ and eval/ (one shared check)
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [3, np.int32(3), np.int64(3)])
def test_check_int_accepts_python_and_numpy_integers(value):
    got = check_int("n", value, 1)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("bad", [True, 3.0, "3", None, np.float32(3.0), 0, -2])
def test_check_int_refuses_non_integers_and_values_below_the_minimum(bad):
    check_raises(lambda: check_int("max_len", bad, 1), "max_len", repr(bad))


def test_is_integer_takes_numpy_integers_but_no_bool():
    assert is_integer(-1) and is_integer(np.int64(2)) and is_integer(np.uint8(2))
    assert not any(is_integer(x) for x in (True, np.bool_(True), 1.0, np.float64(1.0), "1", None))


def test_check_int_minimum_is_inclusive():
    assert check_int("eos_id", 0, 0) == 0
    check_raises(lambda: check_int("eos_id", -1, 0), "eos_id", ">= 0")


def test_check_distinct_names_the_repeated_values():
    check_distinct("lengths", [64, 128])
    check_distinct("tasks", ("needle",))
    check_raises(lambda: check_distinct("lengths", (64, 128, 64)), "lengths",
                 "lengths must be distinct, got lengths=[64, 128, 64]")


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
def test_an_array_scale_is_checked_like_a_temperature(fn):
    """A [B, T] scale (1 / tau of learned_temperature) broadcast against [T, H] when B = 1 and T = H: a per-head
    scale where a per-token one was meant. It is refused as the temperature is; [B, T, 1] is per token."""
    b, t = 1, 4
    q, k, v = (jax.random.normal(jax.random.key(i), (b, t, t, D)) for i in range(3))
    per_token = jnp.linspace(0.1, 1.0, t)[None]
    member = jnp.ones((b, t, K), bool)
    call = {
        "dot_product_attention": lambda q, k, v, **kw: (
            focal_attention(q, k, v, **kw) if "temperature" in kw else dot_product_attention(q, k, v, **kw)),
        "focal_attention": lambda q, k, v, **kw: focal_attention(q, k, v, **kw),
        "focus_attention": lambda q, k, v, **kw: focus_attention(q, k, v, member / K, window=1, **kw),
        "focus_sparse_attention_reference": lambda q, k, v, **kw: focus_sparse_attention(
            q, k, v, member, window=1, **kw),
        "focus_sparse_attention_decomposed": lambda q, k, v, **kw: focus_sparse_attention(
            q, k, v, member, window=1, impl="decomposed", block_size=4, **kw)}[fn]
    check_raises(lambda: call(q, k, v, scale=per_token), "scale", "ambiguous")
    check_raises(lambda: call(q, k, v, scale=jnp.ones((b, t + 1, 1))), "scale", str((b, t, t)))
    got = call(q, k, v, scale=per_token[:, :, None])
    want = call(q, k, v, scale=1.0, temperature=1.0 / per_token[:, :, None])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert not np.allclose(got, call(q, k, v, scale=1.0), atol=1e-3)


@pytest.mark.parametrize("fn, name", [(fn, name) for fn in ATTENTION_FNS for name in ("temperature", "scale")
                                      if (fn, name) != ("dot_product_attention", "temperature")])  # (it takes none)
def test_a_bool_temperature_or_scale_is_refused(fn, name):
    """`temperature=True` ran as 1.0 (a bool is an int to Python)."""
    check_raises(lambda: ATTENTION_FNS[fn](Q, KK, V, **{name: True}), name, "True")


@pytest.mark.parametrize("fn", list(ATTENTION_FNS))
@pytest.mark.parametrize("axis", [0, 1, 2, 3])
def test_an_empty_axis_is_refused_by_name(fn, axis):
    """T = 0 failed in a reduction with no identity, or in a slice or broadcast (each path its own way); D = 0
    as 'scale must be a finite number, got scale=inf' though no scale was given."""
    shape = [B, T, H, D]
    shape[axis] = 0
    empty = ones(*shape)
    g, member = jnp.full((*shape[:2], K), 1.0 / K), jnp.ones((*shape[:2], K), bool)  # groups of q's tokens
    call = {"focus_attention": lambda q, k, v: focus_attention(q, k, v, g),
            "focus_sparse_attention_reference": lambda q, k, v: focus_sparse_attention(q, k, v, member),
            "focus_sparse_attention_decomposed": lambda q, k, v: focus_sparse_attention(
                q, k, v, member, impl="decomposed", block_size=4)}.get(fn, ATTENTION_FNS[fn])
    check_raises(lambda: call(empty, empty, empty), "q", tuple(shape))
    if axis == 3:  # an empty value head_dim alone
        check_raises(lambda: ATTENTION_FNS[fn](Q, KK, empty), "v", tuple(shape))


@pytest.mark.parametrize("bad", ["no", "False", None, 1])
def test_causal_must_be_a_bool(bad):
    """`causal='no'` was read by its truth value (causal); None meant non-causal."""
    check_raises(lambda: focal_attention(Q, KK, V, causal=bad), "causal", repr(bad))
    check_raises(lambda: dot_product_attention(Q, KK, V, causal=bad), "causal", repr(bad))
    check_raises(lambda: sinkhorn(G, causal=bad), "causal", repr(bad))
    assert focal_attention(Q, KK, V, causal=np.bool_(False)).shape == Q.shape


@pytest.mark.parametrize("bad", [jnp.ones(3), jnp.ones(T), "a", None])
def test_learned_temperature_bias_must_be_a_number(bad):
    """A [seq] bias was added per position (the docstring says a scalar), a [3] one failed in a broadcast naming
    nothing, a string with a bare TypeError."""
    x, w = ones(B, T, 6), jnp.zeros(6)
    check_raises(lambda: learned_temperature(x, w, tau_min=5.0, tau_max=10.0, bias=bad), "bias")
    assert float(learned_temperature(x, w, tau_min=5.0, tau_max=10.0, bias=jnp.float32(7.0))[0, 0]) == 7.0


@pytest.mark.parametrize("name, call", [
    ("window", lambda x: focal_attention(Q, KK, V, window=x)),
    ("causal", lambda x: dot_product_attention(Q, KK, V, causal=x)),
    ("softcap", lambda x: focal_attention(Q, KK, V, softcap=x)),
    ("sink", lambda x: focus_sparse_attention(Q, KK, V, MEM, window=2, sink=x)),
    ("max_groups", lambda x: focus_sparse_attention(Q, KK, V, MEM, window=2, max_groups=x)),
    ("block_size", lambda x: focus_sparse_attention(Q, KK, V, MEM, window=2, impl="decomposed", block_size=x)),
    ("n_iters", lambda x: sinkhorn(G, n_iters=x)),
    ("unroll", lambda x: sinkhorn(G, unroll=x))])
def test_a_traced_setting_is_named_with_how_to_make_it_static(name, call):
    """A setting that shapes the program, passed as an argument of a jitted function, was refused as
    'got window=JitTracer(~int32[])' with no word on what to do; the message says to pass it as a Python value.
    An untraced bad value gets no such hint."""
    value = True if name in ("causal", "unroll") else 3
    with pytest.raises(ValueError, match=rf"got {name}=.*Tracer.*it is traced: {name} shapes the program.*"
                                         rf"static_argnames='{name}'"):
        jax.jit(lambda x: call(x))(value)
    with pytest.raises(ValueError) as info:
        call("3")
    assert "traced" not in str(info.value) and f"got {name}='3'" in str(info.value)
