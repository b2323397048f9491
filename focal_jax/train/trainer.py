"""The training loop: one linear function, `train(config, workdir)`, from one CPU to a multi-host pod.

Launch: `python -m focal_jax.train --config experiments/quickstart.py:runlocal --workdir /tmp/run`.
The step is `nnx.split` -> `jax.value_and_grad` -> `jax.jit` on pure pytrees (the trainable parameters as a plain
dict, the frozen ones as another), with `nnx.merge` inside the loss, so NNX API changes cannot reach it.
"""

import contextlib
import dataclasses
import os
import pathlib
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from focal_jax.convert.hf import from_hf, read_hf_config
from focal_jax.data import build_data, train_iterator
from focal_jax.data.tokenizer import VocabSizeError, copy_tokenizer, tokenizer_file
from focal_jax.nn.gpt2 import GPT2
from focal_jax.nn.attention import FOCUS_KINDS, record_attention
from focal_jax.nn.llama import Llama
from focal_jax.nn.models import attention_layers, unfilled_paths
from focal_jax.nn.retrofit import NEW_TYPES, kmeans_centroids, kmeans_init, retrofit
from focal_jax.nn.variables import Centroid, Temperature
from focal_jax.train import checkpoint
from focal_jax.train.config import (DTYPES, ConfigError, RunConfig, check_attention_fields, check_config,
                                    check_data_fields, check_data_files, check_routing_trains, check_windows,
                                    built_model_section, config_differences, warmup_note, with_defaults)
from focal_jax.train.metrics import MetricWriter, Progress, mfu, peak_flops, train_flops_per_token
from focal_jax.train.optimizer import (learning_rate_schedule, make_optimizer, merge_params, param_paths, path_str,
                                       select_params, split_trainable)
from focal_jax.train.sharding import (abstract_on_mesh, check_batch_layout, drawn_on_mesh, make_mesh, param_sharding,
                                      place_model, place_tree, shard_batch, tree_shardings)


