"""The Pallas kernels (`focal_jax.kernels.focus_sparse`) against the naive reference: the GPU form in interpret mode,
or as Triton kernels when a GPU is there (`make gpu-check`), and for a subset the TPU form in interpret mode with its
DMAs; their GPU and TPU lowering without a device; the block plan's coverage and cost. Matrix products run in full
float32 here (`jax.default_matmul_precision('float32')`): on a GPU jax's default for float32 inputs, which the
kernels follow, is TF32."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax.attention import focus_sparse_attention, reference, topk_membership
from focal_jax.bench import _fused_grad, traced_equations, walked_step_bytes
from focal_jax.kernels import focus_sparse as ks
from focal_jax.nn.attention import Attention, AttentionConfig
from helpers import assert_close, lowering_target, rand_qkv


def random_membership(seed, b, t, groups, k):
    scores = jax.random.normal(jax.random.key(seed), (b, t, groups))
    return topk_membership(scores, k)


def out_and_grads(fn, args):
    """`fn(*args)` and the gradients of sum(sin(out)) w.r.t. every argument, from one jitted call: the kernels'
    forward runs once (the primal output of their `custom_vjp` is its forward rule's), which halves what the TPU
    form's slow interpretation costs."""
    def loss(*a):
        out = fn(*a)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    grads, out = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
    return out, grads


def assert_matches(reference_fn, kernel_fn, args, atol, what):
    """`kernel_fn(*args)` equals `reference_fn(*args)` to `atol`, and the gradients of sum(sin(out)) w.r.t. every
    argument agree to `atol` relative to the largest reference value (at least 1). Returns the kernel's output."""
    (expected, expected_grads), (got, got_grads) = out_and_grads(reference_fn, args), out_and_grads(kernel_fn, args)
    assert_close(got, expected, atol=atol, what=what)
    for name, e, g in zip("qkvt", expected_grads, got_grads):
        scale = max(1.0, float(jnp.max(jnp.abs(e))))
        assert_close(g, e, atol=atol * scale, what=f"{what} d{name}")
    return got


pytestmark = pytest.mark.usefixtures("fast_compiles")

GPU_FORM = "triton" if jax.default_backend() == "gpu" else "interpret"


@pytest.fixture(autouse=True)
def float32_matmuls():
    with jax.default_matmul_precision("float32"):
        yield

CASES = {  # name: (t, groups, k, window, sink, segmented, heads, kv_heads, head_dim, softcap, block, band_block)
    "odd length, top-1": (77, 3, 1, 5, 0, False, 4, 4, 16, None, 16, 8),
    "top-2, segments, GQA, head_dim 64": (70, 4, 2, 9, 0, True, 4, 2, 64, None, 32, 16),
    "one group": (50, 1, 1, 4, 0, False, 2, 1, 16, None, 16, 8),
    "more groups than tokens (two bitmask words), top-3": (20, 40, 3, 3, 0, False, 2, 2, 16, None, 16, 8),
    "window 0, sink 3, softcap": (45, 3, 1, 0, 3, True, 2, 2, 16, 20.0, 16, 8),
    "window >= T (int32's largest), head_dim 128": (40, 4, 1, 2 ** 31 - 1, 0, False, 2, 2, 128, None, 16, 16),
    "k = K": (33, 3, 3, 2, 0, False, 2, 1, 16, None, 16, 8),
    "sink 100 of each document, in steps": (150, 3, 1, 4, 100, True, 2, 2, 16, None, 16, 8),
}


# The TPU form is slower to interpret: cases that cover its reads (GQA, multi-group ids, segments, sink walks, the
# band, ids of two bitmask words transposed in the kernel).
TPU_CASES = ["top-2, segments, GQA, head_dim 64", "window 0, sink 3, softcap",
             "more groups than tokens (two bitmask words), top-3"]


@pytest.mark.parametrize("name,backend", [(name, GPU_FORM) for name in CASES]
                         + [(name, "mosaic_interpret") for name in TPU_CASES])
def test_focus_kernel_matches_reference(name, backend):
    t, groups, k, window, sink, segmented, h, hk, d, softcap, block, band_block = CASES[name]
    if backend == "triton":  # Triton's matrix products take at least 16 rows
        block, band_block = max(block, 16), max(band_block, 16)
    q, key, v = rand_qkv(len(name), 2, t, h, hk, d)
    membership = random_membership(1, 2, t, groups, k)
    # Segment ids -1 and 0: the kernels' plans mark padding with -1, so user ids must not be read as padding.
    segment_ids = (jnp.arange(t)[None] >= jnp.array([[t // 3], [t // 2]])).astype(jnp.int32) - 1 if segmented else None
    temperature = jax.random.uniform(jax.random.key(2), (2, t, h), minval=0.5, maxval=2.0)

    def expected(q, key, v, temperature):
        return reference.focus_hard_attention(q, key, v, membership, window=window, temperature=temperature,
                                              segment_ids=segment_ids, sink=sink, softcap=softcap)

    def kernel(q, key, v, temperature):
        return ks.focus_sparse_pallas(q, key, v, membership, multiplier=d ** -0.5 / temperature, window=window,
                                      segment_ids=segment_ids, sink=sink, softcap=softcap, block_size=block,
                                      band_block_size=band_block, backend=backend, max_groups=k)

    assert_matches(expected, kernel, (q, key, v, temperature), 1e-5, f"{name} ({backend})")


def test_arbitrary_membership_and_empty_groups():
    """Tokens in no group, in several groups, and groups left empty (of unequal sizes)."""
    t = 60
    q, k, v = rand_qkv(3, 1, t, 2, 2, 8)
    bits = jax.random.bernoulli(jax.random.key(4), 0.4, (1, t, 5))
    membership = bits.at[:, :, 1].set(False).at[:, :, 3].set(False)  # groups 1 and 3 empty
    assert not bool(jnp.all(jnp.any(membership, axis=-1)))  # some tokens belong to no group
    expected = lambda q, k, v: reference.focus_hard_attention(q, k, v, membership, window=4)
    kernel = lambda q, k, v: focus_sparse_attention(q, k, v, membership, window=4, impl="pallas", block_size=16)
    assert_matches(expected, kernel, (q, k, v), 1e-5, "arbitrary membership")


def test_full_blocks_of_tokens_in_two_groups():
    """A group that fills whole key blocks with tokens that also belong to a lower group: those blocks are one
    group and one segment but not full, since a pair that shares the lower group is counted there (top-2)."""
    t = 64
    q, k, v = rand_qkv(30, 1, t, 2, 2, 8)
    in_group_0 = jax.random.bernoulli(jax.random.key(31), 0.5, (1, t))
    membership = jnp.stack([in_group_0, jnp.ones((1, t), bool), ~in_group_0], axis=-1)  # everyone in group 1
    expected = lambda q, k, v: reference.focus_hard_attention(q, k, v, membership, window=2)
    kernel = lambda q, k, v: ks.focus_sparse_pallas(q, k, v, membership, multiplier=8 ** -0.5, window=2,
                                                    block_size=16, band_block_size=16, max_groups=2)
    assert_matches(expected, kernel, (q, k, v), 1e-5, "full blocks of two-group tokens")


@pytest.mark.parametrize("backend", [GPU_FORM, "mosaic_interpret"])
def test_top1_with_tokens_in_no_group(backend):
    """One entry slot per token (`max_groups=1`), where the GPU form's set-B forward kernel merges set A's results
    at its tokens' entries into its own, its set-A backward kernels write their gradients in token order and set
    B's add theirs: tokens in no group (whose set-A gradient rows nothing writes), segments, GQA, a length that
    fills no tile."""
    t = 45
    q, k, v = rand_qkv(25, 2, t, 4, 2, 16)
    membership = random_membership(26, 2, t, 3, 1) & jax.random.bernoulli(jax.random.key(27), 0.7, (2, t, 1))
    assert not bool(jnp.all(jnp.any(membership, axis=-1)))
    segment_ids = (jnp.arange(t)[None] >= jnp.array([[0], [20]])).astype(jnp.int32)
    expected = lambda q, k, v: reference.focus_hard_attention(q, k, v, membership, window=6, segment_ids=segment_ids)
    kernel = lambda q, k, v: ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.25, window=6,
                                                    segment_ids=segment_ids, max_groups=1, backend=backend,
                                                    **({"block_size": 16, "band_block_size": 16}
                                                       if backend == GPU_FORM else {}))
    assert_matches(expected, kernel, (q, k, v), 1e-5, f"top-1, tokens in no group ({backend})")


@pytest.mark.parametrize("dense", [False, True])
def test_segment_ids_as_far_apart_as_int32_allows(dense):
    """Segment ids whose differences overflow int32 (-2**31, 0 and 2**31 - 1) keep their documents apart and none
    is read as padding, as in the reference: Focus (top-2, a sink) and dense attention."""
    t = 40
    q, k, v = rand_qkv(28, 1, t, 2, 2, 8)
    pos = jnp.arange(t)[None]
    segment_ids = jnp.where(pos < 14, -2 ** 31, jnp.where(pos < 27, 0, 2 ** 31 - 1)).astype(jnp.int32)
    if dense:
        expected = reference.attention(q, k, v, segment_ids=segment_ids)
        got = ks.dot_product_pallas(q, k, v, multiplier=8 ** -0.5, segment_ids=segment_ids, block_size=16)
    else:
        membership = random_membership(29, 1, t, 3, 2)
        expected = reference.focus_hard_attention(q, k, v, membership, window=3, segment_ids=segment_ids, sink=2)
        got = focus_sparse_attention(q, k, v, membership, window=3, segment_ids=segment_ids, sink=2, impl="pallas",
                                     block_size=16, max_groups=2)
    assert_close(got, expected, atol=1e-5, what=f"int32-wide segment ids (dense={dense})")


@pytest.mark.parametrize("backend", [GPU_FORM, "mosaic_interpret"])
def test_the_multiplier_is_applied_inside_the_kernels(backend):
    """The logits' multiplier is applied to the float32 scores inside the kernels, and to dq and dk there: a number
    (the scale and a constant temperature: dense, focal and Focus attention) as a setting, a per-query array (a
    learned temperature) as an operand, whose gradient the dq kernels compute. Nothing of q's size is multiplied
    outside them (at 16K compiled for an H200 the scaling of q and of dq read and wrote 0.13 GB each); the
    decomposed path, which scales q, is the control. Numerics of a number against the reference with a softcap, a
    sink, segments and GQA (`test_focus_kernel_matches_reference` has per-query arrays); v's head dim differs from
    q's so that only q-sized products are counted."""
    t, d = 45, 16
    q, k, _ = rand_qkv(30, 2, t, 4, 2, d)
    v = jax.random.normal(jax.random.key(31), (2, t, 2, 8))
    membership = random_membership(32, 2, t, 3, 1)
    segment_ids = (jnp.arange(t)[None] >= jnp.array([[0], [20]])).astype(jnp.int32)
    blocks = {"block_size": 16, "band_block_size": 16} if backend == GPU_FORM else {}
    settings = dict(window=4, sink=3, softcap=20.0, segment_ids=segment_ids)
    expected = lambda q, k, v: reference.focus_hard_attention(q, k, v, membership, temperature=0.4, **settings)
    kernel = lambda q, k, v, multiplier=d ** -0.5 / 0.4: ks.focus_sparse_pallas(
        q, k, v, membership, multiplier=multiplier, backend=backend, max_groups=1, **blocks, **settings)
    assert_matches(expected, kernel, (q, k, v), 1e-5, f"a number ({backend})")
    # A traced scalar temperature goes the per-query way: its gradient sums the 360 per-query ones (here -0.26,
    # from terms whose absolute values sum to about 450: float32 cancellation, hence the tolerance).
    per_temperature = lambda attend: jax.jit(jax.grad(lambda t: jnp.sum(jnp.sin(attend(t)))))
    got = per_temperature(lambda t: kernel(q, k, v, multiplier=d ** -0.5 / t))(0.4)
    want = per_temperature(lambda t: reference.focus_hard_attention(q, k, v, membership, temperature=t,
                                                                    **settings))(0.4)
    assert_close(got, want, atol=1e-4, what=f"d temperature ({backend})")

    def products_of_q_size(attend, *multiplier):
        loss = lambda q, k, v, *m: jnp.sum(attend(q, k, v, *m))
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(3 + len(multiplier)))))(q, k, v, *multiplier).jaxpr
        return [eqn for eqn, _ in traced_equations(jaxpr)
                if eqn.primitive.name == "mul" and eqn.outvars[0].aval.shape == q.shape]

    assert products_of_q_size(kernel) == []
    assert products_of_q_size(kernel, jnp.full((2, t, 4), d ** -0.5 / 0.4)) == []
    decomposed = lambda q, k, v, temperature: focus_sparse_attention(
        q, k, v, membership, temperature=temperature, impl="decomposed", block_size=16, max_groups=1, **settings)
    assert products_of_q_size(decomposed, jnp.full((2, t, 4), 0.4))


def test_bf16_inputs_accumulate_in_float32():
    t = 64
    q, k, v = rand_qkv(5, 1, t, 4, 2, 16)
    membership = random_membership(6, 1, t, 4, 1)
    expected = lambda q, k, v: reference.focus_hard_attention(q, k, v, membership, window=8)
    kernel = lambda q, k, v: ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.25, window=8, block_size=16,
                                                    band_block_size=16)
    out = assert_matches(expected, lambda *a: kernel(*(x.astype(jnp.bfloat16) for x in a)), (q, k, v), 2e-2, "bf16")
    assert out.dtype == jnp.bfloat16


