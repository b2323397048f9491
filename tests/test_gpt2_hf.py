"""GPT-2: Hugging Face parity (tiny random GPT2LMHeadModel, safetensors), loader errors, Focus retrofit invariants.

The reference is PyTorch `transformers`, never our own code. torch and transformers are test dependencies: these
tests must run (not skip) in CI.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from focal_jax.convert.gpt2 import config_from_hf, load_gpt2
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.variables import Centroid

VOCAB, D, LAYERS, HEADS, N_POS = 97, 64, 2, 4, 64


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random GPT2LMHeadModel saved with safetensors, and its torch model."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=N_POS, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:  # non-trivial values, so a mis-mapped tensor shows
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("attn.c_attn.weight"):  # attention logits of a trained model's size (std ~2, not ~0.1)
                p.mul_(4.0)
            if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_proj.weight"):
                p.mul_(20.0)  # GELU inputs of order 1 and an MLP that matters: tanh vs erf GELU shows in logits
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _config_json(path):
    return json.loads((path / "config.json").read_text())


def _tokens(batch, length, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length)).astype(np.int32)


@nnx.jit
def _forward(model, tokens, positions=None, segment_ids=None):
    return model(tokens, positions=positions, segment_ids=segment_ids)


def _logits(model, tokens, **kw):
    """Our logits as numpy, through one jitted forward (compiles once per model structure and shape)."""
    return np.asarray(_forward(model, jnp.asarray(tokens), **{k: jnp.asarray(v) for k, v in kw.items()}))


@pytest.fixture(scope="module")
def dense(hf_dir):
    path, _ = hf_dir
    return load_gpt2(path, _config_json(path), dtype=jnp.float32)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


LONG = 32  # one sequence length for most checks, so the jitted forward compiles once per model structure


def test_logits_match_transformers(hf_dir, dense):
    _, torch_model = hf_dir
    tokens = _tokens(2, LONG)
    logits = dense(jnp.asarray(tokens[:, :5]))  # eager call: the public interface, float32 [B, T, V]
    assert logits.dtype == jnp.float32 and logits.shape == (2, 5, VOCAB)
    # Well inside the required 1e-4: float32 agrees to ~3e-7 here, while erf GELU in place of GPT-2's tanh GELU
    # would be off by ~7e-5, which 1e-4 would let through.
    np.testing.assert_allclose(_logits(dense, tokens), _torch_logits(torch_model, tokens), atol=1e-5, rtol=1e-5)


def test_logits_match_with_explicit_positions_and_unprefixed_names(hf_dir, tmp_path):
    """Checkpoints without the `transformer.` prefix (GPT2Model / original OpenAI files) load the same."""
    path, torch_model = hf_dir
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(file))
    assert any(name.startswith("transformer.") for name in tensors)
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()},
              str(tmp_path / "model.safetensors"))
    model = load_gpt2(tmp_path, _config_json(path), dtype=jnp.float32)
    tokens = _tokens(2, LONG, seed=1)
    positions = np.broadcast_to(np.arange(LONG, dtype=np.int32), (2, LONG))
    np.testing.assert_allclose(_logits(model, tokens, positions=positions), _torch_logits(torch_model, tokens),
                               atol=1e-4, rtol=1e-4)


def _rewrite(path, tmp_path, edit):
    tensors = {}
    for file in path.glob("*.safetensors"):
        tensors.update(load_file(file))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_missing_tensor_is_named(hf_dir, tmp_path):
    path, _ = hf_dir
    bad = _rewrite(path, tmp_path, lambda t: t.pop("transformer.h.1.mlp.c_fc.weight"))
    with pytest.raises(ValueError, match=r"'transformer\.h\.1\.mlp\.c_fc\.weight'.*missing"):
        load_gpt2(bad, _config_json(path), dtype=jnp.float32)


def test_wrong_shape_names_tensor_and_both_shapes(hf_dir, tmp_path):
    path, _ = hf_dir

    def edit(t):
        t["transformer.h.0.attn.c_attn.weight"] = np.zeros((D, 2 * D), np.float32)

    bad = _rewrite(path, tmp_path, edit)
    want = rf"'transformer\.h\.0\.attn\.c_attn\.weight'.*\({D}, {2 * D}\).*\({D}, {3 * D}\)"
    with pytest.raises(ValueError, match=want):
        load_gpt2(bad, _config_json(path), dtype=jnp.float32)


def test_untied_head_is_refused(hf_dir, tmp_path):
    """GPT-2 ties its output head to wte; a checkpoint with its own head must not load with that head dropped."""
    path, _ = hf_dir
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        config_from_hf({**_config_json(path), "tie_word_embeddings": False})
    tensors = load_file(str(path / "model.safetensors"))
    wte = tensors["transformer.wte.weight"]
    (tmp_path / "same").mkdir(), (tmp_path / "other").mkdir()
    same = _rewrite(path, tmp_path / "same", lambda t: t.update({"lm_head.weight": wte.copy()}))
    load_gpt2(same, _config_json(path))  # a stored copy of the tied head is fine
    other = _rewrite(path, tmp_path / "other", lambda t: t.update({"lm_head.weight": wte + 1.0}))
    with pytest.raises(ValueError, match="lm_head.weight differs from its wte.weight"):
        load_gpt2(other, _config_json(path))


def test_token_ids_and_positions_out_of_range(hf_dir):
    model = load_gpt2(hf_dir[0], _config_json(hf_dir[0]))
    with pytest.raises(ValueError, match=rf"tokens must be in \[0, {VOCAB}\), got values from -1 to 5"):
        model(jnp.array([[3, 5, -1]]))
    with pytest.raises(ValueError, match=rf"positions must be in \[0, {N_POS}\), got values from 0 to {N_POS}"):
        model(jnp.array([[3, 5]]), positions=jnp.array([[0, N_POS]]))
    # Under jit the ids are not known: an id out of range gives NaN rather than wrapping around to the last row.
    logits = _logits(model, np.array([[3, 5, -1]]))
    assert np.isnan(logits[0, 2]).all()


def test_bad_config_names_the_field(hf_dir):
    path, _ = hf_dir
    with pytest.raises(ValueError, match="n_heads"):
        GPT2Config(d_model=64, n_heads=5)
    with pytest.raises(ValueError, match="layer_norm_eps"):
        GPT2Config(layer_norm_eps=0.0)
    with pytest.raises(ValueError, match="kind='sparse'"):
        GPT2Config(kind="sparse")
    with pytest.raises(ValueError, match="focus_groupz"):
        config_from_hf(_config_json(path), focus_groupz=4)
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        config_from_hf({**_config_json(path), "reorder_and_upcast_attn": True})


def test_packed_segments_equal_separate_documents(hf_dir, dense):
    """Two documents packed in one row (segment ids, positions restarting at 0) give each document's own logits."""
    _, torch_model = hf_dir
    a, b = _tokens(1, 10, seed=5), _tokens(1, 13, seed=6)
    tokens = np.concatenate([a, b], axis=1)
    positions = np.concatenate([np.arange(10), np.arange(13)])[None].astype(np.int32)
    segment_ids = np.array([[1] * 10 + [2] * 13], np.int32)
    logits = _logits(dense, tokens, positions=positions, segment_ids=segment_ids)
    np.testing.assert_allclose(logits[:, :10], _torch_logits(torch_model, a), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[:, 10:], _torch_logits(torch_model, b), atol=1e-4, rtol=1e-4)


