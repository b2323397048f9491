"""Shared test helpers: random attention inputs, a max-abs-error comparison, an experiment file's config, stubbed
run directories and usage errors of the command lines."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np


def rand_qkv(seed, b=2, t=40, h=4, hk=None, d=8, dv=None):
    """Standard-normal float32 q `[b, t, h, d]`, k `[b, t, hk, d]`, v `[b, t, hk, dv]` (hk, dv default to h, d)."""
    hk = h if hk is None else hk
    dv = d if dv is None else dv
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32)
    k = jax.random.normal(kk, (b, t, hk, d), jnp.float32)
    v = jax.random.normal(kv, (b, t, hk, dv), jnp.float32)
    return q, k, v


def assert_close(x, y, atol=1e-5, what=""):
    """Same shape and max |x - y| < atol (compared in float32)."""
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    assert x.shape == y.shape, (what, x.shape, y.shape)
    err = float(np.max(np.abs(x - y))) if x.size else 0.0
    assert err < atol, f"{what}: max abs err {err:.3g} >= {atol:.1g}"


def lowering_target(platform, shape=(1, 1, 1), axes=("data", "fsdp", "tensor")):
    """A context for `jit(f).trace(...).lower(lowering_platforms=(platform,))` without such a device: an abstract
    mesh of `shape` (no devices needed), whose abstract device is a GPU for 'cuda' (from jax 0.11 on the Triton
    lowering reads its target from it when no GPU is present; 'tpu' needs none)."""
    device = None
    if platform == "cuda":
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                                     abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_experiment(name: str, arg: str):
    """`experiments/NAME.py`'s `get_config(arg)` (the experiments are files, not an importable package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def stored_run_config(workdir: str):
    """The config (a ConfigDict) stored with the latest checkpoint of the focal_jax run in `workdir`."""
    import ml_collections

    from focal_jax.train import checkpoint

    return ml_collections.ConfigDict(checkpoint.stored_config(checkpoint.read_meta(workdir)[1]))


def hf_focus_retrofit_config(run: str, hf_directory: str, *, window: int):
    """The config of a one-step centroid-only Focus retrofit (K = 2, d_g 8) of the Hugging Face directory
    `hf_directory` (model family 'hf'), with the data and training settings of the focal_jax run `run`."""
    import ml_collections

    config = stored_run_config(run)
    config.model = ml_collections.ConfigDict({"family": "hf"})
    config.update(init_from=hf_directory, total_steps=1)
    config.retrofit.focus = {"groups": 2, "dim": 8, "window": window}
    config.optim.trainable = "centroids"
    return config


def usage_error(capsys, main, argv, needle: str):
    """`main(argv)` (a command line) exits as argparse does on a usage error (code 2), its message holding
    `needle`."""
    import pytest

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def stub_run_workdir(tmp_path, tokenizer, monkeypatch, make_model, *, step: int):
    """A run directory holding `tokenizer`'s file whose loading gives `make_model()` at checkpoint `step` of a run
    trained at 64 tokens (`load_model` and `read_meta` monkeypatched): no training."""
    from focal_jax.train import checkpoint, trainer

    workdir = tmp_path / "run"
    workdir.mkdir(parents=True)
    (workdir / "tokenizer.model").write_bytes(open(tokenizer.path, "rb").read())
    monkeypatch.setattr(trainer, "load_model", lambda path, step=None, mesh=None: make_model())
    stored = (step, {"config": {"data": {"seq_len": 64}}})
    monkeypatch.setattr(checkpoint, "read_meta", lambda path, step=None: stored)
    return workdir