@pytest.mark.parametrize("window,backend", [(None, GPU_FORM), (0, GPU_FORM), (7, GPU_FORM), (100, GPU_FORM),
                                            (None, "mosaic_interpret"), (7, "mosaic_interpret")])
def test_dense_and_focal_through_the_kernel(window, backend):
    """No groups: every causal pair (one group) or the local band (no group), against jax.nn.dot_product_attention
    (an outside implementation) and the reference, with segments, GQA and a focal temperature."""
    t = 50
    q, k, v = rand_qkv(7, 2, t, 4, 2, 16)
    segment_ids = (jnp.arange(t)[None] >= 20).astype(jnp.int32) * jnp.ones((2, 1), jnp.int32)

    def outside(q, k, v):
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=0.25 / 0.4,
                                            local_window_size=None if window is None else (window, 0))

    kernel = lambda q, k, v: ks.dot_product_pallas(q, k, v, multiplier=0.25 / 0.4, window=window,
                                                   segment_ids=segment_ids, block_size=16,
                                                   band_block_size=16 if backend == "triton" else 8, backend=backend)
    expected = jax.jit(lambda q, k, v: reference.attention(q, k, v, temperature=0.4, window=window,
                                                           segment_ids=segment_ids))(q, k, v)
    got = assert_matches(outside, kernel, (q, k, v), 1e-5, f"window={window} vs jax.nn")
    assert_close(got, expected, atol=1e-5, what=f"window={window} vs reference")


