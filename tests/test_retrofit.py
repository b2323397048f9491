"""Retrofit invariants (focal_jax.nn.retrofit) on tiny random Hugging Face GPT-2 and LLaMA (GQA) models built from
configs and saved as safetensors (no download): Focus within the window and hard top-k = K leave the pretrained
logits unchanged; only the new parameters are added, differentiated and given optimizer state; the paper's
parameter counts; Focal t = 1 is dense; bad settings are named."""

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

from focal_jax.convert.hf import from_hf
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.nn.attention import CUSTOM_KINDS, AttentionConfig
from focal_jax.nn.lora import LoRAConfig
from focal_jax.nn.retrofit import (FocalConfig, FocusConfig, WindowConfig, count_params, replace_attention, retrofit,
                                   trainable_filter)
from focal_jax.nn.variables import Centroid, Temperature

VOCAB, D, LAYERS, HEADS = 97, 64, 2, 4
WINDOW, GROUPS, DIM = 6, 4, 16
LONG = 24


def _save_gpt2(directory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("attn.c_attn.weight"):  # attention logits of a trained model's size
                p.mul_(4.0)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _save_llama(directory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=2, intermediate_size=96,
                                      initializer_range=0.1, rope_theta=500.0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family(request, tmp_path_factory):
    """(name, checkpoint directory, torch model)."""
    directory = str(tmp_path_factory.mktemp(request.param))
    torch_model = {"gpt2": _save_gpt2, "llama": _save_llama}[request.param](directory)
    return request.param, directory, torch_model


def _tokens(length, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (2, length)).astype(np.int32)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _logits(model, tokens):
    return np.asarray(_forward(model, jnp.asarray(tokens)))


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def _attention(model):
    return [layer.attn for layer in model.h] if isinstance(model, GPT2) else [l.self_attn for l in model.layers]


def _model_attention_config(model):
    return model.config.attention_config() if isinstance(model, GPT2) else model.config.attention


def _assert_close(x, y, atol):
    err = float(np.abs(np.asarray(x) - np.asarray(y)).max())
    assert err <= atol, f"max abs err {err:.3g} > {atol:.1g}"


# ------------------------------------------------------------------------------------------ logits invariants


def test_focus_soft_within_window_equals_original(family):
    """Soft gate: in a sequence of <= window + 1 tokens every pair is local, nothing is gated, the logits are the
    pretrained model's. Past the window the gate acts and they differ (so the comparison can fail)."""
    name, directory, torch_model = family
    original = from_hf(directory)
    model = retrofit(from_hf(directory), FocusConfig(groups=GROUPS, dim=DIM, window=WINDOW), rngs=1)
    short = _tokens(WINDOW + 1, seed=1)
    _assert_close(_logits(model, short), _logits(original, short), atol=1e-6)
    _assert_close(_logits(model, short), _torch_logits(torch_model, short), atol=1e-4)
    longer = _tokens(LONG, seed=2)
    diff = np.abs(_logits(model, longer) - _logits(original, longer))
    assert diff[:, :WINDOW + 1].max() <= 1e-6  # queries whose keys are all local are untouched
    assert diff[:, WINDOW + 1:].max() > 1e-3


def test_focus_hard_topk_all_groups_equals_original(family):
    """Hard top-k = K: every pair shares a group, the mask is the causal one, logits are the pretrained model's at
    any length; top-k = 1 at the same length is sparse and changes them. Switching soft -> hard on a Focus model
    keeps its centroids."""
    name, directory, _ = family
    tokens = _tokens(LONG, seed=3)
    want = _logits(from_hf(directory), tokens)
    focus = FocusConfig(groups=GROUPS, dim=DIM, window=WINDOW)
    model = retrofit(from_hf(directory), focus)
    centroids = [np.asarray(a.centroids[...]) for a in _attention(model)]
    model = retrofit(model, dataclasses.replace(focus, topk=GROUPS))
    assert all(np.array_equal(np.asarray(a.centroids[...]), c) for a, c in zip(_attention(model), centroids))
    _assert_close(_logits(model, tokens), want, atol=1e-5)
    sparse = retrofit(from_hf(directory), dataclasses.replace(focus, topk=1))
    assert np.abs(_logits(sparse, tokens) - want).max() > 1e-3


def test_a_focus_retrofit_with_a_sink_keeps_the_original_within_the_window_and_at_all_groups(family):
    """FOCUS_SPEC OQ-12 and OQ-15 with a sink (`FocusConfig.sink`, the layers' `focus_sink`): the sink keys of a
    sequence of <= window + 1 tokens are local anyway, and hard top-k = K keeps every causal pair, so both leave the
    pretrained logits unchanged; past the window the soft gate spares the sink keys, which changes the logits of
    the same retrofit (same centroids) without a sink."""
    name, directory, _ = family
    focus = FocusConfig(groups=GROUPS, dim=DIM, window=WINDOW, sink=2)
    original = from_hf(directory)
    model = retrofit(from_hf(directory), focus, rngs=1)
    assert {a.config.focus_sink for a in _attention(model)} == {_model_attention_config(model).focus_sink} == {2}
    short, longer = _tokens(WINDOW + 1, seed=1), _tokens(LONG, seed=3)
    _assert_close(_logits(model, short), _logits(original, short), atol=1e-6)
    hard = retrofit(from_hf(directory), dataclasses.replace(focus, topk=GROUPS), rngs=1)
    _assert_close(_logits(hard, longer), _logits(original, longer), atol=1e-5)
    soft = _logits(model, longer)
    without = _logits(replace_attention(model, focus_sink=0), longer)
    assert np.abs(soft - without)[:, :WINDOW + 1].max() <= 1e-6
    assert np.abs(soft - without)[:, WINDOW + 1:].max() > 1e-3


def test_focal_constant(family):
    """Focal t = 1 is dense attention; t = 0.4 sharpens and changes the logits."""
    name, directory, _ = family
    tokens = _tokens(LONG, seed=4)
    want = _logits(from_hf(directory), tokens)
    model = retrofit(from_hf(directory), FocalConfig(t=1.0))
    assert _model_attention_config(model).kind == "focal" and not nnx.state(model, Temperature)
    _assert_close(_logits(model, tokens), want, atol=1e-6)
    assert np.abs(_logits(retrofit(from_hf(directory), FocalConfig(t=0.4)), tokens) - want).max() > 1e-2


# ------------------------------------------------------------------------------- only new parameters added


def _flat(model, filter=nnx.Param):
    return {path: (type(v), np.asarray(v.get_value())) for path, v in nnx.to_flat_state(nnx.state(model, filter))}


def test_retrofit_adds_only_new_parameters_and_keeps_config_consistent(family):
    name, directory, _ = family
    model = from_hf(directory)
    before = _flat(model)
    model = retrofit(model, FocalConfig(t=0.5))
    model = retrofit(model, FocusConfig(groups=GROUPS, dim=DIM, window=WINDOW, topk=2, gate="log"))
    after = _flat(model)
    assert set(before) < set(after)
    for path, (kind, value) in before.items():  # the pretrained parameters: same type, same values
        assert after[path][0] is kind and np.array_equal(after[path][1], value), path
    added = {path: kind for path, (kind, _) in after.items() if path not in before}
    assert set(added.values()) == {Centroid} and len(added) == 2 * LAYERS  # w_g and centroids per layer
    # The model's config describes its layers (Focal then Focus combine into 'focal+focus').
    config = _model_attention_config(model)
    assert (config.kind, config.focal_t, config.focus_topk, config.focus_gate) == ("focal+focus", 0.5, 2, "log")
    assert all(a.config == config for a in _attention(model))
    # A rebuild from the model's own config has the same structure (what a checkpoint restore relies on).
    cls = GPT2 if name == "gpt2" else Llama
    rebuilt = nnx.eval_shape(lambda: cls(model.config, rngs=nnx.Rngs(0)))
    assert jax.tree.structure(nnx.state(rebuilt)) == jax.tree.structure(nnx.state(model))


def test_constant_focal_onto_a_focus_model_makes_it_focal_plus_focus():
    """Focus, then a constant Focal temperature: every layer becomes 'focal+focus' with that t (Focal then Focus,
    above, gives the same kind). Its logits are those of a model built as 'focal+focus' with the same parameters,
    and not the Focus model's."""
    tiny = GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4)
    model = retrofit(GPT2(tiny, rngs=nnx.Rngs(0)), FocusConfig(groups=4, dim=8, window=4), rngs=1)
    tokens = jnp.arange(16)[None] * 3 % 50
    focus_logits = np.asarray(model(tokens))
    retrofit(model, FocalConfig(t=0.5))
    assert [(a.config.kind, a.config.focal_t) for a in _attention(model)] == [("focal+focus", 0.5)] * 2
    assert (model.config.kind, model.config.focal_t) == ("focal+focus", 0.5)
    built = GPT2(dataclasses.replace(tiny, kind="focal+focus", focal_t=0.5, focus_groups=4, focus_dim=8,
                                     focus_window=4), rngs=nnx.Rngs(2))
    nnx.update(built, nnx.state(model))
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(built(tokens)))
    assert not np.allclose(np.asarray(model(tokens)), focus_logits, atol=1e-3)