def log(message: str):
    """Print on process 0 only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def build_model(run: RunConfig, *, seed: int, base_step: int | None = None, hf_dtype=jnp.float32, mesh=None,
                progress=None):
    """The model of `run` with freshly initialised parameters (drawn by one jitted call, onto `mesh` if one is
    given: `drawn_on_mesh`), or, for model family 'hf', the model `init_from`
    holds: a Hugging Face directory (its tensors read as `hf_dtype`; with a `mesh`, each straight into its sharding
    there, this process reading only its own shards; `progress` gets a line once they are read), or a focal_jax run
    directory (the whole model of that run at its checkpoint `base_step`, default the latest, rebuilt from its own
    base with its retrofits and trained parameters, on `mesh` if one is given (`load_model`): e.g. phase 2 of a
    retrofit whose phase 1 started from a Hugging Face directory), its blocks rematerialised if `model.remat`."""
    if run.family == "hf":
        if checkpoint.is_hf_directory(run.init_from):
            try:
                model = from_hf(run.init_from, dtype=hf_dtype, progress=progress,
                                sharding=None if mesh is None else param_sharding(mesh))
            except ValueError as e:  # an unsupported architecture, a missing or misshapen tensor
                raise ConfigError(f"init_from={run.init_from!r}: {e}") from None
        else:
            log(f"model: the model of the run {run.init_from}")
            model = load_model(run.init_from, step=base_step, mesh=mesh)
        if run.hf_remat:
            model.config = dataclasses.replace(model.config, remat=True)
        return model
    cls = GPT2 if run.family == "gpt2" else Llama
    return drawn_on_mesh(cls, run.model, seed, mesh)


def new_param_paths(model) -> set[str]:
    """Paths of the parameters a retrofit or a new attention kind adds (`Centroid`, `Temperature`, `LoRA`): the only
    ones that may be missing from a pretrained checkpoint."""
    return set(param_paths(nnx.state(model, NEW_TYPES)))


KMEANS_KEY = 1  # folded into the run's seed for the k-means++ seeding, apart from the seed's parameter draws
BASE_STEP_GONE = ("the step of init_from that this run started from; the base run may have deleted it as it went "
                  "on, keeping keep_checkpoints steps")


def load_pretrained(model, workdir: str, *, with_base: bool = True, step: int | None = None):
    """Copy the parameters of a focal_jax workdir's latest checkpoint (or of checkpoint `step`) into `model` in
    place. Parameters the checkpoint lacks must be new ones (`new_param_paths`), or frozen ones that a run from
    scratch stored before 0.6.9 did not save (its seed's draws are copied: `_copy_seed_draws`); a checkpoint of a
    run that itself started from a pretrained model (trainable parameters only) first loads its own `init_from`
    (unless `with_base=False`: the model already holds it). Returns the model."""
    checkpoint.require_step(workdir, step)
    step, meta = checkpoint.read_meta(workdir, step)
    if meta.get("params_scope") == "trainable" and with_base:
        base = meta.get("init_from")
        if not base:
            raise ConfigError(f"{workdir!r} saved only its trainable parameters but records no init_from")
        if checkpoint.is_hf_directory(base):
            raise ConfigError(f"{workdir!r} was trained from the Hugging Face directory {base!r}; start from it "
                              f"with model.family='hf' and init_from={workdir!r} (the architecture then comes from "
                              f"that run)")
        checkpoint.require_step(base, meta.get("init_from_step"), BASE_STEP_GONE)
        load_pretrained(model, base, step=meta.get("init_from_step"))
    saved = checkpoint.saved_param_paths(workdir, step)
    shapes = param_shapes(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    missing, extra, wrong = param_differences(saved, shapes)
    if extra:
        raise ConfigError(f"init_from={workdir!r} holds parameters the model does not have: {_listed(extra)}")
    if wrong:
        raise ConfigError(f"init_from={workdir!r} has parameters of the wrong shape: {wrong[:5]}")
    missing = set(missing)
    trained = set(meta.get("trainable", ()))  # the run's own trainable parameters: in each of its checkpoints
    seeded = []
    if meta.get("params_scope") != "trainable" and with_base:
        undeclared = sorted(missing - new_param_paths(model))
        if undeclared and not set(saved) - trained and not missing & trained:
            # a run from scratch stored before 0.6.9 saved its trainable parameters only: the rest are its seed's
            seeded = _copy_seed_draws(model, workdir, step, undeclared)
        elif undeclared:
            raise ConfigError(f"init_from={workdir!r} is missing parameters that are not new in this config: "
                              f"{_listed(undeclared)}")
    # with_base=False: the model holds the run's base, or (a run from scratch stored before 0.6.9, which saved its
    # trainable parameters only) the frozen parameters drawn from the run's seed; a checkpoint that holds frozen
    # parameters (a run from scratch since 0.6.9) holds them all
    elif meta.get("params_scope") != "trainable" and set(saved) - trained:
        trained = set(shapes)
    if lost := sorted(missing & trained):
        raise ConfigError(f"the checkpoint of step {step} in {workdir!r} is missing parameters its run saved: "
                          f"{_listed(lost)} (a damaged or partly copied checkpoint)")
    _, loaded_state, _ = nnx.split(model, lambda path, _: path_str(path) in saved, ...)
    loaded = nnx.to_pure_dict(loaded_state)
    shardings = jax.tree.map(lambda x: x.sharding, loaded)
    values = checkpoint.load_params(workdir, step, loaded, shardings)
    nnx.update(model, values)
    new = sorted(missing - set(seeded)) if meta.get("params_scope") != "trainable" and with_base else []
    log(f"loaded {len(saved)} parameters of {workdir} (step {step})"
        + (f"; {len(seeded)} drawn from its seed (stored before 0.6.9, it saved its trainable ones only)"
           if seeded else "")
        + (f"; new: {new[:4]}{' ...' if len(new) > 4 else ''}" if new else ""))
    return model


def _copy_seed_draws(model, workdir: str, step: int, paths: list[str]) -> list[str]:
    """Copy into `model` the parameters at `paths` as the seed of the run in `workdir` draws them (`load_model`
    rebuilds that run): the frozen parameters of a run from scratch stored before 0.6.9, which saved only the
    ones it trained. Returns `paths`; ConfigError naming those the run lacks or has in another shape."""
    run_model = load_model(workdir, step=step)
    drawn = param_shapes(nnx.to_pure_dict(nnx.state(run_model, nnx.Param)))
    shapes = param_shapes(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    if absent := [path for path in paths if path not in drawn]:
        raise ConfigError(f"init_from={workdir!r} is missing parameters that are not new in this config: "
                          f"{_listed(absent)}")
    if wrong := [f"{path}: init_from {drawn[path]} vs model {shapes[path]}" for path in paths
                 if drawn[path] != shapes[path]]:
        raise ConfigError(f"init_from={workdir!r} has parameters of the wrong shape: {wrong[:5]}")
    wanted = set(paths)

    def selected(path, _):
        return path_str(path) in wanted

    _, source, _ = nnx.split(run_model, selected, ...)
    _, target, _ = nnx.split(model, selected, ...)
    nnx.update(model, jax.tree.map(lambda value, current: jax.device_put(value.astype(current.dtype), current.sharding),
                                   nnx.to_pure_dict(source), nnx.to_pure_dict(target)))
    return paths


def param_shapes(params: dict) -> dict[str, tuple]:
    """`{path: shape}` of the nested pure dict `params` (as `checkpoint.saved_param_paths` gives a checkpoint's)."""
    return {path_str(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def param_differences(saved: dict[str, tuple], shapes: dict[str, tuple]) -> tuple[list, list, list]:
    """`(missing, extra, wrong)` between a checkpoint's `{path: shape}` and a model's: the model's paths the
    checkpoint lacks, the checkpoint's paths the model lacks (both sorted), and `'path: checkpoint S vs model S'`
    for the shared paths whose shapes differ."""
    missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
    wrong = [f"{p}: checkpoint {saved[p]} vs model {shapes[p]}" for p in saved if p in shapes and saved[p] != shapes[p]]
    return missing, extra, wrong


def _listed(paths: list[str]) -> str:
    return f"{paths[:5]}{' ...' if len(paths) > 5 else ''}"


def check_resumable(workdir: str, step: int, saved: dict[str, tuple], params: dict):
    """ConfigError unless checkpoint `step` of `workdir`, whose parameters are `saved` (`{path: shape}`), holds
    exactly the parameters `params` (the nested pure dict a resume restores) in their shapes, naming those missing,
    extra or of another shape (orbax's own errors name none of them)."""
    missing, extra, wrong = param_differences(saved, param_shapes(params))
    problems = [f"{what}: {_listed(paths)}" for what, paths in
                (("missing", missing), ("not in the model", extra), ("of the wrong shape", wrong)) if paths]
    if problems:
        raise ConfigError(f"cannot resume from the checkpoint of step {step} in {workdir!r}: parameters "
                          f"{'; '.join(problems)} (a damaged or partly copied checkpoint: delete that step's "
                          f"directory to resume from the one before, or use a new workdir)")


def pinned_base_step(run: RunConfig, meta: dict | None = None) -> int | None:
    """The checkpoint step of the focal_jax run `init_from` that `run` starts from: the one its checkpoint `meta`
    records, else (a new run, or one stored before steps were recorded) the latest; None when `init_from` is not a
    focal_jax run. A run stays on that step while the base run goes on training."""
    if not run.init_from or checkpoint.is_hf_directory(run.init_from):
        return None
    if meta is not None and meta.get("init_from_step") is not None:
        return meta["init_from_step"]
    return checkpoint.read_meta(run.init_from)[0]


def host_device():
    """The device a run builds its model on before placing it on the mesh: this process's CPU device (host memory,
    so that a model larger than one accelerator can load), or its first device where JAX has no CPU backend
    (`JAX_PLATFORMS` without 'cpu')."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return jax.local_devices()[0]


def init_model(run: RunConfig, *, base_step: int | None = None, hf_dtype=jnp.float32, mesh=None, progress=None):
    """The model a run starts from, before its own checkpoint: scratch or Hugging Face (`build_model`, a Hugging
    Face directory's tensors read as `hf_dtype`, onto `mesh` if one is given), then the pretrained `init_from`
    workdir's parameters (of its checkpoint `base_step`, default the latest), then the retrofits (Focal, Focus, then
    LoRA: `retrofit` hands a `LoRAConfig` to `focal_jax.nn.lora.add_lora`). With a `mesh`, a model whose every
    parameter the `init_from` workdir holds is not drawn: it is built abstractly and restored straight onto the
    mesh (`restore_onto_mesh`). A Focus retrofit with `init='kmeans'` gets random centroids here: a new run fits
    them once its parameters are on the mesh (`fit_kmeans_centroids`); a resume or a stored run's model reads them
    from a checkpoint."""
    if base_step is not None:
        checkpoint.require_step(run.init_from, base_step, BASE_STEP_GONE)
    pretrained = run.init_from and run.family != "hf"
    if pretrained and checkpoint.is_hf_directory(run.init_from):
        raise ConfigError(f"init_from={run.init_from!r} is a Hugging Face directory: set model.family='hf'")
    model = None
    if pretrained and mesh is not None:
        model = restore_onto_mesh(lambda: build_model(run, seed=run.seed), run.init_from, step=base_step, mesh=mesh)
    if model is None:
        model = build_model(run, seed=run.seed, base_step=base_step, hf_dtype=hf_dtype, mesh=mesh, progress=progress)
        if pretrained:
            load_pretrained(model, run.init_from, step=base_step)
    for change in run.retrofit:
        if kmeans_init(change):
            change = dataclasses.replace(change, init="random")
        model = retrofit(model, change, rngs=run.seed)
    return model


def restore_onto_mesh(make_model, workdir: str, *, step: int | None, mesh):
    """The model `make_model()` builds, built abstractly (nothing drawn) with each variable carrying the trainer's
    sharding on `mesh` (`abstract_on_mesh`), then filled by `load_pretrained` from checkpoint `step` of `workdir`
    (default the latest) and the runs it started from: each process reads only its own shards. None, with nothing
    read, when those checkpoints do not hold every variable of the model (`stored_param_paths`): it must then be
    drawn (parameters a config adds, or a run from scratch stored before 0.6.9)."""
    model = abstract_on_mesh(nnx.eval_shape(make_model), mesh)
    if not set(param_paths(nnx.state(model))) <= stored_param_paths(workdir, step):
        return None
    model = load_pretrained(model, workdir, step=step)
    if abstract := unfilled_paths(model):
        raise ValueError(f"the checkpoints of {workdir!r} did not fill {abstract[:4]}")
    return model


def stored_param_paths(workdir: str, step: int | None = None) -> set[str]:
    """The paths of the parameters that `load_pretrained(model, workdir, step=step)` fills: those of the checkpoint
    (default the latest), and, for a run that saved only its trainable parameters, those of the run it started from
    (at the step it started from, recursively)."""
    step, meta = checkpoint.read_meta(workdir, step)
    paths = set(checkpoint.saved_param_paths(workdir, step))
    base = meta.get("init_from")
    if meta.get("params_scope") == "trainable" and base and not checkpoint.is_hf_directory(base):
        checkpoint.require_step(base, meta.get("init_from_step"), BASE_STEP_GONE)
        paths |= stored_param_paths(base, meta.get("init_from_step"))
    return paths


def fit_kmeans_centroids(graphdef, trainable: dict, frozen: dict, batch: dict, *, seed: int,
                         compute_dtype=jnp.float32) -> dict:
    """`trainable` (placed on the mesh) with each Focus layer's centroids replaced by the k-means of its routing
    inputs on `batch` (a global batch, `shard_batch`), as `retrofit.kmeans_centroids` fits them: sharded forward
    passes with the parameters cast to `compute_dtype` (all but the routing ones, as in a training step): k-means fits
    any model the run can train, on the routing inputs its first step sees. Each new centroid array keeps its
    leaf's dtype and sharding; in a multi-process run, all take process 0's fit. Call it under the run's mesh."""
    model = nnx.merge(graphdef, trainable, frozen)
    kmeans_centroids(model, [batch], key=jax.random.fold_in(jax.random.key(seed), KMEANS_KEY), progress=log,
                     dtype=compute_dtype)
    fitted = select_params(nnx.to_pure_dict(nnx.state(model)), trainable)

    def placed(path, old, new):
        if not path_str(path).endswith("centroids"):
            return old
        new = np.asarray(new, old.dtype)
        if jax.process_count() > 1:  # (k-means on each process's own device need not agree to the last bit)
            from jax.experimental import multihost_utils

            new = np.asarray(multihost_utils.broadcast_one_to_all(new))
        return jax.device_put(new, old.sharding)

    return jax.tree_util.tree_map_with_path(placed, trainable, fitted)


def load_model(workdir: str, *, step: int | None = None, mesh=None):
    """The model of a focal_jax run directory with the parameters of its latest checkpoint, or of checkpoint
    `step` (for evaluation, generation, export). ValueError names the saved steps when `step` is not one.
    Parameters are float32 whatever the run's `param_dtype` (a retrofit's frozen base as its `init_from` stores it,
    not the bf16-rounded copy a `param_dtype='bfloat16'` run trained on).

    mesh: a `jax.sharding.Mesh` with axes `('data', 'fsdp', 'tensor')` (`focal_jax.train.sharding.make_mesh`), for
    evaluation on several devices (a model larger than one, or data-parallel), its parameters laid out as the
    trainer lays them out. A run whose checkpoints (with those of the focal_jax runs it started from) hold every
    parameter, e.g. a run from scratch or a retrofit of one, is restored straight onto the mesh
    (`restore_onto_mesh`: nothing drawn, each process reading its own shards). A run from a Hugging Face directory
    reads it straight onto the mesh, and its own checkpoint's parameters and any drawn ones are built in host memory
    (`host_device`), then placed (`place_model`). Run it under `jax.set_mesh(mesh)`, so that the Pallas kernels run
    per shard. Default: built on the default device."""
    checkpoint.require_step(workdir, step)
    step, meta = checkpoint.read_meta(workdir, step)
    run = check_config(ml_collections.ConfigDict(checkpoint.stored_config(meta)))
    if mesh is not None and run.family != "hf":
        def make_model():
            return init_model(dataclasses.replace(run, init_from=None))  # the architecture with its retrofits

        if (model := restore_onto_mesh(make_model, workdir, step=step, mesh=mesh)) is not None:
            return model
    with contextlib.nullcontext() if mesh is None else jax.default_device(host_device()):
        model = init_model(run, base_step=meta.get("init_from_step"), mesh=mesh)  # holds the run's init_from
        model = load_pretrained(model, workdir, with_base=False, step=step)
    return model if mesh is None else place_model(model, mesh)


def matmul_param_count(model, paths=None) -> int:
    """Parameters that take part in matmuls (for the FLOP estimate): all but the position table and an untied
    input-embedding table (lookups); only those at `paths` (e.g. the frozen ones) when given."""
    tied = getattr(model.config, "tie_embeddings", isinstance(model, GPT2))
    sizes = {path_str(p): x.size for p, x in jax.tree_util.tree_flatten_with_path(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0] if paths is None or path_str(p) in paths}
    lookups = [p for p in sizes if p == "wpe/embedding" or (p == "embed_tokens/embedding" and not tied)]
    return sum(sizes.values()) - sum(sizes[p] for p in lookups)


def model_flops_per_token(model, frozen, seq_len: int) -> float:
    """Training FLOPs per token of `model` on sequences of `seq_len` (`metrics.train_flops_per_token`), with the
    matmul parameters in `frozen` (the split's frozen tree) counted without a weight gradient."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.d_model // config.n_heads
    return train_flops_per_token(matmul_param_count(model), config.n_layers, seq_len, config.n_heads * head_dim,
                                 n_frozen=matmul_param_count(model, set(param_paths(frozen))))


def cast_floats(tree, dtype, *, keep=frozenset()):
    """Floating leaves of `tree` cast to `dtype` (integers untouched, and the leaves at the paths in `keep`)."""
    def cast(path, x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and path_str(path) not in keep else x
    return jax.tree_util.tree_map_with_path(cast, tree)


def routing_param_paths(model) -> frozenset[str]:
    """Paths of the Focus routing and learned-temperature parameters (`Centroid`, `Temperature`): a training step
    leaves them in the dtype they are kept in (`param_dtype`, float32 by default) rather than the compute dtype
    (`make_steps`), as the products they enter are float32 (`routing_scores`, `learned_temperature`). They are few
    (d_model * d_g + K * d_g, d_model + 1 per layer)."""
    return frozenset(param_paths(nnx.state(model, (Centroid, Temperature))))


def masked_nll(logits, targets, loss_mask):
    """`(sum of -log p(target), number of targets)` over the positions where `loss_mask` is 1.
    logits `[B, T, V]` (taken in float32), targets int `[B, T]`, loss_mask `[B, T]`.

    -log p(target) is `logsumexp(logits) - logits . one_hot(target)`: its gradient is elementwise, so XLA fuses it
    into the LM head's bf16 cotangent (`einsum_f32`) rather than first scattering into a float32 `[B, T, V]` array,
    as a gather's gradient does (1.9 GiB for the 400M model at B = 8, T = 2048; BENCHMARKS.md)."""
    logits = logits.astype(jnp.float32)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32), axis=-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
    return jnp.sum(nll * loss_mask), jnp.sum(loss_mask)


def real_token_mask(batch):
    """float32 `[B, T]`: 1 for real tokens, 0 for padding (segment id 0; all real without segment ids)."""
    segment_ids = batch.get("segment_ids")
    if segment_ids is None:
        return jnp.ones(batch["inputs"].shape, jnp.float32)
    return (segment_ids != 0).astype(jnp.float32)


def balance_loss(g, valid):
    """The auxiliary group-balance loss of one Focus layer (the Switch Transformer load-balancing form):
    `K * sum_k f_k * P_k`, where over the real tokens of the batch `f_k` is the share whose top group (argmax of g)
    is k (no gradient) and `P_k` the mean assignment probability of group k. It is 1 at perfect balance and K when
    one group takes every token; its gradient lowers the probability of over-full groups.

    g: `[B, T, K]` assignment rows (summing to 1); valid: `[B, T]`, 1 for real tokens, 0 for padding. Returns a
    float32 scalar."""
    g = g.astype(jnp.float32)
    valid = valid.astype(jnp.float32)[..., None]
    n = jnp.maximum(jnp.sum(valid), 1.0)
    top = jax.nn.one_hot(jnp.argmax(g, axis=-1), g.shape[-1], dtype=jnp.float32)
    f = jax.lax.stop_gradient(jnp.sum(top * valid, axis=(0, 1)) / n)
    p = jnp.sum(g * valid, axis=(0, 1)) / n
    return g.shape[-1] * jnp.sum(f * p)


def group_counts(records, valid):
    """int32 `[L, K]`: per Focus layer recorded by `record_attention`, the real tokens whose top group is each k;
    None when no layer routes."""
    routed = [r["g"] for r in records if "g" in r]
    if not routed:
        return None
    return jnp.stack([jnp.sum(jax.nn.one_hot(jnp.argmax(g, -1), g.shape[-1], dtype=jnp.int32)
                              * valid.astype(jnp.int32)[..., None], axis=(0, 1)) for g in routed])


def tau_sums(records, valid):
    """float32 `[L, 4]`: per learned-temperature layer recorded by `record_attention`, over the real tokens (and
    heads, for a per-head tau `[B, T, H]`): the sum of tau, the number at tau_min, the number at tau_max (the hard
    clip's flat ends, where tau gets no gradient) and the number of taus; None when no layer learns its
    temperature."""
    learned = [r for r in records if "tau" in r]
    if not learned:
        return None
    sums = []
    for r in learned:
        tau = r["tau"]
        weight = jnp.broadcast_to(valid.astype(jnp.float32).reshape(valid.shape + (1,) * (tau.ndim - 2)), tau.shape)
        sums.append(jnp.stack([jnp.sum(tau * weight), jnp.sum((tau <= r["config"].tau_min) * weight),
                               jnp.sum((tau >= r["config"].tau_max) * weight), jnp.sum(weight)]))
    return jnp.stack(sums)


def _without_remat(model):
    """`model` with block rematerialisation off (so that `record_attention` sees each layer's values in the outer
    trace); the parameters are the same."""
    if getattr(model.config, "remat", False):
        model.config = dataclasses.replace(model.config, remat=False)
    return model


def make_steps(graphdef, tx, compute_dtype, *, balance_weight: float = 0.0, keep_float32=frozenset()):
    """`(train_step, eval_step)`, pure functions of (trainable dict, opt_state, frozen dict, batch).

    The parameters are cast to `compute_dtype` for the forward pass, except those at the paths in `keep_float32`
    (`routing_param_paths`: with bf16 compute, W_g, C, w_tau and tau_bias rounded to bf16 moved the routing scores by
    up to 0.036 and tau by up to 0.28%).

    balance_weight: weight of the mean over Focus layers of `balance_loss`, added to the LM loss (0: off; then the
    step is exactly the plain one). With a weight > 0 the forward pass runs without rematerialisation (the
    assignments are read with `record_attention`), and the train metrics hold `balance_loss`.
    eval_step returns `(nll sum, target count, group counts [L, K] or None, tau sums [L, 4] or None)`: the counts
    (argmax group of the real tokens, per Focus layer) give the eval records' dominance, the tau sums
    (`tau_sums`, per learned-temperature layer) their tau statistics.
    """
    def forward(trainable, frozen, batch, record):
        model = nnx.merge(graphdef, cast_floats(trainable, compute_dtype, keep=keep_float32),
                          cast_floats(frozen, compute_dtype, keep=keep_float32))
        if not record:
            return model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"]), []
        with record_attention() as records:
            logits = _without_remat(model)(batch["inputs"], positions=batch["positions"],
                                           segment_ids=batch["segment_ids"])
        return logits, records

    def loss_fn(trainable, frozen, batch):
        logits, records = forward(trainable, frozen, batch, record=balance_weight > 0)
        total, count = masked_nll(logits, batch["targets"], batch["loss_mask"])
        loss = total / jnp.maximum(count, 1.0)
        aux = {"tokens": count}
        routed = [r["g"] for r in records if "g" in r]
        if routed:
            aux["balance_loss"] = jnp.mean(jnp.stack([balance_loss(g, real_token_mask(batch)) for g in routed]))
            return loss + balance_weight * aux["balance_loss"], (loss, aux)
        return loss, (loss, aux)

    def train_step(trainable, opt_state, frozen, batch):
        (_, (loss, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, frozen, batch)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
        return trainable, opt_state, metrics

    def eval_step(trainable, frozen, batch):
        logits, records = forward(trainable, frozen, batch, record=True)
        total, count = masked_nll(logits, batch["targets"], batch["loss_mask"])
        valid = real_token_mask(batch)
        return total, count, group_counts(records, valid), tau_sums(records, valid)

    return train_step, eval_step


def evaluate(eval_step, trainable, frozen, batches, mesh) -> dict:
    """Held-out loss (mean over target tokens) and perplexity; for Focus models also `dominance` (share of real
    tokens in the largest group, argmax of g, mean over layers; 1/K is perfect balance), `dominance_max` (the
    worst layer) and each layer's, `dominance/layer_i`; for a learned temperature (FOCAL_SPEC OQ-F4) `tau` and
    `tau_clipped` (the mean tau of the real tokens and the share of them at tau_min or tau_max, where the hard clip
    passes no gradient; means over the layers) and the same per layer, `tau/layer_i` and `tau_clipped/layer_i`."""
    total, count, counts, taus = 0.0, 0.0, None, None
    for batch in batches:
        t, c, n, s = eval_step(trainable, frozen, shard_batch(batch, mesh))
        total, count = total + float(t), count + float(c)
        if n is not None:
            n = np.asarray(jax.device_get(n), np.int64)
            counts = n if counts is None else counts + n
        if s is not None:
            s = np.asarray(jax.device_get(s), np.float64)
            taus = s if taus is None else taus + s
    loss = total / max(count, 1.0)
    result = {"loss": loss, "perplexity": float(np.exp(min(loss, 50.0))), "tokens": count}
    if counts is not None:
        dominance = counts.max(axis=1) / np.maximum(counts.sum(axis=1), 1)
        result.update(dominance=float(dominance.mean()), dominance_max=float(dominance.max()))
        result.update({f"dominance/layer_{i}": float(d) for i, d in enumerate(dominance)})
    if taus is not None:
        real = np.maximum(taus[:, 3], 1.0)
        tau, clipped = taus[:, 0] / real, (taus[:, 1] + taus[:, 2]) / real
        result.update(tau=float(tau.mean()), tau_clipped=float(clipped.mean()))
        for i in range(len(tau)):
            result.update({f"tau/layer_{i}": float(tau[i]), f"tau_clipped/layer_{i}": float(clipped[i])})
    return result


def warn_if_schedule_changed(stored_config: dict, run: RunConfig, step: int):
    """Say so when a resumed run's learning rate after `step` differs from what the stored run would have used:
    `total_steps` and `optim.decay_steps` may change on resume, and the cosine decay ends at `decay_steps`
    (default `total_steps`)."""
    stored_config = with_defaults(stored_config)  # (a config may leave keys at their defaults)
    stored_total = stored_config["total_steps"]
    stored_optim = dataclasses.replace(run.optim, decay_steps=stored_config["optim"]["decay_steps"])
    counts = np.arange(step, max(run.total_steps, step + 1))  # the updates still to run (the schedule's counts)
    before = np.asarray(learning_rate_schedule(stored_optim, stored_total)(counts))
    now = np.asarray(learning_rate_schedule(run.optim, run.total_steps)(counts))
    changed = np.flatnonzero(~np.isclose(before, now, rtol=1e-6, atol=0.0))
    if changed.size:
        i = changed[0]
        changes = ", ".join(f"{name} {old} -> {new}" for name, old, new in (
            ("total_steps", stored_total, run.total_steps),
            ("optim.decay_steps", stored_optim.decay_steps, run.optim.decay_steps)) if old != new)
        log(f"note: the learning-rate schedule changed on resume ({changes}): step {counts[i] + 1} trains at lr "
            f"{now[i]:.3g} where the stored run would have used {before[i]:.3g}. To extend a run on its old decay, "
            f"set --config.optim.decay_steps={stored_optim.decay_steps or stored_total}")


def check_seed_draws(stored_config: dict, run: RunConfig):
    """ConfigError when `run` resumes a run from scratch stored before 0.6.9 (its frozen parameters are not in its
    checkpoints but drawn from its seed) with another `model.init_std`, which would draw them differently."""
    stored, now = built_model_section(stored_config["model"]).get("init_std"), getattr(run.model, "init_std", None)
    if stored != now:
        raise ConfigError(f"model.init_std={now} differs from the stored run's {stored}: that run, "
                          f"stored before 0.6.9, keeps its frozen parameters as its seed draws them, so they must be "
                          f"drawn alike (give model.init_std as stored, in a config file for None)")


def data_fingerprint(data) -> dict | None:
    """What identifies a run's in-memory training data (its data state is only the next batch's index, so a resumed
    run must build the same rows); None when streaming (the stream's data state holds a digest of its files)."""
    if data.streaming:
        return None
    return {"documents": data.n_train_documents, "rows": data.n_train_rows, "tokens": data.n_train_tokens,
            "eval_documents": data.n_eval_documents}


def check_resumed_data(workdir: str, data, meta: dict):
    """ConfigError unless the data a resumed run built is the data its checkpoints were trained on: the tokenizer the
    workdir holds (a tokenizer trained on a corpus whose files changed would give token ids another meaning) and,
    in memory, the same training rows (`data_fingerprint`, recorded since checkpoints hold it). Copies the tokenizer
    into a workdir that lacks it."""
    try:
        saved = tokenizer_file(workdir)
    except FileNotFoundError:
        copy_tokenizer(data.tokenizer, workdir)
        saved = None
    if saved is not None and pathlib.Path(saved).read_bytes() != pathlib.Path(data.tokenizer.path).read_bytes():
        raise ConfigError(f"workdir {workdir} holds a run trained with the tokenizer {saved}, but its data now gives "
                          f"another one ({data.tokenizer.path}): the training files (data.paths) or data.tokenizer "
                          f"changed since its checkpoints; restore them, or use a new workdir")
    stored, now = meta.get("data"), data_fingerprint(data)
    if stored is not None and now is not None and stored != now:
        raise ConfigError(f"workdir {workdir} holds a run trained on other data: {stored} then, {now} now (the "
                          f"training files, data.paths, changed since its checkpoints); restore them, or use a new "
                          f"workdir")


class StopSignal:
    """Remembers a SIGTERM (preemption) so that the loop saves a checkpoint and stops at the next step.

    Single-process runs only (`install=False` leaves SIGTERM alone): in a multi-process run the processes must stop
    at the same step, since saving and every train step are collective, but each would note its own SIGTERM at a
    step of its own (or one process alone is preempted), and the others would wait for it forever. There, JAX's
    preemption service (started by `jax.distributed.initialize`) catches SIGTERM on any process and agrees with the
    others on one step (`manager.reached_preemption`); a Python handler would take SIGTERM away from it."""

    def __init__(self, install: bool = True):
        self.received = False
        self._previous = None
        self._install = install

    def __enter__(self):
        if not self._install:
            return self
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler
            self._previous = None
        return self

    def _handle(self, signum, frame):
        self.received = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@contextlib.contextmanager
def saves_finished(manager):
    """Wait for the checkpoint being written when the block ends, also by an exception: saving is asynchronous, and
    a crash just after a save would leave that checkpoint unfinished (the run would resume from the one before)."""
    try:
        yield
    finally:
        manager.wait_until_finished()


def check_init_from(run: RunConfig):
    """ConfigError naming `init_from` when the run cannot start from it, found from its files alone (before any
    data is built): a Hugging Face directory (config.json next to *.safetensors) for a model family other than
    'hf', or one whose config.json `from_hf` refuses (`read_hf_config`: not a JSON object, an unsupported
    model_type, ...); for family 'hf', a directory that is neither such a directory nor a focal_jax run (no
    checkpoint). (A directory without a checkpoint for the other families is found when the run loads it.)"""
    if not run.init_from:
        return
    if checkpoint.is_hf_directory(run.init_from):
        if run.family != "hf":
            raise ConfigError(f"init_from={run.init_from!r} is a Hugging Face directory: set model.family='hf'")
        try:
            read_hf_config(run.init_from)
        except ValueError as e:
            raise ConfigError(f"init_from={run.init_from!r}: {e}") from None
    elif run.family == "hf" and not checkpoint.saved_steps(run.init_from):
        neither = (f"init_from={run.init_from!r} is neither a Hugging Face model directory (config.json next to "
                   f"*.safetensors weights) nor a focal_jax run (no checkpoint in "
                   f"{checkpoint.checkpoint_dir(run.init_from)})")
        try:
            read_hf_config(run.init_from)
        except ValueError as e:  # no config.json, or a bad one
            raise ConfigError(f"{neither}: {e}") from None
        raise ConfigError(f"{neither}: it has config.json but no *.safetensors file")


def check_run(config, workdir: str) -> tuple[RunConfig, dict, int | None, dict | None]:
    """`(run, config_data, resume_step, stored)` for a run of `config` in `workdir`: the checked config
    (`check_config`, with refused: the attention and data settings it would ignore, a window that covers every key
    of the sequences in a new run (`check_windows`), and hard routing as the only thing to train
    (`check_routing_trains`)), the config as checkpoints store it, and, when `workdir` holds a run, its latest step
    and that checkpoint's meta (both None otherwise).
    ValueError naming a bad setting, a `workdir` that is a URL (metrics, plots and the tokenizer copy are written
    with file operations), a run there that this config cannot resume (another config, or a step past
    `total_steps`), an `init_from` the run cannot start from (`check_init_from`, a ConfigError: e.g. a Hugging Face
    directory `from_hf` refuses), a data file that is missing (`check_data_files`), or a mesh that does not fit
    the devices or the batch (`make_mesh`, `check_batch_layout`)."""
    run = check_config(config)
    check_attention_fields(run.model)
    check_data_fields(run.data)
    check_routing_trains(run)
    if "://" in workdir:
        raise ValueError(f"workdir={workdir!r} is a URL; give a directory (a bucket mounted with Cloud Storage FUSE, "
                         f"a network file system): metrics, plots and the tokenizer copy are written as local files")
    config_data = checkpoint.with_absolute_paths(checkpoint.config_json(config))
    workdir = os.path.abspath(os.path.expanduser(workdir))
    resume_step, stored = None, None
    saved = checkpoint.saved_steps(workdir)
    if saved:
        resume_step = saved[-1]
        stored = checkpoint.read_meta(workdir, resume_step)[1]
        diffs = config_differences(checkpoint.stored_config(stored), config_data)
        if diffs:
            raise ValueError(f"workdir {workdir} holds a run of a different config (step {resume_step}); "
                             f"use a new workdir. Differences: " + "; ".join(diffs[:8]))
        if resume_step > run.total_steps:
            raise ValueError(f"workdir {workdir} holds a checkpoint at step {resume_step}, past "
                             f"total_steps={run.total_steps}: give total_steps >= {resume_step} to resume it, or a "
                             f"new workdir")
    else:  # a stored run trained with its windows (an older version took one covering every key): it resumes
        check_windows(run)
    check_init_from(run)
    check_data_files(run.data)
    check_batch_layout(make_mesh(run.mesh), run.batch_size, jax.process_count())
    return run, config_data, resume_step, stored


def train(config, workdir: str, *, stop_after: int | None = None) -> list[dict]:
    """Train as `config` (an `ml_collections.ConfigDict`, see `focal_jax.train.config`) says, in `workdir`.

    Resumes from the workdir's latest checkpoint when there is one. `stop_after` stops (with a checkpoint) once that
    step is done, as a preemption would (tests use it). Returns the train metrics records logged by this call.
    Raises ValueError (`ConfigError` for the config's mistakes) naming what is wrong, and when another run trains
    in `workdir` (`checkpoint.workdir_lock`).
    """
    run, config_data, resume_step, stored = check_run(config, workdir)
    workdir = os.path.abspath(os.path.expanduser(workdir))
    if note := warmup_note(run):
        log(f"warning: {note}")
    with checkpoint.workdir_lock(workdir):
        return _train(run, config_data, resume_step, stored, workdir, stop_after)


def _train(run: RunConfig, config_data: dict, resume_step: int | None, stored: dict | None, workdir: str,
           stop_after: int | None) -> list[dict]:
    """`train` once `check_run` has passed and the workdir is held."""
    # ---------------------------------------------------------------- Devices
    mesh = make_mesh(run.mesh)
    manager = checkpoint.make_manager(workdir, keep=run.keep_checkpoints, create=False)
    log(f"devices: {jax.device_count()} ({jax.devices()[0].device_kind}) in {jax.process_count()} process(es), "
        f"mesh {dict(mesh.shape)}; workdir {workdir}")

    # ---------------------------------------------------------------- Data
    # A resumed run keeps the tokenizer its workdir holds (check_resumed_data), rather than one built anew.
    # (what the files or the settings cannot give, e.g. no held-out documents, is found here: before the model)
    try:
        data = build_data(run.data, global_batch=run.batch_size, seed=run.seed,
                          workdir=workdir if resume_step is None else None)
        eval_batches = data.eval_batches(run.eval_batches) if run.eval_batches else []
    except VocabSizeError as e:
        raise ConfigError(f"data.{e}") from None
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    if len(eval_batches) < run.eval_batches:
        log(f"note: eval_batches={run.eval_batches}, but the held-out rows fill {len(eval_batches)} batches of "
            f"{run.batch_size}: each evaluation reads those")
    if resume_step is not None:
        check_resumed_data(workdir, data, stored)
    log(f"data: {data.describe()}, vocab {data.tokenizer.vocab_size}")

    # ---------------------------------------------------------------- Model: scratch, pretrained, retrofit
    data_iter = train_iterator(data)
    kmeans = any(kmeans_init(change) for change in run.retrofit)
    init_from_step = pinned_base_step(run, stored)
    host = host_device()
    param_dtype = DTYPES[run.param_dtype]
    with jax.default_device(host):  # in host memory: no one accelerator need hold the model before the mesh does
        # (a draw from scratch, a Hugging Face directory (read as param_dtype) and a base run holding every
        # parameter go straight onto the mesh, each process placing only its own shards; retrofits' new parameters
        # are built here)
        model = init_model(run, base_step=init_from_step, hf_dtype=param_dtype, mesh=mesh, progress=log)
    vocab = model.config.vocab_size
    if vocab < data.tokenizer.vocab_size:
        raise ConfigError(f"model vocab_size={vocab} is smaller than the tokenizer's {data.tokenizer.vocab_size}: "
                          f"set model.vocab_size or data.vocab_size")
    n_positions = getattr(model.config, "n_positions", None)  # GPT-2's learned position table (a lookup clamps)
    if n_positions is not None and run.data.seq_len > n_positions:
        raise ConfigError(f"data.seq_len={run.data.seq_len} is longer than the model's n_positions={n_positions} "
                          f"(GPT-2's learned position table; positions past it would all read its last row): set "
                          f"data.seq_len <= {n_positions}")
    kinds = sorted({attn.config.kind for attn in attention_layers(model)})
    if run.balance_weight > 0 and not set(kinds) & set(FOCUS_KINDS):
        raise ConfigError(f"balance_weight={run.balance_weight} balances Focus groups, but the model's attention kind "
                          f"is {kinds}: set it to 0, or give the model Focus (model.attn.kind, retrofit.focus)")
    graphdef, trainable, frozen = split_trainable(model, run.optim)
    frozen_centroids = [p for p in param_paths(frozen) if p.endswith("centroids")]
    if frozen_centroids and kmeans:
        raise ConfigError(f"retrofit.focus.init='kmeans' needs the centroids trained (optim.trainable), but "
                          f"{frozen_centroids[0]} is frozen: a resumed run would rebuild it at random")
    flops_per_token = model_flops_per_token(model, frozen, run.data.seq_len)
    keep_float32 = routing_param_paths(model)
    del model
    with jax.default_device(host):
        trainable, frozen = cast_floats(trainable, param_dtype), cast_floats(frozen, param_dtype)
    n_trainable = sum(x.size for x in jax.tree.leaves(trainable))
    n_total = n_trainable + sum(x.size for x in jax.tree.leaves(frozen))
    log(f"model: {run.family}, {n_total:,} parameters, {n_trainable:,} trainable ({run.optim.trainable}"
        f"{', /' + run.optim.trainable_regex + '/' if run.optim.trainable_regex else ''})")

    # ---------------------------------------------------------------- Optimizer, sharding
    tx = make_optimizer(run.optim, run.total_steps)
    trainable_sharding, frozen_sharding = tree_shardings(trainable, mesh), tree_shardings(frozen, mesh)
    trainable, frozen = place_tree(trainable, trainable_sharding), place_tree(frozen, frozen_sharding)
    if kmeans and resume_step is None:  # on the run's first batch, which training then starts on
        start = data_iter.get_state()
        first = shard_batch(next(data_iter), mesh)
        data_iter.set_state(start)
        log(f"retrofit: k-means centroids from the first batch ({run.batch_size} x {run.data.seq_len} tokens)")
        with jax.set_mesh(mesh):
            trainable = fit_kmeans_centroids(graphdef, trainable, frozen, first, seed=run.seed,
                                             compute_dtype=DTYPES[run.compute_dtype])
    opt_sharding = tree_shardings(jax.eval_shape(tx.init, trainable), mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(trainable)

    # ---------------------------------------------------------------- Resume
    # A run from a pretrained model saves its trainable parameters only; a run from scratch saves them all (the
    # frozen ones too), so that its checkpoints alone rebuild the model.
    def saved_params(trainable):
        return trainable if run.init_from else merge_params(trainable, frozen)

    start_step = 0
    if resume_step is not None:
        # (runs from scratch stored before 0.6.9 saved their trainable parameters only, the frozen ones being the
        # seed's; since, all of them, so a checkpoint with any frozen parameter must hold them all)
        saved = checkpoint.saved_param_paths(workdir, resume_step)
        with_frozen = not run.init_from and bool(set(param_paths(frozen)) & set(saved))
        if not run.init_from and not with_frozen and jax.tree.leaves(frozen):
            check_seed_draws(stored["config"], run)
        check_resumable(workdir, resume_step, saved, merge_params(trainable, frozen) if with_frozen else trainable)
        params, opt_state, data_state, _ = checkpoint.restore(
            manager, resume_step, params=merge_params(trainable, frozen) if with_frozen else trainable,
            opt_state=opt_state, opt_sharding=opt_sharding,
            params_sharding=merge_params(trainable_sharding, frozen_sharding) if with_frozen else trainable_sharding)
        trainable = select_params(params, trainable)
        if with_frozen:  # the saved ones, should this jax version draw the seed's differently
            frozen = select_params(params, frozen)
        data_iter.set_state(data_state)
        start_step = resume_step
        log(f"resumed from {checkpoint.checkpoint_dir(workdir)} at step {start_step}")
        warn_if_schedule_changed(stored["config"], run, resume_step)
    manager.close()
    meta = {"config": config_data, "init_from": run.init_from, "init_from_step": init_from_step,
            "params_scope": "trainable" if run.init_from else "all", "trainable": param_paths(trainable),
            "data": data_fingerprint(data)}

    # ---------------------------------------------------------------- Compiled steps
    train_step, eval_step = make_steps(graphdef, tx, DTYPES[run.compute_dtype], balance_weight=run.balance_weight,
                                       keep_float32=keep_float32)
    train_step = jax.jit(train_step, donate_argnums=(0, 1),
                         out_shardings=(trainable_sharding, opt_sharding, None))
    eval_step = jax.jit(eval_step)
    tokens_per_step = run.batch_size * run.data.seq_len
    lr_schedule = learning_rate_schedule(run.optim, run.total_steps)
    peak = peak_flops()

    # ---------------------------------------------------------------- Loop
    os.makedirs(workdir, exist_ok=True)
    manager = checkpoint.make_manager(workdir, keep=run.keep_checkpoints)
    # (no checkpoint: the records an earlier attempt logged go, a zero-shot evaluation at step 0 too)
    writer = MetricWriter(workdir, resume_step=-1 if resume_step is None else start_step)
    progress = Progress(run.total_steps, initial_step=start_step)
    logged, last_time, last_step = [], time.perf_counter(), start_step

    def evaluate_and_write(step) -> float:
        """Evaluates the current parameters on the held-out batches, writes and prints the result; returns the
        seconds it took."""
        start = time.perf_counter()
        result = evaluate(eval_step, trainable, frozen, eval_batches, mesh)
        writer.write(step, result, kind="eval")
        seconds = time.perf_counter() - start
        progress.write(f"step {step}: held-out loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} "
                       f"({len(eval_batches)} batches, {seconds:.1f} s)")
        return seconds

    # The mesh context lets the Pallas kernels run per shard (`focal_jax.kernels.partition`); the steps trace here.
    with StopSignal(install=jax.process_count() == 1) as stop, jax.set_mesh(mesh), saves_finished(manager):
        if run.total_steps == 0 and resume_step is None:  # a zero-shot baseline: the starting model, evaluated, saved
            if eval_batches:
                evaluate_and_write(0)
            checkpoint.save(manager, 0, params=saved_params(trainable), opt_state=opt_state,
                            data_state=data_iter.get_state(), meta={**meta, "step": 0}, force=True)
        for step in range(start_step + 1, run.total_steps + 1):
            batch = shard_batch(next(data_iter), mesh)
            trainable, opt_state, metrics = train_step(trainable, opt_state, frozen, batch)

            if step % run.log_every == 0 or step == run.total_steps:
                metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                tokens_per_s = tokens_per_step * (step - last_step) / (now - last_time)
                last_time, last_step = now, step
                metrics.update(lr=float(lr_schedule(step - 1)), tokens_per_s=tokens_per_s)
                utilisation = mfu(tokens_per_s, flops_per_token, jax.device_count(), peak)
                if utilisation is not None:
                    metrics["mfu"] = utilisation
                writer.write(step, metrics)
                logged.append({"step": step, **metrics})
                progress.update(step, loss=metrics["loss"], tokens_per_s=tokens_per_s, mfu=utilisation)

            # tokens_per_s and mfu count training time only: the time of evaluations and checkpoint saves is left
            # out, each clocked once the steps dispatched before it have run
            if eval_batches and (step % run.eval_every == 0 or step == run.total_steps):
                jax.block_until_ready(trainable)
                last_time += evaluate_and_write(step)

            preempted = stop.received or manager.reached_preemption(step)
            stopping = preempted or step == stop_after
            if step % run.ckpt_every == 0 or step == run.total_steps or stopping:
                jax.block_until_ready(trainable)
                save_start = time.perf_counter()
                checkpoint.save(manager, step, params=saved_params(trainable), opt_state=opt_state,
                                data_state=data_iter.get_state(), meta={**meta, "step": step}, force=True)
                last_time += time.perf_counter() - save_start
            if stopping:
                log(f"stopping at step {step} ({'SIGTERM' if preempted else 'requested'}); checkpoint saved")
                break
    # ---------------------------------------------------------------- Finish
    manager.close()
    progress.close()
    writer.close()
    if jax.process_index() == 0 and logged:
        # Imported here: `focal_jax.train` imports this module, and `python -m focal_jax.train.plot` warns when the
        # package has already imported the module it is about to run.
        from focal_jax.train.plot import plot_losses

        # (the loss, and a Focus run's dominance or a learned temperature's tau per layer: `default_panels`)
        log(f"loss curve: {plot_losses([workdir], os.path.join(workdir, 'loss.png'))}")
    return logged