def test_no_intermediate_is_as_large_as_t_squared():
    t = 512
    q, k, v = rand_qkv(8, 1, t, 2, 2, 8)
    membership = random_membership(9, 1, t, 4, 1)
    fn = lambda q, k, v: jnp.sum(ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=8,
                                                        block_size=16, band_block_size=8))
    sizes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            sizes.extend(int(np.prod(getattr(v.aval, "shape", ()) or (1,))) for v in eqn.outvars)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v).jaxpr)
    assert max(sizes) < t * t // 2


def test_model_impl_pallas_equals_xla():
    shape = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8)
    x = jax.random.normal(jax.random.key(10), (2, 40, 32))
    positions = jnp.broadcast_to(jnp.arange(40), (2, 40))
    for kind, extra in (("dense", {}), ("focal", {"window": 6}), ("focal_learned", {}),
                        ("focal_learned", {"tau_granularity": "head", "tau_bias": False, "tau_min": 0.05}),
                        ("focus", {"focus_topk": 1, "focus_groups": 4, "focus_window": 5}),
                        ("focal+focus", {"focus_topk": 2, "focus_groups": 4, "focus_window": 5})):
        layer = Attention(AttentionConfig(**shape, kind=kind, **extra), rngs=nnx.Rngs(0))
        forward = nnx.jit(lambda layer, x: layer(x, positions=positions))
        expected = forward(layer, x)
        layer.config = AttentionConfig(**shape, kind=kind, impl="pallas", **extra)
        assert_close(forward(layer, x), expected, atol=1e-5, what=kind)


