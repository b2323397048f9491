"""The trainer: meshes, resume, preemption, multi-process, init precedence, retrofit, bad input, experiments."""

import ast
import dataclasses
import glob
import copy
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from focal_jax.convert.hf import to_hf
from focal_jax.nn.attention import record_attention
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, focal_config
from focal_jax.nn.variables import Centroid
from focal_jax.train import checkpoint, train, trainer
from focal_jax.train.config import ConfigError, check_config, config_differences, default_config
from focal_jax.train.metrics import read_metrics
from focal_jax.train.optimizer import (OptimConfig, decay_mask, learning_rate_schedule, make_optimizer, param_paths,
                                       split_trainable)
from focal_jax.train.sharding import check_batch_layout, make_mesh, partition_spec, shard_batch
from focal_jax.train.trainer import cast_floats, init_model, load_model, masked_nll
from helpers import load_experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden_trainable.json")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizers"))


def dense_model() -> ml_collections.ConfigDict:
    """The model section of the quickstart's runlocal config with dense attention (a Focal paper baseline)."""
    return load_experiment("quickstart", "runlocal,attn=baseline").model


def tiny(cache_dir, **overrides) -> ml_collections.ConfigDict:
    """The quickstart's runlocal config with 8 sequences per step (8 fake devices), quiet and short."""
    config = load_experiment("quickstart", "runlocal")
    config.data.cache_dir = cache_dir
    config.batch_size = 8
    config.total_steps = 3
    config.eval_batches = 0
    config.update(overrides)
    return config


def losses(workdir) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(workdir, kind="train")}


def latest_step(workdir):
    return checkpoint.make_manager(workdir, create=False).latest_step()


# ------------------------------------------------------------------------------------------------ units


def test_schedule_clip_and_decay_mask():
    config = GPT2Config(vocab_size=16, n_positions=8, d_model=8, n_layers=1, n_heads=2, kind="focal_learned",
                        tau_granularity="head", tau_min=1.0, tau_max=2.0)
    params = nnx.to_pure_dict(nnx.state(GPT2(config, rngs=nnx.Rngs(0)), nnx.Param))
    mask = {p: m for p, m in zip(param_paths(params), jax.tree.leaves(decay_mask(params)))}
    assert mask["h/0/attn/q_proj/kernel"] and mask["wte/embedding"]
    assert not mask["h/0/attn/q_proj/bias"] and not mask["h/0/ln_1/scale"] and not mask["ln_f/bias"]
    assert np.ndim(params["h"][0]["attn"]["w_tau"]) == 2  # [d_model, n_heads]: a matrix, yet not decayed
    assert not mask["h/0/attn/w_tau"] and not mask["h/0/attn/tau_bias"]
    # Zero gradients: AdamW moves only the decayed leaves (by lr * wd * param), never norms and biases.
    tx = make_optimizer(OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.5), total_steps=10)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
    for path, update, param in zip(param_paths(params), jax.tree.leaves(updates), jax.tree.leaves(params)):
        expected = -0.1 * 0.5 * param if mask[path] else jnp.zeros_like(param)
        np.testing.assert_allclose(update, expected, rtol=1e-6, err_msg=path)
    # Global-norm clipping at 1: a huge gradient gives the same update as the unit-norm one.
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e6), params)
    tx = make_optimizer(OptimConfig(lr=0.1, warmup_steps=0, weight_decay=0.0, b1=0.0, b2=0.0), total_steps=10)
    clipped, _ = tx.update(grads, tx.init(params), params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(clipped))


def test_trainable_selection_and_frozen_have_no_optimizer_state():
    model = Llama(focal_config("tiny", attn={"kind": "focus"}), rngs=nnx.Rngs(0))
    _, trainable, frozen = split_trainable(model, OptimConfig(trainable="centroids"))
    assert param_paths(trainable) == [f"layers/{i}/self_attn/{n}" for i in (0, 1) for n in ("centroids", "w_g")]
    opt_state = make_optimizer(OptimConfig(), 10).init(trainable)
    n_state = sum(x.size for x in jax.tree.leaves(opt_state))
    n_trainable = sum(x.size for x in jax.tree.leaves(trainable))
    assert n_state == 2 * n_trainable + 2  # Adam mu and nu of the centroids, two step counters
    _, trainable, _ = split_trainable(model, OptimConfig(trainable_regex=r"layers/1/.*(q_proj|k_proj)"))
    assert param_paths(trainable) == ["layers/1/self_attn/k_proj/kernel", "layers/1/self_attn/q_proj/kernel"]
    with pytest.raises(ValueError, match="no parameter is trainable.*trainable_regex='nothing'"):
        split_trainable(model, OptimConfig(trainable_regex="nothing"))
    with pytest.raises(ValueError, match="optim.trainable='bias'"):
        OptimConfig(trainable="bias")


def test_trainable_types_select_their_parameters():
    """optim.trainable 'temperature' and 'centroids+temperature' select a learned-temperature layer's `Temperature`
    parameters, 'centroids' and 'centroids+temperature' a Focus layer's `Centroid` ones (nothing else)."""
    learned = Llama(focal_config("tiny", attn={"kind": "focal_learned"}), rngs=nnx.Rngs(0))
    focus = Llama(focal_config("tiny", attn={"kind": "focus"}), rngs=nnx.Rngs(0))
    temperature = [f"layers/{i}/self_attn/{n}" for i in (0, 1) for n in ("tau_bias", "w_tau")]
    centroids = [f"layers/{i}/self_attn/{n}" for i in (0, 1) for n in ("centroids", "w_g")]
    for trainable in ("temperature", "centroids+temperature"):
        assert param_paths(split_trainable(learned, OptimConfig(trainable=trainable))[1]) == temperature, trainable
    for trainable in ("centroids", "centroids+temperature"):
        assert param_paths(split_trainable(focus, OptimConfig(trainable=trainable))[1]) == centroids, trainable


def test_mesh_and_partition_specs():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert partition_spec("layers/0/self_attn/q_proj/kernel", (64, 64), mesh) == jax.sharding.PartitionSpec(
        "fsdp", "tensor")
    assert partition_spec("layers/0/mlp/down_proj/kernel", (172, 64), mesh) == jax.sharding.PartitionSpec(
        "tensor", "fsdp")
    assert partition_spec("embed_tokens/embedding", (511, 64), mesh) == jax.sharding.PartitionSpec(None, "fsdp")
    assert partition_spec("norm/scale", (64,), mesh) == jax.sharding.PartitionSpec(None)
    assert dict(make_mesh({"data": -1, "tensor": 2}).shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    with pytest.raises(ValueError, match="has 6 devices, but there are 8"):
        make_mesh({"data": 3, "fsdp": 2, "tensor": 1})
    with pytest.raises(ValueError, match="unknown axes \\['model'\\]"):
        make_mesh({"model": 2})
    for sizes in ({"data": -1, "fsdp": 0}, {"data": 0}, {"data": -2, "fsdp": 8}, {"data": -1, "fsdp": -1}):
        with pytest.raises(ValueError, match=re.escape("mesh sizes must be >= 1, with at most one -1; got")):
            make_mesh(sizes)
    check_batch_layout(mesh, 8, 4)
    with pytest.raises(ValueError, match="batch_size=6 must be a multiple of the data-parallel size 4"):
        check_batch_layout(mesh, 6, 1)
    # two hosts of four devices, the batch split over two: each host's rows would be taken for the whole batch
    with pytest.raises(ValueError, match="splits the batch 2 ways .* which 4 processes cannot share"):
        check_batch_layout(make_mesh({"data": 2, "tensor": 4}), 8, 4)


def test_unknown_config_keys_name_themselves():
    for section, key in (("", "totl_steps"), ("model", "n_layer"), ("data", "seqlen"), ("optim", "learning_rate"),
                         ("mesh", "model")):
        config = default_config()
        (config if not section else config[section])[key] = 1
        with pytest.raises(ValueError, match=f"unknown config key {section + '.' if section else ''}{key}; valid keys "
                                             f"of {section or 'the config'}: "):
            check_config(config)
    config = default_config()
    config.seq_len, config.warmup_steps = 64, 10  # keys of a section, given at the top
    with pytest.raises(ValueError, match=r"unknown config keys seq_len, warmup_steps \(did you mean data.seq_len or "
                                         r"optim.warmup_steps\?\); valid keys of the config: "):
        check_config(config)
    config = default_config()
    config.model.family = "t5"
    with pytest.raises(ValueError, match="model.family='t5' is not one of"):
        check_config(config)


def test_mesh_sizes_must_be_integers():
    """A mesh size that is not an integer was cut by int() (2.5 -> 2: another mesh, silently) or failed with
    int()'s message, which names neither the axis nor the setting."""
    for value in (2.5, True, "x", 0, -2):
        config = default_config()
        config.mesh = {"data": value, "fsdp": 4, "tensor": 1}
        with pytest.raises(ValueError, match=re.escape(f"mesh.data must be an integer >= 1 or -1 (the rest of the "
                                                       f"devices), got mesh.data={value!r}")):
            check_config(config)


def test_retrofit_sections_and_adam_betas_are_checked():
    config = default_config()
    config.retrofit.focal = {}  # Focal with its defaults (it used to be dropped: no retrofit at all)
    assert [type(change).__name__ for change in check_config(config).retrofit] == ["FocalConfig"]
    config = default_config()
    config.retrofit.focus = {"groups": 4}
    with pytest.raises(ValueError, match=r"retrofit.focus needs retrofit.focus.dim, retrofit.focus.window"):
        check_config(config)
    for name in ("b1", "b2"):  # Adam divides by 1 - b ** step
        config = default_config()
        config.optim[name] = 1.0
        with pytest.raises(ValueError, match=rf"optim.{name} must be in \[0, 1\), got {name}=1.0"):
            check_config(config)
    # lr = inf trained NaN parameters from step 2 on, eps = inf made every Adam update 0, weight_decay = NaN
    for name, bad in (("lr", math.inf), ("eps", math.inf), ("weight_decay", math.inf), ("weight_decay", math.nan)):
        config = default_config()
        config.optim[name] = bad
        with pytest.raises(ValueError, match=rf"optim.{name} must be a finite number .*, got {name}={bad}"):
            check_config(config)
    for name, bad in (("clip", "1.0"), ("lr", None), ("b1", True), ("weight_decay", "0")):  # a config file's typo
        with pytest.raises(ValueError, match=re.escape(f"optim.{name} must be a number, got {name}={bad!r}")):
            OptimConfig(**{name: bad})  # (the comparisons raised TypeError, naming neither setting nor value)


@pytest.mark.parametrize("family, model, needle", [
    ("llama", {"attn": {"focal_t": 0.3}}, "kind='dense' does not read focal_t=0.3 (read by kinds ('focal', "),
    ("llama", {"attn": {"kind": "focal", "focus_topk": 2}}, "kind='focal' does not read focus_topk=2"),
    ("gpt2", {"tau_min": 2.0, "focal_t": 0.5, "kind": "focus"}, "kind='focus' does not read focal_t=0.5 (read by "
     "kinds ('focal', 'focal+focus')), tau_min=2.0 (read by kinds ('focal_learned',))"),
])
def test_training_refuses_attention_settings_its_kind_does_not_read(family, model, needle, tmp_path):
    """`--config.model.attn.focal_t=0.3` without kind='focal' trained dense attention, silently."""
    config = default_config()
    config.model = {"family": family, **({"size": "tiny"} if family == "llama" else {"vocab_size": 64}), **model}
    check_config(config)  # (a stored run with such settings still loads)
    with pytest.raises(ValueError, match=re.escape(needle)):
        train(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_task_kwargs_is_a_section():
    """`data.task_kwargs` takes one option at a time (`--config.data.task_kwargs.n_pairs=6`) or a dict; a run stored
    with (key, value) pairs, as before, is the same config."""
    config = default_config()
    config.data.task_kwargs.n_pairs = 6
    assert check_config(config).data.task_kwargs == (("n_pairs", 6),)
    config.data.task_kwargs = {"n_queries": 2, "n_pairs": 5}
    assert check_config(config).data.task_kwargs == (("n_pairs", 5), ("n_queries", 2))
    current = checkpoint.config_json(config)
    stored = {**current, "data": {**current["data"], "task_kwargs": [["n_pairs", 5], ["n_queries", 2]]}}
    assert config_differences(stored, current) == []
    stored["data"]["task_kwargs"] = [["n_pairs", 4], ["n_queries", 2]]
    assert config_differences(stored, current) == ["data.task_kwargs.n_pairs: 4 (stored) vs 5 (now)"]


def test_a_model_section_compares_as_the_model_it_builds():
    """A resume compares `model` and `retrofit` as the configs they build: leaving out a default (`family: 'llama'`,
    an attention setting, Focus's tau) or naming a Focal size instead of its fields is the same config (each was 'a
    different config'); a changed setting is named by its key, and a section that builds nothing is compared as
    written."""
    llama = {"family": "llama", "vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "intermediate": 128,
             "attn": {"kind": "focal", "focal_t": 0.4}}
    without_defaults = {k: v for k, v in llama.items() if k != "family"} | {"attn": {"kind": "focal"}}
    assert config_differences({"model": llama}, {"model": without_defaults}) == []
    assert config_differences({"model": llama}, {"model": {**llama, "attn": {"kind": "focal", "focal_t": 0.3}}}) == [
        "model.attn.focal_t: 0.4 (stored) vs 0.3 (now)"]
    assert config_differences({"model": llama}, {"model": {**llama, "n_layers": 3}}) == [
        "model.n_layers: 2 (stored) vs 3 (now)"]
    sized = {"size": "400M", "vocab_size": 512}
    spelled = dataclasses.asdict(check_config(ml_collections.ConfigDict({"model": sized})).model)
    assert config_differences({"model": sized}, {"model": spelled | {"attn": dict(spelled["attn"])}}) == []
    gpt2 = {"family": "gpt2", "n_layers": 2, "kind": "focal"}
    assert config_differences({"model": gpt2}, {"model": gpt2 | {"focal_t": 0.4, "impl": "xla"}}) == []
    assert config_differences({"model": {"family": "hf"}}, {"model": {"family": "hf", "remat": False}}) == []
    assert config_differences({"model": {"family": "hf"}}, {"model": {"family": "hf", "remat": True}}) == [
        "model.remat: False (stored) vs True (now)"]
    assert config_differences({"model": {"d_model": 64, "bogus": 1}}, {"model": {"d_model": 64}}) == [
        "model.bogus: 1 (stored) vs None (now)"]
    focus = {"groups": 4, "dim": 16, "window": 8}
    assert config_differences({"retrofit": {"focus": focus}}, {"retrofit": {"focus": focus | {"tau": 0.1},
                                                                            "focal": None}}) == []
    assert config_differences({"retrofit": {"focus": focus}}, {"retrofit": {"focus": focus | {"tau": 0.2}}}) == [
        "retrofit.focus.tau: 0.1 (stored) vs 0.2 (now)"]
    assert config_differences({"retrofit": {"focal": {}}}, {"retrofit": {"focal": {"t": 0.4}}}) == []
    assert config_differences({"retrofit": {"window": 8}}, {"retrofit": {"window": 9}}) == [
        "retrofit.window: 8 (stored) vs 9 (now)"]
    assert config_differences({"retrofit": {}}, {"retrofit": {"focal": {}}}) == [
        "retrofit.focal: None (stored) vs {'t': 0.4, 'learned': False, 'tau_min': 5.0, 'tau_max': 10.0, "
        "'tau_mode': 'prefix', 'tau_clip': 'hard', 'tau_granularity': 'layer', 'tau_bias': True, 'tau_input': "
        "'normed'} (now)"]


def test_optimizer_is_adamw_after_global_norm_clipping():
    """make_optimizer against a NumPy AdamW (b1 on the first moment, b2 on the second, eps, decoupled weight decay
    on matrices only, the schedule's lr at the update's index 0, 1, ...) fed gradients first clipped to global norm
    `clip`: a huge first gradient enters Adam's moments at norm 1, so the small ones after it still move the
    parameters as much as they would after a unit gradient."""
    config = OptimConfig(lr=0.1, warmup_steps=0, final_lr_fraction=0.5, b1=0.8, b2=0.9, eps=1e-3, weight_decay=0.3,
                         clip=1.0)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 2)).astype(np.float32), "b": rng.normal(size=(2,)).astype(np.float32)}
    grads = [{k: (scale * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}
             for scale in (1e4, 0.1, 0.2)]
    tx, schedule = make_optimizer(config, total_steps=3), learning_rate_schedule(config, 3)
    state, got = tx.init(params), params
    want = {k: v.astype(np.float64) for k, v in params.items()}
    mu, nu = ({k: np.zeros_like(v) for k, v in want.items()} for _ in range(2))
    for t, g in enumerate(grads):
        updates, state = tx.update(g, state, got)
        got = optax.apply_updates(got, updates)
        norm = math.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64))) for x in g.values()))
        lr = float(schedule(t))
        for k in want:
            clipped = g[k].astype(np.float64) * min(1.0, config.clip / norm)
            mu[k] = config.b1 * mu[k] + (1 - config.b1) * clipped
            nu[k] = config.b2 * nu[k] + (1 - config.b2) * clipped ** 2
            step = (mu[k] / (1 - config.b1 ** (t + 1))) / (np.sqrt(nu[k] / (1 - config.b2 ** (t + 1))) + config.eps)
            decay = config.weight_decay * want[k] if want[k].ndim >= 2 else 0.0
            want[k] = want[k] - lr * (step + decay)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{k} after update {t}")


