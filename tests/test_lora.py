"""The LoRA baseline retrofit (focal_jax.nn.lora): outputs unchanged at init, the r (in + out) parameter count, the
update against a naive x W + b + (alpha / r) x A B, merging, split / merge / jit / bf16, KV-cache generation, training
only the LoRA parameters, the trainer run of experiments/lora_baseline.py with a resume, and bad settings named."""

import dataclasses
import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from focal_jax.nn.generate import generate, init_cache
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.nn.lora import LoRAConfig, LoRALinear, add_lora, merge_lora
from focal_jax.nn.models import attention_layers
from focal_jax.nn.retrofit import retrofit
from focal_jax.nn.variables import LoRA
from focal_jax.train import checkpoint, train
from focal_jax.train.config import check_config
from focal_jax.train.metrics import read_metrics
from focal_jax.train.optimizer import OptimConfig, make_optimizer, param_paths, split_trainable
from focal_jax.train.trainer import cast_floats, load_model, make_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, B, T = 61, 2, 10
PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def _llama():
    """GQA, head_dim != d_model / n_heads, QK-norm: every projection has its own (in, out)."""
    config = LlamaConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
                         intermediate=48, qk_norm="head")
    return Llama(config, rngs=nnx.Rngs(1))


def _gpt2():
    return GPT2(GPT2Config(vocab_size=VOCAB, n_positions=32, d_model=32, n_layers=2, n_heads=4), rngs=nnx.Rngs(2))


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _tokens(seed=0, length=T):
    return jax.random.randint(jax.random.key(seed), (B, length), 0, VOCAB)


def _projection_shapes(model) -> list[dict]:
    """Per layer, {letter: (in, out)} of the attention projections, from the model's config (not its arrays)."""
    c = model.config
    if isinstance(model, GPT2):
        d, q_dim, kv_dim = c.d_model, c.d_model, c.d_model
    else:
        head_dim = c.head_dim or c.d_model // c.n_heads
        d, q_dim, kv_dim = c.d_model, c.n_heads * head_dim, (c.n_kv_heads or c.n_heads) * head_dim
    shapes = {"q": (d, q_dim), "k": (d, kv_dim), "v": (d, kv_dim), "o": (q_dim, d)}
    return [shapes] * c.n_layers


def _randomise_lora_b(model, seed=0):
    """Give every lora_b non-zero values, as training would, so that the update changes the outputs."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    for attn in attention_layers(model):
        for name in PROJECTIONS.values():
            proj = getattr(attn, name)
            if isinstance(proj, LoRALinear):
                proj.lora_b.set_value(0.2 * jax.random.normal(next(keys), proj.lora_b[...].shape))
    return model


def _lora_model(family, targets="qkvo", rank=3, alpha=6.0):
    return _randomise_lora_b(add_lora(MODELS[family](), LoRAConfig(rank, alpha, targets), rngs=7))


def _flat(model, filter=nnx.Param) -> dict:
    state = nnx.to_pure_dict(nnx.state(model, filter))
    return dict(zip(param_paths(state), jax.tree.leaves(state)))


# ------------------------------------------------------------------------------------------------ the module


@pytest.mark.parametrize("family,targets", [("llama", "qkvo"), ("gpt2", "qv"), ("llama", ("o_proj", "k"))])
def test_outputs_unchanged_at_init_and_parameter_count(family, targets):
    model = MODELS[family]()
    tokens = _tokens()
    base_logits, base_params = model(tokens), _flat(model)
    config = LoRAConfig(rank=3, alpha=6.0, targets=targets)
    add_lora(model, config, rngs=0)
    np.testing.assert_array_equal(model(tokens), base_logits)
    expected = sum(3 * (n_in + n_out) for layer in _projection_shapes(model)
                   for letter, (n_in, n_out) in layer.items() if letter in config.targets)
    lora = _flat(model, LoRA)
    assert sum(x.size for x in lora.values()) == expected
    letters = [letter for letter in PROJECTIONS if letter in config.targets]
    prefix = "h/{}/attn" if family == "gpt2" else "layers/{}/self_attn"
    assert sorted(lora) == sorted(f"{prefix.format(i)}/{PROJECTIONS[t]}/lora_{m}"
                                  for i in range(2) for t in letters for m in "ab")
    # Every pretrained parameter keeps its path and its value; A is random, B is zero.
    non_lora = _flat(model, nnx.All(nnx.Param, nnx.Not(LoRA)))
    assert sorted(non_lora) == sorted(base_params)
    for path, value in base_params.items():
        np.testing.assert_array_equal(non_lora[path], value, err_msg=path)
    for path, value in lora.items():
        assert value.dtype == jnp.float32
        assert (np.abs(value).max() > 0) == path.endswith("lora_a"), path


def test_lora_initialisation():
    """As PEFT's LoRA: A uniform in +-1/sqrt(in_features) (kaiming-uniform with a = sqrt(5)), B zero."""
    base = nnx.Linear(256, 4, rngs=nnx.Rngs(0))
    lora = LoRALinear(base, rank=8, scale=2.0, key=jax.random.key(1))
    a, b = np.asarray(lora.lora_a[...]), np.asarray(lora.lora_b[...])
    assert a.shape == (256, 8) and b.shape == (8, 4)
    assert 0.9 / 16 < np.abs(a).max() <= 1 / 16 and abs(a.mean()) < 0.005
    np.testing.assert_array_equal(b, 0.0)


