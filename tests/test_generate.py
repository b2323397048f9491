"""KV-cache decoding and generation (focal_jax.nn.generate) on tiny random models built in-process (no download):
decoding with the cache equals the full-sequence forward at every position (dense, focal, focal_learned, hard causal
Focus, focal+focus and a softcap on LLaMA GQA; dense GPT-2; hard causal Focus with an attention sink); greedy
`generate` equals repeated argmax of the full forward; nucleus sampling is reproducible, draws each step afresh and
stays in the nucleus; bad arguments and undecodable attention kinds raise ValueError."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax import attention as fa
from focal_jax.nn.generate import _generate, generate, init_cache, sample_logits
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.nn.retrofit import replace_attention

# The hard causal routing of the tiny Focus model has near-ties (top-two group scores 1e-5 to 1e-4 apart), so greedy
# generation through the cache picks the full forward's argmax only where both round alike: with XLA's CPU passes off
# (`make test`), a flipped group moved the full forward's own logits by up to 2.2 and the generated tokens differed.
# Module-wide, not for that test alone: jax reuses an executable compiled earlier in the process, whatever the
# setting is now.
pytestmark = pytest.mark.usefixtures("optimized_cpu_code")

VOCAB, B, T, PREFILL = 61, 2, 14, 5
FOCUS = dict(kind="focus", focus_topk=1, focus_causal=True, focus_window=2, focus_groups=4, focus_dim=8)
KINDS = {
    "dense": {},
    "focal": dict(kind="focal", focal_t=0.4),
    "focal_learned": dict(kind="focal_learned", tau_min=0.5, tau_max=8.0),
    "focal_learned_smooth_clip": dict(kind="focal_learned", tau_min=0.5, tau_max=8.0, tau_clip="smooth"),
    "focal_learned_per_head": dict(kind="focal_learned", tau_min=0.5, tau_max=8.0, tau_granularity="head"),
    "focal_learned_per_token_residual": dict(kind="focal_learned", tau_min=0.5, tau_max=8.0, tau_mode="token",
                                             tau_input="residual"),
    "focal_learned_literal_per_head": dict(kind="focal_learned", tau_min=0.5, tau_max=8.0, tau_granularity="head",
                                           tau_bias=False, tau_clip="smooth"),
    "focus_hard_causal": FOCUS,
    "focal+focus_hard_causal": dict(FOCUS, kind="focal+focus", focal_t=0.4),
    "focal_softcap": dict(kind="focal", focal_t=0.4, softcap=2.0),
}


def _llama(attn):
    config = LlamaConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=48,
                         rope_theta=500.0, qk_norm="head", attn=attn)
    model = Llama(config, rngs=nnx.Rngs(0))
    if config.attention.kind == "focal_learned":  # a w_tau that makes tau vary with the prefix (inside the clip)
        for i, layer in enumerate(model.layers):
            w = 0.3 * jax.random.normal(jax.random.key(10 + i), layer.self_attn.w_tau.shape)
            layer.self_attn.w_tau[...] = w
            if config.attention.tau_bias:
                layer.self_attn.tau_bias[...] = jnp.full(layer.self_attn.tau_bias.shape, 3.0)
    return model


def _gpt2(**kw):
    return GPT2(GPT2Config(vocab_size=VOCAB, n_positions=32, d_model=32, n_layers=2, n_heads=4, **kw),
                rngs=nnx.Rngs(1))


def _tokens(seed=2, length=T):
    return jax.random.randint(jax.random.key(seed), (B, length), 0, VOCAB)


def _decode_all(model, tokens, max_len):
    """Logits of every position from prefill (PREFILL tokens), one chunk of 3, then single tokens."""
    cache = init_cache(model, tokens.shape[0], max_len)
    out = []
    bounds = [0, PREFILL, PREFILL + 3] + list(range(PREFILL + 4, tokens.shape[1] + 1))
    for start, stop in zip(bounds[:-1], bounds[1:]):
        logits, cache = model(tokens[:, start:stop], cache=cache)
        out.append(logits)
    assert int(cache["index"]) == tokens.shape[1]
    return jnp.concatenate(out, axis=1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_llama_cached_decoding_equals_full_forward(kind):
    model = _llama(KINDS[kind])
    tokens = _tokens()
    full = model(tokens)
    decoded = _decode_all(model, tokens, max_len=T + 3)  # spare slots must stay invisible
    np.testing.assert_allclose(decoded, full, atol=1e-4, rtol=0)
    if kind == "focal_learned":  # the temperature really varies along the prefix and with the sequence
        layer = model.layers[0]
        x = layer.input_layernorm(model.embed_tokens(tokens))
        tau = fa.learned_temperature(x, layer.self_attn.w_tau[...], tau_min=0.5, tau_max=8.0,
                                     bias=layer.self_attn.tau_bias[...])
        assert float(jnp.std(tau)) > 0.05 and float(tau.min()) > 0.5 and float(tau.max()) < 8.0


def test_hard_focus_mask_is_not_trivial():
    """The Focus decoding test above hides keys: the causal top-1 mask of layer 0 drops distant pairs."""
    model = _llama(FOCUS)
    tokens = _tokens()
    layer = model.layers[0]
    x = layer.input_layernorm(model.embed_tokens(tokens))
    g = fa.sinkhorn(fa.routing_scores(x, layer.self_attn.w_g[...], layer.self_attn.centroids[...], tau=0.1),
                    causal=True)
    mask = fa.focus_mask(fa.topk_membership(g, 1), window=2)
    causal = np.tril(np.ones((T, T), bool))
    assert mask.sum() < B * causal.sum() - 20
    assert (np.asarray(mask) != causal).any(axis=(0, 2)).sum() >= T // 2  # many queries lose keys


def test_cached_decoding_with_a_sink_equals_the_full_forward():
    """FOCUS_SPEC OQ-12 in KV-cache decoding: with `focus_sink=2` every query also sees cache slots 0 and 1, as the
    full forward (`focus_sparse_attention(sink=2)`) does; the sink changes that forward, so a cache that ignored it
    would differ from it."""
    model = _llama(dict(FOCUS, focus_sink=2))
    tokens = _tokens()
    full = model(tokens)
    np.testing.assert_allclose(_decode_all(model, tokens, max_len=T + 3), full, atol=1e-4, rtol=0)
    without = replace_attention(model, focus_sink=0)(tokens)
    assert float(jnp.abs(full - without).max()) > 1e-3


def test_gpt2_cached_decoding_equals_full_forward():
    model = _gpt2()
    tokens = _tokens()
    np.testing.assert_allclose(_decode_all(model, tokens, max_len=20), model(tokens), atol=1e-4, rtol=0)


def _greedy_reference(model, prompt, n):
    """Repeated argmax of the full forward (no cache). The sequence lives in a fixed-size buffer so that one jitted
    forward serves every step: position i's logits depend only on tokens <= i (causal attention and routing)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, seq: nnx.merge(graphdef, state)(seq))
    t0 = prompt.shape[1]
    seq = jnp.zeros((prompt.shape[0], t0 + n), prompt.dtype).at[:, :t0].set(prompt)
    for t in range(t0, t0 + n):
        seq = seq.at[:, t].set(jnp.argmax(forward(state, seq)[:, t - 1], axis=-1).astype(seq.dtype))
    return seq


