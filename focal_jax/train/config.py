"""The trainer's config schema: every key with its default, and the checks that turn a `ConfigDict` into the
frozen dataclasses the code uses (so that an unknown or misspelt key fails at once, with its name).

    seed, total_steps, batch_size (global sequences per step), log_every, eval_every, eval_batches, ckpt_every,
    keep_checkpoints, mesh {data, fsdp, tensor}, compute_dtype, param_dtype, init_from, balance_weight (the Focus
    balance loss, `focal_jax.train.trainer.balance_loss`; 0 = off), retrofit {window, focal, focus, lora},
    model {family, size, <LlamaConfig / GPT2Config fields>}, data {DataConfig fields}, optim {OptimConfig fields}
"""

import dataclasses
import json
import math
import os
import re
import typing

import jax.numpy as jnp
import ml_collections

from focal_jax._validation import is_integer
from focal_jax.data.config import FILE_SOURCES, DataConfig
from focal_jax.data.sources import expand_paths
from focal_jax.nn.attention import FOCUS_KINDS, AttentionConfig, unread_fields_message
from focal_jax.nn.gpt2 import GPT2Config
from focal_jax.nn.llama import DERIVED_ATTENTION_FIELDS, FOCAL_SIZES, LlamaConfig, focal_config
from focal_jax.nn.lora import LoRAConfig
from focal_jax.nn.retrofit import FocalConfig, FocusConfig, WindowConfig
from focal_jax.train.optimizer import OptimConfig

FAMILIES = ("llama", "gpt2", "hf")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SEED_LIMIT = 2**32  # grain's shuffle takes seeds below it (`focal_jax.data.pipeline`)


def default_config() -> ml_collections.ConfigDict:
    """Every top-level key the trainer reads, with its default (a tiny LLaMA on the builtin corpus)."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.total_steps = 100
    config.batch_size = 8
    config.log_every = 10
    config.eval_every = 50
    config.eval_batches = 4
    config.ckpt_every = 50
    config.keep_checkpoints = 3
    config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    config.compute_dtype = "bfloat16"  # activations and matmuls; parameters and optimizer state in param_dtype
    config.param_dtype = "float32"
    config.init_from = ml_collections.FieldReference(None, field_type=str)  # a focal_jax workdir or HF directory
    # Weight of the auxiliary group-balance loss of Focus layers (trainer.balance_loss), added to the LM loss; 0 = off.
    config.balance_weight = 0.0
    # Each None or a dict of FocusConfig / FocalConfig / LoRAConfig fields, e.g. lora = {"rank": 4, "alpha": 8.0,
    # "targets": "qkvo"}; window: None or an int w, a sliding window put on the loaded model's attention (key j
    # visible iff 0 <= i - j <= w; WindowConfig, any model family, kinds dense / focal / focal_learned). Applied in
    # the order window, focal, focus, lora.
    config.retrofit = ml_collections.ConfigDict({"focus": None, "focal": None, "lora": None,
                                                 "window": ml_collections.FieldReference(None, field_type=int)})
    config.model = ml_collections.ConfigDict({"family": "llama", "size": "tiny"})
    config.data = _section(DataConfig())
    # A section, so that `--config.data.task_kwargs.n_pairs=6` (or a dict in a config file) sets one option of the
    # synthetic task; DataConfig stores them as sorted (key, value) pairs.
    del config.data["task_kwargs"]
    config.data.task_kwargs = ml_collections.ConfigDict()
    config.optim = _section(OptimConfig())
    return config


def _section(instance) -> ml_collections.ConfigDict:
    """A ConfigDict of a dataclass's fields; fields that default to None become typed references, so that
    `--config.data.cache_dir=DIR` can set them from the command line."""
    hints = typing.get_type_hints(type(instance))
    section = ml_collections.ConfigDict()
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if value is None:
            field_type = next(t for t in typing.get_args(hints[field.name]) if t is not type(None))
            value = ml_collections.FieldReference(None, field_type=field_type)
        section[field.name] = value
    return section


def _check_keys(where: str, keys, allowed, sections: typing.Mapping | None = None):
    """ValueError naming the `keys` (of the section `where`, e.g. 'data.') that are not `allowed`, and, for one
    that is a key of a section in `sections` (e.g. `lr`, of `optim`), where it belongs."""
    unknown = sorted(set(keys) - set(allowed))
    if unknown:
        belongs = [f"{where}{name}.{key}" for key in unknown for name, section in (sections or {}).items()
                   if isinstance(section, ml_collections.ConfigDict) and key in section]
        hint = f" (did you mean {' or '.join(belongs)}?)" if belongs else ""
        raise ValueError(f"unknown config key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(f'{where}{k}' for k in unknown)}{hint}; valid keys of "
                         f"{where.rstrip('.') or 'the config'}: {sorted(allowed)}")


def _as_dict(value, where: str | None = None) -> dict:
    """A config section (a ConfigDict, a dict, None for empty) as a dict; with `where` (its dotted name), a
    ValueError naming it when it is not a section (e.g. `config.mesh = 4` in a config file)."""
    if value is None:
        return {}
    if isinstance(value, ml_collections.ConfigDict):
        return value.to_dict()
    if where is not None and not isinstance(value, typing.Mapping):
        raise ValueError(f"{where} must be a section (a dict of its fields), got {where}={value!r}")
    return dict(value)


def _named(where: str, error: ValueError, names) -> ValueError:
    """`error` with the field name its message starts with put under its section `where`, e.g. DataConfig's
    'seq_len must be ...' as 'data.seq_len must be ...'; `error` itself when its message starts with no name of
    `names` (messages that name their class, 'GPT2Config: ...', 'FocalConfig: ...', or their section, 'optim.lr
    ...', stay as they are)."""
    first = re.match(r"\w+", str(error))
    if first is None or first.group() not in names:
        return error
    return ValueError(where + str(error))


def _dataclass(cls, where: str, values: dict):
    fields = dataclasses.fields(cls)
    _check_keys(where, values, [f.name for f in fields])
    required = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values]
    if missing:
        raise ValueError(f"{where.rstrip('.')} needs {', '.join(where + name for name in missing)} (it has "
                         f"{sorted(values) or 'nothing'})")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return cls(**values)
    except ValueError as e:
        raise _named(where, e, [f.name for f in fields]) from None