def test_seed_sets_the_new_parameters(family):
    _, directory, _ = family
    focus = FocusConfig(groups=GROUPS, dim=DIM, window=WINDOW)
    a, b, c = (retrofit(from_hf(directory), focus, rngs=r) for r in (3, nnx.Rngs(params=3), 4))
    leaves = lambda m: [np.asarray(x) for x in jax.tree.leaves(nnx.state(m, Centroid))]
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not any(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c)))
    layers = leaves(a)  # each layer gets its own draw
    assert not np.array_equal(layers[0], layers[2])
    half = retrofit(from_hf(directory), focus, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(half, Centroid))} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(nnx.state(half, nnx.Not(Centroid)))} == {jnp.dtype(jnp.float32)}


def test_focal_learned_adds_temperature(family):
    _, directory, _ = family
    model = retrofit(from_hf(directory), FocalConfig(learned=True, tau_min=4.0, tau_max=9.0))
    config = _model_attention_config(model)
    assert (config.kind, config.tau_min, config.tau_max) == ("focal_learned", 4.0, 9.0)
    assert count_params(model, Temperature) == LAYERS * (D + 1)
    assert count_params(model, trainable_filter("centroids+temperature")) == LAYERS * (D + 1)
    assert count_params(model, trainable_filter("temperature")) == LAYERS * (D + 1)  # optim.trainable's too
    assert float(_attention(model)[0].tau_bias[...]) == 6.5  # Attention's own init: middle of the range
    assert np.isfinite(_logits(model, _tokens(LONG))).all()


