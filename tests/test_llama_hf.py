"""LLaMA-family models against Hugging Face transformers (tiny random models built from configs, no download),
the Attention module's kinds against those logits, config validation, import errors, and the paper's sizes."""

import dataclasses
import json
import re
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from focal_jax.convert.hf import from_hf, read_hf_config, to_hf
from focal_jax.nn.attention import Attention, AttentionConfig
from focal_jax.nn.generate import generate
from focal_jax.nn.layers import rope, rope_inverse_frequencies
from focal_jax.nn.llama import Llama, LlamaConfig, focal_config, param_count
from focal_jax.nn.variables import Centroid, Temperature

from helpers import assert_close

VOCAB, T = 100, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
              initializer_range=0.1)
FAMILIES = {
    # name: (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=500.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=4)),
}


def make_hf(family, directory, seed=0):
    """A tiny random HF model saved as safetensors in `directory`; norm gains and biases are perturbed away from
    their 1 / 0 initialisation so that loading them is tested too."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, (2, T)).astype(np.int32)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    return directory, make_hf("llama", directory)


# ------------------------------------------------------------------------------------------- HF parity


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_from_hf_logits_equal_transformers(family, tokens, tmp_path):
    hf = make_hf(family, str(tmp_path))
    model = from_hf(str(tmp_path))
    expected = hf_logits(hf, tokens)
    logits = model(jnp.asarray(tokens))
    assert logits.dtype == jnp.float32
    assert np.abs(expected).max() > 0.5  # logits are not trivially small
    assert_close(logits, expected, atol=1e-4, what=family)
    # The comparison can fail: doubling the relative distances (RoPE) moves the logits far beyond the tolerance.
    shifted = model(jnp.asarray(tokens), positions=jnp.broadcast_to(2 * jnp.arange(T), tokens.shape))
    assert np.abs(np.asarray(shifted) - expected).max() > 1e-2
    # Export: transformers loads what to_hf writes and computes the same logits.
    to_hf(model, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert_close(hf_logits(reloaded, tokens), expected, atol=1e-4, what=f"{family} to_hf")


def test_config_mapping(llama_dir, tmp_path):
    model = from_hf(llama_dir[0])
    c = model.config
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.rope_theta, c.tie_embeddings) == (4, 2, 16, 500.0, False)
    assert model.layers[0].self_attn.k_proj.kernel.shape == (64, 32)  # [in, out], GQA
    mistral = make_hf("mistral", str(tmp_path))
    model = from_hf(str(tmp_path))
    assert model.config.attention.window == 4  # HF sliding_window 5: i - j < 5
    tokens = np.arange(2 * T).reshape(2, T) % VOCAB
    no_window = with_attention(model)  # the same weights with full causal attention
    assert np.abs(np.asarray(no_window(jnp.asarray(tokens))) - hf_logits(mistral, tokens)).max() > 1e-3


def test_from_hf_bfloat16(llama_dir, tokens):
    model = from_hf(llama_dir[0], dtype=jnp.bfloat16)
    assert model.layers[0].self_attn.q_proj.kernel.dtype == jnp.bfloat16
    logits = model(jnp.asarray(tokens))
    assert logits.dtype == jnp.float32
    assert_close(logits, hf_logits(llama_dir[1], tokens), atol=0.15, what="bf16")


def test_bfloat16_checkpoint(tokens, tmp_path):
    """A checkpoint stored in bfloat16 (as most released ones are) loads; numpy alone cannot read bf16."""
    hf = make_hf("qwen2", str(tmp_path / "f32"))
    hf.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"), safe_serialization=True)
    model = from_hf(str(tmp_path / "bf16"))
    assert model.layers[0].self_attn.q_proj.kernel.dtype == jnp.float32
    # transformers reloads the same bf16 weights in float32 (a fresh float32 rotary table, unlike hf.float()).
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32)
    assert_close(model(jnp.asarray(tokens)), hf_logits(reference.eval(), tokens), atol=1e-4, what="bf16 checkpoint")


def test_packed_segments_equal_separate_documents(llama_dir, tokens):
    model = from_hf(llama_dir[0])
    segment_ids = jnp.asarray([[0] * 6 + [1] * 10, [3] * 16], jnp.int32)
    logits = model(jnp.asarray(tokens), segment_ids=segment_ids)  # positions restart at each document
    hf = llama_dir[1]
    assert_close(logits[0, :6], hf_logits(hf, tokens[:1, :6])[0], atol=1e-4, what="doc 0")
    assert_close(logits[0, 6:], hf_logits(hf, tokens[:1, 6:])[0], atol=1e-4, what="doc 1")
    assert_close(logits[1], hf_logits(hf, tokens[1:])[0], atol=1e-4, what="row 1")
    # a segment is the tokens with one id, contiguous or not (as the masks have it): doc 0 split around doc 1
    split = jnp.asarray([[0] * 3 + [1] * 10 + [0] * 3], jnp.int32)
    order = np.r_[0:3, 13:16]
    logits = model(jnp.asarray(tokens[:1]), segment_ids=split)
    assert_close(logits[0, order], hf_logits(hf, tokens[:1, order])[0], atol=1e-4, what="doc 0 around doc 1")


def test_to_hf_paper_model_and_errors(tmp_path, tokens):
    model = Llama(focal_config("tiny"), rngs=nnx.Rngs(0))  # the Focal paper's architecture: Qwen3-like
    to_hf(model, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "qwen3"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert_close(hf_logits(reloaded, tokens), model(jnp.asarray(tokens)), atol=1e-4, what="paper tiny to_hf")
    with pytest.raises(ValueError, match=re.escape("to_hf needs attention kind 'dense' or 'focal' (a constant "
                                                   "temperature, folded into the queries; transformers has no "
                                                   "'focal_learned' attention), got kind='focal_learned'")):
        to_hf(Llama(focal_config("tiny", attn=dict(kind="focal_learned", tau_min=1.0, tau_max=2.0)),
                    rngs=nnx.Rngs(0)), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"qkv_bias=True, qk_norm='head'"):
        to_hf(Llama(focal_config("tiny", qkv_bias=True), rngs=nnx.Rngs(0)), str(tmp_path / "x"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_to_hf_folds_a_constant_focal_temperature_into_the_queries(family, tokens, tmp_path):
    """A model with Focal attention at t = 0.4 is written as dense attention whose queries are scaled by 1/t (the
    q projection's weight and bias, or the q-norm gains of Qwen3 and OLMo-2); transformers' logits equal the Focal
    model's, and differ from the dense model's, so the temperature is not lost."""
    from focal_jax.nn.retrofit import FocalConfig, retrofit
    hf = make_hf(family, str(tmp_path / "hf"))
    model = retrofit(from_hf(str(tmp_path / "hf")), FocalConfig(t=0.4))
    to_hf(model, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    got, dense = hf_logits(reloaded, tokens), hf_logits(hf, tokens)
    assert_close(got, model(jnp.asarray(tokens)), atol=1e-4, what=f"{family} focal to_hf")
    assert np.abs(got - dense).max() > 1e-2
    written = load_file(str(tmp_path / "export" / "model.safetensors"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    scaled = "q_norm.weight" if family in ("qwen3", "olmo2") else "q_proj.weight"
    name = f"model.layers.0.self_attn.{scaled}"
    np.testing.assert_allclose(written[name], original[name] / 0.4, rtol=1e-6)
    unchanged = "model.layers.0.self_attn.k_proj.weight"
    np.testing.assert_array_equal(written[unchanged], original[unchanged])


def test_to_hf_refuses_to_drop_the_parameters_of_a_focus_or_focal_model_viewed_as_dense(tmp_path, tokens):
    from focal_jax.nn.retrofit import FocalConfig, FocusConfig, replace_attention, retrofit
    dense = Llama(focal_config("tiny"), rngs=nnx.Rngs(0))
    expected = dense(jnp.asarray(tokens))
    for added, names in ((FocusConfig(groups=4, dim=8, window=4), r"layers.0.self_attn.centroids.*w_g"),
                         (FocalConfig(learned=True), r"layers.0.self_attn.tau_bias.*w_tau")):
        model = retrofit(Llama(focal_config("tiny"), rngs=nnx.Rngs(0)), added)
        replace_attention(model, kind="dense", allow_unused=True)
        with pytest.raises(ValueError, match=rf"4 parameters .*{names}.*allow_unused=True"):
            to_hf(model, str(tmp_path / "refused"))
        assert not (tmp_path / "refused").exists()
        to_hf(model, str(tmp_path / "dense"), allow_unused=True)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense")).eval()
        assert_close(hf_logits(reloaded, tokens), expected, atol=1e-4, what=f"{type(added).__name__} as dense")
    with pytest.raises(ValueError, match=r"allow_unused must be a bool, got allow_unused='yes'"):
        to_hf(dense, str(tmp_path / "x"), allow_unused="yes")


def test_to_hf_takes_token_ids_and_files_from_the_source(llama_dir, tmp_path, tokens):
    source = tmp_path / "source"
    shutil.copytree(llama_dir[0], source)
    with open(source / "config.json") as f:
        config = json.load(f)
    config.update(bos_token_id=5, eos_token_id=[7, 9], max_position_embeddings=8192)
    with open(source / "config.json", "w") as f:
        json.dump(config, f)
    with open(source / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 5, "eos_token_id": [7, 9]}, f)
    model = from_hf(str(source))
    to_hf(model, str(tmp_path / "export"), source=str(source))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert (reloaded.config.bos_token_id, reloaded.config.eos_token_id) == (5, [7, 9])
    assert reloaded.config.max_position_embeddings == 8192
    assert reloaded.generation_config.eos_token_id == [7, 9]
    assert_close(hf_logits(reloaded, tokens), hf_logits(llama_dir[1], tokens), atol=1e-4, what="to_hf with source")
    to_hf(model, str(tmp_path / "bare"))  # without a source: transformers' defaults
    with open(tmp_path / "bare" / "config.json") as f:
        assert "eos_token_id" not in json.load(f)
    with pytest.raises(ValueError, match="source=.*no config.json"):
        to_hf(model, str(tmp_path / "x"), source=str(tmp_path))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match="directory=.*a_file' is a file; expected a directory"):  # FileExistsError
        to_hf(model, str(tmp_path / "a_file"))


def test_to_hf_refuses_a_softcap(llama_dir, tmp_path):
    model = with_attention(from_hf(llama_dir[0]), softcap=30.0)
    with pytest.raises(ValueError, match=r"softcap=30\.0"):
        to_hf(model, str(tmp_path))


def test_token_ids_out_of_range(llama_dir):
    model = from_hf(llama_dir[0])
    with pytest.raises(ValueError, match=rf"tokens must be in \[0, {VOCAB}\), got values from 3 to {VOCAB}"):
        model(jnp.array([[3, VOCAB]]))
    assert model([[1, 2, 3]]).shape == (1, 3, VOCAB)  # a list, as GPT-2 takes it
    with pytest.raises(ValueError, match=r"segment_ids must have the shape of tokens \(1, 3\), got shape \(1, 2\)"):
        model(jnp.array([[1, 2, 3]]), segment_ids=jnp.ones((1, 2), jnp.int32))


def test_a_config_from_a_file_stays_hashable():
    """`rope_llama3` read from a config file is a list: the model config keeps it as a tuple (generate's jit needs
    a hashable config; it used to fail)."""
    attn = {"rope_llama3": [8.0, 1.0, 4.0, 80]}
    config = LlamaConfig(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, intermediate=32, attn=attn)
    assert config == dataclasses.replace(config, attn={"rope_llama3": (8.0, 1.0, 4.0, 80)}) and hash(config)
    assert generate(Llama(config, rngs=nnx.Rngs(0)), jnp.ones((1, 3), jnp.int32), max_new_tokens=2).shape == (1, 5)


def test_jit_through_split_merge(llama_dir, tokens):
    graphdef, state = nnx.split(from_hf(llama_dir[0]))
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    assert_close(forward(state, jnp.asarray(tokens)), hf_logits(llama_dir[1], tokens), atol=1e-4, what="jit")


# ------------------------------------------------------------------------ attention kinds on HF weights


def with_attention(model, **attn):
    """The same weights in a model whose attention has the given `AttentionConfig` fields."""
    new = Llama(dataclasses.replace(model.config, attn=attn), rngs=nnx.Rngs(1))
    nnx.update(new, nnx.state(model))  # the new parameters keep their initialisation
    return new


@pytest.mark.parametrize("causal", [False, True])
def test_packed_focus_equals_separate_documents(llama_dir, tokens, causal):
    """Soft Focus with its Sinkhorn over each packed document only: a packed row's logits equal each document's
    own forward (the paper's column sums, causal=False, would otherwise mix the documents' routing)."""
    model = with_attention(from_hf(llama_dir[0]), kind="focus", focus_window=2, focus_groups=3, focus_dim=8,
                           focus_causal=causal)
    row = jnp.asarray(tokens[:1])
    packed = model(row, segment_ids=jnp.asarray([[0] * 6 + [1] * 10], jnp.int32))
    assert_close(packed[0, :6], model(row[:, :6])[0], atol=1e-4, what="doc 0")
    assert_close(packed[0, 6:], model(row[:, 6:])[0], atol=1e-4, what="doc 1")


@pytest.mark.parametrize("attn", [
    dict(kind="focal", focal_t=1.0),
    dict(kind="focal_learned", tau_min=3.0, tau_max=6.0),  # tau_bias set to sqrt(head_dim) = 4 below
    dict(kind="focus", focus_window=T, focus_groups=4),  # every causal pair is local: nothing gated
    dict(kind="focus", focus_window=2, focus_groups=4, focus_topk=4),  # all groups: the causal mask
    dict(kind="focal+focus", focal_t=1.0, focus_window=2, focus_groups=3, focus_topk=3),
    dict(kind="dense", softcap=1e6),  # a cap far above every logit
])
def test_kinds_reduce_to_dense(attn, llama_dir, tokens):
    model = with_attention(from_hf(llama_dir[0]), **attn)
    if attn["kind"] == "focal_learned":
        for layer in model.layers:
            layer.self_attn.tau_bias[...] = 4.0
    assert_close(model(jnp.asarray(tokens)), hf_logits(llama_dir[1], tokens), atol=1e-4, what=str(attn))


@pytest.mark.parametrize("attn", [
    dict(kind="focal", focal_t=0.4),
    dict(kind="focal_learned"),  # tau starts at 7.5, not sqrt(16) = 4
    dict(kind="focus", focus_window=2, focus_groups=4),
    dict(kind="focus", focus_window=2, focus_groups=4, focus_topk=1),
    dict(kind="dense", softcap=0.5),
    dict(kind="focus", focus_window=2, focus_groups=4, focus_topk=1, impl="decomposed", softcap=0.5),
])
def test_kinds_change_logits(attn, llama_dir, tokens):
    model = with_attention(from_hf(llama_dir[0]), **attn)
    assert np.abs(np.asarray(model(jnp.asarray(tokens))) - hf_logits(llama_dir[1], tokens)).max() > 1e-3


def test_hard_focus_impls_agree(llama_dir, tokens):
    base = from_hf(llama_dir[0])
    attn = dict(kind="focal+focus", focus_window=3, focus_groups=4, focus_topk=2, focus_causal=True)
    ref = with_attention(base, **attn)
    fast = with_attention(base, **attn, impl="decomposed")
    nnx.update(fast, nnx.state(ref))
    assert_close(fast(jnp.asarray(tokens)), ref(jnp.asarray(tokens)), atol=1e-4, what="decomposed")


def test_new_parameter_types_and_counts():
    base = focal_config("tiny")
    focus = focal_config("tiny", attn=dict(kind="focus", focus_groups=4, focus_dim=16))
    learned = focal_config("tiny", attn=dict(kind="focal_learned"))
    assert param_count(focus, Centroid) == base.n_layers * (64 * 16 + 4 * 16)
    assert param_count(focus) == param_count(base) + param_count(focus, Centroid)
    assert param_count(learned, Temperature) == base.n_layers * (64 + 1)
    assert param_count(base, Centroid) == param_count(base, Temperature) == 0
    attention = Attention(focus.attention, rngs=nnx.Rngs(0))
    assert isinstance(attention.w_g, Centroid) and attention.w_g.shape == (64, 16)
    np.testing.assert_allclose(np.linalg.norm(attention.centroids[...], axis=-1), 1.0, rtol=1e-5)
    assert 0.01 < float(jnp.std(attention.w_g[...])) < 0.03


# ------------------------------------------------------------------------------------------- layers


def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, LlamaRotaryEmbedding
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=1000.0)
    x = np.random.default_rng(1).standard_normal((2, 5, 4, 16)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [9, 3, 100, 7, 0]])
    xt = torch.as_tensor(x).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(config)(xt, torch.as_tensor(positions))
    expected, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    got = rope(jnp.asarray(x), jnp.asarray(positions), 1000.0)
    assert_close(got, expected.transpose(1, 2).numpy(), atol=1e-4, what="rope")


def test_attention_without_rope_matches_numpy():
    """The GPT-2 form (no rotary, biases on q/k/v and the output, MHA) against a naive numpy computation."""
    config = AttentionConfig(d_model=24, n_heads=3, n_kv_heads=3, head_dim=8, qkv_bias=True, out_bias=True,
                             rope_theta=None)
    module = Attention(config, rngs=nnx.Rngs(0))
    for i, proj in enumerate((module.q_proj, module.k_proj, module.v_proj, module.o_proj)):
        proj.bias[...] = jax.random.normal(jax.random.key(i), proj.bias.shape)
    x = np.random.default_rng(2).standard_normal((2, 7, 24)).astype(np.float32)
    w = {n: (np.asarray(getattr(module, n).kernel[...]), np.asarray(getattr(module, n).bias[...]))
         for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    q, k, v = ((x @ w[n][0] + w[n][1]).reshape(2, 7, 3, 8) for n in ("q_proj", "k_proj", "v_proj"))
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(8) + np.where(np.tri(7, dtype=bool), 0.0, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("bhts,bshd->bthd", weights, v).reshape(2, 7, 24) @ w["o_proj"][0] + w["o_proj"][1]
    positions = jnp.zeros((2, 7), jnp.int32)  # ignored without rotary
    assert_close(module(jnp.asarray(x), positions=positions), out, atol=1e-4, what="no-rope attention")


# ---------------------------------------------------------------------------------------- bad input


def test_missing_tensor_names_it(tmp_path):
    make_hf("llama", str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(64, 96\)"):
        from_hf(str(tmp_path))


def test_wrong_shape_names_tensor_and_shapes(tmp_path):
    make_hf("qwen2", str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.k_proj.bias"] = np.zeros(31, np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.bias.*\(31,\).*\(32,\)"):
        from_hf(str(tmp_path))


def test_unused_tensor_names_it(tmp_path):
    """A tensor the config gives no place to (here a qkv bias in a plain LLaMA checkpoint) is an error, not
    silently dropped: the model would not be the one that was saved."""
    make_hf("llama", str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.ones(64, np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use: \['model\.layers\.0\.self_attn\.q_proj\.bias'"):
        from_hf(str(tmp_path))


def test_tensor_in_two_files_names_it(tmp_path):
    """Without an index every *.safetensors file is read; a tensor stored in two of them is ambiguous."""
    make_hf("llama", str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    os.remove(path)
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[: len(names) // 2 + 1]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[len(names) // 2:]}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{names[len(names) // 2]}' appears in more than one"):
        from_hf(str(tmp_path))


def test_unknown_model_type_names_it(llama_dir, tmp_path):
    with open(os.path.join(llama_dir[0], "config.json")) as f:
        config = json.load(f)
    config["model_type"] = "mamba9"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"mamba9.*llama.*qwen3"):
        from_hf(str(tmp_path))


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope type 'yarn'.*'default'.*'llama3'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, r"partial_rotary_factor=0\.5"),
    ({"model_type": "qwen3", "attention_bias": True}, r"qwen3 with attention_bias=True"),
    ({"mlp_bias": True}, r"mlp_bias=True"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu'"),
])
def test_unsupported_config_names_it(llama_dir, tmp_path, changes, message):
    with open(os.path.join(llama_dir[0], "config.json")) as f:
        config = json.load(f)
    for key, value in changes.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(llama_dir[0], "model.safetensors"), tmp_path)
    with pytest.raises(ValueError, match=message):
        from_hf(str(tmp_path))


def test_safetensors_files_are_chosen_as_transformers_does(llama_dir, tmp_path, tokens):
    """model.safetensors alone when it exists, else the index's files; other safetensors files beside them (such
    as Mistral's consolidated.safetensors, in its own tensor names) are not read."""
    directory, hf = llama_dir
    single = tmp_path / "single"
    shutil.copytree(directory, single)
    save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)}, str(single / "consolidated.safetensors"))
    assert_close(from_hf(str(single))(jnp.asarray(tokens)), hf_logits(hf, tokens), atol=1e-4, what="single file")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="20KB")
    assert not (sharded / "model.safetensors").exists() and (sharded / "model.safetensors.index.json").exists()
    save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)}, str(sharded / "consolidated.safetensors"))
    assert_close(from_hf(str(sharded))(jnp.asarray(tokens)), hf_logits(hf, tokens), atol=1e-4, what="index")
    os.remove(next(p for p in sharded.glob("model-*.safetensors")))
    with pytest.raises(ValueError, match="maps tensors to files that are not in"):
        from_hf(str(sharded))