class ConfigError(ValueError):
    """A setting of a run that cannot work, found once the run's data or model is built (a vocabulary smaller than
    the tokenizer's, an `init_from` run of another architecture, ...); `python -m focal_jax.train` prints it as one
    line, as it does the errors of `check_config`."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A checked trainer config: the scalar settings plus the frozen dataclasses built from the sections."""

    seed: int
    total_steps: int
    batch_size: int
    log_every: int
    eval_every: int
    eval_batches: int
    ckpt_every: int
    keep_checkpoints: int
    mesh: dict
    compute_dtype: str
    param_dtype: str
    init_from: str | None  # absolute (the config may give it relative to the working directory)
    balance_weight: float
    family: str
    model: LlamaConfig | GPT2Config | None  # None for family 'hf' (the architecture comes from init_from)
    retrofit: tuple  # WindowConfig / FocalConfig / FocusConfig / LoRAConfig, applied in this order
    data: DataConfig
    optim: OptimConfig
    raw: ml_collections.ConfigDict  # the config as given, stored in checkpoints
    hf_remat: bool = False  # family 'hf': rematerialise the loaded model's blocks (`model.remat`)


def model_config(section: dict) -> tuple[str, LlamaConfig | GPT2Config | None]:
    """`(family, model config)` from the `model` section: `family` 'llama' (with an optional Focal paper `size`,
    then any LlamaConfig field), 'gpt2' (GPT2Config fields) or 'hf' (built from `init_from`; only `remat`, which
    `RunConfig.hf_remat` holds)."""
    section = dict(section)
    family = section.pop("family", "llama")
    if family not in FAMILIES:
        raise ValueError(f"model.family={family!r} is not one of {FAMILIES}")
    if family == "hf":
        _check_keys("model.", section, ["remat"])
        if not isinstance(section.get("remat", False), bool):
            raise ValueError(f"model.remat must be True or False, got {section['remat']!r}")
        return family, None
    if family == "gpt2":
        return family, _dataclass(GPT2Config, "model.", section)
    size = section.pop("size", None)
    names = [f.name for f in dataclasses.fields(LlamaConfig)]
    _check_keys("model.", section, names)
    if size is not None and size not in FOCAL_SIZES:
        raise ValueError(f"model.size={size!r} is not one of {tuple(FOCAL_SIZES)}")
    try:
        return family, LlamaConfig(**section) if size is None else focal_config(size, **section)
    except ValueError as e:  # a LlamaConfig field, else an attention setting (LlamaConfig builds its AttentionConfig)
        named = _named("model.", e, names)
        raise (_named("model.attn.", e, [f.name for f in dataclasses.fields(AttentionConfig)]) if named is e
               else named) from None


