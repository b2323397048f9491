"""The trainer: meshes, resume, preemption, multi-process, init precedence, retrofit, bad input, experiments."""

import glob
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, focal_config
from focal_jax.nn.variables import Centroid
from focal_jax.train import checkpoint, train
from focal_jax.train.config import check_config, default_config
from focal_jax.train.metrics import read_metrics
from focal_jax.train.optimizer import OptimConfig, decay_mask, make_optimizer, param_paths, split_trainable
from focal_jax.train.sharding import make_mesh, partition_spec
from focal_jax.train.trainer import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden_trainable.json")


def load_experiment(name: str, arg: str) -> ml_collections.ConfigDict:
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizers"))


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
    params = nnx.to_pure_dict(nnx.state(GPT2(GPT2Config(vocab_size=16, n_positions=8, d_model=8, n_layers=1,
                                                         n_heads=2), rngs=nnx.Rngs(0)), nnx.Param))
    mask = {p: m for p, m in zip(param_paths(params), jax.tree.leaves(decay_mask(params)))}
    assert mask["h/0/attn/q_proj/kernel"] and mask["wte/embedding"]
    assert not mask["h/0/attn/q_proj/bias"] and not mask["h/0/ln_1/scale"] and not mask["ln_f/bias"]
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


def test_unknown_config_keys_name_themselves():
    for section, key in (("", "totl_steps"), ("model", "n_layer"), ("data", "seqlen"), ("optim", "learning_rate"),
                         ("mesh", "model")):
        config = default_config()
        (config if not section else config[section])[key] = 1
        with pytest.raises(ValueError, match=f"unknown config key {section + '.' if section else ''}{key}"):
            check_config(config)
    config = default_config()
    config.model.family = "t5"
    with pytest.raises(ValueError, match="model.family='t5' is not one of"):
        check_config(config)


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


def test_cli_unknown_override_fails_with_its_name(tmp_path):
    proc = run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", str(tmp_path),
                    "--config.totl_steps=3"])
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and "totl_steps" in output
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_agree_with_one(tmp_path, cache_dir):
    one = str(tmp_path / "one")
    train(tiny(cache_dir, total_steps=2), one)  # 8 devices in this process
    two = str(tmp_path / "two")
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(rank),
                   JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                   XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
        procs.append(run_cli(["--config", "experiments/quickstart.py:runlocal", "--workdir", two,
                              f"--config.data.cache_dir={cache_dir}", "--config.batch_size=8",
                              "--config.total_steps=2", "--config.eval_batches=0"], env=env))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "in 2 process(es)" in outputs[0] and "devices: 8" in outputs[0]
    np.testing.assert_allclose(list(losses(two).values()), list(losses(one).values()), atol=1e-5)
    assert latest_step(two) == 2


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


def _get(tree, path):
    for key in path.split("/"):
        tree = tree[int(key)] if key.isdigit() else tree[key]
    return tree


def test_init_from_hugging_face_directory(tmp_path, cache_dir):
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    hf_dir = str(tmp_path / "hf")
    transformers.LlamaForCausalLM(hf_config).save_pretrained(hf_dir, safe_serialization=True)
    config = tiny(cache_dir, init_from=hf_dir, total_steps=2)
    config.model = {"family": "hf"}
    config.retrofit.focus = {"groups": 2, "dim": 8, "window": 8}
    config.optim.trainable = "centroids"
    workdir = str(tmp_path / "run")
    train(config, workdir)
    assert sorted(checkpoint.saved_param_paths(workdir, 2)) == [
        f"layers/{i}/self_attn/{n}" for i in (0, 1) for n in ("centroids", "w_g")]
    assert np.isfinite(list(losses(workdir).values())).all()
    model = load_model(workdir)  # the Hugging Face base plus the trained centroids
    saved = checkpoint.load_params(workdir, 2, *_centroids_and_shardings(model))
    np.testing.assert_array_equal(model.layers[1].self_attn.w_g[...], saved["layers"][1]["self_attn"]["w_g"])


def _centroids_and_shardings(model):
    centroids = nnx.to_pure_dict(nnx.state(model, Centroid))
    return centroids, jax.tree.map(lambda x: x.sharding, centroids)


def test_golden_trainable_parameters(tmp_path, cache_dir):
    """Which parameters each experiment trains (tests/golden_trainable.json); a change here is deliberate."""
    golden = json.load(open(GOLDEN))
    base = str(tmp_path / "base")
    train(tiny(cache_dir, total_steps=1), base)
    for name, arg in experiment_args(base).items():
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
    assert_fails_cleanly(config, str(tmp_path / "a"), "no file matches the pattern .*missing/\\*.txt",
                         FileNotFoundError)

    config = tiny(cache_dir)
    config.optim.lr_peak = 1.0
    assert_fails_cleanly(config, str(tmp_path / "c"), "unknown config key optim.lr_peak")

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

    tied = tiny(cache_dir, total_steps=1)
    tied.model.tie_embeddings = True
    tied_dir = str(tmp_path / "tied")
    train(tied, tied_dir)
    assert_fails_cleanly(tiny(cache_dir, init_from=tied_dir), str(tmp_path / "e"),
                         "missing parameters that are not new in this config: \\['lm_head/kernel'\\]")


# ------------------------------------------------------------------------------------------------ experiments


def experiment_args(base_workdir: str) -> dict:
    """The runlocal argument of every experiment file (a new experiment must be added here)."""
    return {"quickstart": "runlocal", "focus_retrofit": f"runlocal,init_from={base_workdir}",
            "focus_sparse": "runlocal"}


def test_every_experiment_runs_two_steps(tmp_path, cache_dir):
    base = str(tmp_path / "base")
    train(tiny(cache_dir, total_steps=1), base)
    names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "experiments", "*.py")))
    args = experiment_args(base)
    assert names == sorted(args), "every experiment needs its runlocal argument in experiment_args"
    for name in names:
        config = load_experiment(name, args[name])
        config.data.cache_dir = cache_dir
        config.update(total_steps=2, batch_size=8)
        workdir = str(tmp_path / name)
        train(config, workdir)
        assert sorted(losses(workdir)) == [1, 2], name
        assert load_experiment(name, args[name].replace("runlocal", "")).total_steps > 100, name
