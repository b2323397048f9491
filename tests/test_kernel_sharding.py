"""The Pallas kernels inside a partitioned (multi-device) jitted step: under a mesh they run per shard
(`focal_jax.kernels.partition`, a `shard_map` over batch and heads), with the same values and gradients as the
reference, and no all-gather of their operands; their GPU and TPU lowerings see per-shard shapes. 8 fake CPU
devices (conftest), interpret mode."""

import math
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from focal_jax import attention as fa
from focal_jax.attention import focus_sparse_attention, reference, topk_membership
from focal_jax.eval.decode import greedy_decode
from focal_jax.kernels import focus_sparse as ks
from focal_jax.kernels.partition import Layout, layout
from focal_jax.nn.attention import Attention, AttentionConfig
from focal_jax.nn.generate import generate, init_cache
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.train.sharding import batch_sharding, tree_shardings
from helpers import assert_close, lowering_target, rand_qkv

pytestmark = pytest.mark.usefixtures("fast_compiles")

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")


def make_mesh(shape):
    """A mesh over the first prod(shape) devices, Auto axes as the trainer's `make_mesh`."""
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=jax.devices()[:math.prod(shape)])


def pallas_operand_shapes(fn, *args):
    """The operand shapes of every `pallas_call` in the jaxpr of `fn(*args)` (nested jaxprs included)."""
    calls = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                calls.append([tuple(v.aval.shape) for v in eqn.invars])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return calls


def assert_per_shard(calls, batch, heads, head_axis=2):
    """Every kernel operand has `batch` rows, and the query-head operands `heads` heads: activations are `[B, rows,
    H, C]` in the GPU form (`head_axis` 2; its per-row statistics `[B, H, rows, 1]` not counted) and `[B, H, rows,
    C]` in the TPU form (1)."""
    assert calls
    for shapes in calls:
        assert {s[0] for s in shapes} == {batch}, shapes
        assert max(s[head_axis] for s in shapes if len(s) == 4 and s[-1] > 1) == heads, shapes


def test_layout_splits_batch_and_heads_where_the_axes_divide():
    mesh = make_mesh((2, 2, 2))
    assert layout(None, 4, 4, 2) == Layout(None, None, 1)
    assert layout(mesh, 4, 4, 2) == Layout(("data", "fsdp"), ("tensor",), 1)
    assert layout(mesh, 2, 4, 4) == Layout(("data",), ("tensor",), 1)  # fsdp does not divide the rest
    assert layout(mesh, 3, 4, 1) == Layout(None, ("tensor",), 2)       # MQA: the kv head repeated per shard
    assert layout(mesh, 4, 6, 3) == Layout(("data", "fsdp"), ("tensor",), 2)
    assert layout(mesh, 4, 3, 1) == Layout(("data", "fsdp"), None, 1)  # 3 heads on 2: replicated
    assert layout(make_mesh((1, 1, 1)), 4, 4, 2) == Layout(None, None, 1)


CASES = {  # name: (mesh shape (data, fsdp, tensor), batch, heads, kv heads)
    "GQA, batch over data x fsdp, heads over tensor": ((2, 2, 2), 4, 4, 2),
    "MQA, the kv head repeated per tensor shard": ((2, 1, 2), 2, 4, 1),
    "heads that tensor does not divide, replicated": ((2, 1, 2), 2, 3, 1),
}
CONTRAST = "GQA, batch over data x fsdp, heads over tensor"  # also compiled outside the mesh context