def test_packed_segments_default_positions_restart_per_document(hf_dir, dense):
    """Without positions, segment ids alone make positions restart at each document (as Llama's do), so a packed
    document's logits equal the document run alone; a document split around another counts on."""
    _, torch_model = hf_dir
    a, b = _tokens(1, 10, seed=5), _tokens(1, 13, seed=6)
    logits = np.asarray(dense(jnp.asarray(np.concatenate([a, b], axis=1)),
                              segment_ids=jnp.asarray([[1] * 10 + [2] * 13], jnp.int32)))
    np.testing.assert_allclose(logits[:, :10], _torch_logits(torch_model, a), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits[:, 10:], _torch_logits(torch_model, b), atol=1e-4, rtol=1e-4)
    split = np.asarray(dense(jnp.asarray(np.concatenate([a[:, :4], b, a[:, 4:]], axis=1)),
                             segment_ids=jnp.asarray([[1] * 4 + [2] * 13 + [1] * 6], jnp.int32)))
    np.testing.assert_allclose(split[:, np.r_[0:4, 17:23]], _torch_logits(torch_model, a), atol=1e-4, rtol=1e-4)


def test_bfloat16_load(hf_dir, dense):
    """dtype=bfloat16 stores every parameter (new Centroids too) in bf16, each the float32 load's value rounded (the
    logits alone would not show a mis-mapped bias: bf16 puts them 0.0048 off PyTorch's, a zeroed `c_proj.bias`
    0.008); logits stay float32 and near PyTorch's."""
    path, torch_model = hf_dir
    model = load_gpt2(path, _config_json(path), dtype=jnp.bfloat16, kind="focus", focus_groups=GROUPS,
                      focus_window=WINDOW)
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    pretrained = nnx.to_flat_state(nnx.state(dense, nnx.Param))
    loaded = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert len(pretrained) > 20 and all(key in loaded for key, _ in pretrained)
    for key, param in pretrained:
        np.testing.assert_array_equal(loaded[key].get_value(), param.get_value().astype(jnp.bfloat16), err_msg=key)
    tokens = _tokens(2, WINDOW + 1, seed=7)
    logits = _forward(model, jnp.asarray(tokens))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(torch_model, tokens), atol=2e-2, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Focus retrofit invariants (same pretrained weights, new Centroid parameters only).

WINDOW, GROUPS = 8, 4


def _focus(path, **kw):
    return load_gpt2(path, _config_json(path), dtype=jnp.float32, kind="focus", focus_groups=GROUPS, focus_dim=16,
                     focus_window=WINDOW, **kw)