# ------------------------------------------------------------------------------------------------ lowering


@pytest.mark.parametrize("platform,backend", [("cuda", "triton"), ("tpu", "mosaic")])
@pytest.mark.parametrize("dtype,head_dim", [(jnp.bfloat16, 128), (jnp.float32, 64)])
def test_lowers_without_a_device(platform, backend, dtype, head_dim):
    """The Triton (GPU) and Mosaic (TPU) lowerings (forward and backward; hard Focus with a sink, dense, local) run
    at trace time, so lowering, block-shape and memory-space errors surface here (two rows: a block of a per-row
    table then differs from the whole array)."""
    b, t, h, hk = 2, 256, 4, 2
    q = jnp.zeros((b, t, h, head_dim), dtype)
    k = v = jnp.zeros((b, t, hk, head_dim), dtype)
    membership = random_membership(11, b, t, 8, 1)
    temperature = jnp.ones((b, t, h))

    def loss(q, k, v, temperature):
        out = ks.focus_sparse_pallas(q, k, v, membership, multiplier=1 / temperature, window=32, sink=4,
                                     block_size=128, backend=backend)
        return jnp.sum(out.astype(jnp.float32))

    dense = lambda q, k, v: jnp.sum(ks.dot_product_pallas(q, k, v, multiplier=0.1, backend=backend))
    local = lambda q, k, v: jnp.sum(ks.dot_product_pallas(q, k, v, multiplier=0.1, window=16, backend=backend))
    custom_call = {"cuda": "triton", "tpu": "tpu_custom_call"}[platform]
    for fn, args in ((jax.grad(loss, argnums=(0, 1, 2, 3)), (q, k, v, temperature)),
                     (jax.grad(dense, argnums=(0, 1, 2)), (q, k, v)), (jax.grad(local, argnums=(0, 1, 2)), (q, k, v))):
        with lowering_target(platform):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert custom_call in text.lower()


def pallas_operands(jaxpr):
    """Shapes and dtypes of every operand and result of the `pallas_call`s in `jaxpr` and its sub-jaxprs."""
    return [(tuple(x.aval.shape), x.aval.dtype) for eqn, _ in traced_equations(jaxpr)
            if eqn.primitive.name == "pallas_call" for x in eqn.invars + eqn.outvars]