RETROFITS = {"focal": FocalConfig, "focus": FocusConfig, "lora": LoRAConfig}


def retrofit_configs(section: dict) -> list:
    """The retrofit configs of the `retrofit` section, in the order they apply: `WindowConfig` (`window`), then
    `FocalConfig`, `FocusConfig` and `LoRAConfig` (`focal`, `focus`, `lora`: each a dict of its fields, `{}` for its
    defaults, None for none)."""
    _check_keys("retrofit.", section, ("focus", "focal", "lora", "window"))
    retrofit = []
    window = section.get("window")
    if window is not None:
        if section.get("focus") is not None:
            raise ValueError(f"retrofit.window={window!r} and retrofit.focus do not go together: Focus has its own "
                             f"local window (retrofit.focus.window)")
        try:
            retrofit.append(WindowConfig(window))
        except ValueError as e:
            raise ValueError(f"retrofit.window: {e}") from None
    for name, cls in RETROFITS.items():
        if section.get(name) is not None:  # {} too: e.g. Focal with its defaults
            retrofit.append(_dataclass(cls, f"retrofit.{name}.", _as_dict(section[name])))
    return retrofit


def check_attention_fields(model: LlamaConfig | GPT2Config | None) -> None:
    """ValueError naming the attention settings of `model` that its attention kind does not read (e.g.
    `model.attn.focal_t=0.3` with kind 'dense'): the run would train another attention than the one asked for.
    The trainer checks the runs it trains; stored runs load as they are."""
    if model is not None and (unread := unread_fields_message(model.attention)):
        raise ValueError(f"model {unread}: set the kind that uses them, or leave them out")


def check_data_fields(data: DataConfig) -> None:
    """ValueError when `data.paths` names files but `data.source` reads none ('builtin', 'synthetic'), e.g. paths
    set and the source left at its default: the run would train on another corpus than the files named. The
    trainer checks the runs it trains; stored runs load as they are."""
    if data.paths and data.source not in FILE_SOURCES:
        raise ValueError(f"data.paths={list(data.paths)} names files, but data.source={data.source!r} reads none: set "
                         f"data.source to the files' format ({', '.join(FILE_SOURCES)}), or leave paths out")


def check_data_files(data: DataConfig) -> None:
    """ValueError naming a pattern of `data.paths` / `data.eval_paths` that matches no file, or a `data.tokenizer`
    that is not a file (before the run builds its data, which would say so in a traceback)."""
    where = f"relative paths are from the working directory {os.getcwd()}"
    for name in ("paths", "eval_paths"):
        try:
            expand_paths(getattr(data, name))
        except FileNotFoundError as e:
            raise ValueError(f"data.{name}: {e} ({where})") from None
    if data.tokenizer and not os.path.isfile(os.path.expanduser(data.tokenizer)):
        raise ValueError(f"data.tokenizer={data.tokenizer!r} is not a file ({where}; a SentencePiece .model or a "
                         f"Hugging Face tokenizer.json)")


