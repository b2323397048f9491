"""`register_attention`: a function registered by name becomes an attention kind of the models and the trainer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax.attention import reference
from focal_jax.nn.attention import AttentionConfig, CUSTOM_KINDS, check_decodable, register_attention
from focal_jax.nn.llama import Llama, LlamaConfig


@pytest.fixture
def sharp_attention():
    """A variant written as the notebooks do: the naive reference math at temperature 0.5."""
    def sharp(q, k, v, *, segment_ids):
        return reference.attention(q, k, v, temperature=0.5, segment_ids=segment_ids)

    register_attention("sharp_test", sharp)
    yield "sharp_test"
    CUSTOM_KINDS.pop("sharp_test")


def model(attn):
    config = LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64, attn=attn)
    return Llama(config, rngs=nnx.Rngs(0))


def test_registered_kind_runs_in_the_model(sharp_attention):
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 50)
    segment_ids = jnp.array([[1] * 5 + [2] * 7, [1] * 12])
    positions = jnp.array([list(range(5)) + list(range(7)), list(range(12))])
    custom = model({"kind": sharp_attention})(tokens, segment_ids=segment_ids, positions=positions)
    focal = model({"kind": "focal", "focal_t": 0.5})(tokens, segment_ids=segment_ids, positions=positions)
    np.testing.assert_allclose(custom, focal, atol=1e-5)
    dense = model({"kind": "dense"})(tokens, segment_ids=segment_ids, positions=positions)
    assert float(jnp.max(jnp.abs(custom - dense))) > 1e-3  # the registered function is what ran


def test_bad_registrations_and_kinds_name_the_value(sharp_attention):
    shape = dict(d_model=8, n_heads=2, n_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="'focal' is a built-in attention kind"):
        register_attention("focal", lambda q, k, v, *, segment_ids: q)
    with pytest.raises(ValueError, match="fn must be callable"):
        register_attention("x", 3)
    with pytest.raises(ValueError, match=r"kind='nope' is not one of .*\(registered: \('sharp_test',\)\)"):
        AttentionConfig(**shape, kind="nope")
    with pytest.raises(ValueError, match="takes impl='xla', got impl='pallas'"):
        AttentionConfig(**shape, kind=sharp_attention, impl="pallas")
    for name, value in (("window", 1), ("softcap", 0.01)):  # accepted and silently ignored before
        with pytest.raises(ValueError, match=rf"{name}={value} would not reach: it gets q, k, v and segment_ids"):
            AttentionConfig(**shape, kind=sharp_attention, **{name: value})
    with pytest.raises(ValueError, match="has no KV-cache form"):
        check_decodable(AttentionConfig(**shape, kind=sharp_attention))