@pytest.mark.parametrize("family", ["llama_focus", "gpt2"])
def test_greedy_generate_equals_repeated_argmax(family):
    model = _llama(FOCUS) if family == "llama_focus" else _gpt2()
    prompt = _tokens(seed=3, length=4)
    out = generate(model, prompt, max_new_tokens=8)
    assert out.shape == (B, 12) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out, _greedy_reference(model, prompt, 8))
    # 11 prompt tokens: 10 prefilled at once (the length bucket below 11), the 11th fed through the cache
    long_prompt = _tokens(seed=6, length=11)
    np.testing.assert_array_equal(generate(model, long_prompt, max_new_tokens=5),
                                  _greedy_reference(model, long_prompt, 5))
    if family == "gpt2":  # an (essentially) empty nucleus keeps only the most probable token: sampling is greedy
        np.testing.assert_array_equal(generate(model, prompt, max_new_tokens=8, temperature=1.0, top_p=1e-6, rng=5),
                                      out)
    assert len(set(np.asarray(out[:, 4:]).ravel().tolist())) > 1  # not a degenerate constant continuation


def test_sampling_is_reproducible():
    model = _gpt2()
    prompt = _tokens(seed=4, length=3)
    a = generate(model, prompt, max_new_tokens=6, temperature=1.5, top_p=0.9, rng=jax.random.key(7))
    b = generate(model, prompt, max_new_tokens=6, temperature=1.5, top_p=0.9, rng=jax.random.key(7))
    c = generate(model, prompt, max_new_tokens=6, temperature=1.5, top_p=0.9, rng=jax.random.key(8))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[:, :3], prompt)
    assert (np.asarray(a) != np.asarray(c)).any()
    assert ((np.asarray(a) >= 0) & (np.asarray(a) < VOCAB)).all()