def test_a_learned_temperature_range_above_sqrt_head_dim_is_warned_with_the_rescaled_one():
    """The paper's clip range [5, 10] is tuned for head_dim 128 (sqrt = 11.3). GPT-2's heads are 64 wide: there
    tau = 10 is softer than dense attention's sqrt(64) = 8, so the retrofit warns and names FOCAL_SPEC OQ-F6's
    rescaled range. Head dim 128, the rescaled range, and a constant temperature do not warn."""
    gpt2 = GPT2(GPT2Config(vocab_size=VOCAB, n_positions=16, d_model=128, n_layers=1, n_heads=2), rngs=nnx.Rngs(0))
    with pytest.warns(UserWarning, match=re.escape(
            "tau_max=10 > sqrt(head_dim=64) = 8: the learned temperature tau replaces sqrt(head_dim), so it may "
            "attend more softly than dense attention. The paper's range [5, 10] is tuned for head_dim 128; for "
            "head_dim 64 it is tau_min=3.536, tau_max=7.071")) as record:
        retrofit(gpt2, FocalConfig(learned=True))
    assert all("sqrt(head_dim=64)" in str(w.message) for w in record)  # not FocalConfig's check's own probe
    settings = dict(d_model=256, n_heads=2, n_kv_heads=2, kind="focal_learned")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AttentionConfig(head_dim=128, **settings)
        AttentionConfig(head_dim=64, tau_min=3.536, tau_max=7.071, **settings)
        AttentionConfig(**{**settings, "kind": "focal"}, head_dim=16)


# ----------------------------------------------------------------------------- gradients and optimizer state


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))


def _grads(model, filter, tokens):
    """Gradients of the loss w.r.t. the parameters selected by `filter`, in the style of the train step (DESIGN.md):
    nnx.split by filter -> jax.grad -> jax.jit on pure pytrees, nnx.merge inside the loss."""
    graphdef, trainable, rest = nnx.split(model, filter, ...)
    loss = lambda params, rest: _loss(nnx.merge(graphdef, params, rest), tokens)
    return jax.jit(jax.grad(loss))(trainable, rest)


def test_centroid_only_training(family):
    """Differentiating by type: with the 'centroids' filter only Centroid leaves get (non-zero) gradients; an
    optimizer built with wrt= that filter holds state for the Centroids alone, and a step (AdamW, weight decay)
    leaves every other parameter bit-for-bit unchanged. With 'all' (nnx.Param) every parameter gets a gradient."""
    name, directory, _ = family
    model = retrofit(from_hf(directory), FocusConfig(groups=GROUPS, dim=DIM, window=WINDOW))
    tokens = jnp.asarray(_tokens(LONG + 1, seed=5))  # longer than the window: the routing matters
    n_centroid = count_params(model, Centroid)
    assert n_centroid == LAYERS * (D * DIM + GROUPS * DIM)

    wrt = trainable_filter("centroids")
    grads = _grads(model, wrt, tokens)
    flat = nnx.to_flat_state(grads)
    assert flat and all(isinstance(v, Centroid) for _, v in flat)
    assert sum(int(v.get_value().size) for _, v in flat) == n_centroid
    assert all(np.abs(np.asarray(v.get_value())).max() > 0 for _, v in flat)

    optimizer = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=wrt)
    opt_leaves = jax.tree.leaves(nnx.state(optimizer, nnx.OptState))
    float_state = sum(int(x.size) for x in opt_leaves if jnp.issubdtype(x.dtype, jnp.floating))
    assert float_state == 2 * n_centroid  # AdamW's mu and nu for the Centroids only
    frozen_before, centroids_before = _flat(model, nnx.Not(Centroid)), _flat(model, Centroid)
    optimizer.update(model, grads)
    frozen_after, centroids_after = _flat(model, nnx.Not(Centroid)), _flat(model, Centroid)
    assert all(np.array_equal(frozen_after[p][1], v) for p, (_, v) in frozen_before.items())
    assert all(not np.array_equal(centroids_after[p][1], v) for p, (_, v) in centroids_before.items())

    all_grads = nnx.to_flat_state(_grads(model, trainable_filter("all"), tokens))
    assert len(all_grads) == len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert all(np.abs(np.asarray(v.get_value())).max() > 0 for _, v in all_grads)
    assert {type(v) for _, v in all_grads} > {Centroid}