def check_windows(run: RunConfig) -> None:
    """ValueError when a window the config sets for training covers every key of its sequences: a Focus window
    (`model.attn.focus_window` of a Focus kind, `retrofit.focus.window`; Focus would route no token by group, so its
    centroids would never train) or a sliding window, the model's own (`model.attn.window`, GPT-2's
    `model.window`) or a retrofit's (`retrofit.window`; it would change nothing: the run would train full causal
    attention), of at least `data.seq_len - 1` (key j is local to query i iff `0 <= i - j <= window`). Only for
    training: a stored run is evaluated at any length."""
    seq_len = run.data.seq_len
    windows = []
    attention = None if run.model is None else run.model.attention
    if attention is not None and attention.kind in FOCUS_KINDS:
        field = "model.focus_window" if run.family == "gpt2" else "model.attn.focus_window"
        windows.append((field, attention.focus_window, "Focus would route no token by group"))
    elif attention is not None and attention.window is not None:
        field = "model.window" if run.family == "gpt2" else "model.attn.window"
        windows.append((field, attention.window, "the window would change nothing"))
    for change in run.retrofit:
        if isinstance(change, FocusConfig):
            windows.append(("retrofit.focus.window", change.window, "Focus would route no token by group"))
        elif isinstance(change, WindowConfig):
            windows.append(("retrofit.window", change.window, "the window would change nothing"))
    for field, window, effect in windows:
        if window >= seq_len - 1:
            raise ValueError(f"{field}={window} covers every key of data.seq_len={seq_len} sequences (key j is local "
                             f"to query i iff 0 <= i - j <= window): {effect}; give a window < {seq_len - 1}, or "
                             f"longer sequences")


def check_routing_trains(run: RunConfig) -> None:
    """ValueError when the run trains only the Focus routing (`optim.trainable` 'centroids', or
    'centroids+temperature' with no learned temperature), every Focus layer is hard (its `focus_topk` or
    `retrofit.focus.topk` set) and there is no balance loss: the top-k membership has no gradient, so every step
    would change nothing (a gradient norm of exactly 0) and the run would save its initial centroids. Train with
    the soft gate (topk None) and evaluate with hard top-k (`python -m focal_jax.eval perplexity --topk k`)."""
    trainable = run.optim.trainable
    learned = (run.model is not None and run.model.attention.kind == "focal_learned") or any(
        isinstance(change, FocalConfig) and change.learned for change in run.retrofit)
    if run.balance_weight > 0 or not (trainable == "centroids" or (trainable == "centroids+temperature"
                                                                   and not learned)):
        return
    topks = []
    if run.model is not None and run.model.attention.kind in FOCUS_KINDS:
        field = "model.focus_topk" if run.family == "gpt2" else "model.attn.focus_topk"
        topks.append((field, run.model.attention.focus_topk))
    topks += [("retrofit.focus.topk", change.topk) for change in run.retrofit if isinstance(change, FocusConfig)]
    if topks and all(topk is not None for _, topk in topks):
        field, topk = topks[-1]
        raise ValueError(f"{field}={topk} (hard top-k routing) with optim.trainable={trainable!r}: the top-k "
                         f"membership has no gradient, so the centroids would never train; train with the soft gate "
                         f"({field} None) and evaluate with hard top-k, or set balance_weight > 0")


def warmup_note(run: RunConfig) -> str | None:
    """One line saying what the learning-rate schedule does with a warmup longer than the schedule
    (`optim.warmup_steps` > `optim.decay_steps`, which defaults to `total_steps`): `learning_rate_schedule` cuts the
    warmup to `decay_steps`; None when the warmup fits or the run trains no step. A note, not an error: a short run
    of a config made for a long one is a common smoke test (`default_config()` itself: 2000 warmup steps of 100)."""
    warmup, total, decay = run.optim.warmup_steps, run.total_steps, run.optim.decay_steps
    if total == 0 or warmup <= (decay or total):
        return None
    if decay is None:
        return (f"optim.warmup_steps={warmup} is longer than the run, total_steps={total} (where the schedule ends, "
                f"optim.decay_steps being None): the warmup is cut to {total} steps, so the learning rate rises the "
                f"whole run, to {total - 1}/{total} of optim.lr={run.optim.lr:g} at its last step, and never "
                f"decays; set optim.warmup_steps below {total} to decay")
    return (f"optim.warmup_steps={warmup} is longer than optim.decay_steps={decay} (where the schedule ends): the "
            f"warmup is cut to {decay} steps, after which the learning rate reaches optim.lr={run.optim.lr:g} and "
            f"falls to optim.final_lr_fraction={run.optim.final_lr_fraction:g} of it one step later (no cosine "
            f"decay); set optim.warmup_steps below {decay}")