@pytest.mark.parametrize("name", CASES)
def test_focus_sparse_pallas_per_shard_equals_reference(name):
    """A jitted loss + gradient (q, k, v and a per-query temperature) through `focus_sparse_attention(
    impl='pallas')` on sharded inputs under `jax.set_mesh`, with an attention sink of 3 (set C, computed by XLA
    outside the kernels): equal to the unsharded reference, each kernel sees its shard only, and (when the heads
    split) the compiled step gathers nothing, while the same step outside the mesh context gathers the kernels'
    operands."""
    shape, b, h, hk = CASES[name]
    mesh, t, d = make_mesh(shape), 40, 8
    q, k, v = rand_qkv(len(name), b, t, h, hk, d)
    temperature = jax.random.uniform(jax.random.key(1), (b, t, h), minval=0.5, maxval=2.0)
    membership = topk_membership(jax.random.normal(jax.random.key(2), (b, t, 3)), 2)
    segment_ids = (jnp.arange(t)[None] >= jnp.arange(b)[:, None] * 5 + 15).astype(jnp.int32)

    def loss(attend):
        def fn(q, k, v, temperature, membership, segment_ids):
            out = attend(q, k, v, membership, window=5, temperature=temperature, segment_ids=segment_ids, sink=3)
            return jnp.sum(jnp.sin(out)), out
        return jax.value_and_grad(fn, argnums=(0, 1, 2, 3), has_aux=True)

    pallas = lambda *a, **kw: focus_sparse_attention(*a, **kw, impl="pallas", block_size=16)
    (_, expected), expected_grads = loss(reference.focus_hard_attention)(q, k, v, temperature, membership,
                                                                         segment_ids)

    tensor = lambda n: "tensor" if n % mesh.shape["tensor"] == 0 else None  # as the trainer's projections
    specs = (P(BATCH, None, tensor(h)), P(BATCH, None, tensor(hk)), P(BATCH, None, tensor(hk)),
             P(BATCH, None, tensor(h)), P(BATCH), P(BATCH))
    shardings = [NamedSharding(mesh, s) for s in specs]
    args = [jax.device_put(x, s) for x, s in zip((q, k, v, temperature, membership, segment_ids), shardings)]
    step = jax.jit(loss(pallas))
    split = layout(mesh, b, h, hk)
    with jax.set_mesh(mesh):
        (_, out), grads = step(*args)
        calls = pallas_operand_shapes(step, *args)
        compiled = step.lower(*args).compile().as_text() if split.heads else None
    assert_close(out, expected, atol=1e-5, what=f"{name}: out")
    for what, g, e in zip("qkvt", grads, expected_grads):
        assert_close(g, e, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(e)))), what=f"{name}: d{what}")

    assert_per_shard(calls, b // math.prod(mesh.shape[a] for a in split.batch),
                     h // mesh.shape["tensor"] if split.heads else h)
    if split.heads:
        assert "all-gather" not in compiled
    if name == CONTRAST:
        outside = step.lower(*args).compile().as_text()  # no mesh context: XLA gathers around the opaque kernel
        assert "all-gather" in outside
        assert_per_shard(pallas_operand_shapes(step, *args), b, h)


@pytest.mark.parametrize("kind,extra", [("focal_learned", {}),
                                        ("focus", {"focus_topk": 2, "focus_groups": 3, "focus_window": 5})])
def test_model_pallas_equals_xla_in_a_sharded_train_step(kind, extra):
    """The model's `impl='pallas'` in a jitted loss + gradient over parameters sharded by the trainer's rules and
    a batch split over data x fsdp (mesh 2 x 2 x 2, GQA 4 / 2 heads), under `jax.set_mesh`: equal to
    `impl='xla'`, with the kernels on per-shard operands."""
    mesh = make_mesh((2, 2, 2))
    b, t, shape = 4, 40, dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8)
    layer = Attention(AttentionConfig(**shape, kind=kind, **extra), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(3), (b, t, 32))
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    segment_ids = (jnp.arange(t)[None] >= jnp.arange(b)[:, None] * 4 + 20).astype(jnp.int32)

    def step(impl):
        config = AttentionConfig(**shape, kind=kind, impl=impl, **extra)

        def loss(params, x, positions, segment_ids):
            model = nnx.merge(graphdef, params)
            model.config = config
            return jnp.mean(jnp.sin(model(x, positions=positions, segment_ids=segment_ids)))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    expected = step("xla")(params, x, positions, segment_ids)
    params = jax.device_put(params, tree_shardings(params, mesh))
    assert params["q_proj"]["kernel"].sharding.spec == P("fsdp", "tensor")
    batch = [jax.device_put(a, batch_sharding(mesh)) for a in (x, positions, segment_ids)]
    pallas = step("pallas")
    with jax.set_mesh(mesh):
        got = pallas(params, *batch)
        calls = pallas_operand_shapes(pallas, params, *batch)
    assert_per_shard(calls, 1, 2)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        e = expected
        for key in path:
            e = e[key.idx if hasattr(key, "idx") else key.key]
        assert_close(g, e, atol=1e-5 * max(1.0, float(jnp.max(jnp.abs(e)))), what=f"{kind} {path}")


