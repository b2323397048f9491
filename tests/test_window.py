"""Sliding windows beyond the LLaMA family: GPT-2's attention fields (window, tau_mode, focus_assign, softcap), the
in-place `replace_attention`, `retrofit(model, WindowConfig(w))` / the trainer's `retrofit.window`, the evaluation
view, and the window baseline experiment on a Hugging Face GPT-2 directory.

References are independent of the code under test: a naive GPT-2 forward written here with an explicit
`0 <= i - j <= w` mask, and `jax.nn.dot_product_attention(local_window_size=(w, 0), is_causal=True)`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax.nn.attention import record_attention
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.nn.retrofit import (REPLACEABLE_FIELDS, FocalConfig, FocusConfig, WindowConfig, replace_attention,
                                   retrofit)
from helpers import load_experiment

pytestmark = pytest.mark.usefixtures("fast_compiles")

VOCAB, T = 61, 24


def _gpt2(seed=0, **fields):
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, d_model=32, n_layers=2, n_heads=4, **fields)
    model = GPT2(config, rngs=nnx.Rngs(seed))
    # Sharper attention than the default init (logits of order 1), so that a window visibly changes the output.
    for block in model.h:
        for proj in (block.attn.q_proj, block.attn.k_proj):
            proj.kernel[...] = 4.0 * proj.kernel[...]
    return model


def _llama(seed=0, **attn):
    config = LlamaConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=48,
                         attn=attn)
    return Llama(config, rngs=nnx.Rngs(seed))


def _same_params(model, like):
    """`model` with the parameters of `like` (same structure)."""
    nnx.update(model, nnx.state(like, nnx.Param))
    return model


def _tokens(length=T, batch=2, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, length)), jnp.int32)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def _layer_norm(x, ln, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * np.asarray(ln.scale[...]) + np.asarray(ln.bias[...])


def _linear(x, layer):
    return x @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])


def naive_gpt2_logits(model, tokens, window):
    """GPT-2's forward in float64 numpy from `model`'s parameter arrays, attention masked explicitly: key j visible
    to query i iff `0 <= i - j <= window` (window None: `j <= i`)."""
    c = model.config
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    h, d = c.n_heads, c.d_model // c.n_heads
    x = np.asarray(model.wte.embedding[...], np.float64)[tokens] + np.asarray(model.wpe.embedding[...])[:t]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    mask = (j <= i) & ((i - j <= window) if window is not None else True)
    for block in model.h:
        y = _layer_norm(x, block.ln_1, c.layer_norm_eps)
        q, k, v = (_linear(y, p).reshape(b, t, h, d) for p in (block.attn.q_proj, block.attn.k_proj,
                                                               block.attn.v_proj))
        logits = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(d)
        logits = np.where(mask, logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out = np.einsum("bhij,bjhd->bihd", p, v).reshape(b, t, c.d_model)
        x = x + _linear(out, block.attn.o_proj)
        y = _layer_norm(x, block.ln_2, c.layer_norm_eps)
        u = _linear(y, block.mlp.c_fc)
        u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u ** 3)))  # gelu_new
        x = x + _linear(u, block.mlp.c_proj)
    x = _layer_norm(x, model.ln_f, c.layer_norm_eps)
    return x @ np.asarray(model.wte.embedding[...], np.float64).T


# ------------------------------------------------------------------------------------------------ GPT-2 fields


@pytest.mark.parametrize("window", [0, 3, 8])
def test_gpt2_window_equals_the_naive_masked_forward(window):
    model = _gpt2(window=window)
    tokens = _tokens()
    logits = np.asarray(_forward(model, tokens))
    np.testing.assert_allclose(logits, naive_gpt2_logits(model, tokens, window), atol=2e-4, rtol=0)
    full = naive_gpt2_logits(model, tokens, None)
    assert not np.allclose(logits, full, atol=1e-2)  # the window changed something (else the test proves nothing)
    assert model.h[0].attn.config.window == window


def test_gpt2_window_attention_equals_jax_local_window():
    """Every layer's attention output (from its recorded q, k, v) equals jax.nn.dot_product_attention with
    local_window_size=(w, 0), is_causal=True."""
    w = 5
    model = _gpt2(window=w)
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens):
        with record_attention() as records:
            nnx.merge(graphdef, state)(tokens)
        return [(r["q"], r["k"], r["v"], r["attend"](r["x"], r["q"], r["k"], r["v"], None)) for r in records]

    layers = run(state, _tokens())
    assert len(layers) == model.config.n_layers
    for q, k, v, out in layers:
        expected = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(w, 0))
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)


def test_gpt2_window_longer_than_the_input_changes_nothing():
    w = 10
    windowed = _gpt2(window=w)
    full = _same_params(_gpt2(seed=1), windowed)
    short = _tokens(length=w + 1)  # every causal key lies within the window: the same math (float32 rounding)
    np.testing.assert_allclose(_forward(windowed, short), _forward(full, short), atol=1e-6, rtol=0)
    long = _tokens(length=w + 2)
    assert not np.allclose(_forward(windowed, long), _forward(full, long), atol=1e-3)


def test_gpt2_window_decodes_with_a_cache_like_the_full_forward():
    from focal_jax.nn.generate import init_cache

    model = _gpt2(window=4)
    tokens = _tokens(length=12, batch=1)
    full = np.asarray(_forward(model, tokens))
    cache = init_cache(model, 1, 12)
    logits, cache = model(tokens[:, :7], cache=cache)
    steps = [logits]
    for i in range(7, 12):
        logits, cache = model(tokens[:, i:i + 1], cache=cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-4, rtol=0)


def test_gpt2_passes_tau_mode_focus_assign_softcap_through():
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, d_model=32, n_layers=1, n_heads=4, kind="focal_learned",
                        tau_mode="sequence", softcap=30.0, window=7)
    a = config.attention_config()
    assert (a.kind, a.tau_mode, a.softcap, a.window) == ("focal_learned", "sequence", 30.0, 7)
    assert config.attention == a
    learned = dict(tau_clip="smooth", tau_granularity="head", tau_bias=False, tau_input="residual")
    a = GPT2Config(vocab_size=VOCAB, kind="focal_learned", **learned).attention_config()
    assert {name: getattr(a, name) for name in learned} == learned
    model = retrofit(_gpt2(), FocalConfig(learned=True, **learned))  # the residual stream reaches GPT-2's layers
    assert model.h[0].attn.w_tau.shape == (32, 4) and np.isfinite(_forward(model, _tokens())).all()
    focus = GPT2Config(vocab_size=VOCAB, kind="focus", focus_assign="softmax").attention_config()
    assert focus.focus_assign == "softmax"
    # softcap changes the logits: a model with softcap equals the naive forward only without it.
    capped = _gpt2(softcap=1.0)
    assert not np.allclose(_forward(capped, _tokens()), naive_gpt2_logits(capped, _tokens(), None), atol=1e-3)


@pytest.mark.parametrize("fields, needle", [
    (dict(window=-1), "window must be an integer >= 0, got window=-1"),
    (dict(window=2.5), "window=2.5"),
    (dict(window=4, kind="focus"), "window=4 is for the non-Focus kinds; kind='focus' uses focus_window"),
    (dict(tau_mode="suffix"), "tau_mode='suffix' is not one of"),
    (dict(focus_assign="argmax"), "focus_assign='argmax' is not one of"),
    (dict(softcap=0.0), "softcap must be a finite number > 0, got softcap=0.0"),
    (dict(softcap=float("inf")), "softcap must be a finite number > 0, got softcap=inf"),  # every logit NaN
])
def test_gpt2_config_names_a_bad_attention_field(fields, needle):
    with pytest.raises(ValueError, match="GPT2Config: .*" + needle.replace("(", r"\(").replace("[", r"\[")):
        GPT2Config(vocab_size=VOCAB, **fields)


# ------------------------------------------------------------------------------------------------ replace_attention


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_replace_attention_window_equals_a_model_built_with_it(family):
    build = _gpt2 if family == "gpt2" else _llama
    model = build(seed=0)
    fields = {"window": 3}
    built = _same_params(build(seed=1, **fields), model)
    tokens = _tokens()
    before = np.asarray(_forward(model, tokens))
    arrays = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert replace_attention(model, window=3) is model
    assert all(a is b for a, b in zip(arrays, jax.tree.leaves(nnx.state(model, nnx.Param))))  # no copy, no new
    np.testing.assert_allclose(_forward(model, tokens), _forward(built, tokens), atol=1e-6, rtol=0)
    assert not np.allclose(_forward(model, tokens), before, atol=1e-3)
    assert model.config == built.config
    layers = model.h if family == "gpt2" else model.layers
    assert all((blk.attn if family == "gpt2" else blk.self_attn).config == built.config.attention for blk in layers)
    # and back: window=None restores the full attention exactly.
    replace_attention(model, window=None)
    np.testing.assert_array_equal(_forward(model, tokens), before)


def test_replace_attention_changes_settings_of_the_kind_it_has():
    model = _llama(kind="focus", focus_groups=4, focus_dim=8, focus_window=4)
    hard = _same_params(_llama(seed=1, kind="focus", focus_groups=4, focus_dim=8, focus_window=4, focus_topk=2,
                               focus_causal=True), model)
    replace_attention(model, focus_topk=2, focus_causal=True)
    assert model.config == hard.config
    np.testing.assert_allclose(_forward(model, _tokens()), _forward(hard, _tokens()), atol=1e-6, rtol=0)
    gpt2 = replace_attention(_gpt2(), kind="focal", focal_t=0.5)  # dense <-> focal: the same parameters
    assert (gpt2.config.kind, gpt2.config.focal_t, gpt2.h[1].attn.config.focal_t) == ("focal", 0.5, 0.5)
    assert replace_attention(gpt2) is gpt2  # nothing to change


@pytest.mark.parametrize("changes, needle", [
    (dict(kind="focus"), r"kind='dense' -> 'focus' needs parameters .*\['centroids', 'w_g'\].*retrofit"),
    (dict(kind="focal_learned"), r"kind='dense' -> 'focal_learned' needs parameters .*\['tau_bias', 'w_tau'\]"),
    (dict(n_heads=2), r"cannot change n_heads=2: a field of the model's architecture.*'window'"),
    (dict(focus_groups=2), r"cannot change focus_groups=2"),
    (dict(windw=3), r"cannot change windw=3: not an AttentionConfig field; it changes \(.*'window'"),
    (dict(focal_t=0.3), r"focal_t=0.3 would change nothing on attention kind='dense'.*\('focal', 'focal\+focus'\)"),
    (dict(focus_topk=1), r"focus_topk=1 would change nothing on attention kind='dense'"),
    (dict(window=-2), r"window must be an integer >= 0, got window=-2"),
    (dict(rope_ntk_factor=2.0, rope_trained_len=8), r"rope_ntk_factor=2.0 needs rotary embeddings"),
])
def test_replace_attention_refuses_and_names_the_field(changes, needle):
    model = _gpt2()
    config, configs = model.config, [b.attn.config for b in model.h]
    with pytest.raises(ValueError, match=needle):
        replace_attention(model, **changes)
    assert model.config == config and [b.attn.config for b in model.h] == configs  # untouched


def test_replace_attention_refusals_on_focus_and_unused_parameters():
    focus = _llama(kind="focus", focus_groups=4, focus_dim=8, focus_window=4)
    with pytest.raises(ValueError, match="window=8 is for the non-Focus kinds; kind='focus' uses focus_window"):
        replace_attention(focus, window=8)
    with pytest.raises(ValueError, match=r"would leave the parameters \['centroids', 'w_g'\].*allow_unused=True"):
        replace_attention(focus, kind="dense")
    replace_attention(focus, kind="dense", allow_unused=True)  # an evaluation view's change
    assert focus.config.attention.kind == "dense" and focus.layers[0].self_attn.centroids is not None
    with pytest.raises(ValueError, match="supports focal_jax Llama and GPT2 models, got int"):
        replace_attention(3, window=2)
    assert "window" in REPLACEABLE_FIELDS and "n_heads" not in REPLACEABLE_FIELDS


def test_attention_view_with_a_window_is_the_zero_shot_model():
    """The zero-shot window evaluation (pretrained weights under a window, no training): a view over the same
    arrays, the model itself unchanged."""
    from focal_jax.eval.diagnostics import attention_view

    model = _gpt2()
    view = attention_view(model, window=4)
    np.testing.assert_allclose(_forward(view, _tokens()), naive_gpt2_logits(model, _tokens(), 4), atol=2e-4, rtol=0)
    assert model.config.window is None and view.config.window == 4 and view.h[0].attn.config.window == 4
    assert view.h[0].attn.q_proj.kernel.get_value() is model.h[0].attn.q_proj.kernel.get_value()


# ------------------------------------------------------------------------------------------------ retrofit.window


def test_retrofit_window_config():
    model = _gpt2()
    built = _same_params(_gpt2(seed=1, window=6), model)
    assert retrofit(model, WindowConfig(6)) is model and model.config == built.config
    np.testing.assert_allclose(_forward(model, _tokens()), _forward(built, _tokens()), atol=1e-6, rtol=0)
    focal = retrofit(_llama(kind="focal"), WindowConfig(0))
    assert focal.config.attention.window == 0 and focal.config.attention.kind == "focal"
    with pytest.raises(ValueError, match=r"window=-1"):
        WindowConfig(-1)
    focus = retrofit(_gpt2(), FocusConfig(groups=2, dim=4, window=8))
    with pytest.raises(ValueError, match=r"window=6\) on attention kind='focus'.*focus_window=8"):
        retrofit(focus, WindowConfig(6))
    with pytest.raises(ValueError, match=r"cannot retrofit Focus onto attention with a sliding window"):
        retrofit(_gpt2(window=4), FocusConfig(groups=2, dim=4, window=8))


def test_training_config_retrofit_window():
    from focal_jax.train.config import check_config

    config = load_experiment("quickstart", "runlocal")
    config.retrofit.window = 0  # falsy, still a window
    assert check_config(config).retrofit == (WindowConfig(0),)
    config.retrofit.window = 8
    config.retrofit.focus = {"groups": 2, "dim": 4, "window": 8}
    with pytest.raises(ValueError, match=r"retrofit.window=8 and retrofit.focus do not go together"):
        check_config(config)
    config.retrofit.focus = None
    config.model.attn = {"kind": "focus", "focus_groups": 2}
    with pytest.raises(ValueError, match=r"retrofit.window=8 cannot go on model attention kind='focus'"):
        check_config(config)
    config.model.attn = {}
    config.retrofit.window = -3
    with pytest.raises(ValueError, match=r"retrofit.window: .*window=-3"):
        check_config(config)


# ------------------------------------------------------------------------------------------------ the experiment


def test_window_baseline_trains_on_a_hugging_face_gpt2_directory(tmp_path):
    """experiments/focus_window_baseline.py:runlocal,hf=DIR on a tiny random GPT2LMHeadModel directory
    (safetensors, tokenizer.json) trains 2 steps through `train`; the run's model has the window on every layer."""
    import torch
    import transformers

    from focal_jax.train import train
    from focal_jax.train.metrics import read_metrics
    from focal_jax.train.trainer import load_model
    from test_tokenizer_hf import SENTENCES, make_tokenizer_json

    hf_dir = tmp_path / "gpt2"
    tokenizer_json = make_tokenizer_json(str(tmp_path / "tokenizer"))
    import tokenizers

    reference = tokenizers.Tokenizer.from_file(tokenizer_json)
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=reference.get_vocab_size(), n_positions=128, n_embd=32,
                                        n_layer=2, n_head=4, bos_token_id=None,
                                        eos_token_id=reference.token_to_id("<|endoftext|>"))
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(hf_dir, safe_serialization=True)
    (hf_dir / "tokenizer.json").write_bytes(open(tokenizer_json, "rb").read())
    for i in range(12):
        (tmp_path / f"doc{i}.txt").write_text(" ".join(SENTENCES[i % 4:] + SENTENCES[:i % 4]))

    config = load_experiment("focus_window_baseline", f"runlocal,hf={hf_dir}")
    assert config.model.to_dict() == {"family": "hf"} and config.retrofit.window == 16
    assert load_experiment("focus_window_baseline", f"hf={hf_dir}").retrofit.window == 128
    config.data.update(source="text", paths=(str(tmp_path / "doc*.txt"),))
    config.update(total_steps=2, batch_size=8, eval_batches=0)
    workdir = str(tmp_path / "run")
    train(config, workdir)
    losses = {r["step"]: r["loss"] for r in read_metrics(workdir, kind="train")}
    assert sorted(losses) == [1, 2] and np.isfinite(list(losses.values())).all()
    model = load_model(workdir)
    assert isinstance(model, GPT2) and model.config.window == 16
    assert all(block.attn.config.window == 16 for block in model.h)
    tokens = _tokens(length=40, batch=1) % reference.get_vocab_size()
    np.testing.assert_allclose(_forward(model, tokens), naive_gpt2_logits(model, tokens, 16), atol=2e-4, rtol=0)

    with pytest.raises(ValueError, match="exactly one of init_from=WORKDIR or hf=DIRECTORY"):
        load_experiment("focus_window_baseline", "runlocal")