def check_config(config: ml_collections.ConfigDict) -> RunConfig:
    """Validate `config` against `default_config()` and build a `RunConfig`; raises ValueError naming any unknown
    key or bad value (a field of a section by its dotted name, e.g. `data.seq_len`)."""
    defaults = default_config()
    _check_keys("", config.keys(), defaults.keys(), sections=defaults)
    merged = {k: config.get(k, defaults[k]) for k in defaults.keys()}
    seed = merged["seed"]
    if not is_integer(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be an integer >= 0 and < 2**32 (the data shuffle's limit), got seed={seed!r}")
    sections = {name: _as_dict(merged[name], name) for name in ("mesh", "retrofit", "model", "data", "optim")}
    for name in ("total_steps", "batch_size", "log_every", "eval_every", "ckpt_every", "keep_checkpoints",
                 "eval_batches"):
        # 0 steps: a zero-shot baseline; 0 eval batches: no evaluation
        value, least = merged[name], 0 if name in ("total_steps", "eval_batches") else 1
        if not is_integer(value) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {name}={value!r}")
        merged[name] = int(value)
    for name in ("compute_dtype", "param_dtype"):
        if not isinstance(merged[name], str) or merged[name] not in DTYPES:
            raise ValueError(f"{name}={merged[name]!r} is not one of {tuple(DTYPES)}")
    weight = merged["balance_weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
        raise ValueError(f"balance_weight must be a finite number >= 0, got balance_weight={weight!r}")
    mesh = sections["mesh"]
    _check_keys("mesh.", mesh, ("data", "fsdp", "tensor"))
    for axis, size in mesh.items():
        if not is_integer(size) or not (size >= 1 or size == -1):
            raise ValueError(f"mesh.{axis} must be an integer >= 1 or -1 (the rest of the devices), got "
                             f"mesh.{axis}={size!r}")
        mesh[axis] = int(size)
    retrofit = retrofit_configs(sections["retrofit"])
    window = next((c.window for c in retrofit if isinstance(c, WindowConfig)), None)
    family, model = model_config(sections["model"])
    if window is not None and model is not None and model.attention.kind in FOCUS_KINDS:
        raise ValueError(f"retrofit.window={window!r} cannot go on model attention kind={model.attention.kind!r}: "
                         f"Focus has its own local window (focus_window={model.attention.focus_window})")
    init_from = merged["init_from"]
    if init_from is not None and not isinstance(init_from, (str, os.PathLike)):
        raise ValueError(f"init_from must be None or a directory (a path), got init_from={init_from!r}")
    if family == "hf" and not init_from:
        raise ValueError("model.family='hf' builds the model from a Hugging Face directory: set init_from")
    if init_from and not os.path.isdir(os.path.expanduser(init_from)):
        raise ValueError(f"init_from={init_from!r} is not a directory (a focal_jax workdir or a Hugging Face "
                         f"model directory)")
    return RunConfig(
        seed=int(seed), total_steps=merged["total_steps"], batch_size=merged["batch_size"],
        log_every=merged["log_every"], eval_every=merged["eval_every"], eval_batches=merged["eval_batches"],
        ckpt_every=merged["ckpt_every"], keep_checkpoints=merged["keep_checkpoints"], mesh=mesh,
        compute_dtype=merged["compute_dtype"], param_dtype=merged["param_dtype"],
        init_from=os.path.abspath(os.path.expanduser(init_from)) if init_from else None,
        balance_weight=float(weight), family=family, model=model,
        retrofit=tuple(retrofit), data=_dataclass(DataConfig, "data.", sections["data"]),
        optim=_dataclass(OptimConfig, "optim.", sections["optim"]), raw=config,
        hf_remat=family == "hf" and sections["model"].get("remat", False))


# Keys (dotted) that may change when a run resumes from its own workdir (everything else must match the stored
# config). `model.init_std` draws parameters that the checkpoint then replaces (the trainer refuses a change for a
# run stored before 0.6.9 whose frozen parameters are its seed's draws).
RESUMABLE_CHANGES = ("total_steps", "optim.decay_steps", "log_every", "eval_every", "eval_batches", "ckpt_every",
                     "keep_checkpoints", "mesh", "data.prefetch", "data.cache_dir", "model.init_std")


def task_kwargs_dict(value) -> dict:
    """`data.task_kwargs` of a config dict as a dict (runs stored by 0.6.9 and earlier hold (key, value) pairs)."""
    return dict(value.items() if hasattr(value, "items") else value or ())


def with_defaults(config: dict) -> dict:
    """A config dict (`checkpoint.config_json`) with the keys it leaves out (which `check_config` reads at their
    defaults) filled in: the top-level keys and the fields of the sections `data`, `optim` and `mesh` (`model` and
    `retrofit` stay as given: their keys depend on the model family and on which retrofits are set;
    `config_differences` compares them as the configs they build). So a stored config and the same config with a
    default written out compare equal, and a resume can read any key."""
    defaults = json.loads(default_config().to_json_best_effort(sort_keys=True))
    complete = {**defaults, **config}
    for section in ("data", "optim", "mesh"):
        if isinstance(config.get(section), dict):
            complete[section] = {**defaults[section], **config[section]}
    return complete


def config_differences(stored: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between two config dicts (nested), ignoring `RESUMABLE_CHANGES`; a key
    either side leaves out is read at its default (`with_defaults`; `model` and `retrofit` as the configs they
    build: `built_model_section`, `built_retrofit_section`), so a run stored before a key was added resumes when the
    key holds its default now."""
    stored, current = with_defaults(stored), with_defaults(current)
    for key, built_section in (("model", built_model_section), ("retrofit", built_retrofit_section)):
        built = built_section(stored.get(key)), built_section(current.get(key))
        if None not in built:
            stored[key], current[key] = built
    return _differences(stored, current, "")


def built_model_section(section) -> dict | None:
    """The `model` section of a config dict as the model config it builds (`model_config`): its family and every
    field, defaults filled in, `size` spelled out, and (LlamaConfig) `attn` as every attention setting; so a section
    that leaves out a default (`family: 'llama'`, `attn.focal_t`) compares equal to one that writes it. None when
    the section builds no model config (it is then compared as written)."""
    try:
        family, model = model_config(_as_dict(section))
    except (ValueError, TypeError):
        return None
    if model is None:  # family 'hf'
        return {"family": family, "remat": _as_dict(section).get("remat", False)}
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    if family == "llama":
        attention = dataclasses.asdict(model.attention)
        fields["attn"] = {k: v for k, v in attention.items() if k not in DERIVED_ATTENTION_FIELDS}
    return json.loads(json.dumps({"family": family, **fields}, default=str))


def built_retrofit_section(section) -> dict | None:
    """The `retrofit` section of a config dict as the retrofit configs it builds (`retrofit_configs`): each one set,
    with every field (`window` as its number), so a field left at its default compares equal to one written out.
    None when the section builds none (it is then compared as written)."""
    try:
        configs = retrofit_configs(_as_dict(section or {}))
    except (ValueError, TypeError):
        return None
    names = {cls: name for name, cls in RETROFITS.items()}
    built = {names[type(c)]: dataclasses.asdict(c) for c in configs if type(c) in names}
    built.update({"window": c.window for c in configs if isinstance(c, WindowConfig)})
    return json.loads(json.dumps(built, default=str))


def _differences(stored: dict, current: dict, prefix: str) -> list[str]:
    diffs = []
    for key in sorted(set(stored) | set(current)):
        full = prefix + key
        if full in RESUMABLE_CHANGES:
            continue
        a, b = stored.get(key), current.get(key)
        if full == "data.task_kwargs":
            a, b = task_kwargs_dict(a), task_kwargs_dict(b)
        if full == "init_from":  # the same directory, however it is written
            a, b = (os.path.realpath(os.path.expanduser(x)) if isinstance(x, str) else x for x in (a, b))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            a, b = list(a), list(b)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} (stored) vs {b!r} (now)")
    return diffs
