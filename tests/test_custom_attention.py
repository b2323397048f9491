"""`register_attention`: a function registered by name becomes an attention kind of the models and the trainer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax.attention import reference
from focal_jax.nn.attention import Attention, AttentionConfig, CUSTOM_KINDS, check_decodable, register_attention
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
    # a function without segment_ids failed at the first call, with Python's unexpected-keyword TypeError
    with pytest.raises(ValueError, match=r"fn must take the keyword argument segment_ids .* 'plain' takes \['q', "
                                         r"'k', 'v'\]"):
        def plain(q, k, v):
            return q
        register_attention("plain", plain)
    register_attention("with_kwargs", lambda q, k, v, **kwargs: q)  # (**kwargs takes it)
    CUSTOM_KINDS.pop("with_kwargs")


def test_a_registered_function_of_the_wrong_output_shape_is_named(sharp_attention):
    """An output of another shape failed in a reshape ('cannot reshape array of shape (1, 4, 4, 2) into shape
    (1, 4, 32)') that named no kind."""
    register_attention("halved_test", lambda q, k, v, *, segment_ids: q[..., :2])
    try:
        with pytest.raises(ValueError, match=re.escape("registered as kind='halved_test' must return q's shape "
                                                       "[B, T, H, D] = (1, 4, 4, 8), got (1, 4, 4, 2)")):
            model({"kind": "halved_test"})(jnp.zeros((1, 4), jnp.int32))
    finally:
        CUSTOM_KINDS.pop("halved_test")


def test_the_attention_layer_takes_positions_as_a_list_as_the_models_do():
    """`Attention(...)(x, positions=[[0, 1, 2, 3]])` raised AttributeError ('list' object has no attribute
    'shape'); Llama and GPT-2 take lists, and a wrong shape is named."""
    layer = Attention(AttentionConfig(d_model=16, n_heads=2, n_kv_heads=2, head_dim=8), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, 4, 16))
    np.testing.assert_array_equal(layer(x, positions=[[0, 1, 2, 3]]), layer(x, positions=jnp.arange(4)[None]))
    with pytest.raises(ValueError, match=re.escape("positions must have shape [batch, seq] = (1, 4), got shape "
                                                   "(1, 3)")):
        layer(x, positions=[[0, 1, 2]])