def test_focus_soft_equals_dense_within_window(hf_dir, dense):
    """Soft gate, no top-k: every pair of a sequence of <= window + 1 tokens is local, so nothing is gated and the
    logits are the dense model's (why the paper's short benchmarks show zero degradation). In a longer sequence the
    queries past the window are gated and differ."""
    path, torch_model = hf_dir
    focus = _focus(path)
    assert nnx.state(focus, Centroid) and not nnx.state(dense, Centroid)
    short = _tokens(2, WINDOW + 1, seed=2)
    np.testing.assert_allclose(_logits(focus, short), _logits(dense, short), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(_logits(focus, short), _torch_logits(torch_model, short), atol=1e-4, rtol=1e-4)
    longer = _tokens(2, LONG, seed=3)
    diff = np.abs(_logits(focus, longer) - _logits(dense, longer))
    assert diff[:, :WINDOW + 1].max() <= 1e-6  # queries whose keys are all local are untouched
    assert diff[:, WINDOW + 1:].max() > 1e-4


def test_focus_hard_topk_all_groups_equals_dense(hf_dir, dense):
    """Hard top-k with k = K: every pair shares a group, so the mask is causal and logits are dense at any length;
    k = 1 at the same length is sparse and differs."""
    path, _ = hf_dir
    tokens = _tokens(2, LONG, seed=4)
    want = _logits(dense, tokens)
    np.testing.assert_allclose(_logits(_focus(path, focus_topk=GROUPS), tokens), want, atol=1e-5, rtol=1e-5)
    assert np.abs(_logits(_focus(path, focus_topk=1), tokens) - want).max() > 1e-3


def test_gpt2_124m_focus_centroid_count_is_papers():
    """The Focus paper's count: GPT-2 124M with K = 4, d_g = 16 has 12 x (768 x 16 + 4 x 16) = 148,224 routing
    parameters. Counted on an abstract model (nnx.eval_shape: nothing allocated)."""
    config = GPT2Config(vocab_size=50257, n_positions=1024, d_model=768, n_layers=12, n_heads=12, kind="focus",
                        focus_groups=4, focus_dim=16)
    model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    count = lambda state: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert count(nnx.state(model, Centroid)) == 148_224
    # and the base model is GPT-2 124M (tied head): 124,439,808 parameters besides the centroids
    assert count(nnx.state(model, nnx.Param)) - 148_224 == 124_439_808


def test_from_hf_dispatches_gpt2(hf_dir, dense):
    from focal_jax.convert.hf import from_hf

    path, _ = hf_dir
    model = from_hf(str(path))
    assert isinstance(model, GPT2)
    tokens = _tokens(2, LONG)
    np.testing.assert_allclose(_logits(model, tokens), _logits(dense, tokens), atol=1e-6)


def test_to_hf_writes_gpt2_back_and_folds_a_constant_focal_temperature(hf_dir, dense, tmp_path):
    """`to_hf` of GPT-2: the directory holds the checkpoint's tensors exactly (q, k and v fused back into
    `c_attn`; the tied head not written), and transformers' logits equal the original's. With Focal attention at
    t = 0.4 the q columns of `c_attn` are scaled by 1/t, and transformers' logits equal the Focal model's. A
    learned temperature and a sliding window are refused by name."""
    from focal_jax.convert.hf import from_hf, to_hf
    from focal_jax.nn.retrofit import FocalConfig, replace_attention, retrofit
    path, torch_model = hf_dir
    tokens = _tokens(2, LONG)
    to_hf(dense, str(tmp_path / "dense"), source=str(path))
    written = load_file(str(tmp_path / "dense" / "model.safetensors"))
    original = {name: x for name, x in load_file(str(path / "model.safetensors")).items()
                if not name.endswith((".attn.bias", ".attn.masked_bias")) and name != "lm_head.weight"}
    assert sorted(written) == sorted(original)
    for name in original:
        np.testing.assert_array_equal(written[name], original[name], err_msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense")).eval()
    assert type(reloaded).__name__ == "GPT2LMHeadModel"
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-5)

    focal = retrofit(from_hf(str(path)), FocalConfig(t=0.4))
    to_hf(focal, str(tmp_path / "focal"))
    written = load_file(str(tmp_path / "focal" / "model.safetensors"))
    c_attn = original["transformer.h.0.attn.c_attn.weight"]
    np.testing.assert_allclose(written["transformer.h.0.attn.c_attn.weight"][:, :D], c_attn[:, :D] / 0.4, rtol=1e-6)
    np.testing.assert_array_equal(written["transformer.h.0.attn.c_attn.weight"][:, D:], c_attn[:, D:])
    got = _torch_logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "focal")).eval(), tokens)
    np.testing.assert_allclose(got, _logits(focal, tokens), atol=1e-4)
    assert np.abs(got - _torch_logits(torch_model, tokens)).max() > 1e-2

    with pytest.raises(ValueError, match="got kind='focal_learned'"):
        to_hf(retrofit(from_hf(str(path)), FocalConfig(learned=True, tau_min=2.0, tau_max=4.0)),
              str(tmp_path / "x"))
    with pytest.raises(ValueError, match=r"cannot export GPT-2 with window=8: transformers' GPT-2 has no sliding"):
        to_hf(replace_attention(from_hf(str(path)), window=8), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
