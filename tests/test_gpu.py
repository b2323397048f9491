"""Checks that need a GPU (skipped, and reported as skipped, elsewhere): cuDNN attention in the model against the
XLA path. On a GPU, `test_kernels.py` runs its GPU-form cases as Triton kernels instead of in interpret mode."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from focal_jax.nn.attention import Attention, AttentionConfig
from helpers import assert_close

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("kind,window,segmented,t", [("dense", None, False, 128), ("focal", None, True, 128),
                                                      ("focal", 16, False, 128), ("focal", None, True, 77)])
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
        return forward(x), jax.grad(lambda x: jnp.sum(forward(x).astype(jnp.float32) ** 2))(x)

    (expected, expected_grad), (got, got_grad) = forward_and_gradient("xla"), forward_and_gradient("cudnn")
    assert_close(got, expected, atol=3e-2, what=kind)
    scale = float(jnp.max(jnp.abs(expected_grad.astype(jnp.float32))))
    assert_close(got_grad.astype(jnp.float32) / scale, expected_grad.astype(jnp.float32) / scale, atol=3e-2,
                 what=f"{kind} gradient")