def test_lora_linear_matches_naive_update():
    model = _lora_model("gpt2", targets="qkvo", rank=3, alpha=6.0)
    proj = model.h[1].attn.v_proj
    x = np.asarray(jax.random.normal(jax.random.key(3), (B, T, 32)), np.float64)
    w, bias = np.asarray(proj.kernel[...], np.float64), np.asarray(proj.bias[...], np.float64)
    a, b = np.asarray(proj.lora_a[...], np.float64), np.asarray(proj.lora_b[...], np.float64)
    expected = x @ w + bias + (6.0 / 3) * (x @ a) @ b
    np.testing.assert_allclose(proj(jnp.asarray(x, jnp.float32)), expected, atol=1e-5, rtol=0)
    assert np.abs((x @ a) @ b).max() > 0.1  # the update is not negligible here


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_merge_gives_the_same_logits_and_no_lora(family):
    model = _lora_model(family)
    tokens = _tokens(seed=1)
    before = model(tokens)
    base_logits = MODELS[family]()(tokens)
    assert np.abs(np.asarray(before) - np.asarray(base_logits)).max() > 1e-2  # LoRA changes this model
    merged = merge_lora(model)
    assert not jax.tree.leaves(nnx.state(merged, LoRA))
    assert all(type(getattr(attn, name)) is nnx.Linear for attn in attention_layers(merged)
               for name in PROJECTIONS.values())
    np.testing.assert_allclose(merged(tokens), before, atol=1e-5, rtol=0)
    assert sorted(_flat(merged)) == sorted(_flat(MODELS[family]()))  # a plain model again


def test_split_merge_jit_and_bf16():
    model = _lora_model("llama")
    tokens = _tokens(seed=2)
    eager = model(tokens)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    np.testing.assert_allclose(forward(state, tokens), eager, atol=1e-5, rtol=0)
    bf16 = nnx.merge(graphdef, cast_floats(nnx.to_pure_dict(state), jnp.bfloat16))
    proj = bf16.layers[0].self_attn.q_proj
    assert proj(jnp.ones((1, 2, 32), jnp.bfloat16)).dtype == jnp.bfloat16  # the update keeps the compute dtype
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(cast_floats(nnx.to_pure_dict(state), jnp.bfloat16),
                                                             tokens)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, eager, atol=0.15, rtol=0)


@functools.partial(jax.jit, static_argnums=0)
def _cached_logits(graphdef, state, tokens):
    """Logits of `tokens` fed through the KV cache: a 6-token prefill, one token, then the rest in one chunk."""
    model = nnx.merge(graphdef, state)
    cache = init_cache(model, B, T)
    parts = []
    for start, stop in ((0, 6), (6, 7), (7, T)):
        logits, cache = model(tokens[:, start:stop], cache=cache)
        parts.append(logits)
    return jnp.concatenate(parts, axis=1)