@pytest.mark.parametrize("platform,backend", [("cuda", "triton"), ("tpu", "mosaic")])
def test_lowering_on_a_mesh_sees_per_shard_shapes(platform, backend):
    """Lowered for CUDA / TPU without any such device, under an abstract 2 x 1 x 2 mesh: every Triton / Mosaic
    call (forward and backward) reads the shard's 2 of 4 rows and 2 of 4 heads (1 of 2 kv heads)."""
    b, t, h, hk, d = 4, 256, 4, 2, 64
    q = jnp.zeros((b, t, h, d), jnp.bfloat16)
    k = v = jnp.zeros((b, t, hk, d), jnp.bfloat16)
    membership = topk_membership(jax.random.normal(jax.random.key(4), (b, t, 8)), 1)

    def loss(q, k, v):
        out = ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.1, window=32, block_size=128,
                                     backend=backend)
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    with lowering_target(platform, (2, 1, 2)):
        text = grad.trace(q, k, v).lower(lowering_platforms=(platform,)).as_text()
    custom_call = {"cuda": "triton", "tpu": "tpu_custom_call"}[platform]
    calls = [line for line in text.splitlines() if "custom_call" in line and custom_call in line.lower()]
    assert len(calls) == 6  # two sets x (forward, dq, dk / dv)
    operands = [line[line.rindex(" : (") + 4:line.rindex(") -> ")] for line in calls]
    shapes = [[tuple(int(n) for n in dims.rstrip("x").split("x")) for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", x)]
              for x in operands]
    assert_per_shard(shapes, 2, 2, head_axis=2 if backend == "triton" else 1)  # 2 of 4 rows, 2 of 4 query heads


def test_explicit_mesh_that_splits_nothing_runs_the_kernels():
    """Under `jax.set_mesh` of a mesh with Explicit axes (sharding in types), a call that no axis can split (one
    batch row on 'data' = 2) still runs through `shard_map`: called directly, the kernels failed with a
    ShardingTypeError."""
    q, k, v = rand_qkv(7, 1, 9, 2, 2, 8)
    membership = topk_membership(jax.random.normal(jax.random.key(8), (1, 9, 3)), 1)
    mesh = jax.make_mesh((2, 1, 1), AXES, axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:2])
    attend = lambda q, k, v: focus_sparse_attention(q, k, v, membership, window=2, impl="pallas", block_size=8)
    with jax.set_mesh(mesh):
        got, grads = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(attend(*a))), argnums=(0, 1, 2)))(q, k, v)
    reference_loss = lambda *a: jnp.sum(jnp.sin(reference.focus_hard_attention(*a, membership, window=2)))
    expected, expected_grads = jax.value_and_grad(reference_loss, argnums=(0, 1, 2))(q, k, v)
    assert_close(got, expected, atol=1e-4, what="loss")
    for name, g, e in zip("qkv", grads, expected_grads):
        assert_close(g, e, atol=1e-5, what=f"d{name}")