@pytest.mark.parametrize("backend", ["mosaic", "interpret"])
def test_per_token_ids_and_statistics_are_rows_on_tpus(backend):
    """Every per-token operand of the TPU kernels, the int32 ids and the float32 statistics (log-sum-exp, delta), is
    a row (`[B, C, rows]`, `[B, H, 1, rows]`): as a column `[.., rows, C]` a TPU's (8, 128) tiles pad its last
    dimension to 128 (the statistics: at 4K on a v5e the kernels needed 261 MiB instead of 113; the ids: see
    `test_tpu_walks_copy_little_tile_padding`). The GPU form reads its own block's as columns, the walked blocks'
    as rows (the dk / dv kernels walk the queries, whose scores they compute transposed)."""
    t = 256
    q, k, v = rand_qkv(15, 1, t, 2, 2, 16)
    membership = random_membership(16, 1, t, 4, 1)
    loss = lambda q, k, v: jnp.sum(ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=8,
                                                          block_size=128, backend=backend))
    operands = pallas_operands(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
    ids = [shape for shape, dtype in operands if dtype == jnp.int32 and len(shape) == 3 and max(shape) >= t]
    statistics = [shape for shape, dtype in operands if dtype == jnp.float32 and len(shape) == 4
                  and 1 in shape[2:]]
    id_columns = [shape for shape in ids if shape[1] >= t]
    statistic_columns = [shape for shape in statistics if shape[3] == 1]
    assert len(ids) == 6 * 4  # 2 own and 2 walked in each of the 6 kernels
    assert len(statistics) == 2 + 4 * 2  # lse out of the 2 forward kernels; lse and delta into the 4 backward ones
    if backend == "mosaic":
        assert id_columns == [] and statistic_columns == [], (ids, statistics)
    else:  # own blocks: ids in all 6 kernels, lse out of the forward ones and into the dq ones, delta into those
        assert len(id_columns) == 6 * 2 and len(statistic_columns) == 2 + 2 * 2, (ids, statistics)


def test_tpu_walks_copy_little_tile_padding():
    """What one step of a TPU kernel's walk copies into VMEM, as a TPU's tiles store it, is at most 1.25 times the
    data (bf16, D = 128, blocks of 128). The dk / dv kernels walked the queries' ids as columns `[128, C]`, padded
    to 128 lanes: 200 KiB per step for 67 KiB of data; now rows, 80 KiB."""
    q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    membership = jax.ShapeDtypeStruct((1, 1024, 8), jnp.bool_)
    steps = walked_step_bytes(_fused_grad("mosaic"), q, q, q, membership)
    assert [name for name, _, _ in steps] == ["focus_group", "focus_band", "focus_group_dq", "focus_group_dkv",
                                              "focus_band_dq", "focus_band_dkv"]
    assert all(stored <= 1.25 * data for _, stored, data in steps), steps
    # By hand, focus_group_dkv's slots: q and dO bf16 [128, 128] (32 KiB each, no padding); lse and delta float32
    # [1, 128], ids int32 [4, 128] and the lower-group bitmask int32 [1, 128], each stored as 8 x 128 words (4 KiB).
    kib = 1024
    assert steps[3][1:] == (2 * 32 * kib + 4 * 4 * kib, 2 * 32 * kib + 2 * 512 + 2 * kib + 512), steps[3]


@pytest.mark.parametrize("max_groups", [1, 2])
def test_no_activation_or_gradient_is_scattered(max_groups):
    """The forward's merge and the backward's return to token order gather each token's entries
    (`Plan.token_entries`), and the kernels write bf16 gradients for bf16 inputs: scatter-adds into float32 `[B,
    T + 1, H, C]` arrays were the largest buffers of the TPU form (at 4K on a v5e the kernels needed 113 MiB, the
    decomposed path 65; now 33, `test_compile_only`)."""
    q, k, v = (x.astype(jnp.bfloat16) for x in rand_qkv(17, 1, 256, 2, 1, 16))
    membership = random_membership(18, 1, 256, 4, max_groups)
    loss = lambda q, k, v: jnp.sum(ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=8,
                                                          max_groups=max_groups).astype(jnp.float32))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    scattered = [(eqn.primitive.name, eqn.outvars[0].aval) for eqn, _ in traced_equations(jaxpr)
                 if "scatter" in eqn.primitive.name and jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)]
    assert scattered == []
    backward = [eqn for eqn, _ in traced_equations(jaxpr) if eqn.primitive.name == "pallas_call"][2:]
    gradients = [x.aval.dtype for eqn in backward for x in eqn.outvars]
    assert len(gradients) == 6 and set(gradients) == {jnp.dtype(jnp.bfloat16)}, gradients


@pytest.mark.parametrize("backend", ["interpret", "mosaic"])
def test_gpu_kernels_take_activations_row_major(backend):
    """The GPU form reads q, k, v, dO and writes out, dq, dk, dv as `[B, rows, H, C]`, a program's block being a
    strided slice: no activation is transposed outside the kernels (with head-major operands, transposes moved
    0.87 of the 1.63 GB that XLA's own ops read and wrote in a forward + backward at 16K compiled for an H200). The
    TPU form, whose blocks must tile or span their last two dimensions, stays head-major (the positive control)."""
    d = 16
    q, k, v = rand_qkv(19, 1, 256, 2, 1, d)
    membership = random_membership(20, 1, 256, 4, 1)
    loss = lambda q, k, v: jnp.sum(ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=8,
                                                          block_size=128, backend=backend, max_groups=1))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    transposed = [eqn.invars[0].aval.shape for eqn, _ in traced_equations(jaxpr) if eqn.primitive.name == "transpose"
                  and eqn.invars[0].aval.ndim == 4 and eqn.invars[0].aval.shape[-1] == d]
    activations = {shape for shape, dtype in pallas_operands(jaxpr) if len(shape) == 4 and shape[-1] == d}
    if backend == "interpret":
        assert transposed == [] and all(shape[2] in (1, 2) for shape in activations), (transposed, activations)
    else:
        assert transposed and all(shape[1] in (1, 2) for shape in activations), (transposed, activations)


@pytest.mark.parametrize("backend,max_groups", [("interpret", 2), ("interpret", None), ("mosaic", 2)])
def test_gpu_kernels_gather_the_rows_of_set_a_themselves(backend, max_groups):
    """The GPU form's set-A kernels read q, k, v and dO in token order `[B, T, H, D]` and gather their entries' rows
    inside the kernel: no activation is gathered into entry order outside it (such copies were 0.94 of the 1.83 GB
    that XLA's own ops read and wrote in a forward + backward at 16K compiled for an H200, and with
    `max_groups=None` each is K times larger). The TPU form, whose kernels copy contiguous blocks by DMA, reads
    copies gathered into entry order (the positive control). T = 200 is not a multiple of the blocks, so the
    entries (2 x 200 or 4 x 200 rows, with padding) are not the tokens. (Each token is in 2 of the 4 groups,
    so `max_groups` is at least 2.)"""
    t, d = 200, 16
    q, k, v = rand_qkv(23, 1, t, 2, 1, d)
    membership = random_membership(24, 1, t, 4, 2)
    loss = lambda q, k, v: jnp.sum(ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=8,
                                                          block_size=128 if backend == "mosaic" else 64,
                                                          backend=backend, max_groups=max_groups))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    of_activations = [eqn.outvars[0].aval.shape for eqn, _ in traced_equations(jaxpr) if eqn.primitive.name == "gather"
                      and eqn.invars[0].aval.ndim == 4 and eqn.invars[0].aval.shape[1] == t]
    kernel_rows = {shape[1] for shape, _ in pallas_operands(jaxpr) if len(shape) == 4 and shape[-1] == d}
    if backend == "interpret":
        assert of_activations == [], of_activations
        assert t in kernel_rows, kernel_rows
    else:
        assert of_activations, of_activations


