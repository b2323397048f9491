"""Checks that need a GPU (skipped, and reported as skipped, elsewhere): cuDNN attention in the model against the
XLA path. On a GPU, `test_kernels.py` runs its GPU-form cases as Triton kernels instead of in interpret mode."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from focal_jax.nn.attention import Attention, AttentionConfig
from helpers import assert_close

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.parametrize("kind,window,segmented", [("dense", None, False), ("focal", None, True), ("focal", 16, False)])
def test_cudnn_matches_xla(kind, window, segmented):
    shape = dict(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64)
    b, t = 2, 128
    x = jax.random.normal(jax.random.key(0), (b, t, 256), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    segment_ids = (jnp.arange(t)[None] >= 50).astype(jnp.int32) * jnp.ones((b, 1), jnp.int32) if segmented else None
    layer = Attention(AttentionConfig(**shape, kind=kind, window=window), rngs=nnx.Rngs(0))
    expected = layer(x, positions=positions, segment_ids=segment_ids)
    layer.config = AttentionConfig(**shape, kind=kind, window=window, impl="cudnn")
    assert_close(layer(x, positions=positions, segment_ids=segment_ids), expected, atol=3e-2, what=kind)