def test_learning_rate_schedule_boundaries():
    """Linear warmup from 0 reaches `lr` at warmup_steps; the cosine ends at final_lr_fraction * lr (a fraction of
    the peak, not an absolute rate) at decay_steps (default total_steps) and stays there; a warmup longer than the
    decay is cut to it, so a run shorter than its warmup still reaches the peak at its end."""
    s = learning_rate_schedule(OptimConfig(lr=0.02, warmup_steps=4, final_lr_fraction=0.25), total_steps=20)
    np.testing.assert_allclose([float(s(i)) for i in (0, 2, 4, 12, 20, 30)],
                               [0.0, 0.01, 0.02, 0.0125, 0.005, 0.005], rtol=1e-5, atol=1e-9)
    s = learning_rate_schedule(OptimConfig(lr=0.02, warmup_steps=4, final_lr_fraction=0.25, decay_steps=12), 100)
    np.testing.assert_allclose([float(s(i)) for i in (4, 8, 12, 50)], [0.02, 0.0125, 0.005, 0.005], rtol=1e-5)
    s = learning_rate_schedule(OptimConfig(lr=0.02, warmup_steps=50, final_lr_fraction=0.25), total_steps=10)
    np.testing.assert_allclose([float(s(i)) for i in (5, 10, 11)], [0.01, 0.02, 0.005], rtol=1e-5)


def test_counters_and_settings_that_cannot_train_are_refused():
    """A 0 for a step interval, the batch or the checkpoints kept (total_steps=0 is a zero-shot baseline), a clip of 0
    (every update 0, NaN for a zero gradient), a NaN or infinite balance weight, and a bool or float where a count
    of batches or steps goes fail at once, naming themselves."""
    config = default_config()
    config.total_steps = 0
    check_config(config)
    for name in ("batch_size", "log_every", "eval_every", "ckpt_every", "keep_checkpoints"):
        config = default_config()
        config[name] = 0
        with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {name}=0"):
            check_config(config)
    with pytest.raises(ValueError, match="optim.clip must be None or > 0, got clip=0.0"):
        OptimConfig(clip=0.0)
    for weight in (math.nan, math.inf):  # an infinite loss, NaN gradients
        config = default_config()
        config.balance_weight = weight
        with pytest.raises(ValueError, match=f"balance_weight must be a finite number >= 0, got "
                                             f"balance_weight={weight}"):
            check_config(config)
    config = default_config()
    config.eval_batches = True
    with pytest.raises(ValueError, match="eval_batches must be an integer >= 0, got eval_batches=True"):
        check_config(config)
    for name, value in (("warmup_steps", 2.5), ("warmup_steps", True), ("decay_steps", 10.0)):
        with pytest.raises(ValueError, match=f"optim.{name} must be .*an integer .*got {name}={value}"):
            OptimConfig(**{name: value})


def test_windows_that_cover_every_key_are_refused(tmp_path):
    """A Focus window of at least data.seq_len - 1 leaves no distant key (Focus routes nothing; its centroids never
    train), and so does a retrofit's sliding window (it changes nothing): training refuses them by name, one key
    shorter trains. The same settings still load (`check_config`: a stored run is evaluated at any length)."""
    base = str(tmp_path / "base")
    os.makedirs(base)
    cases = [
        ({"model": {"family": "llama", "size": "tiny", "attn": {"kind": "focus", "focus_window": 127}}},
         "model.attn.focus_window=127"),
        ({"model": {"family": "gpt2", "vocab_size": 512, "n_positions": 128, "d_model": 64, "n_layers": 2,
                    "n_heads": 4, "kind": "focal+focus", "focus_window": 200}}, "model.focus_window=200"),
        ({"init_from": base, "retrofit": {"focus": {"groups": 2, "dim": 8, "window": 127}}},
         "retrofit.focus.window=127"),
        ({"init_from": base, "retrofit": {"window": 1000}}, "retrofit.window=1000")]
    for settings, field in cases:
        config = default_config()
        config.data.seq_len = 128
        for key, value in settings.items():
            config[key] = value
        check_config(config)
        with pytest.raises(ValueError, match=re.escape(f"{field} covers every key of data.seq_len=128 sequences")):
            trainer.check_run(config, str(tmp_path / "run"))
        config.data.seq_len = int(re.search(r"=(\d+)$", field)[1]) + 2  # one distant key
        trainer.check_run(config, str(tmp_path / "run"))


def test_a_stored_run_whose_window_covers_every_key_resumes(tmp_path, cache_dir, monkeypatch):
    """0.6.19 trained a window covering every key; 0.6.20 refused to resume such a run, and the advice (a shorter
    window) was then refused as another config. A stored run resumes; a new one is still refused."""
    config = tiny(cache_dir, total_steps=1)
    config.data.seq_len = 64
    config.model.attn.window = 63
    workdir = str(tmp_path / "run")
    with monkeypatch.context() as patch:
        patch.setattr(trainer, "check_windows", lambda run: None)  # as the versions before 0.6.20
        train(config, workdir)
    assert latest_step(workdir) == 1
    config.total_steps = 2
    train(config, workdir)
    assert latest_step(workdir) == 2
    with pytest.raises(ValueError, match=re.escape("model.attn.window=63 covers every key of data.seq_len=64")):
        trainer.check_run(config, str(tmp_path / "new"))


def test_hard_routing_as_the_only_thing_to_train_is_refused(tmp_path):
    """Hard top-k membership has no gradient: a run that trains only the centroids of hard Focus layers (no balance
    loss) ran with a gradient norm of exactly 0 and saved its initial centroids. Training refuses it by name; the
    soft gate, a balance loss, a learned temperature beside the centroids, or full training still run."""
    base = str(tmp_path / "base")
    os.makedirs(base)
    retrofit_focus = {"init_from": base, "retrofit": {"focus": {"groups": 2, "dim": 8, "window": 16, "topk": 1}},
                      "optim": {"trainable": "centroids"}}
    own_focus = {"model": {"family": "llama", "size": "tiny",
                           "attn": {"kind": "focus", "focus_window": 16, "focus_topk": 2}},
                 "optim": {"trainable": "centroids+temperature"}}
    gpt2_focus = {"model": {"family": "gpt2", "vocab_size": 512, "n_positions": 128, "d_model": 64, "n_layers": 2,
                            "n_heads": 4, "kind": "focus", "focus_window": 16, "focus_topk": 1},
                  "optim": {"trainable": "centroids"}}
    cases = [(retrofit_focus, "retrofit.focus.topk=1", ("retrofit", "focus", "topk")),
             (own_focus, "model.attn.focus_topk=2", ("model", "attn", "focus_topk")),
             (gpt2_focus, "model.focus_topk=1", ("model", "focus_topk"))]
    for settings, field, path in cases:
        def config_of(change=None):
            config = default_config()
            config.data.seq_len = 128
            for key, value in copy.deepcopy(settings).items():
                config[key] = value
            if change:
                change(config)
            return config

        with pytest.raises(ValueError, match=re.escape(f"{field} (hard top-k routing) with optim.trainable=")):
            trainer.check_run(config_of(), str(tmp_path / "run"))

        def soft(config):
            section = config
            for key in path[:-1]:
                section = section[key]
            section[path[-1]] = None

        def balanced(config):
            config.balance_weight = 0.01

        def everything(config):
            config.optim.trainable = "all"

        for change in (soft, balanced, everything):
            trainer.check_run(config_of(change), str(tmp_path / "run"))

    def learned(config):
        config.retrofit.focal = {"learned": True, "t": None}
        config.optim.trainable = "centroids+temperature"

    config = default_config()
    config.data.seq_len = 128
    for key, value in copy.deepcopy(retrofit_focus).items():
        config[key] = value
    learned(config)
    trainer.check_run(config, str(tmp_path / "run"))


def test_batches_split_over_data_and_fsdp():
    """A batch's rows are split over both batch axes (data x fsdp), each device holding its own rows; replicated over
    tensor."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    batch = shard_batch({"inputs": np.arange(8 * 3, dtype=np.int32).reshape(8, 3)}, mesh)
    inputs = batch["inputs"]
    assert inputs.sharding.shard_shape(inputs.shape) == (2, 3)
    rows = {tuple(np.asarray(shard.data)[:, 0] // 3) for shard in inputs.addressable_shards}
    assert rows == {(0, 1), (2, 3), (4, 5), (6, 7)}


def test_evaluate_weights_batches_by_their_targets():
    """The held-out loss is the mean over all target tokens (a batch with few targets weighs little), not the mean
    of the batches' means; dominance and the learned temperature's statistics sum each layer's counts over the
    batches first, then take the mean (and max) over the layers. (A stand-in eval_step: the nll sum and target count
    of the batch, given counts and tau sums.)"""
    full, sparse = np.ones((8, 4), np.float32), np.zeros((8, 4), np.float32)
    sparse[:, 0] = 1  # 8 targets
    batches = [{"nll": 1.0 * full, "mask": full}, {"nll": 4.0 * sparse, "mask": sparse}]
    counts = iter([np.array([[3, 1], [2, 2]]), np.array([[0, 4], [2, 2]])])  # [layers, groups] of each batch
    # [layers, (tau sum, at tau_min, at tau_max, real tokens)] of each batch
    taus = iter([np.array([[60.0, 2, 0, 8], [40.0, 0, 0, 8]]), np.array([[16.0, 0, 1, 2], [10.0, 1, 1, 2]])])

    def eval_step(trainable, frozen, batch):
        return jnp.sum(batch["nll"] * batch["mask"]), jnp.sum(batch["mask"]), next(counts), next(taus)

    result = trainer.evaluate(eval_step, None, None, batches, make_mesh({"data": -1}))
    assert result["tokens"] == 40.0
    np.testing.assert_allclose(result["loss"], (32 + 32) / 40, rtol=1e-6)  # not (1 + 4) / 2
    np.testing.assert_allclose(result["perplexity"], math.exp(1.6), rtol=1e-6)
    # layer 0: [3, 5] -> 5/8 (not the batches' mean (3/4 + 1) / 2), layer 1: [4, 4] -> 1/2
    np.testing.assert_allclose([result["dominance"], result["dominance_max"]], [(5 / 8 + 1 / 2) / 2, 5 / 8])
    # tau per layer over the real tokens of both batches: 76 / 10 and 50 / 10; clipped 3 / 10 and 2 / 10
    np.testing.assert_allclose([result["tau/layer_0"], result["tau/layer_1"], result["tau"]], [7.6, 5.0, 6.3])
    np.testing.assert_allclose([result["tau_clipped/layer_0"], result["tau_clipped/layer_1"],
                                result["tau_clipped"]], [0.3, 0.2, 0.25])


# ------------------------------------------------------------------------------------------------ runs


def test_meshes_give_the_same_losses(tmp_path, cache_dir):
    runs = {}
    for shape in ((8, 1, 1), (2, 4, 1), (2, 2, 2)):
        workdir = str(tmp_path / "x".join(map(str, shape)))
        train(tiny(cache_dir, mesh=dict(zip(("data", "fsdp", "tensor"), shape))), workdir)
        runs[shape] = losses(workdir)
    assert list(runs[(8, 1, 1)]) == [1, 2, 3]
    for shape, values in runs.items():
        np.testing.assert_allclose(list(values.values()), list(runs[(8, 1, 1)].values()), atol=1e-5, rtol=0,
                                   err_msg=str(shape))


def test_resume_reproduces_the_uninterrupted_run(tmp_path, cache_dir):
    config = tiny(cache_dir, total_steps=20, ckpt_every=5, eval_batches=1, eval_every=10)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(config, straight)
    train(config, resumed, stop_after=10)
    assert latest_step(resumed) == 10 and max(losses(resumed)) == 10
    train(config, resumed)
    assert losses(resumed) == losses(straight)  # exactly, every step 1..20
    assert sorted(losses(resumed)) == list(range(1, 21))
    evals = [r["loss"] for r in read_metrics(straight, kind="eval")]
    assert evals == [r["loss"] for r in read_metrics(resumed, kind="eval")] and len(evals) == 2
    assert os.path.getsize(os.path.join(resumed, "loss.png")) > 1000
    assert glob.glob(os.path.join(resumed, "tb", "events.*"))


def test_a_crash_right_after_a_checkpoint_keeps_it(tmp_path, cache_dir, monkeypatch):
    """An exception in the loop (here the data failing as step 3 starts) right after a checkpoint began (step 2,
    written asynchronously) used to leave that checkpoint unfinished (a temporary directory, abandoned when the
    process exits), so the run resumed from the one before it; train now waits for it before the error goes up."""
    config = tiny(cache_dir, total_steps=4, ckpt_every=2)
    straight, crashed = str(tmp_path / "straight"), str(tmp_path / "crashed")
    train(config, straight)
    shard_batch, calls = trainer.shard_batch, []

    def failing(batch, mesh):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("the data file system went away")
        return shard_batch(batch, mesh)

    with monkeypatch.context() as patch:
        patch.setattr(trainer, "shard_batch", failing)
        with pytest.raises(OSError, match="went away"):
            train(config, crashed)
        assert checkpoint.saved_steps(crashed) == [2]  # at once, as the error reaches the caller
    train(config, crashed)
    assert losses(crashed) == losses(straight) and sorted(losses(crashed)) == [1, 2, 3, 4]


def test_a_zero_step_run_killed_before_its_checkpoint_logs_its_evaluation_once(tmp_path, cache_dir, monkeypatch):
    """A zero-shot run (total_steps=0) killed while saving its step 0 had logged its evaluation; started again with
    no checkpoint to resume, it kept that record (the records of steps <= 0 stayed) and logged a second one."""
    config = tiny(cache_dir, total_steps=0, eval_batches=1)
    workdir = str(tmp_path / "zero")

    def killed(*args, **kwargs):
        raise RuntimeError("killed during the save")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save", killed)
        with pytest.raises(RuntimeError, match="killed during the save"):
            train(config, workdir)
    assert latest_step(workdir) is None and [r["step"] for r in read_metrics(workdir, kind="eval")] == [0]
    train(config, workdir)
    assert latest_step(workdir) == 0 and [r["step"] for r in read_metrics(workdir)] == [0]


def test_a_schedule_changed_after_the_resume_step_is_noted(capsys):
    """The note compared the two schedules at the resumed step only: total_steps raised during the warmup (the same
    rate there) went unnoted, though the cosine after the warmup is stretched (step 7 on). It names the settings
    that changed only (it printed `optim.decay_steps None -> None` too)."""
    def config(total_steps):
        c = default_config()
        c.update(total_steps=total_steps)
        c.optim.warmup_steps = 5
        return c

    trainer.warn_if_schedule_changed(checkpoint.config_json(config(10)), check_config(config(20)), 2)
    out = capsys.readouterr().out
    assert "learning-rate schedule changed on resume (total_steps 10 -> 20): step 7 trains at lr" in out
    assert "--config.optim.decay_steps=10" in out
    trainer.warn_if_schedule_changed(checkpoint.config_json(config(10)), check_config(config(10)), 2)
    assert "schedule changed" not in capsys.readouterr().out
    # resumed at the last step: only its own update is left to compare (lr at count 9 of the stored schedule,
    # decaying to step 10, and of the new one, which reached its end at step 9)
    shorter = config(10)
    shorter.optim.decay_steps = 9
    trainer.warn_if_schedule_changed(checkpoint.config_json(config(10)), check_config(shorter), 9)
    assert "(optim.decay_steps None -> 9): step 10 trains at lr" in capsys.readouterr().out


def test_sequences_longer_than_gpt2_positions_are_refused(tmp_path, cache_dir):
    """A GPT-2 with n_positions=32 trained on 64-token sequences: positions past its learned table were clamped by
    the lookup (all read its last row), and the run trained silently."""
    config = tiny(cache_dir, total_steps=1)
    config.model = {"family": "gpt2", "vocab_size": 512, "n_positions": 32, "d_model": 64, "n_layers": 2,
                    "n_heads": 4}
    workdir = str(tmp_path / "run")
    with pytest.raises(ValueError, match=r"data.seq_len=64 is longer than the model's n_positions=32"):
        train(config, workdir)
    assert latest_step(workdir) is None
    config.model.n_positions = 64  # a table as long as the sequences: every position has its own row
    train(config, workdir)
    assert latest_step(workdir) == 1


def test_resume_refuses_data_that_changed(tmp_path, cache_dir):
    """Files added to the training glob between a run and its resume (the same config): the tokenizer was trained
    anew on the new corpus, copied over the workdir's, and training went on with token ids of another meaning (and
    other rows), silently. Now the resume refuses, and the workdir keeps the tokenizer its checkpoints used."""
    from focal_jax.data.config import DataConfig
    from focal_jax.data.sources import read_documents

    docs = read_documents(DataConfig(source="builtin", cache_dir=cache_dir))[:120]  # written as text files
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(docs[:60]):
        (corpus / f"{i:03d}.txt").write_text(doc)
    config = tiny(cache_dir, total_steps=2)
    config.data.update(source="text", paths=(str(corpus / "*.txt"),))
    workdir = str(tmp_path / "run")
    train(config, workdir, stop_after=1)
    saved = open(os.path.join(workdir, "tokenizer.model"), "rb").read()
    train(config, workdir, stop_after=2)  # the same data: resumes
    assert latest_step(workdir) == 2
    for i, doc in enumerate(docs[60:]):
        (corpus / f"{60 + i:03d}.txt").write_text(doc)
    config.total_steps = 3
    with pytest.raises(ValueError, match="trained with the tokenizer .*tokenizer.model, but its data now gives "
                                         "another one"):
        train(config, workdir)
    assert open(os.path.join(workdir, "tokenizer.model"), "rb").read() == saved and latest_step(workdir) == 2
    config.data.tokenizer = os.path.join(str(tmp_path), "tok.model")
    open(config.data.tokenizer, "wb").write(saved)  # the same tokenizer, other documents: other rows
    other = str(tmp_path / "other")
    for i in range(60, 120):
        os.rename(corpus / f"{i:03d}.txt", tmp_path / f"{i:03d}.txt")
    train(config, other, stop_after=1)
    for i in range(60, 120):
        os.rename(tmp_path / f"{i:03d}.txt", corpus / f"{i:03d}.txt")
    with pytest.raises(ValueError, match="holds a run trained on other data"):
        train(config, other)
    assert latest_step(other) == 1


def test_doc_mask_false_trains_each_row_as_one_sequence_and_is_kept_on_resume(tmp_path, cache_dir):
    """`data.doc_mask=False` (FOCAL_SPEC OQ-F9): the tokens of a row attend across its documents, so the first
    step's loss (the same initial model, the same tokens and targets) differs from the masked run's; a resume must
    keep the setting."""
    def synthetic_run(**data):  # short documents, several to a row
        c = tiny(cache_dir, total_steps=1, eval_batches=1)
        c.data.update(source="synthetic", n_synthetic=300, **data)
        return c

    masked, merged = str(tmp_path / "masked"), str(tmp_path / "merged")
    train(synthetic_run(), masked)
    config = synthetic_run(doc_mask=False)
    train(config, merged)
    assert losses(masked)[1] != losses(merged)[1]
    [masked_eval], [merged_eval] = read_metrics(masked, kind="eval"), read_metrics(merged, kind="eval")
    assert masked_eval["loss"] != merged_eval["loss"]
    config.total_steps = 2
    config.data.doc_mask = True
    with pytest.raises(ValueError, match=r"different config.*data.doc_mask: False \(stored\) vs True \(now\)"):
        train(config, merged)
    config.data.doc_mask = False
    train(config, merged)
    assert sorted(losses(merged)) == [1, 2]


def test_eval_batches_past_the_held_out_rows_evaluate_the_rows_once_and_say_so(tmp_path, cache_dir, capsys):
    """eval_batches=100000 on a small held-out split padded it to 100000 batches (minutes of forward passes over
    padding at every evaluation, with nothing printed). The run evaluates the batches the rows fill, as
    eval_batches set to that number does, says so, and prints each evaluation's loss."""
    def run(eval_batches):
        c = tiny(cache_dir, total_steps=1, eval_batches=eval_batches)
        c.data.update(source="synthetic", n_synthetic=300)
        return c

    workdir = str(tmp_path / "many")
    capsys.readouterr()
    train(run(100000), workdir)
    out = capsys.readouterr().out
    filled = int(re.search(r"note: eval_batches=100000, but the held-out rows fill (\d+) batches of 8: each "
                           r"evaluation reads those", out).group(1))
    assert 1 <= filled < 100
    [record] = read_metrics(workdir, kind="eval")
    assert re.search(rf"step 1: held-out loss {record['loss']:.4f}, perplexity {record['perplexity']:.2f} "
                     rf"\({filled} batches, [\d.]+ s\)", out), out
    exact = str(tmp_path / "exact")
    train(run(filled), exact)
    assert "note: eval_batches" not in capsys.readouterr().out
    [want] = read_metrics(exact, kind="eval")
    assert (record["loss"], record["tokens"]) == (want["loss"], want["tokens"])