# ------------------------------------------------------------------------------------------ parameter counts


def test_gpt2_124m_focus_count_is_papers():
    """GPT-2 124M with K = 4, d_g = 16: 12 x (768 x 16 + 4 x 16) = 148,224 Centroid parameters (the Focus paper's
    count), nothing else added. Abstract models only (nnx.eval_shape: nothing allocated)."""
    config = GPT2Config()  # Hugging Face gpt2: vocab 50257, 1024 positions, d 768, 12 layers, 12 heads
    base = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    model = nnx.eval_shape(lambda: retrofit(GPT2(config, rngs=nnx.Rngs(0)), FocusConfig(groups=4, dim=16, window=128)))
    assert count_params(base) == 124_439_808
    assert count_params(model, trainable_filter("centroids")) == 148_224
    assert count_params(model) - count_params(base) == 148_224
    assert count_params(model, Temperature) == 0


def test_mistral_7b_like_counts():
    """d = 4096, 32 layers, K = 2, d_g = 16: 32 x (4096 x 16 + 2 x 16) = 2,098,176 Centroids; learned Focal adds
    32 x (4096 + 1) Temperatures."""
    config = LlamaConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate=14336)
    base = count_params(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    focus = nnx.eval_shape(lambda: retrofit(Llama(config, rngs=nnx.Rngs(0)), FocusConfig(groups=2, dim=16, window=256)))
    assert count_params(focus, Centroid) == 2_098_176
    assert count_params(focus) - base == 2_098_176
    focal = nnx.eval_shape(lambda: retrofit(Llama(config, rngs=nnx.Rngs(0)), FocalConfig(learned=True)))
    assert count_params(focal, Temperature) == 32 * (4096 + 1)
    assert count_params(focal) - base == 32 * (4096 + 1)


# ---------------------------------------------------------------------------------------------- bad settings


def test_configs_take_numpy_numbers_as_python_ones():
    """A sweep's `np.int64` / `np.float32` values were refused ('groups must be an integer'); they are taken, and
    stored as the Python numbers they hold (configs are hashed as static data and written to JSON)."""
    focus = FocusConfig(groups=np.int64(4), dim=np.int32(16), window=np.int64(8), topk=np.int64(2),
                        tau=np.float32(0.25))
    assert focus == FocusConfig(groups=4, dim=16, window=8, topk=2, tau=0.25)
    assert type(focus.groups) is int and type(focus.tau) is float
    assert FocalConfig(t=np.float32(0.5)) == FocalConfig(t=0.5) and WindowConfig(np.int64(4)) == WindowConfig(4)
    attention = AttentionConfig(d_model=np.int64(32), n_heads=np.int64(4), n_kv_heads=np.int64(2), head_dim=8,
                                kind="focus", focus_groups=np.int64(4), focus_dim=np.int64(8), focus_window=np.int64(2))
    assert attention == AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, kind="focus", focus_groups=4,
                                        focus_dim=8, focus_window=2)
    llama = LlamaConfig(vocab_size=np.int64(61), d_model=32, n_layers=np.int64(1), n_heads=4, intermediate=48)
    gpt2 = GPT2Config(vocab_size=np.int64(61), n_positions=16, d_model=32, n_layers=1, n_heads=4)
    assert type(llama.n_layers) is type(gpt2.vocab_size) is int
    assert type(LoRAConfig(rank=np.int64(2), alpha=np.float32(4.0)).rank) is int


@pytest.mark.parametrize("kwargs, field", [
    (dict(groups=0, dim=16, window=8), "groups"),
    (dict(groups=4, dim=-1, window=8), "dim"),
    (dict(groups=4, dim=16, window=-1), "window"),
    (dict(groups=4, dim=16, window=8, tau=0.0), "tau"),
    (dict(groups=4, dim=16, window=8, iters=0), "iters"),
    (dict(groups=4, dim=16, window=8, gate="hard"), "gate"),
    (dict(groups=4, dim=16, window=8, lam=-1.0), "lam"),
    (dict(groups=4, dim=16, window=8, topk=5), "topk=5"),
    (dict(groups=4, dim=16, window=8, causal=1), "causal"),
    (dict(groups=4, dim=16, window=8, sink=-1), "sink=-1"),
])
def test_bad_focus_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"FocusConfig: .*\b{field}"):
        FocusConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(t=0.0), "t=0.0"),
    (dict(t=None), "t=None"),
    (dict(t=0.3, learned=True), "t=0.3"),
    (dict(learned=True, tau_min=10.0, tau_max=5.0), "tau_min"),
    (dict(learned="yes"), "learned"),
    # tau_bias would start at inf
    (dict(learned=True, tau_max=float("inf")), "tau_max must be a finite number > 0, got tau_max=inf"),
    (dict(learned=True, tau_max=None), "tau_max must be a finite number > 0, got tau_max=None"),
    (dict(t=0.5, tau_max=8.0), "tau_max=8.0 are for the learned temperature"),  # silently ignored before
])
def test_bad_focal_config_names_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"FocalConfig: .*{field}"):
        FocalConfig(**kwargs)