@pytest.mark.parametrize("max_groups", [1, 2])
def test_top1_results_reach_token_order_inside_the_kernels(max_groups):
    """With one entry per token the GPU form's set-A backward kernels store dq, dk and dv at their entries' tokens
    and set B's kernels add them to their own in place: no gradient is gathered back from entry order and summed
    outside (at 16K compiled for an H200 that return read and wrote 0.60 of the 0.96 GB that XLA's own ops moved).
    Likewise set B's forward kernel reads set A's output and log-sum-exp at its tokens' entries and merges them
    with its own. With two entries per token (the control) the forward's merge gathers each token's entries of set
    A's output, and the backward those of dq, dk and dv."""
    t, d = 200, 16
    q, k, v = rand_qkv(28, 1, t, 2, 1, d)
    membership = random_membership(29, 1, t, 4, max_groups)
    loss = lambda q, k, v: jnp.sum(ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=8,
                                                          backend="interpret", max_groups=max_groups))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    from_entries = [eqn.invars[0].aval.shape for eqn, _ in traced_equations(jaxpr) if eqn.primitive.name == "gather"
                    and eqn.invars[0].aval.ndim == 4 and eqn.invars[0].aval.shape[-1] == d
                    and eqn.invars[0].aval.shape[1] != t]
    assert len(from_entries) == (0 if max_groups == 1 else 4), from_entries


@pytest.mark.parametrize("dense", [True, False])
def test_dense_attention_through_the_kernels_gathers_nothing(dense):
    """With every token in the one group (`dot_product_pallas`, no window) set A's entries are the tokens in order:
    nothing is gathered, and the outputs come back sliced (at 16K compiled for an H200 the ops around the kernels
    read and wrote 0.95 GB with gathers, 0.41 without). Focus with two entries per token (the control) gathers
    its outputs back to token order."""
    d = 16
    q, k, v = rand_qkv(21, 1, 200, 2, 1, d)
    membership = random_membership(22, 1, 200, 4, 2)
    attend = ((lambda q, k, v: ks.dot_product_pallas(q, k, v, multiplier=0.3)) if dense else
              (lambda q, k, v: ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=8, max_groups=2)))
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1, 2)))(q, k, v).jaxpr
    gathers = [eqn.outvars[0].aval.shape for eqn, _ in traced_equations(jaxpr) if eqn.primitive.name == "gather"
               and eqn.outvars[0].aval.shape[-1] == d]
    assert (gathers == []) if dense else gathers, gathers


def test_target_platform_sets_the_default_backend():
    here = ks.default_backend()  # 'interpret' on CPU
    assert here == {"gpu": "triton", "tpu": "mosaic"}.get(jax.default_backend(), "interpret")
    assert ks.platform() == jax.default_backend()
    with ks.target_platform("gpu"):
        assert ks.default_backend() == "triton" and ks.platform() == "gpu"
        with ks.target_platform("tpu"):
            assert ks.default_backend() == "mosaic"
        assert ks.default_backend() == "triton"
    with ks.target_platform("cpu"):
        assert ks.default_backend() == "interpret"
    assert ks.default_backend() == here and ks.platform() == jax.default_backend()


def test_a_function_traced_before_target_platform_is_lowered_with_that_platforms_kernels():
    """The backend is chosen at trace time, which jax's trace cache does not key on: a function traced on this CPU
    and then lowered for 'cuda' inside target_platform('gpu') reused the CPU interpreter's program (no Triton
    kernel), and one traced inside it leaked the Triton kernels into a later CPU trace. target_platform clears the
    caches on entering and leaving."""
    q = jnp.zeros((1, 64, 2, 16), jnp.bfloat16)
    membership = random_membership(3, 1, 64, 4, 1)

    def f(q):
        return jnp.sum(focus_sparse_attention(q, q, q, membership, window=4, impl="pallas").astype(jnp.float32))

    def lowered_with_triton():
        text = jax.jit(f).trace(q).lower(lowering_platforms=("cuda",)).as_text()
        return "triton" in text.lower()

    assert not lowered_with_triton()  # (what the docstring warns of: the interpreter's kernels)
    with ks.target_platform("gpu"):
        assert lowered_with_triton()
    assert not lowered_with_triton()