def test_data_problems_are_config_errors_found_before_the_model(tmp_path, cache_dir, monkeypatch):
    """A corpus the settings cannot use (no held-out documents, a bad line) failed with a traceback, the
    evaluation split's only once the model was built; each is a ConfigError (one line on the command line) before
    the model is built."""
    monkeypatch.setattr(trainer, "init_model", lambda *a, **k: pytest.fail("built the model first"))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    config = tiny(cache_dir, total_steps=1, eval_batches=1)
    config.data.update(source="jsonl", paths=(str(corpus),), vocab_size=300, eval_fraction=1e-9)
    with pytest.raises(ConfigError, match=r"^data: there are no evaluation documents \(0 of 40"):
        train(config, str(tmp_path / "no_eval"))
    corpus.write_text(corpus.read_text() + "{not json\n")
    config.data.eval_fraction = 0.1
    with pytest.raises(ConfigError, match=r"^data: .*line 41: not valid JSON"):
        train(config, str(tmp_path / "bad_line"))


def test_a_resume_may_change_the_cache_dir(tmp_path, cache_dir):
    """data.cache_dir only says where tokenizers are cached (a resume keeps the workdir's tokenizer and checks its
    data): a run moved to a machine with another cache path was refused as 'a different config'."""
    workdir, straight = str(tmp_path / "run"), str(tmp_path / "straight")
    train(tiny(cache_dir, total_steps=2), straight)
    train(tiny(cache_dir, total_steps=2), workdir, stop_after=1)
    train(tiny(str(tmp_path / "another_cache"), total_steps=2), workdir)
    assert losses(workdir) == losses(straight)


def test_a_config_that_leaves_keys_at_their_defaults_resumes(tmp_path, cache_dir):
    """check_config reads the keys a config leaves out at their defaults: such a run trained, but its resume failed
    (KeyError 'total_steps' in the schedule check), and writing a default out was 'a different config'."""
    def config(**overrides):
        c = ml_collections.ConfigDict({"batch_size": 8, "eval_batches": 0, "log_every": 1, "compute_dtype": "float32",
                                       "data": {"vocab_size": 512, "seq_len": 64, "cache_dir": cache_dir}})
        c.update(overrides)
        return c

    workdir = str(tmp_path / "run")
    train(config(), workdir, stop_after=1)  # total_steps: the default, 100
    train(config(), workdir, stop_after=2)
    train(config(seed=0, total_steps=100, optim={"lr": 4e-3}), workdir, stop_after=3)  # the defaults written out
    assert latest_step(workdir) == 3 and sorted(losses(workdir)) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"different config.*optim.lr: 0.004 \(stored\) vs 0.001 \(now\)"):
        train(config(optim={"lr": 1e-3}), workdir)


def test_zero_steps_saves_and_evaluates_the_starting_model(tmp_path, cache_dir):
    """A 0-step run (a zero-shot baseline) evaluates its starting model and saves it as step 0; the same command
    with more steps continues from it as a run of those steps from the start would."""
    zero, straight = str(tmp_path / "zero"), str(tmp_path / "straight")
    train(tiny(cache_dir, total_steps=0, eval_batches=1), zero)
    assert latest_step(zero) == 0 and losses(zero) == {}
    [record] = read_metrics(zero, kind="eval")
    assert record["step"] == 0 and np.isfinite(record["loss"])
    start = init_model(check_config(tiny(cache_dir)))
    np.testing.assert_array_equal(load_model(zero).layers[1].mlp.up_proj.kernel[...],
                                  start.layers[1].mlp.up_proj.kernel[...])
    train(tiny(cache_dir, total_steps=2), zero)
    train(tiny(cache_dir, total_steps=2), straight)
    assert losses(zero) == losses(straight) and sorted(losses(zero)) == [1, 2]


def test_remat_and_bf16(tmp_path, cache_dir):
    plain = str(tmp_path / "plain")
    train(tiny(cache_dir), plain)
    remat = str(tmp_path / "remat")
    config = tiny(cache_dir)
    config.model.remat = True
    train(config, remat)
    np.testing.assert_allclose(list(losses(remat).values()), list(losses(plain).values()), atol=1e-5)
    bf16 = str(tmp_path / "bf16")
    train(tiny(cache_dir, compute_dtype="bfloat16"), bf16)
    np.testing.assert_allclose(list(losses(bf16).values()), list(losses(plain).values()), atol=0.05)
    saved = checkpoint.make_manager(bf16, create=False).item_metadata(3)["params"]
    assert {np.dtype(m.dtype) for m in jax.tree.leaves(saved, is_leaf=lambda x: hasattr(x, "dtype"))} == {
        np.dtype("float32")}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compute_dtype_reaches_every_layer(family):
    """Parameters cast to bf16 for the forward pass (what `make_steps` does with compute_dtype) give bf16 layer
    inputs, q, k and v: the embedding lookup does not promote them back to the float32 the model was built with.
    Logits stay float32."""
    model = (Llama(focal_config("tiny"), rngs=nnx.Rngs(0)) if family == "llama" else
             GPT2(GPT2Config(vocab_size=64, n_positions=16, d_model=32, n_layers=2, n_heads=2), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    bf16 = nnx.merge(graphdef, cast_floats(nnx.to_pure_dict(state), jnp.bfloat16))
    with record_attention() as records:
        logits = bf16(jnp.zeros((1, 8), jnp.int32))
    assert len(records) == 2 and logits.dtype == jnp.float32
    assert {records[i][name].dtype for i in range(2) for name in ("x", "q", "k", "v")} == {jnp.dtype(jnp.bfloat16)}


def test_masked_nll_matches_optax():
    """The loss and its gradient against optax's cross-entropy (an outside implementation), with masked positions;
    bf16 logits are taken in float32."""
    import optax

    logits = 4 * jax.random.normal(jax.random.key(0), (2, 7, 50))
    targets = jax.random.randint(jax.random.key(1), (2, 7), 0, 50)
    loss_mask = (jnp.arange(7) < jnp.array([[7], [4]])).astype(jnp.float32)
    want = lambda logits: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * loss_mask)
    total, count = masked_nll(logits, targets, loss_mask)
    assert count == 11 and np.isclose(total, want(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: masked_nll(x, targets, loss_mask)[0])(logits),
                               jax.grad(want)(logits), atol=1e-6)
    total16, _ = masked_nll(logits.astype(jnp.bfloat16), targets, loss_mask)
    assert total16.dtype == jnp.float32
    assert np.isclose(total16, want(logits.astype(jnp.bfloat16).astype(jnp.float32)), rtol=1e-6)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_gradient_runs_every_product_in_16_bits(family):
    """The gradient through a bf16 forward pass (parameters cast as `make_steps` does with compute_dtype) has
    16-bit operands in every matrix product, the backward products of the float32 LM-head and attention logits
    included (`einsum_f32` rounds their float32 cotangents to bf16; autodiff alone ran them with a float32
    operand)."""
    from focal_jax.bench import matmul_flops

    model = (Llama(focal_config("tiny"), rngs=nnx.Rngs(0)) if family == "llama" else
             GPT2(GPT2Config(vocab_size=64, n_positions=16, d_model=32, n_layers=2, n_heads=2), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)

    def loss(params):
        logits = nnx.merge(graphdef, cast_floats(params, jnp.bfloat16))(jnp.zeros((1, 8), jnp.int32))
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

    total, low = matmul_flops(jax.grad(loss), nnx.to_pure_dict(state))
    assert low == total > 0


def run_cli(args, env=None, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "focal_jax.train", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, **kwargs)


def test_cli_sigterm_checkpoints_and_stops(tmp_path, cache_dir):
    workdir = str(tmp_path / "run")
    proc = run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", workdir,
                    f"--config.data.cache_dir={cache_dir}", "--config.total_steps=100000", "--config.batch_size=8",
                    "--config.ckpt_every=100000", "--config.eval_every=100000"])
    deadline = time.time() + 120
    metrics = os.path.join(workdir, "metrics.jsonl")
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    assert "(SIGTERM); checkpoint saved" in output
    step = latest_step(workdir)
    assert step is not None and step >= 3 and max(losses(workdir)) == step


@pytest.mark.parametrize("override, message", [
    ("--config.totl_steps=3", "unknown config key totl_steps"),
    ("--config.lr=3e-4", "unknown config key lr (did you mean optim.lr?)"),
    ("--config.model.n_layer=1", "unknown config key model.n_layer"),
    ("--config.data.task_kwargs.n_sentences=3", "unknown option(s) ['n_sentences'] for task='associative_recall'"),
    ("--config.data.task_kwargs=n_pairs=8",  # (the form before 0.6.10)
     "(config.data.task_kwargs is a section: set its keys one by one, --config.data.task_kwargs.KEY=VALUE)")])
def test_cli_unknown_override_fails_with_its_name(tmp_path, override, message):
    proc = run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", str(tmp_path), override])
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and message in output
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


@pytest.mark.parametrize("where, args, message", [
    ("outside", ["--config", "experiments/quickstart.py:runlocal"], "no file 'experiments/quickstart.py'"),
    ("outside", ["--config=experiments/quickstart.py", "--config.total_steps=2"],
     "no file 'experiments/quickstart.py'"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.totl_steps=3"],
     "unknown config key totl_steps"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.data.source=txt"], "unknown source='txt'"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.mesh.data=0"], "mesh.data must be"),
    ("root", ["--config", "experiments/quickstart.py:runlocl"], "unknown config argument 'runlocl'"),
    ("root", ["--config", "experiments/focus_retrofit.py:init_from=no_such_run,runlocal"],
     "init_from='no_such_run' is not a directory"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--workdir", "gs://bucket/run"], "is a URL"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.data.source=text",
              "--config.data.paths=no_such_dir/*.txt"], "data.paths: no file matches the pattern 'no_such_dir/*.txt'"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.data.source=text",
              "--config.data.paths=README.md", "--config.data.eval_paths=no_such.txt"],
     "data.eval_paths: no file matches the pattern 'no_such.txt'"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.data.tokenizer=no_such.model"],
     "data.tokenizer='no_such.model' is not a file"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.model.attn.kind=focus"],
     "model.attn.focus_window=128 covers every key of data.seq_len=64 sequences"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.mesh.data=3"], "but there are"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.retrofit.focus.groups=4"],
     "--config.retrofit.focus.groups: retrofit.focus is None in this config, so its fields cannot be set one by one"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.model.atn.kind=focus"],
     "--config.model.atn.kind: model.atn is not a key of this config (Did you mean \"attn\""),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.modl.x=4"],
     "--config.modl.x: modl is not a key of this config"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.data.source.x=1"],
     "--config overrides --config.data.source.x: TypeError"),
    ("root", ["--config", "experiments/quickstart.py:runlocal", "--config.batch_size=6"],
     "batch_size=6 must be a multiple of the data-parallel size")])