def test_bad_retrofits_are_named():
    tiny = GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=1, n_heads=4)
    gpt2 = lambda **kw: nnx.eval_shape(lambda: GPT2(dataclasses.replace(tiny, **kw), rngs=nnx.Rngs(0)))
    focus = FocusConfig(groups=4, dim=8, window=4)
    with pytest.raises(ValueError, match="FocusConfig or FocalConfig"):
        retrofit(gpt2(), {"groups": 4})
    with pytest.raises(ValueError, match="kind='focal_learned'"):  # no kind has learned Focal with Focus
        retrofit(gpt2(kind="focal_learned"), focus)
    with pytest.raises(ValueError, match="drop"):  # constant Focal would drop the learned Temperatures
        retrofit(gpt2(kind="focal_learned"), FocalConfig(t=0.4))
    with pytest.raises(ValueError, match="shape"):  # Focus with other groups than the model's own
        retrofit(gpt2(kind="focus", focus_groups=2, focus_dim=8), focus)
    with pytest.raises(ValueError, match="impl='bogus'"):
        retrofit(gpt2(), focus, impl="bogus")
    mistral = LlamaConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, intermediate=48, attn={"window": 4})
    with pytest.raises(ValueError, match=r"sliding window \(window=4, at layers.0.self_attn\): Focus brings its own "
                                         r"local window \(FocusConfig.window\)"):
        retrofit(nnx.eval_shape(lambda: Llama(mistral, rngs=nnx.Rngs(0))), focus)
    with pytest.raises(ValueError, match="Llama and GPT2"):
        retrofit(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), focus)
    with pytest.raises(ValueError, match="'everything'"):
        trainable_filter("everything")
    model = gpt2()  # a failed retrofit leaves the model as it was
    with pytest.raises(ValueError):
        retrofit(model, focus, impl="bogus")
    assert model.config.kind == "dense" and not nnx.state(model, Centroid)
    with pytest.raises(ValueError, match="impl='decomposed' and dtype=None are for Focus and Focal retrofits"):
        retrofit(gpt2(), LoRAConfig(rank=2, alpha=4.0), impl="decomposed")  # LoRA ignored both
    # an integer dtype made all-zero int32 centroids (nothing to train); a string seed failed deep inside nnx
    for bad in (jnp.int32, "int8", bool, "float99"):
        with pytest.raises(ValueError, match=re.escape(f"dtype must be a floating-point dtype (e.g. jnp.float32, "
                                                       f"jnp.bfloat16), got dtype={bad!r}")):
            retrofit(gpt2(), focus, dtype=bad)
    for bad in ("x", 1.5, True):
        with pytest.raises(ValueError, match=re.escape(f"rngs must be an nnx.Rngs, an integer seed or None, got "
                                                       f"rngs={bad!r}")):
            retrofit(gpt2(), focus, rngs=bad)
        with pytest.raises(ValueError, match=re.escape(f"rngs={bad!r}")):
            retrofit(gpt2(), LoRAConfig(rank=2, alpha=4.0), rngs=bad)
    assert retrofit(gpt2(), focus, dtype="bfloat16", rngs=np.int64(3)).h[0].attn.centroids.dtype == jnp.bfloat16


def test_a_retrofit_keeps_the_centroids_a_dense_view_held():
    """A Focus model viewed as dense (`replace_attention(kind='dense', allow_unused=True)`) keeps its centroids; a
    Focus retrofit onto that view keeps them too (it used to draw new ones over the trained ones)."""
    config = GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=1, n_heads=4)
    model = retrofit(GPT2(config, rngs=nnx.Rngs(0)), FocusConfig(groups=4, dim=8, window=4), rngs=1)
    trained = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, Centroid)))
    replace_attention(model, kind="dense", allow_unused=True)
    retrofit(model, FocusConfig(groups=4, dim=8, window=4), rngs=2)
    assert model.config.kind == "focus"
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, Centroid)), trained)
    replace_attention(model, kind="dense", allow_unused=True)
    with pytest.raises(ValueError, match=r"centroids has shape \(4, 8\), the new config needs \(2, 8\)"):
        retrofit(model, FocusConfig(groups=2, dim=8, window=4))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_built_with_settings_its_attention_kind_does_not_read_warns(family):
    """A model built with an attention setting its kind ignores (here `focal_t` on 'dense') warns, naming the field
    and the kinds that read it; an evaluation view of a Focus model as 'dense' keeps its focus_* fields (the shapes
    of the routing it holds) and builds no model, so it does not."""
    def build(**fields):
        if family == "gpt2":
            return GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4, **fields),
                        rngs=nnx.Rngs(0))
        return Llama(LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, intermediate=48, attn=fields),
                     rngs=nnx.Rngs(0))

    with pytest.warns(UserWarning, match=r"^attention kind='dense' does not read focal_t=0\.3 \(read by kinds "
                                         r"\('focal', 'focal\+focus'\)\): set the kind that uses them"):
        build(kind="dense", focal_t=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        focus = retrofit(build(), FocusConfig(groups=4, dim=8, window=4), rngs=1)
        replace_attention(focus, kind="dense", allow_unused=True)
        focus(jnp.zeros((1, 8), jnp.int32))
    assert focus.config.attention.focus_groups == 4


def test_a_registered_kind_is_not_retrofitted(monkeypatch):
    # registered for this test only (the registry is the process's)
    monkeypatch.setitem(CUSTOM_KINDS, "test_retrofit_own", lambda q, k, v, *, segment_ids: q)
    config = LlamaConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, intermediate=48,
                         attn={"kind": "test_retrofit_own"})
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    for change in (FocusConfig(groups=4, dim=8, window=4), FocalConfig(t=0.5)):
        with pytest.raises(ValueError, match="a kind registered with register_attention is its own function"):
            retrofit(model, change)


