"""Checks that need a GPU (skipped, and reported as skipped, elsewhere): cuDNN attention in the model against the
XLA path. On a GPU, `test_kernels.py` runs its GPU-form cases as Triton kernels instead of in interpret mode.

Elsewhere the same check runs with jax.nn's XLA implementation standing in for cuDNN, so that the check itself
(its inputs, dtypes and shapes) cannot break unseen between GPU runs."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from focal_jax.nn import attention
from focal_jax.nn.attention import Attention, AttentionConfig
from helpers import assert_close

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
CUDNN_CASES = [("dense", None, False, 128), ("focal", None, True, 128), ("focal", 16, False, 128),
               ("focal", None, True, 77)]  # kind, window, segmented, T (odd: padded for cuDNN)


@needs_gpu
@pytest.mark.parametrize("kind,window,segmented,t", CUDNN_CASES)
def test_cudnn_matches_xla(kind, window, segmented, t):
    shape = dict(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64)
    b = 2
    x = jax.random.normal(jax.random.key(0), (b, t, 256), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    segment_ids = (jnp.arange(t)[None] >= 50).astype(jnp.int32) * jnp.ones((b, 1), jnp.int32) if segmented else None
    layer = Attention(AttentionConfig(**shape, kind=kind, window=window), rngs=nnx.Rngs(0))
    nnx.update(layer, jax.tree.map(lambda p: p.astype(jnp.bfloat16), nnx.state(layer)))  # bf16 q, k, v for cuDNN

    def forward_and_gradient(impl):
        layer.config = AttentionConfig(**shape, kind=kind, window=window, impl=impl)
        forward = lambda x: layer(x, positions=positions, segment_ids=segment_ids)
        loss = lambda x: jnp.sum(forward(x).astype(jnp.float32) ** 2)
        return jax.jit(lambda x: (forward(x), jax.grad(loss)(x)))(x)

    (expected, expected_grad), (got, got_grad) = forward_and_gradient("xla"), forward_and_gradient("cudnn")
    assert_close(got, expected, atol=3e-2, what=kind)
    scale = float(jnp.max(jnp.abs(expected_grad.astype(jnp.float32))))
    assert_close(got_grad.astype(jnp.float32) / scale, expected_grad.astype(jnp.float32) / scale, atol=3e-2,
                 what=f"{kind} gradient")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the check above runs with cuDNN itself")
def test_the_cudnn_check_runs_with_a_stand_in(monkeypatch):
    """`test_cudnn_matches_xla` with cuDNN's call swapped for jax.nn's XLA implementation: the layer's own guards
    (GPU platform, 16-bit activations) and padding still run."""
    through_jax_nn = attention._jax_nn_causal_attention
    monkeypatch.setattr(attention.focus_sparse, "platform", lambda: "gpu")
    monkeypatch.setattr(attention, "_jax_nn_causal_attention",
                        lambda *args, implementation: through_jax_nn(*args, implementation="xla"))
    for case in CUDNN_CASES:
        test_cudnn_matches_xla(*case)