def test_tied_checkpoint_with_a_different_head_is_refused(tmp_path):
    make_hf("qwen2", str(tmp_path))  # tie_word_embeddings=True
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, path, metadata={"format": "pt"})
    from_hf(str(tmp_path))  # a stored copy of the tied head is fine
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tie_word_embeddings=true but an lm_head.weight that differs"):
        from_hf(str(tmp_path))


@pytest.mark.parametrize("family, removed", [("olmo2", "rms_norm_eps"), ("mistral", "sliding_window")])
def test_missing_config_keys_take_transformers_defaults(family, removed, tmp_path, tokens):
    hf = make_hf(family, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    del config[removed]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    model = from_hf(str(tmp_path))
    if family == "olmo2":
        assert model.config.norm_eps == 1e-5
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()  # its eps is the default now
        assert_close(model(jnp.asarray(tokens)), hf_logits(hf, tokens), atol=1e-4, what="olmo2 default eps")
    else:
        assert model.config.attention.window == 4095  # MistralConfig's sliding_window=4096


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention"] * 2,
                                         ["sliding_attention", "full_attention"]])
def test_mistral_layer_types(layer_types, tmp_path, tokens):
    """transformers loads a mistral config.json that has layer_types as Ministral, whose sliding window is on the
    'sliding_attention' layers only (it used to be put on every layer): uniform types load, mixed ones are refused."""
    make_hf("mistral", str(tmp_path))  # sliding_window=5 < T
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config["layer_types"] = layer_types
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    if len(set(layer_types)) > 1:
        with pytest.raises(ValueError, match=r"layer_types=\['sliding_attention', 'full_attention'\]"):
            from_hf(str(tmp_path))
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert_close(from_hf(str(tmp_path))(jnp.asarray(tokens)), hf_logits(hf, tokens), atol=1e-4, what=str(layer_types))