# ------------------------------------------------------------------------------------------ k-means centroids


@pytest.mark.parametrize("spherical", [True, False])
def test_kmeans_finds_separated_clusters(spherical):
    """Four clusters of 60 points around random centres (unit directions with `spherical`, else points far apart):
    each centre has a centroid within the noise of it; the same key gives the same centroids; fewer points than
    centroids are refused."""
    from focal_jax.nn.retrofit import kmeans

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(4, 8))
    centres = centres / np.linalg.norm(centres, axis=-1, keepdims=True) * (1.0 if spherical else 10.0)
    points = np.concatenate([c + 0.03 * rng.normal(size=(60, 8)) for c in centres]).astype(np.float32)
    found = np.asarray(kmeans(points, 4, key=jax.random.key(1), spherical=spherical))
    assert found.shape == (4, 8)
    for c in centres:
        nearest = found[np.argmin(np.linalg.norm(found - c, axis=-1))]
        assert np.linalg.norm(nearest - c) < 0.05 * np.linalg.norm(c), (nearest, c)
    if spherical:
        np.testing.assert_allclose(np.linalg.norm(found, axis=-1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(found, np.asarray(kmeans(points, 4, key=jax.random.key(1), spherical=spherical)))
    with pytest.raises(ValueError, match=r"k-means of 4 centroids needs points \[N >= 4, d\], got shape \(3, 8\)"):
        kmeans(points[:3], 4, key=jax.random.key(1))


@pytest.mark.parametrize("spherical", [True, False])
def test_kmeans_plus_plus_draws_each_seed_by_its_squared_distance(spherical, monkeypatch):
    """The second seed is drawn with probability proportional to the squared distance to the first: `(1 - cos)^2`
    between unit rows (spherical), `|x - c|^2` otherwise (numpy here)."""
    from focal_jax.nn.retrofit import kmeans

    drawn = []
    choice = jax.random.choice

    def spy(key, n, p=None, **kwargs):
        drawn.append(np.asarray(p))
        return choice(key, n, p=p, **kwargs)

    monkeypatch.setattr(jax.random, "choice", spy)
    points = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
    first = np.asarray(kmeans(points, 2, key=jax.random.key(3), iters=0, spherical=spherical))[0]
    if spherical:
        units = points / np.linalg.norm(points, axis=-1, keepdims=True)
        weights = (1.0 - units @ first) ** 2
    else:
        weights = np.sum((points - first) ** 2, axis=-1)
    [p] = drawn
    np.testing.assert_allclose(p, weights / weights.sum(), rtol=1e-4, atol=1e-7)


def test_kmeans_with_fewer_distinct_points_than_centroids_keeps_unit_centroids_on_the_points():
    """3 distinct unit rows, 5 copies each, and 4 centroids: one cluster is left empty, and its centroid keeps
    its seed (one of the points) rather than becoming the empty cluster's zero mean."""
    from focal_jax.nn.retrofit import kmeans

    points = np.repeat(np.eye(3, 4, dtype=np.float32), 5, axis=0)
    found = np.asarray(kmeans(points, 4, key=jax.random.key(0)))
    assert np.isfinite(found).all()
    np.testing.assert_allclose(np.linalg.norm(found, axis=-1), 1.0, atol=1e-6)
    assert all(np.abs(points - c).max(axis=-1).min() < 1e-6 for c in found), found


def _projected_inputs(model, tokens, segment_ids=None):
    """Each Focus layer's routing inputs `x W_g` at real tokens, from a recorded forward pass: `[N, d_g]` each."""
    from focal_jax.nn.attention import record_attention

    with record_attention() as records:
        model(jnp.asarray(tokens), segment_ids=None if segment_ids is None else jnp.asarray(segment_ids))
    real = np.ones(np.shape(tokens), bool) if segment_ids is None else np.asarray(segment_ids) != 0
    return [np.asarray(r["x"] @ attn.w_g[...])[real] for r, attn in zip(records, _attention(model))]


def test_a_kmeans_retrofit_fits_each_layers_centroids_to_its_routing_inputs(family):
    """`FocusConfig(init='kmeans')` (FOCUS_SPEC OQ-6): each layer's centroids are the spherical k-means of its
    projected routing inputs on the sample (checked from a forward pass of the result: every centroid is a unit
    row, the mean direction of the inputs nearest to it, and they fit the inputs better than the random
    centroids of `init='random'`); padding (segment id 0) is left out; `w_g` keeps its random values."""
    name, directory, _ = family
    tokens = _tokens(LONG, seed=4)
    focus = FocusConfig(groups=GROUPS, dim=DIM, window=WINDOW, init="kmeans")
    model = retrofit(from_hf(directory), focus, rngs=1, init_batches=[tokens])
    random = retrofit(from_hf(directory), dataclasses.replace(focus, init="random"), rngs=1)
    for attn, base in zip(_attention(model), _attention(random)):
        np.testing.assert_array_equal(attn.w_g[...], base.w_g[...])
        assert not np.allclose(attn.centroids[...], base.centroids[...])
    for points, attn, base in zip(_projected_inputs(model, tokens), _attention(model), _attention(random)):
        units = points / np.linalg.norm(points, axis=-1, keepdims=True)
        centroids = np.asarray(attn.centroids[...])
        np.testing.assert_allclose(np.linalg.norm(centroids, axis=-1), 1.0, atol=1e-5)
        nearest = np.argmax(units @ centroids.T, axis=-1)
        for group in np.unique(nearest):
            mean = units[nearest == group].mean(axis=0)
            assert float(mean @ centroids[group] / np.linalg.norm(mean)) > 0.999
        fit = lambda c: float(np.mean(np.max(units @ (c / np.linalg.norm(c, axis=-1, keepdims=True)).T, axis=-1)))
        assert fit(centroids) > fit(np.asarray(base.centroids[...]))
    # Padding: the tokens of segment 0 change, the centroids do not.
    segment_ids = np.ones_like(tokens)
    segment_ids[:, -5:] = 0
    batch = lambda tokens: {"inputs": tokens, "segment_ids": segment_ids}
    other = tokens.copy()
    other[:, -5:] = (other[:, -5:] + 1) % VOCAB
    fitted = [retrofit(from_hf(directory), focus, rngs=1, init_batches=[batch(t)]) for t in (tokens, other)]
    for a, b in zip(*(_attention(m) for m in fitted)):
        np.testing.assert_array_equal(a.centroids[...], b.centroids[...])


@pytest.mark.parametrize("normalize", [True, False])
def test_kmeans_centroids_compile_one_forward_for_all_layers_and_report_each_fit(monkeypatch, normalize):
    """`kmeans_centroids` records each Focus layer's inputs with one compiled forward (the layer index is traced):
    a 3-layer model over 2 batches traces the forward once, not once per layer (a compile each: minutes at 7B).
    `progress` gets a line per layer: its points, their mean cosine (cosine routing) or squared distance (raw dot
    products) to the nearest centroid and the largest cluster's share, as recomputed here from the fitted model's
    routing inputs."""
    import contextlib

    from focal_jax.nn import retrofit as retrofit_module

    traced, recording = [], retrofit_module.record_attention

    @contextlib.contextmanager
    def counted():
        traced.append(1)
        with recording() as records:
            yield records

    model = GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=3, n_heads=4), rngs=nnx.Rngs(0))
    model = retrofit(model, FocusConfig(groups=2, dim=8, window=2, normalize=normalize))
    batches = [_tokens(12, seed=s) % 50 for s in (1, 2)]
    monkeypatch.setattr(retrofit_module, "record_attention", counted)
    lines = []
    retrofit_module.kmeans_centroids(model, batches, key=jax.random.key(0), progress=lines.append)
    assert len(traced) == 1
    monkeypatch.undo()
    assert len(lines) == 3
    inputs = [np.concatenate(layer) for layer in zip(*(_projected_inputs(model, tokens) for tokens in batches))]
    for i, (line, points, attn) in enumerate(zip(lines, inputs, _attention(model))):
        centroids = np.asarray(attn.centroids[...], np.float64)
        points = points.astype(np.float64)
        if normalize:
            closeness = (points / np.linalg.norm(points, axis=-1, keepdims=True)) @ centroids.T
            nearest, fit = closeness.argmax(-1), f"mean cosine to the nearest centroid {closeness.max(-1).mean():.3f}"
        else:
            distances = ((points[:, None] - centroids[None]) ** 2).sum(-1)
            nearest = distances.argmin(-1)
            fit = f"mean squared distance to the nearest centroid {distances.min(-1).mean():.4g}"
        largest = np.bincount(nearest, minlength=2).max() / len(points)
        assert line == (f"k-means centroids of Focus layer {i + 1} of 3: 48 points, {fit}, largest cluster "
                        f"{largest:.0%} of them")