def test_one_compilation_serves_nearby_lengths_and_every_temperature():
    """The cache size and the prefill are bucketed and temperature / top_p are traced: prompts of 10 and 11 tokens,
    17 to 20 tokens in all and any temperature > 0 with top_p < 1 reuse one compiled function (each new setting
    recompiled it: 1.3 s for this GPT-2, 17 to 25 s for a hard Focus LLaMA on CPU)."""
    model = _gpt2()
    generate(model, _tokens(length=10), max_new_tokens=8, temperature=0.7, top_p=0.9, rng=0)
    compiled = _generate._cache_size()
    for length, new, temperature, top_p in [(11, 7, 0.7, 0.9), (10, 9, 1.3, 0.5), (11, 9, 0.2, 0.999)]:
        out = generate(model, _tokens(length=length), max_new_tokens=new, temperature=temperature, top_p=top_p,
                       rng=1)
        assert out.shape == (B, length + new)
        np.testing.assert_array_equal(out[:, :length], _tokens(length=length))
    assert _generate._cache_size() == compiled


def test_sampling_does_not_depend_on_the_cache_size():
    """Token j is drawn with key j of the same split whatever the bucket: a longer generation continues a shorter
    one (the same prefix of tokens), also across the bucket boundary (9 + 7 tokens in a 16-slot cache, 9 + 12 in 24)."""
    model = _gpt2()
    prompt = _tokens(seed=7, length=9)
    short = generate(model, prompt, max_new_tokens=7, temperature=1.0, rng=3)
    long = generate(model, prompt, max_new_tokens=12, temperature=1.0, rng=3)
    np.testing.assert_array_equal(long[:, :16], short)


def test_each_step_samples_with_its_own_key():
    """With every logit equal (a zero head), each new token is uniform over the vocabulary: 24 steps drawn with
    one key reused would all pick the same token."""
    model = _gpt2()
    model.wte.embedding[...] = jnp.zeros_like(model.wte.embedding[...])  # tied head: all logits 0
    out = np.asarray(generate(model, _tokens(seed=5, length=2), max_new_tokens=24, temperature=1.0,
                              rng=jax.random.key(3)))[:, 2:]
    assert all(len(set(row)) > 6 for row in out.tolist()), out


def test_top_p_samples_only_the_nucleus():
    probs = jnp.array([0.05, 0.4, 0.1, 0.3, 0.15])  # sorted: 0.4, 0.3, 0.15, 0.1, 0.05
    logits = jnp.broadcast_to(jnp.log(probs), (4000, 5))
    key = jax.random.key(0)
    for top_p, nucleus in [(0.6, {1, 3}), (0.75, {1, 3, 4}), (0.4, {1}), (1.0, {0, 1, 2, 3, 4})]:
        drawn = np.asarray(sample_logits(logits, key, temperature=1.0, top_p=top_p))
        assert set(drawn.tolist()) == nucleus, top_p
        np.testing.assert_array_equal(drawn, sample_logits(logits, key, temperature=1.0, top_p=top_p))
    # within the nucleus, frequencies follow the renormalised probabilities (0.4 / 0.7 for token 1)
    drawn = np.asarray(sample_logits(logits, key, temperature=1.0, top_p=0.6))
    assert abs((drawn == 1).mean() - 0.4 / 0.7) < 0.04
    np.testing.assert_array_equal(sample_logits(logits[:2], temperature=0.0), [1, 1])


