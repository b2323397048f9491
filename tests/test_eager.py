"""The public attention functions called eagerly (a notebook, a KV-cache decode step outside jit) compile once per
shape: a second call with the same shapes lowers nothing. Sinkhorn's scan, the decomposed path's loops and the
Pallas kernels were built from new closures at every call and compiled again each time (Sinkhorn 0.9 s at T = 256
on CPU, 4 s causal; the decomposed path 0.8 s; the kernels 1 s)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from focal_jax import attention as fa
from focal_jax.kernels.focus_sparse import dot_product_pallas
from focal_jax.nn.generate import init_cache
from focal_jax.nn.llama import Llama, LlamaConfig

B, T, H, HK, D, K, D_MODEL = 2, 24, 4, 2, 8, 3, 16
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # one event per program lowered


def _lowerings(fn):
    """Number of programs lowered while `fn()` runs (and its result is ready)."""
    events = []

    def listener(event, duration, **kwargs):
        if event == LOWERING:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return len(events)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (B, T, H, D))
    k, v = (jax.random.normal(key, (B, T, HK, D)) for key in keys[1:3])
    x = jax.random.normal(keys[3], (B, T, D_MODEL))
    scores = fa.routing_scores(x, jax.random.normal(keys[4], (D_MODEL, 4)), jax.random.normal(keys[5], (K, 4)))
    segment_ids = jnp.repeat(jnp.array([[0, 1, 1], [0, 0, 2]]), T // 3, axis=1)
    return q, k, v, x, scores, segment_ids


def _calls():
    q, k, v, x, scores, segment_ids = _inputs()
    g = fa.sinkhorn(scores)
    membership = fa.topk_membership(g, 1)

    def hard(impl, **kw):
        return lambda: fa.focus_sparse_attention(q, k, v, membership, window=3, impl=impl, block_size=8, **kw)

    def hard_grad(impl):
        return lambda: jax.grad(lambda q: fa.focus_sparse_attention(q, k, v, membership, window=3, impl=impl,
                                                                    block_size=8).sum())(q)

    return {
        "sinkhorn": lambda: fa.sinkhorn(scores),
        "sinkhorn causal": lambda: fa.sinkhorn(scores, causal=True),
        "sinkhorn segments": lambda: fa.sinkhorn(scores, segment_ids=segment_ids),
        "sinkhorn causal segments scan": lambda: fa.sinkhorn(scores, segment_ids=segment_ids, causal=True,
                                                             unroll=False),
        "focal": lambda: fa.focal_attention(q, k, v, temperature=0.4, window=5, segment_ids=segment_ids),
        "learned temperature": lambda: fa.learned_temperature(x, jnp.ones(D_MODEL), tau_min=0.5, tau_max=8.0,
                                                               bias=2.0, segment_ids=segment_ids),
        "focus soft": lambda: fa.focus_attention(q, k, v, g, window=3, segment_ids=segment_ids),
        "focus reference": hard("reference"),
        "focus decomposed": hard("decomposed", segment_ids=segment_ids, max_groups=1),
        "focus decomposed grad": hard_grad("decomposed"),
        "focus pallas": hard("pallas", segment_ids=segment_ids, max_groups=1),
        "focus pallas grad": hard_grad("pallas"),
        "dense pallas": lambda: dot_product_pallas(q, k, v, multiplier=0.5, block_size=8, band_block_size=8),
    }


def test_the_listener_counts_lowerings():
    x = jnp.arange(5.0)
    assert _lowerings(lambda: jax.jit(lambda x: x * 3 + 1)(x)) == 1


@pytest.mark.parametrize("name", list(_calls()))
def test_a_second_eager_call_compiles_nothing(name):
    call = _calls()[name]
    call()
    assert _lowerings(call) == 0


def test_an_eager_decode_step_of_a_focus_model_compiles_once():
    """Each token decoded eagerly through the KV cache of a hard causal-routing Focus model recompiled Sinkhorn's
    scan: 3.3 s a token for a 2-layer model of width 32 on CPU."""
    config = LlamaConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=48,
                         attn=dict(kind="focus", focus_topk=1, focus_causal=True, focus_window=2, focus_groups=4,
                                   focus_dim=8))
    model = Llama(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 8), 0, 40)
    cache = init_cache(model, 1, 8)
    _, cache = model(tokens[:, :5], cache=cache)
    _, cache = model(tokens[:, 5:6], cache=cache)
    state = {}

    def step(i):
        def run():
            state["logits"], state["cache"] = model(tokens[:, i:i + 1], cache=state.get("cache", cache))
            return state["logits"]
        return run

    assert _lowerings(step(6)) == 0
    assert _lowerings(step(7)) == 0