def test_kmeans_centroids_in_a_compute_dtype_see_the_inputs_of_a_model_cast_to_it():
    """`kmeans_centroids(..., dtype=jnp.bfloat16)` (the trainer passes its compute_dtype) fits the centroids that a
    model whose parameters were cast to bf16, all but the routing ones (as a training step casts them), gets with
    the forward in its own dtypes; those differ from the float32 forward's. The stored parameters keep their dtype;
    a dtype that is not a floating type is named."""
    from focal_jax.nn.retrofit import kmeans_centroids

    make = lambda: retrofit(GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4),
                                 rngs=nnx.Rngs(0)), FocusConfig(groups=3, dim=8, window=2), rngs=1)
    batches = [_tokens(12, seed=s) % 50 for s in (1, 2)]
    fitted = kmeans_centroids(make(), batches, key=jax.random.key(0), dtype=jnp.bfloat16)
    cast = make()
    for _, variable in nnx.to_flat_state(nnx.state(cast, nnx.All(nnx.Param, nnx.Not(Centroid)))):
        variable.set_value(variable.get_value().astype(jnp.bfloat16))
    by_hand = kmeans_centroids(cast, batches, key=jax.random.key(0))
    in_float32 = kmeans_centroids(make(), batches, key=jax.random.key(0))
    for a, b, c in zip(_attention(fitted), _attention(by_hand), _attention(in_float32)):
        np.testing.assert_allclose(a.centroids[...], b.centroids[...], atol=1e-6)
        assert not np.allclose(a.centroids[...], c.centroids[...], atol=1e-4)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(fitted))} == {jnp.dtype(jnp.float32)}
    with pytest.raises(ValueError, match="dtype must be a floating-point dtype.*got dtype=<class 'jax.numpy.int32'>"):
        kmeans_centroids(make(), batches, key=jax.random.key(0), dtype=jnp.int32)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_kmeans_refuses_tokens_and_positions_out_of_range(kind):
    """One token id past the vocabulary (or a GPT-2 position past n_positions) in a k-means batch was a NaN row in
    the jitted forward: every centroid NaN, the model NaN from then on, with only 'mean cosine nan' printed."""
    if kind == "llama":
        model = Llama(LlamaConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, intermediate=64),
                      rngs=nnx.Rngs(0))
    else:
        model = GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4), rngs=nnx.Rngs(0))
    focus = FocusConfig(groups=2, dim=8, window=2, init="kmeans")
    good = np.arange(16, dtype=np.int32).reshape(2, 8)
    bad = good.copy()
    bad[1, 3] = 50
    with pytest.raises(ValueError, match=re.escape("the tokens of batch 1 must be in [0, 50), got values from 0 to "
                                                   "50")):
        retrofit(model, focus, init_batches=[good, bad])
    if kind == "gpt2":
        with pytest.raises(ValueError, match=re.escape("the positions of batch 0 (GPT-2's n_positions) must be in "
                                                       "[0, 16), got values from 0 to 19")):
            retrofit(model, focus, init_batches=[np.zeros((1, 20), np.int32)])
    retrofit(model, focus, init_batches=[good])
    assert all(np.isfinite(attn.centroids[...]).all() for attn in _attention(model))