@functools.partial(jax.jit, static_argnums=0)
def _full_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def test_kv_cache_generation():
    model = _lora_model("llama")  # GQA: the cache holds fewer kv heads than q heads
    tokens = _tokens(seed=3)
    graphdef, state = nnx.split(model)
    full = _full_logits(graphdef, state, tokens)
    np.testing.assert_allclose(_cached_logits(graphdef, state, tokens), full, atol=1e-4, rtol=0)
    # Greedy generation equals repeated argmax of the full forward (one sequence buffer, causal model).
    out = generate(model, tokens[:, :4], max_new_tokens=4)
    seq = jnp.zeros((B, 8), tokens.dtype).at[:, :4].set(tokens[:, :4])
    for t in range(4, 8):
        seq = seq.at[:, t].set(jnp.argmax(_full_logits(graphdef, state, seq)[:, t - 1], axis=-1))
    np.testing.assert_array_equal(out, seq)


def test_training_changes_only_lora_parameters():
    remat = GPT2(dataclasses.replace(_gpt2().config, remat=True), rngs=nnx.Rngs(2))  # LoRA inside nnx.remat too
    model = add_lora(remat, LoRAConfig(rank=2, alpha=4.0, targets="qv"), rngs=0)
    before = _flat(model)
    optim = OptimConfig(trainable="lora", lr=1e-2, warmup_steps=0)
    graphdef, trainable, frozen = split_trainable(model, optim)
    assert param_paths(trainable) == sorted(f"h/{i}/attn/{p}/lora_{m}" for i in range(2)
                                            for p in ("q_proj", "v_proj") for m in "ab")
    tx = make_optimizer(optim, total_steps=3)
    train_step, _ = make_steps(graphdef, tx, jnp.float32)
    train_step = jax.jit(train_step)
    opt_state = tx.init(trainable)
    tokens = _tokens(seed=4, length=T + 1)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((B, T)),
             "positions": jnp.broadcast_to(jnp.arange(T), (B, T)), "segment_ids": jnp.ones((B, T), jnp.int32)}
    for _ in range(3):
        trainable, opt_state, metrics = train_step(trainable, opt_state, frozen, batch)
    assert np.isfinite(float(metrics["loss"]))
    after = _flat(nnx.merge(graphdef, trainable, frozen))
    assert sorted(after) == sorted(before)
    for path, value in before.items():
        if "lora_" in path:
            assert np.abs(np.asarray(after[path]) - np.asarray(value)).max() > 1e-4, path
        else:
            np.testing.assert_array_equal(after[path], value, err_msg=path)


# ------------------------------------------------------------------------------------------------ the trainer