def test_top_p_equal_to_the_mass_of_the_first_tokens_keeps_only_them():
    """The nucleus is the fewest tokens whose mass reaches top_p, as in transformers' TopPLogitsWarper: with top_p
    equal, to the bit, to the float32 mass of the two most probable tokens (summed as sample_logits sums it: the
    rounding depends on the array's shape), the third is out; one float32 step above, it is in."""
    logits = jnp.broadcast_to(jnp.log(jnp.array([0.05, 0.4, 0.1, 0.3, 0.15])), (2000, 5))
    ordered = jnp.flip(jnp.sort(logits - jnp.max(logits, axis=-1, keepdims=True), axis=-1), axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass = np.float32((jnp.cumsum(probs, axis=-1) - probs)[0, 2])  # the mass before the third token
    assert abs(mass - 0.7) < 1e-6
    key = jax.random.key(1)
    for top_p, nucleus in [(mass, {1, 3}), (np.nextafter(mass, np.float32(1)), {1, 3, 4})]:
        assert set(np.asarray(sample_logits(logits, key, temperature=1.0, top_p=float(top_p))).tolist()) == nucleus


def test_small_temperatures_sample_the_argmax():
    """softmax(logits / t) tends to the argmax as t -> 0: logits / 1e-37 overflowed float32 (tokens 0 and 1 both at
    +inf, token 0 drawn), and a temperature below float32's smallest normal number (flushed to 0) is refused."""
    logits = jnp.array([[50.0, 60.0, 0.0], [1.0, 3.0, 2.0]])
    for top_p in (1.0, 0.9):
        np.testing.assert_array_equal(sample_logits(logits, jax.random.key(0), temperature=1e-37, top_p=top_p), [1, 1])
    with pytest.raises(ValueError, match="temperature=1e-40"):
        sample_logits(logits, jax.random.key(0), temperature=1e-40)
    with pytest.raises(ValueError, match="temperature=1e-40"):
        generate(_gpt2(), _tokens(length=3), max_new_tokens=2, temperature=1e-40, rng=0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p"),
    (dict(max_new_tokens=2, top_p=1.5), "top_p"),
    (dict(max_new_tokens=2, temperature=1.0), "rng"),
    (dict(max_new_tokens=2, temperature=float("inf"), rng=0), "temperature"),  # sampled uniformly before
    (dict(max_new_tokens=2, temperature=1.0, rng="abc"), "rng"),  # jax's TypeError before
    (dict(max_new_tokens=2, temperature=1.0, rng=jnp.zeros(3)), "rng"),
    (dict(max_new_tokens=40), "n_positions"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        generate(_gpt2(), _tokens(length=3), **kwargs)


def test_numbers_may_be_0d_arrays_and_keys_legacy():
    """A temperature or top_p given as a 0-d numpy or jax array (a sweep's value; the jax one was refused as not a
    number) and a legacy `PRNGKey` sample as the Python numbers and `jax.random.key` do."""
    model, prompt = _gpt2(), _tokens(length=3)
    want = generate(model, prompt, max_new_tokens=3, temperature=0.7, top_p=0.9, rng=jax.random.key(1))
    got = generate(model, prompt, max_new_tokens=3, temperature=jnp.float32(0.7), top_p=np.float32(0.9),
                   rng=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(got, want)


def test_bad_inputs_are_named():
    model = _gpt2()
    with pytest.raises(ValueError, match="prompt"):
        generate(model, jnp.zeros((5,), jnp.int32), max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt"):
        generate(model, jnp.zeros((1, 3)), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_len"):
        init_cache(model, 1, 33)
    with pytest.raises(ValueError, match="segment_ids"):
        model(_tokens(length=3), segment_ids=jnp.zeros((B, 3), jnp.int32), cache=init_cache(model, B, 8))
    cache = init_cache(model, B, 4)
    _, cache = model(_tokens(length=3), cache=cache)
    with pytest.raises(ValueError, match="max_len=4"):
        model(_tokens(length=2), cache=cache)
    with pytest.raises(ValueError, match="model"):
        generate(object(), _tokens(length=3), max_new_tokens=2)
    vocab = model.config.vocab_size
    for bad in (vocab, -3):  # in the jit they gave NaN logits, and token 0 ever after
        with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, {vocab}\)"):
            generate(model, jnp.asarray([[1, bad]], jnp.int32), max_new_tokens=2)


@pytest.mark.parametrize("attn, setting", [
    (dict(FOCUS, focus_causal=False), "focus_causal=False"),
    (dict(FOCUS, focus_topk=None), "focus_topk=None"),
])
def test_undecodable_focus_raises(attn, setting):
    model = _llama(attn)
    with pytest.raises(ValueError, match=setting):
        generate(model, _tokens(length=3), max_new_tokens=2)
    with pytest.raises(ValueError, match=setting):
        init_cache(model, B, 8)


def test_dynamic_ntk_refuses_the_cache():
    """Dynamic NTK RoPE takes its base from the sequence length: keys cached under a shorter sequence's base are not
    the full forward's (cached logits were off by up to 0.31, greedy `generate` left the full forward's argmax at its
    third new token), so generate and init_cache refuse it, naming the setting."""
    model = _llama({"rope_ntk_factor": 4.0, "rope_trained_len": 4})
    with pytest.raises(ValueError, match="rope_ntk_factor=4.0"):
        generate(model, _tokens(length=3), max_new_tokens=2)
    with pytest.raises(ValueError, match="rope_ntk_factor=4.0"):
        init_cache(model, B, 8)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_logits_at_selects_rows_of_the_full_logits(family):
    """`model(..., logits_at=[B, P])` equals the full logits gathered at those rows, with and without a cache."""
    model = _gpt2() if family == "gpt2" else _llama({})
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, VOCAB, (2, 9)), jnp.int32)
    full = model(tokens)
    at = jnp.asarray([[8, 0, 3], [2, 2, 5]])
    np.testing.assert_allclose(model(tokens, logits_at=at), np.take_along_axis(full, at[:, :, None], axis=1),
                               atol=1e-5, rtol=1e-5)
    cached, _ = model(tokens, cache=init_cache(model, 2, 12), logits_at=jnp.asarray([[8], [8]]))
    np.testing.assert_allclose(cached[:, 0], full[:, 8], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"logits_at must be integer indices \[batch, n\] with batch 2"):
        model(tokens, logits_at=jnp.asarray([1, 2]))
    for bad in (9, -1):  # an index past the sequence used to give the last row's logits
        with pytest.raises(ValueError, match=r"logits_at must be sequence indices in \[0, 9\), got values from"):
            model(tokens, logits_at=jnp.asarray([[0, bad], [1, 2]]))