def test_cli_config_mistakes_are_one_line_not_a_traceback(tmp_path, where, args, message):
    """A config file missing (a relative path from outside the repository: experiments/ is not installed), a bad
    key or value in it, or an error of its `get_config` ends in one line naming it, status 2 (ml_collections' and
    the trainer's tracebacks before)."""
    workdir = [] if "--workdir" in args else ["--workdir", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, "-m", "focal_jax.train", *args, *workdir],
                          cwd=str(tmp_path) if where == "outside" else ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m focal_jax.train: error: ") and message in lines[0], lines
    assert not os.path.exists(tmp_path / "run")


def test_cli_names_a_run_the_config_cannot_resume_in_one_line(tmp_path, cache_dir):
    """A workdir holding a run of another config, or a step past total_steps, ended in the trainer's traceback."""
    workdir = str(tmp_path / "run")
    train(tiny(cache_dir, total_steps=1), workdir)
    same = ["--config", "experiments/quickstart.py:runlocal", "--workdir", workdir,
            f"--config.data.cache_dir={cache_dir}", "--config.batch_size=8", "--config.eval_batches=0"]
    for override, message in [("--config.seed=1", "holds a run of a different config (step 1); use a new workdir. "
                                                   "Differences: seed: 0 (stored) vs 1 (now)"),
                              ("--config.total_steps=0", "holds a checkpoint at step 1, past total_steps=0")]:
        done = subprocess.run([sys.executable, "-m", "focal_jax.train", *same, override], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("python -m focal_jax.train: error: workdir ") and \
            message in lines[0], lines
    assert latest_step(workdir) == 1


@pytest.mark.parametrize("override, message", [
    ("--config.model.vocab_size=256", "model vocab_size=256 is smaller than the tokenizer's 512: set model.vocab_size "
                                      "or data.vocab_size"),
    ("--config.data.vocab_size=262", "data.vocab_size=262 is too small for this corpus (")])
def test_cli_names_a_setting_found_wrong_once_the_data_or_model_is_built_in_one_line(tmp_path, cache_dir, override,
                                                                                     message):
    """A vocabulary smaller than the tokenizer's, or one the corpus cannot give a tokenizer of, is found once the
    data and model are built: a `ConfigError`, printed as one line (status 2) like the config's own mistakes, where
    the trainer's traceback was."""
    workdir = str(tmp_path / "run")
    done = subprocess.run([sys.executable, "-m", "focal_jax.train", "--config", "experiments/quickstart.py:runlocal",
                           "--workdir", workdir, f"--config.data.cache_dir={cache_dir}", "--config.batch_size=8",
                           override], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"python -m focal_jax.train: error: {message}"), done.stderr
    assert latest_step(workdir) is None


@pytest.mark.parametrize("flag", ["--help", "--helpfull"])
def test_cli_help_is_a_success(tmp_path, flag):
    """absl's `--help` printed the usage and exited with status 1, as a failure would."""
    done = subprocess.run([sys.executable, "-m", "focal_jax.train", flag], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--workdir" in done.stdout and "python -m focal_jax.train --config" in done.stdout, done.stdout


def test_cli_names_a_missing_process_id(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PROCESS_ID", "JAX_COORDINATOR_ADDRESS")}
    proc = run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", str(tmp_path)],
                   env={**env, "JAX_NUM_PROCESSES": "2"})
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and "JAX_NUM_PROCESSES=2 is set, so JAX_PROCESS_ID must be too" in output, output


def test_cli_names_a_bad_distributed_setting(tmp_path):
    """`--distributed` is read before the config file (which may start JAX's backend by reading a base run's
    checkpoint, after which `jax.distributed.initialize` is refused), so a bad value is named there, in one line."""
    proc = run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", str(tmp_path),
                    "--distributed", "maybe"])
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2, output
    assert "error: --distributed='maybe' is not one of 'auto', 'on', 'off'" in output, output


def test_cli_sets_model_fields_the_experiment_leaves_out(tmp_path, cache_dir):
    """The `model` section holds only what the experiment sets; any LlamaConfig field can still be given."""
    workdir = str(tmp_path / "run")
    proc = run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", workdir,
                    f"--config.data.cache_dir={cache_dir}", "--config.total_steps=1", "--config.eval_batches=0",
                    "--config.batch_size=8", "--config.model.n_layers=1", "--config.model.remat=True",
                    "--config.model.attn.softcap=30.0"])
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    model = checkpoint.read_meta(workdir)[1]["config"]["model"]
    assert (model["n_layers"], model["remat"], model["attn"]["softcap"]) == (1, True, 30.0)


def test_cli_trains_a_focus_model_with_an_attention_sink(tmp_path, cache_dir):
    """`--config.model.attn.focus_sink=2` (FOCUS_SPEC OQ-12) is set from the command line like the other Focus
    settings: two steps train, and the stored run and the model it loads hold the sink."""
    workdir = str(tmp_path / "run")
    proc = run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", workdir,
                    f"--config.data.cache_dir={cache_dir}", "--config.total_steps=2", "--config.eval_batches=0",
                    "--config.batch_size=8", "--config.model.n_layers=1", "--config.model.attn.kind=focus",
                    "--config.model.attn.focus_window=16", "--config.model.attn.focus_sink=2"])
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    assert checkpoint.read_meta(workdir)[1]["config"]["model"]["attn"]["focus_sink"] == 2
    assert [m["step"] for m in read_metrics(workdir, kind="train")][-1] == 2
    assert load_model(workdir).layers[0].self_attn.config.focus_sink == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def two_processes(workdir: str, cache_dir: str, *flags: str, config="experiments/quickstart.py:runlocal") -> list:
    """`config` (the quickstart's runlocal config) started in 2 local processes of 4 CPU devices each (no
    evaluation)."""
    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(rank),
                   JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                   XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
        procs.append(run_cli(["--config", config, "--workdir", workdir,
                              f"--config.data.cache_dir={cache_dir}", "--config.batch_size=8",
                              "--config.eval_batches=0", *flags], env=env))
    return procs


def test_two_processes_agree_with_one(tmp_path, cache_dir):
    one = str(tmp_path / "one")
    train(tiny(cache_dir, total_steps=2), one)  # 8 devices in this process
    two = str(tmp_path / "two")
    procs = two_processes(two, cache_dir, "--config.total_steps=2")
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "in 2 process(es)" in outputs[0] and "devices: 8" in outputs[0]
    np.testing.assert_allclose(list(losses(two).values()), list(losses(one).values()), atol=1e-5)
    assert latest_step(two) == 2


def hf_base(tmp_path, cache_dir) -> str:
    """A Hugging Face LLaMA directory with its tokenizer.model: a dense quickstart run of 2 steps, written by
    `to_hf`."""
    base, hf_dir = str(tmp_path / "base"), tmp_path / "hf"
    train(tiny(cache_dir, total_steps=2, model=dense_model()), base)
    to_hf(load_model(base), str(hf_dir))
    shutil.copy(os.path.join(base, "tokenizer.model"), hf_dir / "tokenizer.model")
    return str(hf_dir)


@pytest.mark.parametrize("start", ["focal_jax run", "Hugging Face directory"])
def test_two_processes_fit_the_kmeans_centroids_of_one(tmp_path, cache_dir, start):
    """`retrofit.focus.init='kmeans'` in 2 processes: the sharded forward reads the first batch of both and each
    process's k-means sees all of its routing inputs (8 x 64 points a layer, as process 0 reports), so the run
    equals the one-process run (centroids at step 0, losses). From a focal_jax run (`init_from=`, whose stored
    config the experiment reads) and from a Hugging Face directory (`hf=`: a dense base run written by `to_hf`,
    with its tokenizer.model)."""
    if start == "focal_jax run":
        base = str(tmp_path / "base")
        train(tiny(cache_dir, total_steps=2), base)
        start_from = f"init_from={base}"
    else:
        start_from = f"hf={hf_base(tmp_path, cache_dir)}"
    config = load_experiment("focus_retrofit", f"runlocal,{start_from},init=kmeans")
    config.update(batch_size=8, total_steps=2, eval_batches=0)
    config.data.cache_dir = cache_dir
    one = str(tmp_path / "one")
    train(config, one)
    two = str(tmp_path / "two")
    procs = two_processes(two, cache_dir, "--config.total_steps=2",
                          config=f"experiments/focus_retrofit.py:runlocal,{start_from},init=kmeans")
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "in 2 process(es)" in outputs[0] and "k-means centroids from the first batch" in outputs[0]
    assert re.search(r"k-means centroids of Focus layer 1 of \d+: 512 points, mean cosine", outputs[0])
    assert "k-means centroids of Focus layer" not in outputs[1]  # (process 0 logs)
    np.testing.assert_allclose(list(losses(two).values()), list(losses(one).values()), atol=1e-5)
    for a, b in zip(load_model(one).layers, load_model(two).layers):
        np.testing.assert_allclose(a.self_attn.centroids[...], b.self_attn.centroids[...], atol=1e-5)


def test_two_processes_read_only_their_own_shards_of_a_hugging_face_directory(tmp_path, cache_dir):
    """A Focus retrofit of a Hugging Face directory on mesh fsdp 2 x tensor 4, in 2 processes of 4 devices each:
    every parameter is read straight onto the mesh, so process 0, whose devices hold the first half of the fsdp
    axis, reads from disk half of the checkpoint's bytes and the norms, which are replicated; the run equals the
    one-process run on the same mesh. `load_model(..., mesh=)` reads the run's base the same way and
    equals the model loaded on one device."""
    hf_dir = hf_base(tmp_path, cache_dir)
    config = load_experiment("focus_retrofit", f"runlocal,hf={hf_dir}")
    config.update(batch_size=8, total_steps=2, eval_batches=0)
    config.mesh.update(data=1, fsdp=2, tensor=4)
    config.data.cache_dir = cache_dir
    one = str(tmp_path / "one")
    train(config, one)
    two = str(tmp_path / "two")
    procs = two_processes(two, cache_dir, "--config.total_steps=2", "--config.mesh.data=1", "--config.mesh.fsdp=2",
                          "--config.mesh.tensor=4", config=f"experiments/focus_retrofit.py:runlocal,hf={hf_dir}")
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    read = re.search(r"read [\d.,]+ MiB \((\d+)%\) of the [\d.,]+ MiB of tensors in \S+ in [\d.]+ s \(the shards "
                     r"this process's devices hold\)", outputs[0])
    assert read, outputs[0]
    assert 50 <= int(read.group(1)) < 60, read.group(0)
    np.testing.assert_allclose(list(losses(two).values()), list(losses(one).values()), atol=1e-5)
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    placed = load_model(two, mesh=mesh)
    q = placed.layers[0].self_attn.q_proj.kernel[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(placed)),
                 nnx.to_pure_dict(nnx.state(load_model(two))))


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(tmp_path, cache_dir):
    """One host preempted (SIGTERM to one process only): both processes save the same step and stop. Each process
    noted its own SIGTERM at its own step: the signalled one saved and left while the other waited in the next
    train step, and both hung."""
    workdir = str(tmp_path / "run")
    procs = two_processes(workdir, cache_dir, "--config.total_steps=100000", "--config.ckpt_every=100000")
    metrics = os.path.join(workdir, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 2:
            break
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the processes did not stop after one of them got SIGTERM")
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "(SIGTERM); checkpoint saved" in outputs[0]
    step = latest_step(workdir)
    assert step is not None and step >= 2 and max(losses(workdir)) == step


def test_a_run_logs_the_lr_each_step_used_and_evaluates_its_last_step(tmp_path, cache_dir):
    """A train record's lr is the one its step's update used (optax counts updates from 0: step 1 trains at
    schedule(0), which is 0 at the start of the warmup, so step 1 leaves the parameters as they started);
    evaluation runs every eval_every steps and at the last step; a finished run started again trains nothing."""
    config = tiny(cache_dir, total_steps=3, eval_every=2, eval_batches=1, ckpt_every=1)  # warmup: 5 steps
    workdir = str(tmp_path / "run")
    records = train(config, workdir)
    schedule = learning_rate_schedule(check_config(config).optim, config.total_steps)
    assert [r["step"] for r in records] == [1, 2, 3]
    np.testing.assert_allclose([r["lr"] for r in records], [float(schedule(i)) for i in (0, 1, 2)], rtol=1e-6)
    assert records[0]["lr"] == 0.0 < records[1]["lr"]
    start, after_one = init_model(check_config(config)), load_model(workdir, step=1)
    np.testing.assert_array_equal(after_one.layers[1].mlp.up_proj.kernel[...], start.layers[1].mlp.up_proj.kernel[...])
    assert [r["step"] for r in read_metrics(workdir, kind="eval")] == [2, 3]
    assert train(config, workdir) == [] and latest_step(workdir) == 3


def test_tokens_per_s_counts_every_step_since_the_last_record(tmp_path, cache_dir, monkeypatch):
    """tokens_per_s of a record is the tokens of all the steps since the previous record over the time since it
    (log_every=2: two steps' tokens; the last step, logged alone, one), on a fake clock that ticks 1 s per reading."""
    clock = [0.0]

    def perf_counter():
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=perf_counter))
    config = tiny(cache_dir, total_steps=3, log_every=2)
    records = train(config, str(tmp_path / "run"))
    tokens_per_step = config.batch_size * config.data.seq_len
    assert [(r["step"], r["tokens_per_s"]) for r in records] == [(2, 2.0 * tokens_per_step), (3, 1.0 * tokens_per_step)]


# ------------------------------------------------------------------------------------------------ init precedence


def test_retrofit_from_own_workdir_trains_centroids_only(tmp_path, cache_dir):
    base = str(tmp_path / "base")
    train(tiny(cache_dir, total_steps=2), base)
    config = load_experiment("focus_retrofit", f"runlocal,init_from={base}")
    config.update(batch_size=8, total_steps=4, ckpt_every=2)
    retro = str(tmp_path / "retro")
    train(config, retro, stop_after=2)
    train(config, retro)
    _, meta = checkpoint.read_meta(retro)
    assert meta["params_scope"] == "trainable" and meta["init_from"] == base
    saved = checkpoint.saved_param_paths(retro, 4)
    assert sorted(saved) == [f"layers/{i}/self_attn/{n}" for i in (0, 1) for n in ("centroids", "w_g")]
    assert sorted(losses(retro)) == [1, 2, 3, 4]
    # load_model rebuilds the retrofit run: the base run's parameters, unchanged, plus the trained centroids.
    base_params = nnx.to_pure_dict(nnx.state(load_model(base), nnx.Param))
    retro_params = nnx.to_pure_dict(nnx.state(load_model(retro), nnx.Param))
    assert len(param_paths(retro_params)) == len(param_paths(base_params)) + 4
    for path, value in zip(param_paths(base_params), jax.tree.leaves(base_params)):
        np.testing.assert_array_equal(_get(retro_params, path), value, err_msg=path)
    # The base run goes on training: the retrofit run stays on the base step it was trained from (step 2).
    assert meta["init_from_step"] == 2
    train(tiny(cache_dir, total_steps=4), base)
    later = nnx.to_pure_dict(nnx.state(load_model(base), nnx.Param))
    path = "layers/0/mlp/up_proj/kernel"
    assert not np.array_equal(_get(later, path), _get(base_params, path))
    retro_params = nnx.to_pure_dict(nnx.state(load_model(retro), nnx.Param))
    for path, value in zip(param_paths(base_params), jax.tree.leaves(base_params)):
        np.testing.assert_array_equal(_get(retro_params, path), value, err_msg=path)
    train(tiny(cache_dir, total_steps=5, keep_checkpoints=1), base)  # step 2 is deleted
    with pytest.raises(ValueError, match=r"has no checkpoint at step=2 \(the step of init_from that this run started "
                                         r"from;.*\); saved steps: \[5\]"):
        load_model(retro)