def test_window_baseline_on_a_gpt2_run(tmp_path):
    """A focal_jax GPT-2 run as the base: the window goes into its model section (GPT2Config.window)."""
    from focal_jax.train import train
    from focal_jax.train.config import check_config

    from focal_jax.configs import common

    base = load_experiment("quickstart", "runlocal")
    base.model = {"family": "gpt2"}
    base = common.runlocal(base, steps=1)  # the tiny GPT-2
    base.update(batch_size=8, eval_batches=0)
    base_dir = str(tmp_path / "base")
    train(base, base_dir)
    config = load_experiment("focus_window_baseline", f"runlocal,init_from={base_dir},window=5")
    run = check_config(config)
    assert run.family == "gpt2" and run.model.window == 5 and run.retrofit == ()
    assert dataclasses.replace(run.model, window=None) == check_config(base).model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_positions_and_segment_ids_as_lists_or_floats(family):
    """positions and segment_ids may be nested lists like tokens; float positions are refused, naming the dtype."""
    from focal_jax.nn.llama import Llama, LlamaConfig
    model = (Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, intermediate=32), rngs=nnx.Rngs(0))
             if family == "llama" else GPT2(GPT2Config(vocab_size=32, n_positions=8, d_model=16, n_layers=1,
                                                       n_heads=2), rngs=nnx.Rngs(0)))
    tokens = [[1, 2, 3, 4]]
    want = model(jnp.asarray(tokens), positions=jnp.asarray([[0, 1, 0, 1]]), segment_ids=jnp.asarray([[1, 1, 2, 2]]))
    np.testing.assert_array_equal(model(tokens, positions=[[0, 1, 0, 1]], segment_ids=[[1, 1, 2, 2]]), want)
    with pytest.raises(ValueError, match="positions must .*integers.*float32"):
        model(tokens, positions=jnp.asarray([[0.0, 0.5, 1.0, 1.5]]))
    with pytest.raises(ValueError, match=r"tokens must .*\(both >= 1\), got shape \(1, 0\)"):
        model(jnp.zeros((1, 0), jnp.int32))  # (an empty sequence: jnp's "zero-size array to reduction" before)