def test_kmeans_init_is_asked_for_by_name():
    """`init='kmeans'` needs `init_batches`, and `init_batches` and `progress` need it (which then reports the
    fit of the model's one layer); an unknown init is named."""
    model = GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=1, n_heads=4), rngs=nnx.Rngs(0))
    tokens = np.zeros((1, 8), np.int32)
    with pytest.raises(ValueError, match=r"FocusConfig\(init='kmeans'\) fits .*: pass init_batches=\[\.\.\.\]"):
        retrofit(model, FocusConfig(groups=2, dim=8, window=2, init="kmeans"))
    with pytest.raises(ValueError, match=r"init_batches are for FocusConfig\(init='kmeans'\), got FocalConfig"):
        retrofit(model, FocalConfig(t=0.5), init_batches=[tokens])
    with pytest.raises(ValueError, match=r"progress reports the k-means fit of FocusConfig\(init='kmeans'\), got "
                                         r"FocusConfig\(.*init='random'"):
        retrofit(model, FocusConfig(groups=2, dim=8, window=2), progress=print)
    lines = []
    retrofit(model, FocusConfig(groups=2, dim=8, window=2, init="kmeans"), init_batches=[tokens + np.arange(8)],
             progress=lines.append)
    assert len(lines) == 1 and lines[0].startswith("k-means centroids of Focus layer 1 of 1: 8 points, ")
    with pytest.raises(ValueError, match=r"FocusConfig: init='means' is not one of \('random', 'kmeans'\)"):
        FocusConfig(groups=2, dim=8, window=2, init="means")
    assert "focus_init" not in FocusConfig(groups=2, dim=8, window=2, init="kmeans").attention_fields()