def test_a_kmeans_retrofit_fits_its_centroids_on_the_first_batch_and_resumes_exactly(tmp_path, cache_dir, capsys):
    """`retrofit.focus.init='kmeans'` (FOCUS_SPEC OQ-6; `focus_retrofit.py:init=kmeans`): the centroids a run
    starts from (its step-0 checkpoint) are unit rows other than init='random''s, the same in a second fresh run;
    the batch k-means read is still the first one trained on (the data position after 2 steps is 2); a run
    stopped after step 1 and resumed (no second k-means: the checkpoint's centroids) ends with the centroids and
    losses of an uninterrupted one; freezing the centroids is refused."""
    import orbax.checkpoint as ocp

    base = str(tmp_path / "base")
    train(tiny(cache_dir, total_steps=2), base)

    def retrofit_config(init, **overrides):
        config = load_experiment("focus_retrofit", f"runlocal,init_from={base},init={init}")
        config.update({"batch_size": 8, "total_steps": 2, "eval_batches": 0, **overrides})
        return config

    def centroids(workdir):
        model = load_model(workdir)
        return [np.asarray(layer.self_attn.centroids[...]) for layer in model.layers]

    for name, init in (("zero_a", "kmeans"), ("zero_b", "kmeans"), ("zero_random", "random")):
        train(retrofit_config(init, total_steps=0), str(tmp_path / name))
    fitted, again, random = (centroids(str(tmp_path / n)) for n in ("zero_a", "zero_b", "zero_random"))
    for a, b, r in zip(fitted, again, random):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(np.linalg.norm(a, axis=-1), 1.0, atol=1e-5)
        assert not np.allclose(a, r)

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(retrofit_config("kmeans"), straight)
    train(retrofit_config("kmeans"), resumed, stop_after=1)
    assert "k-means centroids from the first batch" in capsys.readouterr().out
    train(retrofit_config("kmeans"), resumed)
    assert "k-means centroids" not in capsys.readouterr().out
    assert losses(straight) == losses(resumed)
    for a, b in zip(centroids(straight), centroids(resumed)):
        np.testing.assert_array_equal(a, b)
    data_state = checkpoint.make_manager(straight, create=False).restore(
        2, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    assert data_state == {"next_index": 2}
    with pytest.raises(ConfigError, match=r"retrofit.focus.init='kmeans' needs the centroids trained "
                                          r"\(optim.trainable\), but layers/0/self_attn/centroids is frozen"):
        config = retrofit_config("kmeans")
        config.optim.trainable_regex = "w_g"
        train(config, str(tmp_path / "frozen"))


def test_a_kmeans_retrofit_fits_on_the_parameters_placed_on_the_mesh(tmp_path, cache_dir, monkeypatch):
    """The k-means forward passes of `retrofit.focus.init='kmeans'` run on the run's placed parameters and global
    batch, not on a copy of the whole model on one device (which a 7B model would not fit): under mesh data 2 x
    fsdp 2 x tensor 2 the q projection k-means reads is split over fsdp and tensor, the batch over data and fsdp.
    The centroids the run starts from equal those of the same run on mesh data 8 (1e-5)."""
    from jax.sharding import PartitionSpec as P

    base = str(tmp_path / "base")
    train(tiny(cache_dir, total_steps=2), base)
    seen, fit = {}, trainer.kmeans_centroids

    def spied(model, batches, **kwargs):
        seen["q_proj"] = model.layers[0].self_attn.q_proj.kernel[...].sharding
        seen["inputs"] = batches[0]["inputs"].sharding
        seen["dtype"] = kwargs["dtype"]  # the forward in the run's compute_dtype
        return fit(model, batches, **kwargs)

    monkeypatch.setattr(trainer, "kmeans_centroids", spied)
    started = {}
    for name, mesh in (("split", {"data": 2, "fsdp": 2, "tensor": 2}), ("data", {"data": 8, "fsdp": 1, "tensor": 1})):
        config = load_experiment("focus_retrofit", f"runlocal,init_from={base},init=kmeans")
        config.update(batch_size=8, total_steps=0, eval_batches=0, mesh=mesh)
        train(config, str(tmp_path / name))
        model = load_model(str(tmp_path / name))
        started[name] = [np.asarray(layer.self_attn.centroids[...]) for layer in model.layers]
        if name == "split":
            assert seen["q_proj"].spec == P("fsdp", "tensor") and len(seen["q_proj"].device_set) == 8
            assert seen["inputs"].spec[0] == ("data", "fsdp") and seen["dtype"] == jnp.float32 == jnp.dtype(
                config.compute_dtype)
    for a, b in zip(started["split"], started["data"]):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_resumed_retrofit_stays_on_its_base_step(tmp_path, cache_dir):
    """A retrofit run resumed after its base run trained on starts again from the base step it was trained from
    (the one its checkpoint records), not from the base's latest: it records that step, and its frozen parameters
    stay those of that step."""
    base = str(tmp_path / "base")
    train(tiny(cache_dir, total_steps=2), base)
    base_params = nnx.to_pure_dict(nnx.state(load_model(base), nnx.Param))
    config = load_experiment("focus_retrofit", f"runlocal,init_from={base}")
    config.update(batch_size=8, total_steps=2, eval_batches=0)
    retro = str(tmp_path / "retro")
    train(config, retro, stop_after=1)
    train(tiny(cache_dir, total_steps=3), base)  # the base goes on: its latest step is 3
    train(config, retro)
    _, meta = checkpoint.read_meta(retro)
    assert (meta["step"], meta["init_from_step"]) == (2, 2)
    retro_params = nnx.to_pure_dict(nnx.state(load_model(retro), nnx.Param))
    for path, value in zip(param_paths(base_params), jax.tree.leaves(base_params)):
        np.testing.assert_array_equal(_get(retro_params, path), value, err_msg=path)


def test_a_relative_init_from_is_kept_as_the_directory_it_named(tmp_path, cache_dir, monkeypatch):
    """A run given `init_from` relative to the directory it started in records that directory (absolute): its model
    loads from any working directory, it resumes with the path written either way, and a resume where the same
    relative path names another directory is refused."""
    monkeypatch.chdir(tmp_path)
    train(tiny(cache_dir, total_steps=1), "base")
    config = load_experiment("focus_retrofit", "runlocal,init_from=base")
    config.update(batch_size=8, total_steps=2, eval_batches=0)
    retro = str(tmp_path / "retro")
    train(config, retro, stop_after=1)
    assert checkpoint.read_meta(retro)[1]["init_from"] == str(tmp_path / "base")
    at_start = nnx.to_pure_dict(nnx.state(load_model(retro), nnx.Param))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    moved = nnx.to_pure_dict(nnx.state(load_model(retro), nnx.Param))  # was: init_from='base' is not a directory
    jax.tree.map(np.testing.assert_array_equal, moved, at_start)
    (tmp_path / "elsewhere" / "base").mkdir()  # 'base' now names another directory
    with pytest.raises(ValueError, match=r"different config.*init_from: '.*/base' \(stored\) vs '.*/elsewhere/base' "
                                         r"\(now\)"):
        train(config, retro)
    monkeypatch.chdir(tmp_path)  # where data.tokenizer ('base/tokenizer.model', relative too) is
    config.init_from = str(tmp_path / "base")
    train(config, retro)
    assert latest_step(retro) == 2


def test_a_run_from_scratch_with_frozen_parameters_saves_them(tmp_path, cache_dir):
    """A run from scratch that trains only some parameters saves the frozen ones too: it resumes exactly, and its
    checkpoints alone rebuild the model."""
    config = tiny(cache_dir, total_steps=2)
    config.optim.trainable_regex = "q_proj"
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(config, straight)
    train(config, resumed, stop_after=1)
    with pytest.MonkeyPatch.context() as patch:  # the frozen parameters come from the checkpoint, not the seed
        build_model = trainer.build_model
        patch.setattr(trainer, "build_model",
                      lambda run, *, seed, **kwargs: build_model(run, seed=seed + 1, **kwargs))
        train(config, resumed)
    assert losses(resumed) == losses(straight) and sorted(losses(straight)) == [1, 2]
    # a run stored before 0.6.9 (trainable parameters only) resumes too
    old = str(tmp_path / "old")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "merge_params", lambda trainable, frozen: trainable)
        train(config, old, stop_after=1)
    saved = set(checkpoint.saved_param_paths(old, 1))
    assert saved == set(checkpoint.read_meta(old)[1]["trainable"]) and all("q_proj" in path for path in saved)
    old_model = nnx.to_pure_dict(nnx.state(load_model(old), nnx.Param))  # frozen ones: the seed's
    resumed_model = nnx.to_pure_dict(nnx.state(load_model(resumed, step=1), nnx.Param))
    for path, value in zip(param_paths(resumed_model), jax.tree.leaves(resumed_model)):
        np.testing.assert_array_equal(_get(old_model, path), value, err_msg=path)
    # and it can be an init_from (it was refused: "missing parameters that are not new"): with its seed's frozen ones
    follow = config.copy_and_resolve_references()
    follow.update(init_from=old, seed=5)
    followed = nnx.to_pure_dict(nnx.state(init_model(check_config(follow)), nnx.Param))
    for path, value in zip(param_paths(old_model), jax.tree.leaves(old_model)):
        np.testing.assert_array_equal(_get(followed, path), value, err_msg=path)
    train(config, old)
    assert losses(old) == losses(straight)
    start = nnx.to_pure_dict(nnx.state(init_model(check_config(config)), nnx.Param))
    trained = nnx.to_pure_dict(nnx.state(load_model(straight), nnx.Param))
    for path, value in zip(param_paths(start), jax.tree.leaves(start)):
        changed = not np.array_equal(_get(trained, path), value)
        assert changed == ("q_proj" in path), path


def test_init_std_may_change_on_resume_unless_frozen_parameters_are_seed_draws(tmp_path, cache_dir):
    """Every checkpoint holds every parameter, so `model.init_std` may change on resume (a Focal paper run started
    before 0.6.22, stored without it, resumes under the experiment's 0.02); a run from scratch stored before 0.6.9
    keeps its frozen parameters as its seed draws them, so there a change is refused."""
    config = tiny(cache_dir, total_steps=2)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(config, straight)
    train(config, resumed, stop_after=1)
    changed = config.copy_and_resolve_references()
    changed.model.init_std = 0.02
    train(changed, resumed)
    assert losses(resumed) == losses(straight) and sorted(losses(straight)) == [1, 2]
    config.optim.trainable_regex = changed.optim.trainable_regex = "q_proj"
    old = str(tmp_path / "old")
    with pytest.MonkeyPatch.context() as patch:  # as before 0.6.9: the trainable parameters only
        patch.setattr(trainer, "merge_params", lambda trainable, frozen: trainable)
        train(config, old, stop_after=1)
    with pytest.raises(ConfigError, match=r"model.init_std=0.02 differs from the stored run's None: that run, "
                                          r"stored before 0.6.9, keeps its frozen parameters as its seed draws"):
        train(changed, old)
    train(config, old)
    assert latest_step(old) == 2


def test_a_bf16_run_keeps_the_learned_temperature_parameters_in_float32(tmp_path, cache_dir, monkeypatch):
    """The trainer passes `routing_param_paths` to its steps: with compute_dtype bfloat16, w_tau and tau_bias reach
    `learned_temperature` in float32 (they were rounded to bf16 with the other weights), the activations in bf16."""
    from focal_jax import attention as fa
    seen = set()
    learned_temperature = fa.learned_temperature
    monkeypatch.setattr(fa, "learned_temperature", lambda x, w, **kw: seen.add(
        (str(x.dtype), str(w.dtype), str(kw["bias"].dtype))) or learned_temperature(x, w, **kw))
    config = tiny(cache_dir, total_steps=1, compute_dtype="bfloat16")
    config.model.attn = {"kind": "focal_learned", "tau_min": 1.8, "tau_max": 3.5}
    train(config, str(tmp_path / "run"))
    assert seen == {("bfloat16", "float32", "float32")}


def test_eval_records_log_the_learned_temperature(tmp_path, cache_dir):
    """FOCAL_SPEC OQ-F4: log per-layer tau and the share of clipped values. At initialisation w_tau = 0 and the
    bias sits at the middle of [tau_min, tau_max], so every real token's tau is that middle and none is clipped;
    `tau_sums` counts the real tokens at either end of the clip."""
    config = tiny(cache_dir, total_steps=0, eval_batches=1)
    config.model.attn = {"kind": "focal_learned", "tau_min": 1.8, "tau_max": 3.5}
    train(config, str(tmp_path / "run"))
    (record,) = read_metrics(str(tmp_path / "run"), kind="eval")
    layers = len(init_model(check_config(config)).layers)
    for name in ["tau"] + [f"tau/layer_{i}" for i in range(layers)]:
        np.testing.assert_allclose(record[name], 2.65, rtol=1e-6, err_msg=name)
    assert record["tau_clipped"] == 0 and f"tau/layer_{layers}" not in record
    attention = check_config(config).model.attention
    tau = jnp.array([[1.8, 2.0, 3.5, 3.5], [1.0, 3.0, 9.0, 2.0]])
    valid = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    sums = trainer.tau_sums([{"x": None}, {"tau": tau, "config": attention}], valid)
    np.testing.assert_allclose(sums, [[1.8 + 2.0 + 3.5 + 1.0 + 3.0 + 9.0 + 2.0, 2, 2, 7]], rtol=1e-6)
    assert trainer.tau_sums([{"g": None}], valid) is None
    per_head = jnp.stack([tau, tau + 0.5], axis=-1)  # tau_granularity='head': [B, T, H], every head counted
    sums = trainer.tau_sums([{"tau": per_head, "config": attention}], valid)
    np.testing.assert_allclose(sums, [[2 * 22.3 + 7 * 0.5, 2 + 1, 2 + 3, 14]], rtol=1e-6)


def test_throughput_leaves_evaluation_out(tmp_path, cache_dir, monkeypatch):
    """tokens_per_s (and mfu) count training time only: an evaluation between two logged steps (here 1000 s of a
    fake clock that otherwise ticks 1 s per reading) used to be charged to the next interval."""
    clock = [0.0]

    def perf_counter():
        clock[0] += 1.0
        return clock[0]

    evaluate = trainer.evaluate

    def slow_evaluate(*args):
        clock[0] += 1000.0
        return evaluate(*args)

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(trainer, "evaluate", slow_evaluate)
    config = tiny(cache_dir, total_steps=3, log_every=1, eval_every=1, eval_batches=1)
    records = train(config, str(tmp_path / "run"))
    tokens_per_step = config.batch_size * config.data.seq_len
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["tokens_per_s"] >= tokens_per_step / 10 for r in records), records


def test_throughput_leaves_checkpoint_saves_out(tmp_path, cache_dir, monkeypatch):
    """tokens_per_s (and mfu) count training time only: a checkpoint save between two logged steps (here 1000 s of
    a fake clock that otherwise ticks 1 s per reading) used to be charged to the next interval."""
    clock = [0.0]

    def perf_counter():
        clock[0] += 1.0
        return clock[0]

    save = checkpoint.save

    def slow_save(*args, **kwargs):
        clock[0] += 1000.0
        return save(*args, **kwargs)

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(checkpoint, "save", slow_save)
    config = tiny(cache_dir, total_steps=3, log_every=1, ckpt_every=1)
    records = train(config, str(tmp_path / "run"))
    tokens_per_step = config.batch_size * config.data.seq_len
    assert [r["step"] for r in records] == [1, 2, 3] and latest_step(str(tmp_path / "run")) == 3
    assert all(r["tokens_per_s"] >= tokens_per_step / 10 for r in records), records


def test_a_changed_schedule_on_resume_is_noted(tmp_path, cache_dir, capsys):
    workdir = str(tmp_path / "run")
    train(tiny(cache_dir, total_steps=2), workdir)
    config = tiny(cache_dir, total_steps=3)
    config.optim.decay_steps = 2  # extended on the stored run's decay: nothing to note
    train(config, workdir)
    assert "schedule changed" not in capsys.readouterr().out
    train(tiny(cache_dir, total_steps=4), workdir)  # the decay now ends at step 4
    out = capsys.readouterr().out
    assert "learning-rate schedule changed on resume (total_steps 3 -> 4, optim.decay_steps 2 -> None)" in out
    assert "--config.optim.decay_steps=2" in out


def _get(tree, path):
    for key in path.split("/"):
        tree = tree[int(key)] if key.isdigit() else tree[key]
    return tree