def test_bad_backend_tpu_block_sizes_triton_launch_and_multiplier_name_the_value():
    q, k, v = rand_qkv(13, 1, 16, 2, 2, 8)
    membership = random_membership(14, 1, 16, 2, 1)
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=4, backend="cuda")
    with pytest.raises(ValueError, match="multiples of 128, got block_size=64, band_block_size=128"):
        ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=4, block_size=64, backend="mosaic")
    with pytest.raises(ValueError, match="num_warps must be one of 1, 2, 4, 8, 16, got num_warps=6"):
        ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=4, num_warps=6)
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1, got num_stages=0"):
        ks.dot_product_pallas(q, k, v, multiplier=0.3, num_stages=0)
    with pytest.raises(ValueError, match=r"broadcastable to \[batch, seq, heads\] = \(1, 16, 2\), got shape \(16, 3\)"):
        ks.dot_product_pallas(q, k, v, multiplier=jnp.ones((16, 3)))
    q, k, v = rand_qkv(13, 1, 4, 4, 4, 8)  # seq == heads: a [batch, seq] multiplier would broadcast as [seq, heads]
    with pytest.raises(ValueError, match=r"= \(1, 4, 4\), got shape \(1, 4\)"):
        ks.dot_product_pallas(q, k, v, multiplier=jnp.ones((1, 4)))
    for bad in (-1.0, 0.0, -jnp.ones((1, 4, 4))):  # ran (focus_sparse_attention refuses such a scale / temperature)
        with pytest.raises(ValueError, match="multiplier must be > 0"):
            ks.dot_product_pallas(q, k, v, multiplier=bad)


# ------------------------------------------------------------------------------------------------ the block plan


# The block plan under jit (outside it, each of its operations would compile on its own).
jitted_plan = jax.jit(ks.plan, static_argnums=(2, 3), static_argnames="max_groups")