def _experiment(arg: str) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location("lora_baseline", os.path.join(ROOT, "experiments",
                                                                                "lora_baseline.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def _losses(workdir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(workdir, kind="train")}


def test_lora_baseline_experiment_trains_and_resumes(tmp_path):
    cache_dir = str(tmp_path / "tokenizers")
    base = str(tmp_path / "base")
    quickstart = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "experiments",
                                                                                   "quickstart.py"))
    module = importlib.util.module_from_spec(quickstart)
    quickstart.loader.exec_module(module)
    config = module.get_config("runlocal")
    config.data.cache_dir = cache_dir
    config.update(batch_size=8, total_steps=1, eval_batches=0)
    train(config, base)

    config = _experiment(f"runlocal,init_from={base},rank=4")
    assert dict(config.retrofit.lora) == {"rank": 4, "alpha": 8.0, "targets": "qv"}
    assert config.optim.trainable == "lora" and _experiment(f"init_from={base}").total_steps == 4000
    config.data.cache_dir = cache_dir
    config.update(batch_size=8, total_steps=2, ckpt_every=1, eval_batches=0)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(config, straight)
    train(config, resumed, stop_after=1)
    assert checkpoint.make_manager(resumed, create=False).latest_step() == 1
    train(config, resumed)
    assert sorted(_losses(resumed)) == [1, 2] and _losses(resumed) == _losses(straight)

    _, meta = checkpoint.read_meta(resumed)
    assert meta["params_scope"] == "trainable" and meta["init_from"] == base
    lora_paths = sorted(f"layers/{i}/self_attn/{p}/lora_{m}" for i in range(2) for p in ("q_proj", "v_proj")
                        for m in "ab")
    assert sorted(checkpoint.saved_param_paths(resumed, 2)) == lora_paths
    # load_model: the base run's parameters, unchanged, plus the trained LoRA parameters.
    base_params, run = _flat(load_model(base)), load_model(resumed)
    run_params = _flat(run)
    assert sorted(run_params) == sorted([*base_params, *lora_paths])
    for path, value in base_params.items():
        np.testing.assert_array_equal(run_params[path], value, err_msg=path)
    assert all(np.abs(run_params[p]).max() > 0 for p in lora_paths)  # lora_b trained away from zero


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="rank=0"):
        LoRAConfig(rank=0, alpha=8.0)
    with pytest.raises(ValueError, match="rank=2.5"):
        LoRAConfig(rank=2.5, alpha=8.0)
    with pytest.raises(ValueError, match="alpha=-1"):
        LoRAConfig(rank=4, alpha=-1)
    with pytest.raises(ValueError, match="unknown target 'x'"):
        LoRAConfig(rank=4, alpha=8.0, targets="qx")
    with pytest.raises(ValueError, match="unknown target 'w_proj'"):
        LoRAConfig(rank=4, alpha=8.0, targets=("q", "w_proj"))
    with pytest.raises(ValueError, match="names a projection twice"):
        LoRAConfig(rank=4, alpha=8.0, targets=("q", "q_proj"))
    with pytest.raises(ValueError, match="targets=''"):
        LoRAConfig(rank=4, alpha=8.0, targets="")
    assert LoRAConfig(rank=4, alpha=8, targets=("v_proj", "q")).targets == ("q", "v")
    assert LoRAConfig(rank=4, alpha=8, targets="ovkq").targets == ("q", "k", "v", "o")

    model = add_lora(_gpt2(), LoRAConfig(rank=2, alpha=4.0, targets="q"))
    with pytest.raises(ValueError, match=r"h\.0\.attn\.q_proj already has LoRA"):
        retrofit(model, LoRAConfig(rank=2, alpha=4.0, targets="qv"))
    assert isinstance(model.h[0].attn.v_proj, nnx.Linear) and not isinstance(model.h[0].attn.v_proj, LoRALinear)
    with pytest.raises(ValueError, match="config must be a LoRAConfig"):
        add_lora(model, {"rank": 2})
    with pytest.raises(ValueError, match="no parameter is trainable with optim.trainable='lora'"):
        split_trainable(_gpt2(), OptimConfig(trainable="lora"))

    for section, match in (({"rank": 4, "alpha": 8.0, "target": "qv"}, "unknown config key retrofit.lora.target"),
                           ({"rank": 0, "alpha": 8.0}, "rank=0"),
                           ({"rank": 4, "alpha": 8.0, "targets": "x"}, "unknown target 'x'")):
        config = ml_collections.ConfigDict({"retrofit": {"lora": section}})
        with pytest.raises(ValueError, match=match):
            check_config(config)


def test_to_hf_refuses_unmerged_lora_and_writes_the_merged_model(tmp_path):
    from focal_jax.convert.hf import from_hf, to_hf

    model = add_lora(_llama(), LoRAConfig(rank=2, alpha=4.0), rngs=nnx.Rngs(3))
    for path, variable in nnx.iter_graph(model):
        if isinstance(variable, LoRA) and path[-1] == "lora_b":
            variable[...] = 0.1 * jnp.ones_like(variable[...])
    tokens = _tokens()
    expected = model(tokens)
    with pytest.raises(ValueError, match="merge_lora"):
        to_hf(model, str(tmp_path / "unmerged"))
    to_hf(merge_lora(model), str(tmp_path / "merged"))
    reloaded = from_hf(str(tmp_path / "merged"))
    np.testing.assert_allclose(reloaded(tokens), expected, atol=1e-4)