def test_a_run_builds_its_model_on_the_host_device_then_places_it(tmp_path, cache_dir, monkeypatch):
    """A run reads a Hugging Face directory's tensors straight onto the mesh, and builds the rest of its model (a
    Focus retrofit's new parameters) and casts it on `trainer.host_device()` (the host's CPU on a GPU or TPU
    machine, so that no accelerator need hold the whole model), then places it on the mesh. With the host device
    patched to CPU device 5 of 8, the centroids of the built model and the cast trainable tree (the centroids) live
    there, the base and the cast frozen tree on the mesh's 8 devices, and the losses equal those of the same run
    built on device 0."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf_dir = str(tmp_path / "hf")
    transformers.LlamaForCausalLM(hf_config).save_pretrained(hf_dir, safe_serialization=True)

    def config():
        config = tiny(cache_dir, init_from=hf_dir, total_steps=2, param_dtype="bfloat16")
        config.model = {"family": "hf"}
        config.retrofit.focus = {"groups": 2, "dim": 8, "window": 8}
        config.optim.trainable = "centroids"
        return config

    train(config(), str(tmp_path / "device0"))
    devices, split, cast = [], trainer.split_trainable, trainer.cast_floats
    on = lambda *trees: {device for tree in trees for x in jax.tree.leaves(tree) for device in x.devices()}

    def split_spied(model, optim):
        devices.append((on(nnx.state(model, Centroid)), on(nnx.state(model, nnx.Not(Centroid)))))
        return split(model, optim)

    def cast_spied(tree, dtype, **kwargs):
        result = cast(tree, dtype, **kwargs)
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(result)):  # (not the steps' casts)
            devices.append(on(result))
        return result

    monkeypatch.setattr(trainer, "host_device", lambda: jax.devices()[5])
    monkeypatch.setattr(trainer, "split_trainable", split_spied)
    monkeypatch.setattr(trainer, "cast_floats", cast_spied)
    train(config(), str(tmp_path / "device5"))
    mesh, host = set(jax.devices()), {jax.devices()[5]}
    assert devices == [(host, mesh), host, mesh]  # the built model, the trainable and the frozen trees cast
    assert losses(str(tmp_path / "device5")) == losses(str(tmp_path / "device0"))


def test_a_bfloat16_run_reads_a_hugging_face_directory_as_bfloat16(tmp_path, cache_dir, monkeypatch):
    """With param_dtype='bfloat16' the trainer reads the directory's tensors as bf16, so the host never holds a
    float32 copy of the base (280 GB for Llama-2-70B) before casting it. The run trains exactly as when it read
    float32 and cast, the path before 0.6.26: same losses, with a Focus and a LoRA retrofit."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf_dir = str(tmp_path / "hf")
    transformers.LlamaForCausalLM(hf_config).save_pretrained(hf_dir, safe_serialization=True)
    config = tiny(cache_dir, init_from=hf_dir, total_steps=2, param_dtype="bfloat16")
    config.model = {"family": "hf"}
    config.retrofit.focus = {"groups": 2, "dim": 8, "window": 8}
    config.retrofit.lora = {"rank": 2, "alpha": 4.0, "targets": "qv"}
    config.optim.trainable = "centroids"
    read, from_hf = [], trainer.from_hf

    def spied(directory, *, dtype=jnp.float32, **kwargs):
        model = from_hf(directory, dtype=dtype, **kwargs)
        read.append({x.dtype for x in jax.tree.leaves(nnx.state(model))})
        return model

    monkeypatch.setattr(trainer, "from_hf", spied)
    train(config, str(tmp_path / "bf16"))
    assert read == [{jnp.dtype(jnp.bfloat16)}]
    monkeypatch.setattr(trainer, "from_hf", lambda directory, *, dtype, **kwargs: spied(directory, **kwargs))
    train(config, str(tmp_path / "cast"))
    assert read[1] == {jnp.dtype(jnp.float32)}
    assert losses(str(tmp_path / "bf16")) == losses(str(tmp_path / "cast"))
    # evaluation reads the base as float32 whatever the run's param_dtype (load_model)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(load_model(str(tmp_path / "bf16")), nnx.Param))} == {
        jnp.dtype(jnp.float32)}


def test_init_from_hugging_face_directory(tmp_path, cache_dir):
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf_dir = str(tmp_path / "hf")
    transformers.LlamaForCausalLM(hf_config).save_pretrained(hf_dir, safe_serialization=True)
    config = tiny(cache_dir, init_from=hf_dir, total_steps=2)
    config.model = {"family": "hf", "remat": True}  # (was refused: a loaded model's blocks could not be remat'd)
    config.retrofit.focus = {"groups": 2, "dim": 8, "window": 8}
    config.optim.trainable = "centroids"
    assert init_model(check_config(config)).config.remat
    workdir = str(tmp_path / "run")
    train(config, workdir)
    assert sorted(checkpoint.saved_param_paths(workdir, 2)) == [
        f"layers/{i}/self_attn/{n}" for i in (0, 1) for n in ("centroids", "w_g")]
    assert np.isfinite(list(losses(workdir).values())).all()
    model = load_model(workdir)  # the Hugging Face base plus the trained centroids
    saved = checkpoint.load_params(workdir, 2, *_centroids_and_shardings(model))
    np.testing.assert_array_equal(model.layers[1].self_attn.w_g[...], saved["layers"][1]["self_attn"]["w_g"])
    config.model = {"family": "hf", "remat": "yes"}
    with pytest.raises(ValueError, match="model.remat must be True or False, got 'yes'"):
        check_config(config)


def test_an_unsupported_hugging_face_directory_is_a_config_error(tmp_path, cache_dir):
    """from_hf's ValueError (here an unsupported model_type) reached the CLI as a traceback after the data was built;
    it is a ConfigError naming init_from, which the CLI prints as one line."""
    hf_dir = tmp_path / "neox"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "gpt_neox"}')
    (hf_dir / "model.safetensors").write_bytes(b"")
    config = tiny(cache_dir, init_from=str(hf_dir))
    config.model = {"family": "hf"}
    with pytest.raises(ConfigError, match=re.escape(f"init_from={str(hf_dir)!r}: unsupported model_type='gpt_neox'")):
        init_model(check_config(config))


@pytest.mark.parametrize("config_json, family, message", [  # d: the directory's repr, c: its config.json's
    ('{"model_type": "gpt_neox"}', "hf", "{d}: unsupported model_type='gpt_neox' in {c}"),
    ('["llama"]', "hf", "{d}: {c} holds a JSON array; expected a JSON object"),
    ("{model_type: llama}", "hf", "{d}: {c} is not valid JSON"),
    ('{"model_type": "qwen2", "hidden_size": 8}', "hf",
     "{d}: {c} (model_type 'qwen2') lacks ['vocab_size', 'num_hidden_layers', 'num_attention_heads', "
     "'intermediate_size']"),
    (None, "hf", "{d} is neither a Hugging Face model directory (config.json next to *.safetensors weights) nor a "
                 "focal_jax run (no checkpoint in {checkpoints}): {d} has no config.json"),
    ('{"model_type": "llama"}', "llama", "{d} is a Hugging Face directory: set model.family='hf'"),
])
def test_a_bad_init_from_fails_before_the_data_is_built(tmp_path, cache_dir, config_json, family, message):
    """A Hugging Face `init_from` that from_hf refuses (a bad or missing config.json), or one given to a family
    other than 'hf', was found only when the model was built: after the data, and the tokenizer copied into the
    workdir. `check_run` refuses it, as a ConfigError naming init_from, before anything is written."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    if config_json is not None:
        (hf_dir / "config.json").write_text(config_json)
    (hf_dir / "model.safetensors").write_bytes(b"")
    message = re.escape("init_from=" + message.format(d=repr(str(hf_dir)), c=repr(str(hf_dir / "config.json")),
                                                      checkpoints=hf_dir / "checkpoints"))
    config = tiny(cache_dir, init_from=str(hf_dir))
    if family == "hf":
        config.model = {"family": "hf"}
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=message):
        trainer.check_run(config, str(workdir))
    with pytest.raises(ConfigError, match=message):
        train(config, str(workdir))
    assert not workdir.exists() or not list(workdir.iterdir())  # no tokenizer copy, no metrics, no checkpoint


def test_phase2_after_a_phase1_on_a_hugging_face_directory(tmp_path, cache_dir):
    """The Focus paper's Table 5 protocol on a GPT-2 directory: phase 1 trains centroids on the Hugging Face model,
    phase 2 (`focus_finetune.py:init_from=PHASE1`) starts from phase 1's whole model and trains every weight."""
    import torch
    import transformers

    from focal_jax.convert.hf import from_hf

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=32, n_layer=2, n_head=4)
    hf_dir = str(tmp_path / "gpt2")
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(hf_dir, safe_serialization=True)
    phase1, phase2 = str(tmp_path / "phase1"), str(tmp_path / "phase2")
    config = tiny(cache_dir, init_from=hf_dir, total_steps=2, ckpt_every=1)
    config.model = {"family": "hf"}
    config.retrofit.focus = {"groups": 2, "dim": 8, "window": 8}
    config.optim.trainable = "centroids"
    train(config, phase1)

    config = load_experiment("focus_finetune", f"runlocal,init_from={phase1}")
    assert config.model.to_dict() == {"family": "hf"} and config.init_from == phase1
    config.update(total_steps=2, batch_size=8, eval_batches=0)
    start = init_model(check_config(config))
    base, phase1_model = from_hf(hf_dir), load_model(phase1)
    trained = nnx.to_pure_dict(nnx.state(phase1_model, Centroid))
    np.testing.assert_array_equal(start.h[1].attn.centroids[...], trained["h"][1]["attn"]["centroids"])
    np.testing.assert_array_equal(start.h[0].attn.q_proj.kernel[...], base.h[0].attn.q_proj.kernel[...])
    assert start.h[0].attn.config.kind == "focus"
    train(config, phase2)
    saved = checkpoint.saved_param_paths(phase2, 2)
    assert "h/0/attn/q_proj/kernel" in saved and "h/0/attn/centroids" in saved  # every weight trained
    tokens = jnp.arange(20, dtype=jnp.int32)[None] % 512
    finetuned = load_model(phase2)
    assert not np.allclose(finetuned(tokens), phase1_model(tokens))
    assert not np.array_equal(finetuned.h[0].attn.q_proj.kernel[...], base.h[0].attn.q_proj.kernel[...])
    assert len(saved) == len(param_paths(nnx.state(finetuned, nnx.Param)))

    with pytest.raises(ValueError, match="start from it with model.family='hf' and init_from="):
        init_model(check_config(tiny(cache_dir, init_from=phase1)))  # a LLaMA-family run cannot start from it

    # Intermediate checkpoints: step 1 of phase 1 has other centroids than step 2; a missing step names the saved.
    early = nnx.to_pure_dict(nnx.state(load_model(phase1, step=1), Centroid))
    assert not np.array_equal(early["h"][0]["attn"]["centroids"], trained["h"][0]["attn"]["centroids"])
    with pytest.raises(ValueError, match=r"no checkpoint at step=7; saved steps: \[1, 2\]"):
        load_model(phase1, step=7)


def _centroids_and_shardings(model):
    centroids = nnx.to_pure_dict(nnx.state(model, Centroid))
    return centroids, jax.tree.map(lambda x: x.sharding, centroids)


def test_golden_trainable_parameters(tmp_path, cache_dir):
    """Which parameters each experiment trains (tests/golden_trainable.json); a change here is deliberate."""
    golden = json.load(open(GOLDEN))
    base, dense = str(tmp_path / "base"), str(tmp_path / "dense")
    train(tiny(cache_dir, total_steps=1), base)
    train(tiny(cache_dir, total_steps=1, model=dense_model()), dense)
    for name, arg in experiment_args(base, dense).items():
        config = load_experiment(name, arg)
        config.data.cache_dir = cache_dir
        run = check_config(config)
        model = Llama(run.model, rngs=nnx.Rngs(0))
        from focal_jax.nn.retrofit import retrofit

        for change in run.retrofit:
            model = retrofit(model, change)
        assert param_paths(split_trainable(model, run.optim)[1]) == golden[name], name


# ------------------------------------------------------------------------------------------------ bad input


def assert_fails_cleanly(config, workdir, match, error=ValueError):
    with pytest.raises(error, match=match):
        train(config, workdir)
    assert latest_step(workdir) is None


def test_bad_input_fails_before_any_checkpoint(tmp_path, cache_dir):
    config = tiny(cache_dir)
    config.data.update(source="text", paths=(str(tmp_path / "missing" / "*.txt"),))
    assert_fails_cleanly(config, str(tmp_path / "a"), "data.paths: no file matches the pattern .*missing/\\*.txt")

    config = tiny(cache_dir)
    config.optim.lr_peak = 1.0
    assert_fails_cleanly(config, str(tmp_path / "c"), "unknown config key optim.lr_peak")

    config = tiny(cache_dir)  # its source is 'builtin': the files would be ignored (it trained on the builtin corpus)
    config.data.paths = (str(tmp_path / "corpus" / "*.jsonl"),)
    assert_fails_cleanly(config, str(tmp_path / "b"), re.escape(
        f"data.paths=['{tmp_path}/corpus/*.jsonl'] names files, but data.source='builtin' reads none: set "
        f"data.source to the files' format (text, jsonl, parquet, array_record)"))

    workdir = str(tmp_path / "d")
    train(tiny(cache_dir, total_steps=1), workdir)
    with pytest.raises(ValueError, match="different config.*seed: 0 \\(stored\\) vs 1 \\(now\\)"):
        train(tiny(cache_dir, total_steps=1, seed=1), workdir)
    assert latest_step(workdir) == 1

    (tmp_path / "small.txt").write_text("a few words only. " * 20)
    config = tiny(cache_dir)
    config.data.update(source="text", paths=(str(tmp_path / "small.txt"),), eval_fraction=0.0,
                       tokenizer=os.path.join(workdir, "tokenizer.model"))
    assert_fails_cleanly(config, str(tmp_path / "b"), "global batch|global_batch")

    with pytest.raises(ValueError, match=r"holds a checkpoint at step 1, past total_steps=0"):
        train(tiny(cache_dir, total_steps=0), workdir)
    assert_fails_cleanly(tiny(cache_dir, balance_weight=0.1), str(tmp_path / "f"),
                         r"balance_weight=0.1 balances Focus groups, but the model's attention kind is \['focal'\]")
    with pytest.raises(ValueError, match="workdir='gs://bucket/run' is a URL"):
        train(tiny(cache_dir), "gs://bucket/run")
    assert not os.path.exists("gs:")

    tied = tiny(cache_dir, total_steps=1)
    tied.model.tie_embeddings = True
    tied_dir = str(tmp_path / "tied")
    train(tied, tied_dir)
    assert_fails_cleanly(tiny(cache_dir, init_from=tied_dir), str(tmp_path / "e"),
                         "missing parameters that are not new in this config: \\['lm_head/kernel'\\]")
    wider = tiny(cache_dir, init_from=tied_dir)
    wider.model.update(tie_embeddings=True, intermediate=96)
    assert_fails_cleanly(wider, str(tmp_path / "g"), re.escape(
        f"init_from={tied_dir!r} has parameters of the wrong shape: ['layers/0/mlp/down_proj/kernel: checkpoint "))

    small_vocab = tiny(cache_dir)
    small_vocab.model.vocab_size = 256
    assert_fails_cleanly(small_vocab, str(tmp_path / "h"),
                         "model vocab_size=256 is smaller than the tokenizer's 512: set model.vocab_size")


# ------------------------------------------------------------------------------------------------ experiments


EXPERIMENTS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "experiments", "*.py")))


def experiment_args(base_workdir: str, dense_workdir: str = "DENSE") -> dict:
    """The runlocal argument of every experiment file (a new experiment must be added here); focal_adapt starts
    from a baseline (`dense_workdir`, attention kind 'dense')."""
    return {"quickstart": "runlocal", "focus_retrofit": f"runlocal,init_from={base_workdir}",
            "focus_sparse": "runlocal", "focal_scaling": "runlocal",
            "focal_token_scaling": "runlocal,variant=baseline",
            "focal_temperature_ablation": "runlocal,learned,tau_min=3",
            "focal_adapt": f"runlocal,init_from={dense_workdir}",
            "focal_long_context": f"runlocal,init_from={base_workdir}",
            "focus_finetune": f"runlocal,init_from={base_workdir},attn=dense", "focus_scratch": "runlocal",
            "focus_window_baseline": f"runlocal,init_from={base_workdir}",
            "lora_baseline": f"runlocal,init_from={base_workdir}"}