def test_a_mesh_argument_and_an_outer_shard_map():
    """`mesh=` outside any `jax.set_mesh` context splits the call as that context would; inside an outer
    `shard_map` (every axis manual) the kernels run on the shard they are given and split nothing again."""
    mesh, t = make_mesh((2, 1, 2)), 24
    q, k, v = rand_qkv(9, 2, t, 4, 2, 8)
    membership = topk_membership(jax.random.normal(jax.random.key(10), (2, t, 3)), 1)
    expected = reference.focus_hard_attention(q, k, v, membership, window=3)

    def attend(q, k, v, membership, mesh=None):
        return ks.focus_sparse_pallas(q, k, v, membership, multiplier=8 ** -0.5, window=3, block_size=8,
                                      band_block_size=8, max_groups=1, mesh=mesh)

    given = lambda *a: attend(*a, mesh=mesh)
    assert_close(jax.jit(given)(q, k, v, membership), expected, atol=1e-5, what="mesh= argument")
    assert_per_shard(pallas_operand_shapes(given, q, k, v, membership), 1, 2)

    outer = jax.shard_map(attend, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    assert_close(jax.jit(outer)(q, k, v, membership), expected, atol=1e-5, what="inside shard_map")
    assert_per_shard(pallas_operand_shapes(outer, q, k, v, membership), 1, 4)


def test_inside_a_shard_map_that_checks_varying_axes():
    """A user's `jax.shard_map` checks by default (`check_vma=True`) that loop carries and kernel outputs vary over
    the mesh axes their inputs vary over: the decomposed path's zero accumulators and the kernels' output shapes
    did not (a scan TypeError; a ValueError asking for `manual_axis_type`). Values and gradients as the reference,
    with q, k, v split over 'data' and 'tensor' and the membership over 'data' only. Pallas's own interpreter
    (backend 'interpret', the CPU default) slices with indices that do not vary: refused by name."""
    mesh, t = make_mesh((2, 1, 2)), 24
    q, k, v = rand_qkv(11, 2, t, 4, 2, 8)
    membership = topk_membership(jax.random.normal(jax.random.key(12), (2, t, 3)), 1)
    heads, rows = P("data", None, "tensor"), P("data")
    loss = lambda attend: lambda q, k, v, m: jnp.sum(jnp.sin(attend(q, k, v, m)))
    expected = jax.value_and_grad(loss(lambda q, k, v, m: reference.focus_hard_attention(q, k, v, m, window=3)),
                                  argnums=(0, 1, 2))(q, k, v, membership)
    paths = {
        "decomposed": lambda q, k, v, m: focus_sparse_attention(q, k, v, m, window=3, impl="decomposed", block_size=8),
        "mosaic_interpret": lambda q, k, v, m: ks.focus_sparse_pallas(q, k, v, m, multiplier=8 ** -0.5, window=3,
                                                                      block_size=8, band_block_size=8,
                                                                      backend="mosaic_interpret"),
    }
    for name, attend in paths.items():
        inner = jax.shard_map(attend, mesh=mesh, in_specs=(heads, heads, heads, rows), out_specs=heads)
        got = jax.jit(jax.value_and_grad(loss(inner), argnums=(0, 1, 2)))(q, k, v, membership)
        assert_close(got[0], expected[0], atol=1e-4, what=f"{name} loss")
        for d, g, e in zip("qkv", got[1], expected[1]):
            assert_close(g, e, atol=1e-5, what=f"{name} d{d}")
    interpreted = jax.shard_map(lambda q, k, v, m: focus_sparse_attention(q, k, v, m, window=3, impl="pallas"),
                                mesh=mesh, in_specs=(heads, heads, heads, rows), out_specs=heads)
    with pytest.raises(ValueError, match=r"backend='interpret'.*check_vma=True.*\['data', 'tensor'\].*"
                                         r"focus_sparse_pallas\(\.\.\., backend='mosaic_interpret'\)"):
        jax.jit(interpreted)(q, k, v, membership)


@pytest.mark.parametrize("platform,backend", [("cuda", "triton"), ("tpu", "mosaic")])
def test_lowering_inside_a_shard_map_that_checks_varying_axes(platform, backend):
    """The Triton / Mosaic kernels (forward and backward) inside a user's `jax.shard_map` with `check_vma=True`,
    lowered for CUDA / TPU without such a device: their outputs state the axes they vary over."""
    b, t, h, hk, d = 4, 256, 4, 2, 64
    q = jnp.zeros((b, t, h, d), jnp.bfloat16)
    k = v = jnp.zeros((b, t, hk, d), jnp.bfloat16)
    membership = topk_membership(jax.random.normal(jax.random.key(4), (b, t, 8)), 1)

    def loss(q, k, v, membership):
        out = ks.focus_sparse_pallas(q, k, v, membership, multiplier=0.1, window=32, block_size=128, backend=backend)
        return jnp.sum(out.astype(jnp.float32))

    heads = P("data", None, "tensor")
    with lowering_target(platform, (2, 1, 2)):
        grad = jax.shard_map(jax.grad(loss, argnums=(0, 1, 2)), mesh=jax.sharding.get_abstract_mesh(),
                             in_specs=(heads, heads, heads, P("data")), out_specs=heads)
        text = jax.jit(grad).trace(q, k, v, membership).lower(lowering_platforms=(platform,)).as_text()
    custom_call = {"cuda": "triton", "tpu": "tpu_custom_call"}[platform]
    assert len([line for line in text.splitlines() if "custom_call" in line and custom_call in line.lower()]) == 6


def test_attention_functions_under_an_explicit_mesh():
    """Under `jax.set_mesh` of a mesh with Explicit axes (`jax.make_mesh`'s default), with q, k, v split over
    'data' (batch) and 'tensor' (heads; one kv head a device) and the routing inputs over 'data': every public
    function gives the unsharded call's values, sharded as its inputs (`jnp.repeat` of the kv heads, `jnp.unique`
    and `vmap` of the segment reductions and the decomposed path's `lax.map` over the batch raised before), and
    the attention functions their gradients, sharded as q, k, v. The Focus functions with a sink of 2 (each
    document's; the fast paths' set C gathered in XLA), `focus_sparse_attention` with one of 20 (set C in two steps
    of 16, a `lax.scan`)."""
    mesh = jax.make_mesh((2, 1, 2), AXES, axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:4])
    b, t = 4, 24
    q, k, v = rand_qkv(13, b, t, 4, 2, 8)
    scores = jax.random.normal(jax.random.key(14), (b, t, 3))
    x, w_tau = jax.random.normal(jax.random.key(15), (b, t, 16)), jax.random.normal(jax.random.key(16), (16,))
    args = (q, k, v, scores, topk_membership(scores, 1), jnp.zeros((b, t), jnp.int32).at[:, 13:].set(1), x)
    sparse = lambda impl: lambda q, k, v, s, m, seg, x: focus_sparse_attention(
        q, k, v, m, window=3, impl=impl, block_size=8, segment_ids=seg, temperature=0.7, sink=20)
    attention = {
        "dot_product_attention": lambda q, k, v, s, m, seg, x: fa.dot_product_attention(q, k, v, window=5,
                                                                                          segment_ids=seg),
        "focal_attention": lambda q, k, v, s, m, seg, x: fa.focal_attention(q, k, v, temperature=0.5,
                                                                            segment_ids=seg),
        "focus_attention": lambda q, k, v, s, m, seg, x: fa.focus_attention(q, k, v, s, window=3, segment_ids=seg,
                                                                            sink=2),
        **{f"focus_sparse_attention {impl}": sparse(impl) for impl in ("reference", "decomposed", "pallas")},
    }
    routing = {
        "sinkhorn": lambda q, k, v, s, m, seg, x: fa.sinkhorn(s, segment_ids=seg),
        "sinkhorn causal": lambda q, k, v, s, m, seg, x: fa.sinkhorn(s, segment_ids=seg, causal=True, unroll=False),
        "focus_mask": lambda q, k, v, s, m, seg, x: fa.focus_mask(m, window=3, segment_ids=seg, sink=2),
        "learned_temperature": lambda q, k, v, s, m, seg, x: fa.learned_temperature(x, w_tau, tau_min=0.5,
                                                                                     tau_max=8.0, segment_ids=seg),
    }
    want = {name: fn(*args) for name, fn in {**attention, **routing}.items()}
    loss = lambda fn: lambda q, k, v, *rest: jnp.sum(jnp.sin(fn(q, k, v, *rest)))
    want_grads = {name: jax.grad(loss(fn), argnums=(0, 1, 2))(*args) for name, fn in attention.items()}
    heads, rows = P("data", None, "tensor"), P("data")
    leading = lambda spec: (tuple(spec) + (None,) * 3)[:3]
    with jax.set_mesh(mesh):
        sharded = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, (heads,) * 3 + (rows,) * 4)]
        for name, fn in {**attention, **routing}.items():
            got = jax.jit(fn)(*sharded)
            assert leading(jax.typeof(got).sharding.spec) == leading(heads if name in attention else rows), name
            assert_close(got, want[name], atol=1e-5, what=name)
        for name, fn in attention.items():
            grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(*sharded)
            for d, g, e in zip("qkv", grads, want_grads[name]):
                assert leading(jax.typeof(g).sharding.spec) == leading(heads), (name, d, jax.typeof(g))
                assert_close(g, e, atol=1e-5, what=f"{name} d{d}")