def test_a_dtype_that_is_not_floating_point_is_an_error(llama_dir):
    """from_hf(dtype=jnp.int32) truncated every weight to an integer (almost all of them to 0), silently."""
    for bad in (jnp.int32, "uint8", "bogus"):
        with pytest.raises(ValueError, match=re.escape(f"dtype must be a floating-point dtype (e.g. jnp.float32, "
                                                       f"jnp.bfloat16), got dtype={bad!r}")):
            from_hf(llama_dir[0], dtype=bad)


def test_no_safetensors_is_an_error(llama_dir, tmp_path):
    with open(os.path.join(llama_dir[0], "config.json")) as f, open(tmp_path / "config.json", "w") as g:
        g.write(f.read())
    with pytest.raises(ValueError, match="safetensors"):
        from_hf(str(tmp_path))


def test_a_bad_directory_or_config_json_is_named(tmp_path):
    """A path that is not a directory said "has no config.json"; a malformed config.json raised json's bare
    JSONDecodeError, which names no file."""
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=re.escape(f"{missing!r} is not a directory")):
        from_hf(missing)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{model_type: llama}")
    with pytest.raises(ValueError, match=re.escape(f"{str(broken / 'config.json')!r} is not valid JSON")):
        from_hf(str(broken))
    (broken / "config.json").write_text('[{"model_type": "llama"}]')  # (was an AttributeError: no .get on a list)
    with pytest.raises(ValueError, match=re.escape(f"{str(broken / 'config.json')!r} holds a JSON array; expected a "
                                                   f"JSON object")):
        from_hf(str(broken))
    with pytest.raises(ValueError, match=re.escape(f"{str(broken / 'config.json')!r} holds a JSON array")):
        read_hf_config(str(broken))  # (what the trainer checks init_from with, before it builds any data)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("num_attention_heads"), "{c} (model_type 'llama') lacks ['num_attention_heads']"),
    (lambda c: c.update(rms_norm_eps="x"), "config.json rms_norm_eps='x' must be a number"),
    (lambda c: [d.update(rope_theta=None) for d in (c, c.get("rope_parameters") or {})],  # (5.x holds it there)
     "config.json rope_theta=None must be a number"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear"}),
     "config.json rope_scaling of rope_type 'linear': factor=None must be a number"),
])
def test_a_config_json_field_missing_or_not_a_number_is_named(llama_dir, tmp_path, edit, message):
    """A missing num_attention_heads raised a bare KeyError, rms_norm_eps='x' "could not convert string to float:
    'x'": neither named the field (nor the file). The trainer's early check of an init_from (read_hf_config)
    finds a missing field too."""
    directory = tmp_path / "edited"
    shutil.copytree(llama_dir[0], directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    message = re.escape(message.format(c=repr(str(directory / "config.json"))))
    with pytest.raises(ValueError, match=message):
        from_hf(str(directory))
    if "lacks" in message:
        with pytest.raises(ValueError, match=message):
            read_hf_config(str(directory))


SHAPE = dict(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("field, value, message", [
    ("kind", "sparse", r"kind='sparse'.*'dense'.*'focal_learned'.*'focal\+focus'"),
    ("impl", "triton", r"impl='triton'.*'xla'.*'cudnn'.*'decomposed'.*'pallas'"),
    ("qk_norm", "layer", r"qk_norm='layer'.*None.*'head'.*'full'"),
    ("focus_gate", "hard", r"focus_gate='hard'.*'paper'.*'log'"),
    ("n_kv_heads", 3, r"n_kv_heads=3.*n_heads=4"),
    ("focal_t", 0.0, r"focal_t.*0\.0"),
    ("tau_max", 5.0, r"tau_min.*tau_max=5\.0"),
    ("focus_topk", 9, r"focus_topk=9.*focus_groups=8"),
    ("focus_window", -1, r"focus_window.*-1"),
    ("head_dim", 7, r"head_dim=7"),
    ("window", -2, r"window.*-2"),
])
def test_attention_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**{**SHAPE, field: value})


def test_impl_kind_combinations():
    with pytest.raises(ValueError, match=r"decomposed.*focus_topk"):
        AttentionConfig(**SHAPE, kind="focus", impl="decomposed")
    with pytest.raises(ValueError, match=r"cudnn.*focus"):
        AttentionConfig(**SHAPE, kind="focus", impl="cudnn")
    with pytest.raises(ValueError, match=r"window=3.*focus_window"):
        AttentionConfig(**SHAPE, kind="focus", window=3)
    with pytest.raises(ValueError, match=r"impl='pallas'.*soft gate"):
        AttentionConfig(**SHAPE, kind="focus", impl="pallas")
    x, positions = jnp.ones((1, 4, 32)), jnp.zeros((1, 4), jnp.int32)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU"):
            Attention(AttentionConfig(**SHAPE, impl="cudnn"), rngs=nnx.Rngs(0))(x, positions=positions)


@pytest.mark.parametrize("t,window,segmented", [(37, None, True), (37, 5, False), (1, None, False), (36, 5, True)])
def test_cudnn_path_pads_odd_lengths(t, window, segmented):
    """impl='cudnn' calls jax.nn.dot_product_attention through `_jax_nn_causal_attention`, which pads an odd length
    by one token (cuDNN trains only on even ones). Run here with jax.nn's XLA implementation: output and gradients
    equal focal attention at the odd length."""
    from focal_jax.attention import focal_attention
    from focal_jax.nn.attention import _jax_nn_causal_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (2, t, h, 8)) for i, h in enumerate((4, 2, 2)))
    segment_ids = (jnp.arange(t)[None] >= jnp.array([[t // 3], [t // 2]])).astype(jnp.int32) if segmented else None
    padded = jax.jit(lambda q, k, v: _jax_nn_causal_attention(q, k, v, 0.4, window, segment_ids,
                                                              implementation="xla"))
    direct = jax.jit(lambda q, k, v: focal_attention(q, k, v, temperature=0.4, window=window,
                                                     segment_ids=segment_ids))
    np.testing.assert_allclose(padded(q, k, v), direct(q, k, v), atol=1e-5)
    loss = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(loss(padded), loss(direct)):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_llama_config_validation():
    with pytest.raises(ValueError, match=r"kind='nope'.*'dense'"):
        focal_config("tiny", attn=dict(kind="nope"))
    with pytest.raises(ValueError, match=r"attn\['windw'\].*focus_window"):
        focal_config("tiny", attn=dict(windw=3))
    with pytest.raises(ValueError, match=r"attn\['n_heads'\]"):
        focal_config("tiny", attn=dict(n_heads=2))
    with pytest.raises(ValueError, match=r"size='3B'.*400M"):
        focal_config("3B")
    with pytest.raises(ValueError, match=r"n_layers.*0"):
        LlamaConfig(vocab_size=10, d_model=8, n_layers=0, n_heads=2, intermediate=8)
    assert hash(focal_config("tiny", attn=dict(kind="focal"))) == hash(focal_config("tiny", attn=(("kind", "focal"),)))


# -------------------------------------------------------------------------------------- paper sizes


# FOCAL_SPEC.md Table 3, "inferred: count" column (vocab 32000, untied, MHA, no bias), in millions.
SPEC_COUNTS_M = {"400M": 393, "777M": 778, "1.3B": 1345, "2.7B": 2702, "6.7B": 6738, "9.5B": 9468}


@pytest.mark.parametrize("size", sorted(SPEC_COUNTS_M))
def test_paper_sizes(size):
    config = focal_config(size)
    assert config.attention.head_dim == 128 and config.qk_norm == "head" and config.vocab_size == 32000
    count = param_count(config)
    # per layer 4 d^2 + 3 d * intermediate + 2 d (+ 2 * 128 QK-norm gains), plus 2 V d + d
    assert round(count / 1e6) == SPEC_COUNTS_M[size], (size, count)
    named = float(size[:-1]) * (1e6 if size.endswith("M") else 1e9)
    # Within 3% of the name, except "1.3B": the paper's own configuration has 1.345B parameters (3.5%).
    assert abs(count - named) / named < (0.036 if size == "1.3B" else 0.03), (size, count)


def test_init_std_draws_every_projection_and_the_embeddings_from_one_normal():
    """`init_std` (FOCAL_SPEC section 2's choice, 0.02, which the Focal experiments set): every kernel of the
    projections, the embedding table and lm_head ~ N(0, init_std^2); norm gains, Centroids (W_g, C) and the learned
    temperature's parameters as without it. Flax's own initialisers give an embedding table of std 1/sqrt(d)."""
    config = focal_config("tiny", vocab_size=4000, attn=dict(kind="focal_learned", tau_min=1.0, tau_max=2.0))
    plain = nnx.to_flat_state(nnx.state(Llama(config, rngs=nnx.Rngs(0)), nnx.Param))
    drawn = dict(nnx.to_flat_state(nnx.state(Llama(dataclasses.replace(config, init_std=0.02),
                                                   rngs=nnx.Rngs(0)), nnx.Param)))
    redrawn = 0
    for path, param in plain:
        name = "/".join(map(str, path))
        before, after = np.asarray(param.get_value()), np.asarray(drawn[path].get_value())
        if type(param) is nnx.Param and name.endswith(("kernel", "embedding")):
            assert abs(after.std() / 0.02 - 1) < 0.1 and abs(after.mean()) < 0.005, (name, after.std())
            assert not np.array_equal(after, before), name
            redrawn += 1
        else:  # norms, w_tau, tau_bias
            np.testing.assert_array_equal(after, before, err_msg=name)
    assert redrawn == 2 + 2 * 7  # embeddings, lm_head, and per layer q, k, v, o, gate, up, down
    assert abs(np.asarray(dict(plain)[("embed_tokens", "embedding")].get_value()).std() * 8 - 1) < 0.05
    focus = focal_config("tiny", attn=dict(kind="focus", focus_groups=4, focus_window=4))
    centroids = [nnx.to_flat_state(nnx.state(Llama(c, rngs=nnx.Rngs(1)), Centroid))
                 for c in (focus, dataclasses.replace(focus, init_std=0.02))]
    for (path, a), (_, b) in zip(*centroids):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(path))
    for bad in (0.0, -0.02, float("inf"), float("nan"), True, "0.02"):
        with pytest.raises(ValueError, match=re.escape(f"init_std must be None or a finite number > 0, got "
                                                       f"init_std={bad!r}")):
            dataclasses.replace(config, init_std=bad)


def test_tiny_size_runs():
    model = Llama(focal_config("tiny", attn=dict(kind="focal")), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.shape == (1, 8, 1000) and bool(jnp.all(jnp.isfinite(logits)))


# ------------------------------------------------------------------------------------------- dynamic NTK RoPE


def test_dynamic_ntk_rope_matches_transformers(tmp_path):
    """Hugging Face's 'dynamic' rope type: past max_position_embeddings the RoPE base grows (FOCAL_SPEC OQ-F10)."""
    config = transformers.LlamaConfig(**COMMON, num_key_value_heads=2, max_position_embeddings=16,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    model = from_hf(str(tmp_path))
    assert (model.config.attention.rope_ntk_factor, model.config.attention.rope_trained_len) == (2.0, 16)
    plain = with_attention(model, rope_ntk_factor=None, rope_trained_len=None)
    rng = np.random.default_rng(0)
    for length in (12, 40):  # inside and past the trained length
        tokens = rng.integers(0, VOCAB, (2, length)).astype(np.int32)
        expected = hf_logits(hf, tokens)
        assert_close(model(jnp.asarray(tokens)), expected, atol=1e-4, what=f"dynamic NTK, T={length}")
        plain_error = float(np.abs(np.asarray(plain(jnp.asarray(tokens))) - expected).max())
        assert (plain_error < 1e-4) == (length <= 16), (length, plain_error)  # the scaling acts only past 16
    to_hf(model, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    tokens = rng.integers(0, VOCAB, (2, 40)).astype(np.int32)
    assert_close(hf_logits(reloaded, tokens), hf_logits(hf, tokens), atol=1e-4, what="dynamic NTK to_hf")


# Head dim 16, base 500: wavelengths 6.3, 14, 30, 65, 141, 306, 664 and 1,445 tokens, so the llama3 bounds (20 and 80
# tokens) leave two frequencies unchanged, interpolate two and stretch four.
SCALED_ROPE = {
    "linear": ({"factor": 4.0}, dict(rope_linear_factor=4.0)),
    "llama3": ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 80},
               dict(rope_llama3=(8.0, 1.0, 4.0, 80))),
}


@pytest.mark.parametrize("rope_type", sorted(SCALED_ROPE))
def test_scaled_rope_matches_transformers(rope_type, tmp_path):
    """Hugging Face's 'linear' and 'llama3' rope types (LLaMA 3.1 and later checkpoints): from_hf and to_hf."""
    hf_fields, fields = SCALED_ROPE[rope_type]
    config = transformers.LlamaConfig(**COMMON, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_parameters={"rope_type": rope_type, "rope_theta": 500.0, **hf_fields})
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    model = from_hf(str(tmp_path))
    assert {name: getattr(model.config.attention, name) for name in fields} == fields
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    expected = hf_logits(hf, tokens)
    assert_close(model(jnp.asarray(tokens)), expected, atol=1e-4, what=rope_type)
    plain = with_attention(model)
    assert float(np.abs(np.asarray(plain(jnp.asarray(tokens))) - expected).max()) > 1e-2  # the scaling matters
    to_hf(model, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert_close(hf_logits(reloaded, tokens), expected, atol=1e-4, what=f"{rope_type} to_hf")


def test_rope_scaling_replaces_rope_parameters(tmp_path):
    """A config.json holding both: transformers reads rope_scaling alone (5.x replaces rope_parameters with it; 4.x
    knows no rope_parameters), so from_hf does too (it used to read rope_parameters)."""
    make_hf("llama", str(tmp_path))
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config.update(rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 50.0},
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    model = from_hf(str(tmp_path))
    assert (model.config.rope_theta, model.config.attention.rope_linear_factor) == (50.0, 4.0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    assert_close(model(jnp.asarray(tokens)), hf_logits(hf, tokens), atol=1e-4, what="rope_scaling and rope_parameters")


def test_top_level_original_max_position_embeddings_wins(tmp_path):
    """llama3 RoPE with original_max_position_embeddings both at the top of config.json (Phi-3's habit) and in the
    rope dict: transformers reads the top-level one, and so does from_hf."""
    make_hf("llama", str(tmp_path))
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    config.pop("rope_scaling", None)
    config.update(original_max_position_embeddings=20, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 80})
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    model = from_hf(str(tmp_path))
    assert model.config.attention.rope_llama3 == (8.0, 1.0, 4.0, 20)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 40)).astype(np.int32)
    expected = hf_logits(hf, tokens)
    assert_close(model(jnp.asarray(tokens)), expected, atol=1e-4, what="top-level original_max_position_embeddings")
    dict_length = with_attention(model, rope_llama3=(8.0, 1.0, 4.0, 80))
    assert float(np.abs(np.asarray(dict_length(jnp.asarray(tokens))) - expected).max()) > 1e-2  # the choice matters


def test_llama3_rope_keeps_short_wavelengths_and_stretches_long_ones():
    plain = np.asarray(rope_inverse_frequencies(16, 500.0))
    scaled = np.asarray(rope_inverse_frequencies(16, 500.0, llama3=(8.0, 1.0, 4.0, 80)))
    wavelength = 2 * np.pi / plain
    short, long = wavelength < 20, wavelength > 80
    assert (short.sum(), long.sum()) == (2, 4)
    np.testing.assert_array_equal(scaled[short], plain[short])
    np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-6)
    between = ~short & ~long
    assert np.all((plain[between] / 8 < scaled[between]) & (scaled[between] < plain[between]))


@pytest.mark.parametrize("fields,message", [
    (dict(rope_ntk_factor=2.0), "rope_trained_len"),
    (dict(rope_ntk_factor=0.0, rope_trained_len=16), "rope_ntk_factor"),
    (dict(rope_ntk_factor=2.0, rope_trained_len=0), "rope_trained_len"),
    (dict(rope_ntk_factor=2.0, rope_trained_len=16, rope_theta=None), "rope_theta"),
    (dict(rope_linear_factor=-1.0), "rope_linear_factor"),
    (dict(rope_linear_factor=2.0, rope_ntk_factor=2.0, rope_trained_len=16), "at most one RoPE scaling"),
    (dict(rope_llama3=(8.0, 1.0, 4.0)), "rope_llama3"),
    (dict(rope_llama3=(8.0, 4.0, 1.0, 8192)), "low_freq_factor < high_freq_factor"),
    (dict(rope_llama3=(8.0, 1.0, 4.0, 8192), rope_theta=None), "rope_theta"),
])
def test_rope_scaling_config_errors(fields, message):
    base = dict(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**{**base, **fields})