def test_every_experiment_has_a_runlocal_argument():
    assert EXPERIMENTS == sorted(experiment_args("BASE")), "a new experiment needs its argument in experiment_args"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_runs_two_steps(name, runs, tmp_path, cache_dir):
    """Two training steps of the experiment's runlocal config; no evaluation (the same code for every model)."""
    args = experiment_args(runs["base"], runs["dense"])[name]
    config = load_experiment(name, args)
    config.data.cache_dir = cache_dir
    config.update(total_steps=2, batch_size=8, eval_batches=0)
    train(config, str(tmp_path))
    assert sorted(losses(str(tmp_path))) == [1, 2]
    assert load_experiment(name, args.replace("runlocal", "")).total_steps > 100


@pytest.mark.parametrize("attn", ["focus", "focal+focus"])
def test_the_quickstart_trains_focus_from_scratch(attn, tmp_path, cache_dir):
    """`quickstart.py:runlocal,model=tiny,attn=focus` (DESIGN.md's example argument): Focus in every layer with
    causal routing and a window the 64-token sequences reach past; two steps train the routing with the rest."""
    config = load_experiment("quickstart", f"runlocal,model=tiny,attn={attn}")
    config.data.cache_dir = cache_dir
    config.update(total_steps=2, batch_size=8, eval_batches=0)
    train(config, str(tmp_path))
    model = load_model(str(tmp_path))
    attention = {layer.config for layer in trainer.attention_layers(model)}
    assert {(a.kind, a.focus_causal, a.focus_window, a.focal_t) for a in attention} == {(attn, True, 16, 0.4)}
    drawn = trainer.build_model(check_config(config), seed=config.seed)
    trained, initial = (nnx.to_pure_dict(nnx.state(m, Centroid)) for m in (model, drawn))
    assert not any(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(initial)))


# ------------------------------------------------------------------------------------------------ paper sweeps

# The papers' numbers, written out here rather than read from configs/common.py or focal_jax.nn.llama.
FOCAL_TABLE_3 = {  # size: (hidden, intermediate, heads, layers)
    "400M": (1024, 3072, 8, 24), "777M": (1536, 4096, 12, 24), "1.3B": (2048, 5504, 16, 24),
    "2.7B": (2560, 6912, 20, 32), "6.7B": (4096, 11008, 32, 32), "9.5B": (4608, 12288, 36, 36)}