def test_models_generate_and_decode_under_an_explicit_mesh():
    """`Llama` (dense, soft and hard Focus) and `GPT2` called under a mesh with Explicit axes on tokens split over
    'data': the unsharded logits, split over the batch as the tokens (their embedding gather raised before); so
    do `generate` and `greedy_decode`, whose jitted steps took the model's parameters onto that mesh."""
    mesh = jax.make_mesh((2, 1, 2), AXES, axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:4])
    focus = dict(kind="focal+focus", focal_t=0.4, focus_window=2, focus_groups=4, focus_dim=8)
    models = {name: Llama(LlamaConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                      intermediate=48, attn=attn), rngs=nnx.Rngs(0))
              for name, attn in [("dense", {}), ("soft focus", focus),
                                 ("hard focus", dict(focus, focus_topk=1, impl="decomposed"))]}
    models["gpt2"] = GPT2(GPT2Config(vocab_size=61, n_positions=32, d_model=32, n_layers=2, n_heads=4),
                          rngs=nnx.Rngs(1))
    tokens = jax.random.randint(jax.random.key(17), (4, 12), 0, 61)
    want = {name: model(tokens) for name, model in models.items()}
    want_generated = generate(models["gpt2"], tokens[:, :5], max_new_tokens=4)
    want_decoded = greedy_decode(models["gpt2"], [[1, 2, 3], [4, 5]], max_new_tokens=4)
    with jax.set_mesh(mesh):
        split = jax.device_put(tokens, NamedSharding(mesh, P(BATCH)))
        for name, model in models.items():
            got = nnx.jit(lambda model, tokens: model(tokens))(model, split)
            assert jax.typeof(got).sharding.spec[0] == BATCH, (name, jax.typeof(got))
            assert_close(got, want[name], atol=1e-5, what=name)
        np.testing.assert_array_equal(generate(models["gpt2"], split[:, :5], max_new_tokens=4), want_generated)
        assert greedy_decode(models["gpt2"], [[1, 2, 3], [4, 5]], max_new_tokens=4) == want_decoded