def visited_pairs(plan, t, window, block, band_block):
    """Every (query token, key token) pair inside a visited block, as a set (small T only)."""
    pairs = set()
    token = np.asarray(plan.entry_token)
    first = np.asarray(plan.first_key_block)
    for query_block, start in enumerate(first):
        for key_block in range(start, query_block + 1):
            for i in token[query_block * block:(query_block + 1) * block]:
                for j in token[key_block * block:(key_block + 1) * block]:
                    pairs.add((int(i), int(j)))
    for query_block in range(-(-t // band_block)):
        band_start, band_end = (int(x) for x in ks.band_key_blocks(query_block, window=window, block=band_block))
        for key_block in range(band_start, band_end + 1):
            for i in range(query_block * band_block, (query_block + 1) * band_block):
                for j in range(key_block * band_block, (key_block + 1) * band_block):
                    pairs.add((i, j))
    return pairs


@pytest.mark.parametrize("groups,k", [(4, 1), (5, 2)])
def test_plan_covers_every_allowed_pair(groups, k):
    """The kernels' visited blocks hold every pair of `focus_mask` without a sink (a sink's other pairs are set C,
    `focal_jax.attention.sink`)."""
    t, window, block, band_block = 70, 6, 16, 8
    membership = random_membership(12, 1, t, groups, k)
    segment_ids = (jnp.arange(t)[None] >= 30).astype(jnp.int32)
    plan = jitted_plan(membership[0], segment_ids[0], block, band_block)
    allowed = np.asarray(reference.focus_hard_mask(membership, window=window, segment_ids=segment_ids))[0]
    visited = visited_pairs(plan, t, window, block, band_block)
    missing = [(i, j) for i, j in zip(*np.nonzero(allowed)) if (int(i), int(j)) not in visited]
    assert not missing


@pytest.mark.parametrize("groups,k,max_groups", [(4, 1, 1), (5, 3, None), (5, 3, 2), (40, 2, 2)])
def test_plan_token_entries_are_the_entries_of_each_token(groups, k, max_groups):
    """`token_entries[t]` lists, in group order, the entries whose `entry_token` is t, then E (none); with
    `max_groups` below k a token keeps its lowest groups. 40 groups: more groups than T = 21 tokens, two bitmask
    words."""
    t, block = 21, 8
    membership = random_membership(3, 1, t, groups, k)[0]
    plan = jitted_plan(membership, jnp.zeros(t, jnp.int32), block, 8, max_groups=max_groups)
    token, group = np.asarray(plan.entry_token), np.asarray(plan.entry_group)
    entries = np.asarray(plan.token_entries)
    slots = min(max_groups or groups, groups)
    assert entries.shape == (t, slots)
    for i in range(t):
        kept = np.flatnonzero(np.asarray(membership[i]))[:slots]
        expected = [int(np.flatnonzero((token == i) & (group == g))[0]) for g in kept]
        assert list(entries[i]) == expected + [len(token)] * (slots - len(expected)), i


@pytest.mark.parametrize("block", [64, 128])  # the GPU default and the TPU one
def test_plan_cost_is_near_the_pair_count_for_balanced_groups(block):
    """Visited block area (set A blocks + set B blocks) within 10% of the allowed pairs, for balanced groups."""
    t, groups, window, band_block = 32768, 8, 128, 32
    group = np.random.default_rng(0).permutation(np.arange(t) % groups)
    membership = jnp.asarray(group[:, None] == np.arange(groups))
    plan = jitted_plan(membership, jnp.zeros(t, jnp.int32), block, band_block, max_groups=1)
    assert plan.entry_token.shape == (t,)
    first = np.asarray(plan.first_key_block)
    a_blocks = int(np.sum(np.maximum(np.arange(len(first)) - first + 1, 0)))
    b_blocks = 0
    for query_block in range(t // band_block):
        start, end = (int(x) for x in ks.band_key_blocks(query_block, window=window, block=band_block))
        b_blocks += end - start + 1
    counts = np.bincount(group, minlength=groups)
    same_group = int(np.sum(counts * (counts + 1) // 2))
    cross_local = sum(int(np.sum(group[d:] != group[:t - d])) for d in range(1, window + 1))
    visited = a_blocks * block * block + b_blocks * band_block * band_block
    assert visited >= same_group + cross_local
    assert visited / (same_group + cross_local) < 1.10


def test_dot_product_pallas_refuses_bad_inputs_by_name():
    """`dot_product_pallas` is public (README): shapes and settings it cannot run are errors naming the value, not a
    silent run (k shorter than q read past its end; a NaN multiplier or window=-1 gave zeros)."""
    q, k, v = rand_qkv(0, 1, 9, 2, 2, 8)
    attend = lambda q=q, k=k, v=v, **kw: ks.dot_product_pallas(q, k, v, **{"multiplier": 0.3, **kw})
    with pytest.raises(ValueError, match="q seq=9 and k seq=5"):
        attend(k=k[:, :5], v=v[:, :5])
    with pytest.raises(ValueError, match="got q heads=2 and k heads=3"):
        attend(k=jnp.ones((1, 9, 3, 8)), v=jnp.ones((1, 9, 3, 8)))
    with pytest.raises(ValueError, match="window=-1"):
        attend(window=-1)
    with pytest.raises(ValueError, match="segment_ids must be an integer array, got dtype float32"):
        attend(segment_ids=jnp.zeros((1, 9)))
    with pytest.raises(ValueError, match="softcap=0.0"):
        attend(softcap=0.0)
    with pytest.raises(ValueError, match="multiplier=nan"):
        attend(multiplier=float("nan"))
    with pytest.raises(ValueError, match="block_size must be None or an integer >= 1, got block_size=0"):
        attend(block_size=0)
    with pytest.raises(ValueError, match="band_block_size must be None or an integer >= 1, got band_block_size=8.0"):
        attend(window=2, band_block_size=8.0)


def test_focus_sparse_pallas_refuses_bad_inputs_by_name():
    """`focus_sparse_pallas` is public too (README: its `mesh=`, `num_warps`) and checked nothing of what
    `focus_sparse_attention` checks: k heads not dividing q's, window=-1, a float membership and a negative softcap
    ran silently; a window or sink of None, a 2-d membership and short segment_ids failed in a TypeError or
    unpacking error naming nothing."""
    q, k, v = rand_qkv(0, 1, 16, 2, 2, 8)
    membership = topk_membership(jax.random.normal(jax.random.key(1), (1, 16, 3)), 1)
    attend = lambda q=q, k=k, v=v, membership=membership, **kw: ks.focus_sparse_pallas(
        q, k, v, membership, **{"multiplier": 0.3, "window": 2, **kw})
    assert attend().shape == (1, 16, 2, 8)
    for kwargs, message in [
            (dict(k=jnp.ones((1, 16, 3, 8)), v=jnp.ones((1, 16, 3, 8))), "got q heads=2 and k heads=3"),
            (dict(k=k[:, :5], v=v[:, :5]), "q seq=16 and k seq=5"),
            (dict(window=-1), "got window=-1"),
            (dict(window=None), "got window=None"),
            (dict(sink=None), "got sink=None"),
            (dict(membership=membership[..., 0]), r"membership must have shape \[batch, seq, K\] = \[1, 16, K\]"),
            (dict(membership=membership.astype(jnp.float32)), "membership must be a bool array"),
            (dict(segment_ids=jnp.zeros((1, 15), jnp.int32)), r"segment_ids must have shape .* got shape \(1, 15\)"),
            (dict(softcap=-1.0), "softcap=-1.0"),
            (dict(multiplier="a"), "multiplier must be a number or an array"),
            (dict(multiplier=float("inf")), "multiplier=inf"),
            (dict(max_groups=0), "max_groups=0"),
            (dict(membership=jnp.ones((1, 16, 3), bool), max_groups=2), "a token of membership is in 3 groups")]:
        with pytest.raises(ValueError, match=message):
            attend(**kwargs)


@pytest.mark.parametrize("head_dim,dv,block", [(24, 24, 64), (16, 80, 64), (16, 16, 48)])
def test_triton_refuses_shapes_its_lowering_cannot_take_by_name(head_dim, dv, block):
    """Pallas's Triton lowering takes power-of-two block shapes only: a head dim of 24 or 80 (or a block of 48)
    failed deep in the lowering ("all operations have array arguments ... power of 2", an array (64, 24)), naming
    neither the head dim nor the block."""
    q, k, v = rand_qkv(0, 1, 64, 2, 2, head_dim, dv)
    membership = random_membership(1, 1, 64, 4, 1)
    fn = lambda q, k, v: jnp.sum(ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.3, window=4,
                                                        block_size=block, backend="triton"))
    bad = {24: "head_dim=24", 80: "v head_dim=80", 48: "block_size=48"}
    with pytest.raises(ValueError, match=bad[head_dim if head_dim == 24 else dv if dv == 80 else block]):
        with lowering_target("cuda"):
            jax.jit(jax.grad(fn)).trace(q, k, v).lower(lowering_platforms=("cuda",))