FOCAL_TABLE_4_LR = {"400M": 4e-3, "777M": 2e-3, "1.3B": 1e-3, "2.7B": 5e-4, "6.7B": 4e-4, "9.5B": 4e-4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """Run directories the launch lines and the experiments' two steps start from: a tiny base run (Focal), the same
    with dense attention (the Focal paper's baselines), a Focus phase-1 run on the first (K = 8, 3 steps, so that
    its centroids moved), and a stand-in Hugging Face directory (config files only: nothing loads it)."""
    root = tmp_path_factory.mktemp("runs")
    base, phase1, hf = str(root / "base"), str(root / "focus_retrofit"), root / "hf"
    train(tiny(cache_dir, total_steps=1), base)
    train(tiny(cache_dir, total_steps=1, model=dense_model()), str(root / "dense"))
    config = load_experiment("focus_retrofit", f"runlocal,init_from={base},groups=8")
    config.update(total_steps=3, batch_size=8, eval_batches=0)
    train(config, phase1)
    hf.mkdir()
    for name in ("config.json", "tokenizer.model"):
        (hf / name).write_text("")
    return {"base": base, "dense": str(root / "dense"), "phase1": phase1, "hf": str(hf)}


def docstring_blocks(name: str) -> list[str]:
    """The shell blocks of an experiment's docstring: runs of lines indented by 2+ spaces after a blank line."""
    with open(os.path.join(ROOT, "experiments", f"{name}.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read()), clean=False)
    blocks, block, blank = [], None, True
    for line in doc.splitlines() + [""]:
        if line.startswith("  ") and (block is not None or blank):
            block = (block or []) + [line]
        elif block is not None:
            blocks.append("\n".join(block))
            block = None
        blank = not line.strip()
    return blocks


def launch_commands(name: str) -> list[list[str]]:
    """The arguments of every `python ...` command in the docstring's shell blocks, as bash expands them (loops,
    variables, quotes), with `python` replaced by a function that prints its arguments and nothing else on PATH."""
    script = "python() { printf '%s\\0' \"$@\"; printf '\\n\\0'; }\nset -e\n" + "\n".join(docstring_blocks(name))
    result = subprocess.run([shutil.which("bash"), "-c", script], env={"PATH": "/nonexistent"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{name}: its docstring's shell blocks fail: {result.stderr}"
    commands, current = [], []
    for token in result.stdout.split("\0")[:-1]:
        if token == "\n":
            commands.append(current)
            current = []
        else:
            current.append(token)
    return commands


def check_eval_command(name: str, args: list[str]):
    """`python -m focal_jax.eval.MODULE ...` names an evaluation module and only options its parser defines."""
    module = args[1] if args[:1] == ["-m"] else ""
    path = os.path.join(ROOT, *module.split(".")) + ".py"
    assert module.startswith("focal_jax.eval.") and os.path.isfile(path), f"{name}: unknown command {args}"
    with open(path) as f:
        options = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", f.read()))
    used = {a for a in args[2:] if a.startswith("--")}
    assert "--workdir" in used and used <= options, f"{name}: {args} uses options outside {sorted(options)}"


def parse_train_command(name: str, args: list[str]) -> tuple[str, str, dict]:
    """(experiment, its argument, {--config.KEY: value}) of `python -m focal_jax.train ...` arguments."""
    assert args[:2] == ["-m", "focal_jax.train"], f"{name}: unexpected command python {' '.join(args)}"
    flags, overrides, rest = {}, {}, args[2:]
    while rest:
        flag = rest.pop(0)
        if flag.startswith("--config."):
            key, _, value = flag[len("--config."):].partition("=")
            overrides[key] = value
        else:
            assert flag in ("--config", "--workdir") and rest, f"{name}: bad train flag {flag!r} in {args}"
            flags[flag] = rest.pop(0)
    assert set(flags) == {"--config", "--workdir"}, f"{name}: {args} lacks --config or --workdir"
    match = re.fullmatch(r"experiments/(\w+)\.py(?::(.*))?", flags["--config"])
    assert match, f"{name}: --config {flags['--config']!r} is not experiments/NAME.py:ARG"
    return match.group(1), match.group(2) or "", overrides


def local_arg(arg: str, runs: dict) -> str:
    """`arg` with the run directories of the launch lines replaced by local ones (a focus_retrofit run by the
    phase-1 run, a baseline by the dense base run, any other workdir by the base run, a Hugging Face directory by
    the stand-in)."""
    items = []
    for item in filter(None, arg.split(",")):
        key, _, value = item.partition("=")
        if key == "init_from":
            value = (runs["phase1"] if "focus_retrofit" in value else runs["dense"] if "baseline" in value
                     else runs["base"])
        elif key == "hf":
            value = runs["hf"]
        items.append(f"{key}={value}" if _ else key)
    return ",".join(items)


def override(config, key: str, value: str):
    """Apply `--config.KEY=VALUE` as ml_collections does for an existing key (same type)."""
    *parents, last = key.split(".")
    section = config
    for parent in parents:
        section = section[parent]
    assert last in section, f"--config.{key} names no config key"
    section[last] = type(section[last])(value)


def arg_dict(arg: str) -> dict:
    return {k: (v if _ else True) for k, _, v in (item.partition("=") for item in filter(None, arg.split(",")))}


def check_focal_model(run, size, *, norm_eps=1e-5):
    hidden, intermediate, heads, layers = FOCAL_TABLE_3[size]
    m = run.model
    assert (m.d_model, m.intermediate, m.n_heads, m.n_layers) == (hidden, intermediate, heads, layers), size
    assert (m.vocab_size, m.attention.head_dim, m.n_kv_heads, m.tie_embeddings) == (32000, 128, heads, False)
    assert (m.norm_eps, m.init_std) == (norm_eps, 0.02)  # FOCAL_SPEC section 2's choices where the paper is silent
    o = run.optim
    assert (o.b1, o.b2, o.weight_decay, o.clip, run.data.vocab_size) == (0.9, 0.95, 0.05, 1.0, 32000)


def check_variant(run, variant):
    a = run.model.attention
    expected = {"baseline": ("dense", None, None), "focal": ("focal", 0.4, None),
                "learned": ("focal_learned", None, (5.0, 10.0))}[variant]
    assert a.kind == expected[0], (variant, a.kind)
    assert expected[1] is None or a.focal_t == expected[1]
    assert expected[2] is None or (a.tau_min, a.tau_max) == expected[2]


def check_focal_scaling(built):
    grid = set()
    for args, _, run in built:
        size, variant, seq_len = args["size"], args["variant"], int(args.get("seq_len", 2048))
        check_focal_model(run, size)
        check_variant(run, variant)
        assert run.batch_size * run.data.seq_len == 262_144 and run.data.seq_len == seq_len  # 0.26M tokens
        assert (run.optim.lr, run.total_steps, run.optim.warmup_steps, run.optim.final_lr_fraction) == (
            FOCAL_TABLE_4_LR[size], 100_000, 2000, 0.1)
        assert run.model.rope_theta == 10_000
        grid.add((size, seq_len, variant))
    variants = ("baseline", "focal", "learned")
    figure_2 = {(size, 2048, v) for size in FOCAL_TABLE_3 for v in variants}
    figure_4 = {(size, n, v) for size in ("777M", "1.3B", "2.7B") for n in (2048, 4096, 8192) for v in variants}
    assert grid >= figure_2 | figure_4, sorted((figure_2 | figure_4) - grid)


def check_focal_token_scaling(built):
    for args, _, run in built:
        check_focal_model(run, "2.7B")
        check_variant(run, args["variant"])
        assert (run.batch_size, run.data.seq_len, run.optim.lr, run.total_steps) == (1024, 2048, 5e-4, 150_000)
        assert abs(run.total_steps * run.batch_size * run.data.seq_len / 315e9 - 1) < 0.01  # 2.1M x 150K
        assert run.keep_checkpoints * run.ckpt_every >= run.total_steps  # every intermediate checkpoint kept
    assert {args["variant"] for args, _, _ in built} == {"baseline", "focal", "learned"}


def check_focal_temperature_ablation(built):
    constant, learned = set(), set()
    for args, _, run in built:
        check_focal_model(run, "2.7B")
        assert (run.batch_size * run.data.seq_len, run.total_steps, run.optim.lr) == (262_144, 100_000, 5e-4)
        a = run.model.attention
        if args.get("learned"):
            tau = (float(args.get("tau_min", 5)), float(args.get("tau_max", 10)))
            assert (a.kind, a.tau_min, a.tau_max) == ("focal_learned", *tau)
            learned.add(tau)
        else:
            t = float(args["t"])
            assert (a.kind == "dense") if t == 1.0 else ((a.kind, a.focal_t) == ("focal", t)), (t, a)
            constant.add(t)
    assert constant == {0.3, 0.4, 0.5, 0.6, 1.0}
    assert learned == {(m, 10.0) for m in range(1, 8)} | {(5.0, 11.31)}
    # The docstring says t = 0.4 is focal_scaling's 2.7B focal run: the same config.
    assert checkpoint.config_json(load_experiment("focal_temperature_ablation", "t=0.4")) == checkpoint.config_json(
        load_experiment("focal_scaling", "size=2.7B,variant=focal"))


def check_focal_adapt(built):
    for args, _, run in built:
        check_focal_model(run, "2.7B", norm_eps=1e-6)  # the base run's (the local base runs have 1e-6)
        assert run.init_from and run.optim.trainable == "all"
        assert (run.optim.lr, run.total_steps, run.batch_size * run.data.seq_len) == (5e-5, 5000, 262_144)
        assert (run.optim.warmup_steps, run.optim.final_lr_fraction) == (100, 1.0)
        t, a = float(args["t"]), run.model.attention
        assert (a.kind == "dense") if t == 1.0 else ((a.kind, a.focal_t) == ("focal", t)), (t, a)
    assert {float(args["t"]) for args, _, _ in built} == {0.4, 1.0}


def check_focal_long_context(built):
    for args, _, run in built:
        check_focal_model(run, "2.7B", norm_eps=1e-6)  # the base run's (the local base runs have 1e-6)
        check_variant(run, args["variant"])
        assert run.init_from and (run.data.seq_len, run.batch_size, run.model.rope_theta) == (32768, 64, 500_000)
        assert abs(run.total_steps * run.batch_size * run.data.seq_len / 5e9 - 1) < 0.01  # 5B tokens
    assert {args["variant"] for args, _, _ in built} == {"baseline", "focal"}


def check_focus_retrofit(built):
    settings = set()
    for args, _, run in built:
        (focus,) = run.retrofit
        expected = (int(args.get("groups", 4)), int(args.get("dim", 16)), int(args.get("window", 128)),
                    float(args.get("tau", 0.1)), int(args.get("iters", 10)), args.get("gate", "paper"))
        assert (focus.groups, focus.dim, focus.window, focus.tau, focus.iters, focus.gate) == expected
        assert (run.optim.trainable, run.optim.lr, run.data.seq_len) == ("centroids", 1e-3, 1024)
        assert run.total_steps == int(args.get("steps", 4000))
        settings.add(expected[:5])
    paper = ({(4, d, 128, 0.1, 10) for d in (16, 32, 128, 768)} | {(k, 16, 128, 0.1, 10) for k in (4, 8, 16, 32)}
             | {(8, 16, w, 0.1, 10) for w in (64, 128, 256, 512)} | {(8, 16, 128, t, 10) for t in (0.05, 0.1, 0.2, 0.5)}
             | {(8, 16, 128, 0.1, n) for n in (3, 5, 10, 20)} | {(2, 16, w, 0.1, 10) for w in (16, 128, 512)})
    assert settings >= paper, sorted(paper - settings)


def check_focus_finetune(built):
    for args, _, run in built:
        assert (run.optim.trainable, run.optim.lr, run.total_steps, run.data.seq_len) == ("all", 5e-5, 4000, 1024)
        if args.get("attn", "focus") == "focus":  # phase 2 of the local phase-1 run (K = 8 on a Focal base)
            assert (run.model.attention.kind, run.model.attention.focus_groups) == ("focal+focus", 8)
        else:
            assert run.model is None or run.model.attention.kind == "focal"  # the base run's own
    assert {args.get("attn", "focus") for args, _, _ in built} == {"focus", "dense"}


def check_focus_scratch(built):
    for args, _, run in built:
        m = run.model
        if args.get("size", "mistral-7b") == "mistral-7b":
            assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.intermediate, m.vocab_size) == (
                4096, 32, 32, 8, 14336, 32000)
        assert abs(run.total_steps * run.batch_size * run.data.seq_len / 2e9 - 1) < 0.01  # 2B tokens
        assert run.optim.trainable == "all"
        if args["attn"] == "focus":
            assert (m.attention.kind, m.attention.focus_groups, m.attention.focus_window) == ("focus", 4, 128)
        else:
            assert m.attention.kind == "dense"
    assert {args["attn"] for args, _, _ in built} == {"focus", "dense"}


def check_focus_window_baseline(built):
    from focal_jax.nn.retrofit import WindowConfig

    for args, _, run in built:
        window = int(args.get("window", 128))
        if run.family == "hf":  # the architecture comes from the directory: the window goes on the loaded model
            assert run.retrofit == (WindowConfig(window),), run.retrofit
        else:
            assert run.model.attention.window == window and run.retrofit == ()
        steps = 0 if args.get("--config.total_steps") == "0" else 4000  # 0: Table 1's zero-shot row
        assert (run.optim.trainable, run.optim.lr, run.total_steps, run.data.seq_len) == ("all", 5e-5, steps, 1024)
    assert {"hf" in args for args, _, _ in built} == {True, False}  # a LLaMA-family base and GPT-2 directories
    assert any(run.total_steps == 0 and "hf" in args for args, _, run in built)


def check_lora_baseline(built):
    """Table 3's ranks on GPT-2 / PG-19 and Table 4's LRs on Mistral-7B-Instruct (2000 steps), read from the corpus
    (the lines had no data= argument: the builtin corpus)."""
    settings = set()
    for args, _, run in built:
        (lora,) = run.retrofit
        assert (run.optim.trainable, run.data.seq_len, lora.alpha) == ("lora", 1024, 2.0 * lora.rank)
        assert (run.optim.lr, run.total_steps) == (float(args.get("lr", 1e-4)), int(args.get("steps", 4000)))
        if args.get("hf"):
            assert args.get("data") == "/data/pg19/train/*.txt", args
            settings.add((os.path.basename(args["hf"]), lora.rank, run.optim.lr, run.total_steps))
    assert settings == {("gpt2", 4, 1e-4, 4000), ("gpt2", 16, 1e-4, 4000)} | {
        ("Mistral-7B-Instruct-v0.2", 4, lr, 2000) for lr in (1e-5, 5e-5, 1e-4)}


PAPER_CHECKS = {"focal_scaling": check_focal_scaling, "focal_token_scaling": check_focal_token_scaling,
                "focal_temperature_ablation": check_focal_temperature_ablation, "focal_adapt": check_focal_adapt,
                "focal_long_context": check_focal_long_context, "focus_retrofit": check_focus_retrofit,
                "focus_finetune": check_focus_finetune, "focus_scratch": check_focus_scratch,
                "focus_window_baseline": check_focus_window_baseline, "lora_baseline": check_lora_baseline}


def test_docstring_launch_lines_build_the_papers_configs(runs):
    """Every `python -m focal_jax.train` line of every experiment docstring (loops expanded by bash) builds a
    config that passes check_config; the paper experiments' numbers and sweep grids are checked against the specs."""
    built = {}
    for name in EXPERIMENTS:
        commands = launch_commands(name)
        for args in commands:
            if args[:2] != ["-m", "focal_jax.train"]:
                check_eval_command(name, args)
                continue
            experiment, arg, overrides = parse_train_command(name, args)
            config = load_experiment(experiment, local_arg(arg, runs))
            for key, value in overrides.items():
                override(config, key, value)
            run = check_config(config)
            if arg_dict(arg).get("data"):  # the papers' corpora are streamed
                assert run.data.streaming and run.data.paths == (arg_dict(arg)["data"],), (name, arg)
            overridden = {f"--config.{k}": v for k, v in overrides.items()}
            built.setdefault(experiment, []).append(({**arg_dict(arg), **overridden}, config, run))
        assert any(parse_train_command(name, a)[0] == name for a in commands if "focal_jax.train" in a), (
            f"{name}: its docstring has no launch line of its own")
    eval_lines = [a for a in launch_commands("focal_long_context") if "focal_jax.eval.perplexity" in a]  # 64K
    assert any(a[a.index("--seq-len") + 1] == "65536" and "--rope-ntk-factor" in a
               for a in eval_lines if "--seq-len" in a)
    for name, check in PAPER_CHECKS.items():
        check(built[name])


def test_focus_sparse_from_a_soft_gate_focus_run_is_that_model_made_hard(tmp_path, cache_dir, runs):
    """focus_sparse's init_from was loaded into its own model (the 400M, K = 8, causal routing): a K = 4 run of
    focus_scratch failed on the centroids' shapes, and one of K = 8 would be routed causally after training
    non-causally. It is now that run's model with hard top-k routing through the kernels; a run of another
    attention kind is refused by name."""
    soft = str(tmp_path / "soft")
    config = load_experiment("focus_scratch", "runlocal")
    config.data.cache_dir = cache_dir
    config.update(total_steps=1, batch_size=8, eval_batches=0)
    train(config, soft)
    hard = load_experiment("focus_sparse", f"runlocal,init_from={soft}")
    hard.update(total_steps=1, batch_size=8, eval_batches=0)
    routing = check_config(config).model.attention
    attention = check_config(hard).model.attention
    assert (attention.kind, attention.impl, attention.focus_topk) == ("focus", "pallas", 1)
    assert (attention.focus_groups, attention.focus_causal) == (4, False)
    assert dataclasses.replace(attention, impl=routing.impl, focus_topk=None) == routing
    train(hard, str(tmp_path / "hard"))
    assert np.isfinite(losses(str(tmp_path / "hard"))[1])
    with pytest.raises(ValueError, match=r"kind='dense', but focus_sparse \(routing by a soft-gate Focus run's "
                                         r"centroids\) starts from a LLaMA run with kind in "
                                         r"\('focus', 'focal\+focus'\)"):
        load_experiment("focus_sparse", f"init_from={runs['dense']}")


def test_misspelt_experiment_argument_names_the_known_ones():
    for name in EXPERIMENTS:
        with pytest.raises(ValueError, match="unknown config argument 'sise'; known: ") as error:
            load_experiment(name, "runlocal,sise=400M")
        known = re.findall(r"'(\w+)'", str(error.value).split("known: ")[1])
        with open(os.path.join(ROOT, "experiments", f"{name}.py")) as f:
            documented = ast.get_docstring(ast.parse(f.read())).split("Arguments:")[1]
        assert "runlocal" in known and all(re.search(rf"\b{k}\b", documented) for k in known), (name, known)


def test_focus_finetune_starts_from_phase_one(runs):
    """Phase 2 builds the phase-1 model (its Focus settings, its trained centroids, its base weights) and trains
    every parameter; the full-attention control and phase 2 refuse the other kind of run."""
    run = check_config(load_experiment("focus_finetune", f"runlocal,init_from={runs['phase1']}"))
    phase2 = init_model(run)
    phase1 = load_model(runs["phase1"])
    assert phase2.layers[0].self_attn.config == phase1.layers[0].self_attn.config
    phase1_params = nnx.to_pure_dict(nnx.state(phase1, nnx.Param))
    phase2_params = nnx.to_pure_dict(nnx.state(phase2, nnx.Param))
    assert param_paths(phase2_params) == param_paths(phase1_params)
    for path, value in zip(param_paths(phase1_params), jax.tree.leaves(phase1_params)):
        np.testing.assert_array_equal(_get(phase2_params, path), value, err_msg=path)
    # The centroids phase 1 trained are not the ones a fresh retrofit draws (else the check above proves nothing).
    fresh = init_model(check_config(load_experiment("focus_retrofit", f"runlocal,init_from={runs['base']},groups=8")))
    assert not np.array_equal(fresh.layers[0].self_attn.w_g[...], phase1.layers[0].self_attn.w_g[...])
    assert param_paths(split_trainable(phase2, run.optim)[1]) == param_paths(phase2_params)
    with pytest.raises(ValueError, match="is a Focus retrofit run"):
        load_experiment("focus_finetune", f"runlocal,init_from={runs['phase1']},attn=dense")
    with pytest.raises(ValueError, match="attn=focus starts from a phase-1 run"):
        load_experiment("focus_finetune", f"runlocal,init_from={runs['base']}")


def test_with_absolute_paths_resolves_only_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {"seed": 0, "init_from": "base", "data": {"paths": "a/*.txt, /abs/b.txt,", "eval_paths": [],
                                                       "tokenizer": "~/t.model", "source": "text"}}
    assert checkpoint.with_absolute_paths(config) == {
        "seed": 0, "init_from": f"{tmp_path}/base", "data": {
            "paths": [f"{tmp_path}/a/*.txt", "/abs/b.txt"], "eval_paths": [],
            "tokenizer": os.path.expanduser("~/t.model"), "source": "text"}}
    assert config["data"]["paths"] == "a/*.txt, /abs/b.txt,"  # the argument is left as it was
    assert checkpoint.with_absolute_paths({"seed": 0, "data": {"tokenizer": None}}) == {"seed": 0,
                                                                                         "data": {"tokenizer": None}}


def test_relative_data_paths_are_kept_as_the_files_they_named(tmp_path, cache_dir, monkeypatch):
    """A run given `data.paths` and `data.eval_paths` relative to the directory it started in records them
    absolute: its held-out batches load from any working directory, and a resume where the same relative patterns
    name other files is refused by name."""
    from focal_jax.data import DataConfig, read_documents
    from focal_jax.eval.diagnostics import load_run

    documents = read_documents(DataConfig(source="builtin", cache_dir=cache_dir))
    (tmp_path / "corpus").mkdir()
    for name, part in (("train.jsonl", documents[:-20]), ("eval.jsonl", documents[-20:])):
        (tmp_path / "corpus" / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    monkeypatch.chdir(tmp_path)
    config = tiny(cache_dir, total_steps=2)
    config.data.update(source="jsonl", paths=("corpus/train.jsonl",), eval_paths=("corpus/eval.jsonl",))
    workdir = str(tmp_path / "run")
    train(config, workdir, stop_after=1)
    stored = checkpoint.read_meta(workdir)[1]["config"]["data"]
    assert (stored["paths"], stored["eval_paths"]) == ([str(tmp_path / "corpus/train.jsonl")],
                                                       [str(tmp_path / "corpus/eval.jsonl")])
    here = load_run(workdir, n_batches=1).batches
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    moved = load_run(workdir, n_batches=1).batches  # was: no file matches the pattern 'corpus/eval.jsonl'
    jax.tree.map(np.testing.assert_array_equal, moved, here)
    shutil.copytree(tmp_path / "corpus", tmp_path / "elsewhere" / "corpus")  # the same patterns, other files
    with pytest.raises(ValueError, match=r"different config.*data.paths: \['.*/corpus/train.jsonl'\] \(stored\) vs "
                                         r"\['.*/elsewhere/corpus/train.jsonl'\] \(now\)"):
        train(config, workdir)
    monkeypatch.chdir(tmp_path)
    train(config, workdir)
    assert latest_step(workdir) == 2


def _rewrite_params(workdir, edit):
    """Rewrite the latest checkpoint's saved parameters of `workdir` as `edit(params)` (a nested dict) leaves them:
    a damaged or partly copied checkpoint."""
    import orbax.checkpoint as ocp

    path = os.path.join(checkpoint.checkpoint_dir(workdir), str(latest_step(workdir)), "params")
    checkpointer = ocp.StandardCheckpointer()
    params = checkpointer.restore(path)
    edit(params)
    shutil.rmtree(path)
    checkpointer.save(path, params)
    checkpointer.wait_until_finished()


def test_a_damaged_checkpoint_is_refused_by_name_when_loaded_and_when_resumed(tmp_path, cache_dir):
    """A checkpoint whose q_proj was deleted: `load_model` (every evaluator) used to load it silently with that
    parameter at its random initial value, and a resume failed with orbax's traceback naming no parameter; one of
    the wrong shape, resumed, named no parameter either. Each is now a ConfigError naming the parameter (and both
    shapes)."""
    trained = str(tmp_path / "run")
    train(tiny(cache_dir, total_steps=1), trained)
    q_proj = "layers/0/self_attn/q_proj/kernel"
    missing, misshapen = str(tmp_path / "missing"), str(tmp_path / "misshapen")
    shutil.copytree(trained, missing)
    _rewrite_params(missing, lambda params: params["layers"]["0"]["self_attn"].pop("q_proj"))
    shutil.copytree(trained, misshapen)
    kernel = np.shape(load_model(trained).layers[0].self_attn.q_proj.kernel)

    def halve(params):
        attention = params["layers"]["0"]["self_attn"]
        attention["q_proj"]["kernel"] = attention["q_proj"]["kernel"][:, : kernel[1] // 2]

    _rewrite_params(misshapen, halve)
    with pytest.raises(ConfigError, match=re.escape(f"in {missing!r} is missing parameters its run saved: "
                                                    f"['{q_proj}']")):
        load_model(missing)
    with pytest.raises(ConfigError, match=re.escape(f"cannot resume from the checkpoint of step 1 in {missing!r}: "
                                                    f"parameters missing: ['{q_proj}']")):
        train(tiny(cache_dir, total_steps=2), missing)
    halved = (kernel[0], kernel[1] // 2)
    with pytest.raises(ConfigError, match=re.escape(
            f"parameters of the wrong shape: ['{q_proj}: checkpoint {halved} vs model {kernel}']")):
        train(tiny(cache_dir, total_steps=2), misshapen)
    assert latest_step(missing) == latest_step(misshapen) == 1

    partial = tiny(cache_dir, total_steps=1)  # from scratch, q_proj frozen: saved with the trained ones since 0.6.9
    partial.optim.trainable_regex = "mlp"
    frozen_missing = str(tmp_path / "frozen_missing")
    train(partial, frozen_missing)
    _rewrite_params(frozen_missing, lambda params: params["layers"]["0"]["self_attn"].pop("q_proj"))
    partial.total_steps = 2
    with pytest.raises(ConfigError, match=re.escape(f"parameters missing: ['{q_proj}']")):  # resumed with the seed's
        train(partial, frozen_missing)
    with pytest.raises(ConfigError, match=re.escape(f"is missing parameters its run saved: ['{q_proj}']")):
        load_model(frozen_missing)


@pytest.mark.parametrize("damage", ["params removed", "opt_state removed", "a params file cut short"])
def test_a_checkpoint_with_an_item_or_file_lost_is_refused_in_one_line_naming_its_step(tmp_path, cache_dir, damage):
    """A checkpoint whose params or opt_state directory was lost, or one of whose files was cut short (a partial
    copy), failed with orbax's KeyError or tensorstore's OUT_OF_RANGE traceback on resume and in every evaluator.
    It is a ConfigError naming the step and the directory to delete."""
    workdir = str(tmp_path / "run")
    train(tiny(cache_dir, total_steps=1), workdir)
    trained = load_model(workdir).layers[0].mlp.up_proj.kernel[...]
    step_dir = os.path.join(checkpoint.checkpoint_dir(workdir), "1")
    item = os.path.join(step_dir, damage.split()[0] if "removed" in damage else "params")
    if "removed" in damage:
        shutil.rmtree(item)
    else:
        files = [os.path.join(d, f) for d, _, fs in os.walk(item) for f in fs if os.path.basename(d) == "d"]
        assert files, os.listdir(item)
        for path in files:
            open(path, "w").close()
    refusal = re.escape(f"the checkpoint of step 1 in {workdir!r} cannot be read: it is damaged or partly copied (")
    refusal += f".*delete its directory {re.escape(step_dir)} to resume from the step before"
    with pytest.raises(ConfigError, match=refusal):
        train(tiny(cache_dir, total_steps=2), workdir)
    if damage == "opt_state removed":  # evaluation reads no optimizer state
        np.testing.assert_array_equal(load_model(workdir).layers[0].mlp.up_proj.kernel[...], trained)
    else:
        with pytest.raises(ConfigError, match=refusal):
            load_model(workdir)


@pytest.mark.parametrize("error", [KeyError("params"), ValueError("OUT_OF_RANGE: cut short"), OSError("I/O error")])
def test_a_failed_checkpoint_read_is_one_line_naming_the_step_and_its_directory(tmp_path, error):
    """`checkpoint.reading`: each kind of error orbax and tensorstore raise on a damaged checkpoint (the three
    above run for real in the test before) becomes one ConfigError; other errors pass through."""
    workdir = str(tmp_path)
    step_dir = os.path.join(checkpoint.checkpoint_dir(workdir), "3")
    with pytest.raises(ConfigError, match=re.escape(f"the checkpoint of step 3 in {workdir!r} cannot be read: it is "
                                                    f"damaged or partly copied ({type(error).__name__}: ")
                       + f".*delete its directory {re.escape(step_dir)} to resume"):
        with checkpoint.reading(workdir, 3):
            raise error
    with pytest.raises(RuntimeError, match="not a read"):
        with checkpoint.reading(workdir, 3):
            raise RuntimeError("not a read")


def test_a_second_run_in_a_workdir_in_use_is_refused(tmp_path, cache_dir):
    """Two runs in one workdir (a job submitted twice, a requeue while the first still runs) used to write the same
    checkpoints: one crashed saving, the other hung. The second is now refused by name, before it writes anything,
    and the workdir is free again once the first ends, also by an exception."""
    workdir = str(tmp_path / "run")
    with checkpoint.workdir_lock(workdir):
        with pytest.raises(ConfigError, match=re.escape(f"workdir {workdir} is in use by another training run (pid "
                                                        f"{os.getpid()} on ")):
            train(tiny(cache_dir, total_steps=1), workdir)
        assert sorted(os.listdir(workdir)) == [checkpoint.LOCK_FILE]
    with pytest.raises(ConfigError, match="model vocab_size=256 is smaller"):  # fails once the workdir is held
        train(tiny(cache_dir, total_steps=1, model=dict(tiny(cache_dir).model, vocab_size=256)), workdir)
    train(tiny(cache_dir, total_steps=1), workdir)
    assert latest_step(workdir) == 1