def test_models_whose_parameters_and_cache_live_on_an_explicit_mesh():
    """A model whose parameters were placed on a mesh with Explicit axes (`device_put`, or any `nnx.jit` there),
    called eagerly, under `nnx.jit` and `nnx.grad`, and decoding with a KV cache made there (`init_cache`): the
    logits and gradients off the mesh. Before, the module and the cache were captured, not passed, into jax's
    `auto_axes`, and every one of these calls raised jax's mesh-mismatch error."""
    mesh = jax.make_mesh((2, 1, 2), AXES, axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:4])
    hard_focus = dict(kind="focal+focus", focal_t=0.4, focus_window=2, focus_groups=4, focus_dim=8, focus_topk=1,
                      focus_causal=True, impl="decomposed")
    models = {"llama hard focus": Llama(LlamaConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                                    intermediate=48, attn=hard_focus), rngs=nnx.Rngs(0)),
              "gpt2": GPT2(GPT2Config(vocab_size=61, n_positions=32, d_model=32, n_layers=2, n_heads=4),
                           rngs=nnx.Rngs(1))}
    tokens = jax.random.randint(jax.random.key(18), (4, 11), 0, 61)

    def loss(model, tokens):
        return jnp.mean(model(tokens) ** 2)

    for name, model in models.items():
        want = model(tokens)
        want_grads = nnx.grad(loss)(model, tokens)
        with jax.set_mesh(mesh):
            nnx.update(model, jax.device_put(nnx.state(model), NamedSharding(mesh, P())))
            split = jax.device_put(tokens, NamedSharding(mesh, P(BATCH)))
            call = nnx.jit(lambda model, tokens: model(tokens))
            for how, got in [("eager", lambda: model(split)), ("jit", lambda: call(model, split)),
                             ("jit again", lambda: call(model, split))]:
                got = got()
                assert jax.typeof(got).sharding.spec[0] == BATCH, (name, how, jax.typeof(got))
                assert_close(got, want, atol=1e-5, what=f"{name} {how}")
            grads = nnx.jit(nnx.grad(loss))(model, split)
            want_flat = dict(nnx.to_flat_state(want_grads))
            for path, g in nnx.to_flat_state(grads):
                assert_close(g[...], want_flat[path][...], atol=1e-6, what=f"{name} d{path}")
            cache = init_cache(model, 4, 16)
            logits, cache = model(split[:, :8], cache=cache)
            assert_close(logits, want[:, :8], atol=1e-5, what=f"{name} prefill")
            for i in range(8, 11):
                logits, cache = nnx.jit(lambda model, t, c: model(t, cache=c))(model, split[:, i:i + 1], cache)
                assert_close(logits[:, 0], want[:, i], atol=1e-5, what=f"{name} decode step {i}")
