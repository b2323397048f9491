"""Retrofit Focus or Focal attention into a loaded model (GPT-2 or the LLaMA family) in place.

`retrofit(model, FocusConfig(...))` / `retrofit(model, FocalConfig(...))` switches every `Attention` module of the
model to the new kind and adds the parameters that kind needs (`Centroid` for Focus, `Temperature` for learned Focal),
changing nothing else: the pretrained weights are the same arrays, and the model's own config (`Llama.config.attn`,
the attention fields of `GPT2Config`) is updated so that it keeps describing its layers. Train only the new
parameters with `trainable_filter`:

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from focal_jax.nn.gpt2 import GPT2, GPT2Config
  >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4), rngs=nnx.Rngs(0))
  >>> model = retrofit(model, FocusConfig(groups=4, dim=8, window=4))
  >>> model.config.kind, count_params(model, trainable_filter('centroids'))  # 2 x (32 x 8 + 4 x 8)
  ('focus', 576)
  >>> model(jnp.zeros((1, 6), jnp.int32)).shape
  (1, 6, 50)

Combining: Focal (constant) then Focus, or Focus then Focal, gives kind 'focal+focus'. Retrofitting Focus onto a
model that already has Focus with the same `groups` and `dim` keeps the trained centroids and only changes the
settings (e.g. soft gate for training, then `topk=` for hard inference).

`replace_attention(model, window=128)` changes attention settings that add or remove no parameters (a sliding
window, the implementation, hard top-k, a temperature, ...) in place; `retrofit(model, WindowConfig(128))` is the
same change as a retrofit step (the trainer's `retrofit.window`).

New parameters are created by `Attention.__init__` itself: a fresh `Attention` with the new config is built under
`jax.jit` for each layer, and only its `Centroid` / `Temperature` leaves are returned (XLA drops the unused
projections), so their initialisation cannot drift from the module's.
"""

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focal_jax._validation import plain_numbers
from focal_jax.attention.focus import unit_rows
from focal_jax.nn.attention import (CUSTOM_KINDS, FIELD_KINDS, FOCUS_KINDS, Attention, AttentionConfig,
                                    record_attention)
from focal_jax.nn.gpt2 import GPT2, ATTENTION_FIELDS
from focal_jax.nn.layers import as_rngs, check_ids, float_dtype
from focal_jax.nn.llama import Llama
from focal_jax.nn.lora import LoRAConfig, add_lora
from focal_jax.nn.models import attention_modules
from focal_jax.nn.variables import Centroid, LoRA, Temperature

NEW_TYPES = (Centroid, Temperature, LoRA)
TRAINABLE = {"all": nnx.Param, "centroids": Centroid, "temperature": Temperature,
             "centroids+temperature": (Centroid, Temperature), "lora": LoRA}

CENTROID_INITS = ("random", "kmeans")
KMEANS_ITERS = 20

# A minimal valid AttentionConfig whose focus / focal fields are replaced to validate the retrofit configs.
_PROBE = dict(d_model=1, n_heads=1, n_kv_heads=1, head_dim=2, rope_theta=None)


def _validate(cls_name, fields, renames):
    """Build an AttentionConfig with `fields`; re-raise its ValueError with our field names (`renames`). Its
    warnings are not passed on: they would speak of the probe's head_dim, not the model's."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            AttentionConfig(**_PROBE, **fields)
    except ValueError as e:
        message = str(e)
        for theirs, ours in renames.items():
            message = re.sub(rf"\b{theirs}\b", ours, message)
        raise ValueError(f"{cls_name}: {message}") from None


@dataclasses.dataclass(frozen=True)
class FocusConfig:
    """Focus attention (arXiv 2604.03260) to retrofit: `groups` centroids K of dimension `dim` (d_g), local
    `window` w (key j is local to query i iff 0 <= i - j <= w), routing temperature `tau`, Sinkhorn `iters`,
    soft `gate` ('paper' | 'log') with sharpness `lam`, hard top-k membership when `topk` is set (None: soft gate),
    `causal` routing (prefix column sums), `assign` ('sinkhorn', the paper's; 'softmax': the unbalanced collapse
    baseline), `normalize` (cosine routing scores, the default; False: raw dot products), `sink` (the first `sink`
    tokens of each document visible to every later query, FOCUS_SPEC OQ-12; 0, the default, is off). Fields mean
    `AttentionConfig.focus_*`, except `init`, how `retrofit` sets the new centroids (FOCUS_SPEC OQ-6): 'random'
    (default: random unit rows, `Attention`'s own) | 'kmeans' (k-means of each layer's projected routing inputs on
    sample batches, `kmeans_centroids`; `retrofit` then needs `init_batches`). Checked at construction."""

    groups: int
    dim: int
    window: int
    tau: float = 0.1
    iters: int = 10
    gate: str = "paper"
    lam: float = 10.0
    topk: int | None = None
    causal: bool = False
    assign: str = "sinkhorn"
    normalize: bool = True
    sink: int = 0
    init: str = "random"

    def __post_init__(self):
        plain_numbers(self)
        if self.init not in CENTROID_INITS:
            raise ValueError(f"FocusConfig: init={self.init!r} is not one of {CENTROID_INITS}")
        renames = {f"focus_{f.name}": f.name for f in dataclasses.fields(self)}
        _validate("FocusConfig", {"kind": "focus", **self.attention_fields()}, renames)

    def attention_fields(self) -> dict:
        """The `AttentionConfig` fields this config sets (the `focus_*` ones: every field but `init`)."""
        return {f"focus_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "init"}


@dataclasses.dataclass(frozen=True)
class FocalConfig:
    """Focal attention (arXiv 2511.06818) to retrofit: a constant temperature `t` (logits `q.k * scale / t`;
    t < 1 sharpens, t = 1 is dense), or `learned=True`: per-layer `Temperature` parameters with tau clipped to
    [tau_min, tau_max], averaged as `tau_mode` says ('prefix': causal running mean, the default; 'sequence': the
    paper's whole-row mean; 'token': none) and clipped as `tau_clip` says ('hard', the default, |
    'straight_through' | 'smooth'), one tau per layer or per head (`tau_granularity`), with or without the
    mid-range offset (`tau_bias`), from the normed attention input or the residual stream (`tau_input`): the
    `AttentionConfig` fields of those names. With `learned=True`, `t` must be left unset (it becomes None)."""

    t: float | None = 0.4
    learned: bool = False
    tau_min: float = 5.0
    tau_max: float = 10.0
    tau_mode: str = "prefix"
    tau_clip: str = "hard"
    tau_granularity: str = "layer"
    tau_bias: bool = True
    tau_input: str = "normed"

    def __post_init__(self):
        plain_numbers(self)
        if not isinstance(self.learned, bool):
            raise ValueError(f"FocalConfig: learned must be a bool, got learned={self.learned!r}")
        if self.learned:
            if self.t is not None and self.t != 0.4:
                raise ValueError(f"FocalConfig: t={self.t!r} is the constant temperature; learned=True learns it "
                                 f"within [tau_min, tau_max], so leave t unset")
            object.__setattr__(self, "t", None)
            _validate("FocalConfig", dict(kind="focal_learned", **self.attention_fields()), {})
        else:
            if (self.tau_min, self.tau_max) != (5.0, 10.0):
                raise ValueError(f"FocalConfig: tau_min={self.tau_min!r}, tau_max={self.tau_max!r} are for the "
                                 f"learned temperature; set learned=True or leave them unset")
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name in LEARNED_FIELDS[2:]:
                if getattr(self, name) != defaults[name]:
                    raise ValueError(f"FocalConfig: {name}={getattr(self, name)!r} is for the learned temperature; "
                                     f"set learned=True or leave {name} unset")
            if self.t is None:
                raise ValueError("FocalConfig: t=None needs learned=True (give a constant temperature t > 0, or "
                                 "learned=True)")
            _validate("FocalConfig", dict(kind="focal", focal_t=self.t, tau_min=self.tau_min,
                                          tau_max=self.tau_max), {"focal_t": "t"})

    def attention_fields(self) -> dict:
        if self.learned:
            return {name: getattr(self, name) for name in LEARNED_FIELDS}
        return {"focal_t": self.t}


# The fields of a learned FocalConfig, which are AttentionConfig's of the same names.
LEARNED_FIELDS = ("tau_min", "tau_max", "tau_mode", "tau_clip", "tau_granularity", "tau_bias", "tau_input")


@dataclasses.dataclass(frozen=True)
class WindowConfig:
    """A sliding window to put on a loaded model's attention (the trainer's `retrofit.window`): key j is visible to
    query i iff `0 <= i - j <= window` (w + 1 keys, self included; Hugging Face's `sliding_window` is w + 1), the
    same as `jax.nn.dot_product_attention(local_window_size=(window, 0))`. No parameters are added: `retrofit`
    applies it with `replace_attention(model, window=window)`. For attention kinds 'dense', 'focal' and
    'focal_learned'; a Focus kind has its own local window (`FocusConfig.window`)."""

    window: int

    def __post_init__(self):
        plain_numbers(self)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"WindowConfig: window must be an integer >= 0, got window={self.window!r}")


def _new_kind(current: str, config) -> str:
    """The attention kind after retrofitting `config` onto a layer of kind `current`."""
    if isinstance(config, FocusConfig):
        table = {"dense": "focus", "focal": "focal+focus", "focus": "focus", "focal+focus": "focal+focus"}
    elif config.learned:
        table = {"dense": "focal_learned", "focal": "focal_learned", "focal_learned": "focal_learned"}
    else:
        table = {"dense": "focal", "focal": "focal", "focus": "focal+focus", "focal+focus": "focal+focus"}
    if current not in table:
        if current in CUSTOM_KINDS:
            why = "a kind registered with register_attention is its own function"
        elif isinstance(config, FocusConfig) or config.learned:
            why = "there is no kind with both a learned Focal temperature and Focus"
        else:
            why = "a constant temperature would drop the learned Temperature parameters"
        name = f"{type(config).__name__}{'(learned=True)' if getattr(config, 'learned', False) else ''}"
        raise ValueError(f"cannot retrofit {name} onto attention kind={current!r} ({why}); it combines with kind "
                         f"in {tuple(table)}")
    return table[current]


@functools.lru_cache(maxsize=64)
def _param_types(config: AttentionConfig) -> dict:
    """{attribute name: (Variable type, shape, dtype)} of the Centroid / Temperature parameters that
    `Attention(config)` creates, from shapes only (cached per config; do not mutate the result)."""
    abstract = nnx.eval_shape(lambda: Attention(config, rngs=nnx.Rngs(0)))
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Any(*NEW_TYPES))):
        value = var.get_value()
        out[path[-1] if len(path) == 1 else path] = (type(var), tuple(value.shape), value.dtype)
    return out


def _init_fn(config: AttentionConfig, names):
    """A jitted `key -> {name: array}` returning the named parameters of a fresh `Attention(config)`."""

    @jax.jit
    def init(key):
        fresh = Attention(config, rngs=nnx.Rngs(params=key))
        return {name: getattr(fresh, name).get_value() for name in names}

    return init


def _updated_model_config(model, changes: dict):
    """The model's config with the attention `changes` applied, and its attention config."""
    if isinstance(model, Llama):
        config = dataclasses.replace(model.config, attn={**dict(model.config.attn), **changes})
        return config, config.attention
    if isinstance(model, GPT2):
        # GPT2Config carries ATTENTION_FIELDS (all but the RoPE ones): a field it lacks may only take its default.
        defaults = {f.name: f.default for f in dataclasses.fields(AttentionConfig)}
        for name in sorted(set(changes) - set(ATTENTION_FIELDS)):
            if changes[name] != defaults[name]:
                raise ValueError(f"{name}={changes[name]!r} is not available for GPT-2 models (GPT2Config has no "
                                 f"{name} field; only the default {defaults[name]!r}); use a LLaMA-family model")
        changes = {k: v for k, v in changes.items() if k in ATTENTION_FIELDS}
        config = dataclasses.replace(model.config, **changes)
        return config, config.attention_config()
    raise ValueError(f"retrofit supports focal_jax Llama and GPT2 models, got {type(model).__name__}")


# AttentionConfig fields fixed by the model's architecture (its parameter shapes, its norms and rotary base):
# `replace_attention` never changes them.
ARCHITECTURE_FIELDS = ("d_model", "n_heads", "n_kv_heads", "head_dim", "qkv_bias", "out_bias", "qk_norm", "norm_eps",
                       "rope_theta", "focus_groups", "focus_dim")
# The fields `replace_attention` changes (`kind` only between kinds with the same parameters).
REPLACEABLE_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionConfig) if f.name not in ARCHITECTURE_FIELDS)


@functools.lru_cache(maxsize=64)
def _param_specs(config: AttentionConfig) -> dict:
    """{parameter path: (Variable type, shape)} of every parameter `Attention(config)` creates (shapes only)."""
    abstract = nnx.eval_shape(lambda: Attention(config, rngs=nnx.Rngs(0)))
    return {".".join(map(str, path)): (type(var), tuple(var.get_value().shape))
            for path, var in nnx.to_flat_state(nnx.state(abstract))}


def replace_attention(model, *, allow_unused: bool = False, **changes):
    """Change attention settings that add or remove no parameters on every `Attention` module of `model` (a `Llama`
    or `GPT2`) in place, and update `model.config` to match; returns `model`.

    Examples: `replace_attention(model, window=128)` (a sliding window: key j visible to query i iff
    `0 <= i - j <= 128`, e.g. pretrained weights evaluated under a window), `impl='decomposed'`, `focus_topk=2`
    (hard top-k Focus), `focal_t=0.3`, `rope_ntk_factor=2.0, rope_trained_len=2048`, `kind='focal'` on a dense
    model. Every parameter array stays as it is; the forward of the changed model equals that of a model built with
    the changed config from the start and given the same parameters.

    Args:
      model: a focal_jax `Llama` or `GPT2` (also an abstract one from `nnx.eval_shape`).
      allow_unused: also allow a `kind` that uses only some of the layer's parameters (e.g. a Focus model viewed
        as 'dense', its `Centroid`s kept but unused), for evaluation views (`focal_jax.eval.diagnostics.
        attention_view`); the model then holds parameters a fresh model of its config would not have.
      **changes: `AttentionConfig` fields (`REPLACEABLE_FIELDS`) and their new values. None at all is allowed (the
        model is returned unchanged).

    Raises:
      ValueError, naming the field: a field outside `REPLACEABLE_FIELDS` (the architecture's, such as `n_heads` or
        `focus_groups`; the allowed ones are listed); a `kind` that needs new parameters (e.g. 'dense' -> 'focus':
        that is `retrofit`'s job) or that leaves some unused (unless `allow_unused`); a field that the (new) kind
        does not read, set to a new value (e.g. `focal_t` on 'dense', `focus_topk` on 'focal'); any value
        `AttentionConfig` refuses (e.g. `window` on a Focus kind, `focus_topk` > `focus_groups`); a field GPT-2's
        config lacks (RoPE scaling) set on a GPT-2; another model type; layers whose configs differ from the
        model's config.
    """
    if not isinstance(model, (Llama, GPT2)):
        raise ValueError(f"replace_attention supports focal_jax Llama and GPT2 models, got {type(model).__name__}")
    if not isinstance(allow_unused, bool):
        raise ValueError(f"allow_unused must be a bool, got allow_unused={allow_unused!r}")
    for name in changes:
        if name not in REPLACEABLE_FIELDS:
            if name in ARCHITECTURE_FIELDS:
                why = "a field of the model's architecture (its parameter shapes, norms or rotary base)"
            else:
                why = "not an AttentionConfig field"
            raise ValueError(f"replace_attention cannot change {name}={changes[name]!r}: {why}; it changes "
                             f"{REPLACEABLE_FIELDS}")
    modules = attention_modules(model)
    if not modules or not changes:
        return model

    # ---- Check every layer's new config before touching the model.
    news = []
    for path, attn in modules:
        where = ".".join(map(str, path))
        old = attn.config
        new = dataclasses.replace(old, **changes)  # validates; errors name the AttentionConfig field
        for name, value in changes.items():
            kinds = FIELD_KINDS.get(name)  # changing one on a layer of another kind would change nothing
            if kinds is not None and value != getattr(old, name) and new.kind not in kinds:
                raise ValueError(f"{name}={value!r} would change nothing on attention kind={new.kind!r} (at "
                                 f"{where}): it is read by kinds {kinds}")
        old_params, new_params = _param_specs(old), _param_specs(new)
        added = sorted(n for n in new_params if old_params.get(n) != new_params[n])
        if added:
            raise ValueError(f"kind={old.kind!r} -> {new.kind!r} needs parameters the layer ({where}) does not have: "
                             f"{added}; adding parameters is a retrofit (focal_jax.nn.retrofit.retrofit with a "
                             f"FocusConfig or FocalConfig), replace_attention changes settings only")
        unused = sorted(set(old_params) - set(new_params))
        if unused and not allow_unused:
            raise ValueError(f"kind={old.kind!r} -> {new.kind!r} would leave the parameters {unused} of {where} "
                             f"unused (the model would no longer match its config); pass allow_unused=True for an "
                             f"evaluation view")
        news.append(new)
    model_config, model_attention = _updated_model_config(model, changes)
    for (path, _), new in zip(modules, news):
        if new != model_attention:
            raise ValueError(f"layer {'.'.join(map(str, path))} has an attention config that differs from the "
                             f"model's config; replace_attention keeps them equal and cannot here")

    # ---- Apply.
    for (_, attn), new in zip(modules, news):
        attn.config = new
    model.config = model_config
    return model


def _retrofit_window(model, config: WindowConfig, impl: str | None):
    """`retrofit` of a `WindowConfig`: the sliding window through `replace_attention`."""
    for path, attn in attention_modules(model):
        c = attn.config
        if c.kind in FOCUS_KINDS:
            raise ValueError(f"cannot put a sliding window (window={config.window}) on attention kind={c.kind!r} "
                             f"(at {'.'.join(map(str, path))}): Focus has its own local window (focus_window="
                             f"{c.focus_window}, FocusConfig.window); a window is for kinds 'dense', 'focal', "
                             f"'focal_learned'")
        if c.kind in CUSTOM_KINDS:
            raise ValueError(f"cannot put a sliding window (window={config.window}) on the registered attention "
                             f"kind={c.kind!r}: its function does not read window")
    return replace_attention(model, window=config.window, **({} if impl is None else {"impl": impl}))


def retrofit(model, config, *, rngs: nnx.Rngs | int | None = None, impl: str | None = None, dtype=None,
             init_batches=None, progress=None):
    """Put Focus or Focal attention into `model` (a `Llama` or `GPT2`) in place and return it.

    Args:
      model: a loaded model, e.g. from `focal_jax.convert.hf.from_hf`.
      config: `FocusConfig` or `FocalConfig`; a `focal_jax.nn.lora.LoRAConfig` is handed to `add_lora` (the LoRA
        baseline: `LoRA` parameters on the attention projections, the attention kind unchanged); a `WindowConfig`
        puts a sliding window on the attention (`replace_attention(model, window=...)`, no new parameters; kinds
        'dense', 'focal', 'focal_learned' only).
      rngs: `nnx.Rngs` or an integer seed for the new parameters (default seed 0). One key per layer is drawn
        from `rngs.params()`.
      impl: optionally also switch the attention implementation (e.g. 'decomposed' for hard top-k Focus).
      dtype: dtype of the new parameters; None keeps `Attention`'s own (float32, also under a bf16 model, so
        that the trained routing parameters keep full precision).
      init_batches: with `FocusConfig(init='kmeans')`, the sample the centroids are fitted on: a list of token
        arrays `[B, T]` or of batch dicts (`inputs`, optional `positions`, `segment_ids`; segment id 0 is padding),
        as `kmeans_centroids` takes. Only then. `progress` (e.g. `print`) then gets a line per layer fitted.

    Returns:
      `model`, whose `Attention` modules have the new kind and config (`Centroid` / `Temperature` parameters added,
      every other parameter untouched) and whose `config` matches them.

    Raises:
      ValueError: an unsupported model type, a combination no attention kind expresses (learned Focal with Focus),
        a change that would drop parameters (constant Focal onto learned Focal), a Focus retrofit onto a model
        with a sliding window (Mistral's `window`) or with different `groups` / `dim` than the Focus it already
        has, a `WindowConfig` on a Focus model (naming both windows), any invalid resulting `AttentionConfig`
        field (named), `init='kmeans'` without `init_batches`, or `init_batches` or `progress` without it.
    """
    if not isinstance(config, (FocusConfig, FocalConfig, LoRAConfig, WindowConfig)):
        raise ValueError(f"config must be a FocusConfig or FocalConfig (or a LoRAConfig or WindowConfig), got "
                         f"{type(config).__name__}")
    if not isinstance(model, (Llama, GPT2)):
        raise ValueError(f"retrofit supports focal_jax Llama and GPT2 models, got {type(model).__name__}")
    kmeans = kmeans_init(config)
    if kmeans and init_batches is None:
        raise ValueError("FocusConfig(init='kmeans') fits the centroids on sample batches: pass init_batches=[...]")
    if init_batches is not None and not kmeans:
        raise ValueError(f"init_batches are for FocusConfig(init='kmeans'), got {config!r}")
    if progress is not None and not kmeans:
        raise ValueError(f"progress reports the k-means fit of FocusConfig(init='kmeans'), got {config!r}")
    if isinstance(config, WindowConfig):
        return _retrofit_window(model, config, impl)
    rngs = as_rngs(rngs)
    if isinstance(config, LoRAConfig):
        if impl is not None or dtype is not None:
            raise ValueError(f"impl={impl!r} and dtype={dtype!r} are for Focus and Focal retrofits; a LoRAConfig "
                             f"keeps the attention as it is (its LoRA parameters take the projections' dtype)")
        return add_lora(model, config, rngs=rngs)
    if dtype is not None:
        dtype = float_dtype(dtype)
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no Attention modules to retrofit")

    # ---- Work out every layer's new config and parameters before touching the model.
    plans = []
    for path, attn in modules:
        old = attn.config
        if isinstance(config, FocusConfig) and old.window is not None:
            raise ValueError(f"cannot retrofit Focus onto attention with a sliding window (window={old.window}, "
                             f"at {'.'.join(map(str, path))}): Focus brings its own local window (FocusConfig.window)")
        changes = {"kind": _new_kind(old.kind, config), **config.attention_fields()}
        if impl is not None:
            changes["impl"] = impl
        new = dataclasses.replace(old, **changes)  # validates; errors name the AttentionConfig field
        old_params, new_params = _param_types(old), _param_types(new)
        dropped = sorted(set(old_params) - set(new_params))
        if dropped:
            raise ValueError(f"retrofit only adds parameters: kind={old.kind!r} -> {new.kind!r} would drop {dropped}")
        for name in old_params:
            if old_params[name][:2] != new_params[name][:2]:
                raise ValueError(f"{'.'.join(map(str, path))}.{name} has shape {old_params[name][1]}, the new "
                                 f"config needs {new_params[name][1]} (groups / dim differ from the Focus the "
                                 f"model has); retrofit a model without Focus instead")
        for name in set(new_params) - set(old_params):  # parameters a view of another kind kept (replace_attention)
            held = getattr(attn, name, None)
            if isinstance(held, nnx.Variable) and tuple(held.shape) != new_params[name][1]:
                raise ValueError(f"{'.'.join(map(str, path))}.{name} has shape {tuple(held.shape)}, the new config "
                                 f"needs {new_params[name][1]} (groups / dim differ from the ones the model holds)")
        plans.append((attn, changes, new, {n: new_params[n][0] for n in new_params
                                           if n not in old_params and not isinstance(getattr(attn, n, None),
                                                                                     nnx.Variable)}))

    all_changes = {k: v for _, changes, _, _ in plans for k, v in changes.items()}
    if any(changes != all_changes for _, changes, _, _ in plans):
        raise ValueError("the model's layers have different attention kinds; retrofit needs them all alike")
    model_config, model_attention = _updated_model_config(model, all_changes)
    for (path, _), (_, _, new, _) in zip(modules, plans):
        if new != model_attention:
            raise ValueError(f"layer {'.'.join(map(str, path))} has an attention config that differs from the "
                             f"model's config; retrofit keeps them equal and cannot here")

    names = tuple(plans[0][3])
    init = _init_fn(plans[0][2], names) if names else None
    values = [init(rngs.params()) if names else {} for _ in plans]

    # ---- Apply: new configs, new parameters, the model's config.
    for (attn, _, new, new_names), fresh in zip(plans, values):
        attn.config = new
        for name, variable_type in new_names.items():
            value = fresh[name] if dtype is None else fresh[name].astype(dtype)
            setattr(attn, name, variable_type(value))
    model.config = model_config
    if kmeans:
        kmeans_centroids(model, init_batches, key=rngs.params(), progress=progress)
    return model


def kmeans_init(config) -> bool:
    """Whether the retrofit `config` is Focus with k-means centroids (`FocusConfig(init='kmeans')`)."""
    return isinstance(config, FocusConfig) and config.init == "kmeans"


def kmeans(points, k: int, *, key, iters: int = KMEANS_ITERS, spherical: bool = True):
    """k-means of `points [N, d]` -> centroids float32 `[k, d]`, seeded by k-means++ (each next seed drawn with
    probability proportional to its squared distance to the nearest seed so far) from `key`, then `iters` Lloyd
    steps. `spherical`: points and centroids are unit rows and the distance is `1 - cos` (the cosine routing's
    geometry); else squared Euclidean distance. A cluster left empty keeps its centroid.

    Raises ValueError when `points` is not 2-d or holds fewer than `k` rows.
    """
    points = jnp.asarray(points, jnp.float32)
    if points.ndim != 2 or points.shape[0] < k:
        raise ValueError(f"k-means of {k} centroids needs points [N >= {k}, d], got shape {points.shape}")
    if spherical:
        points = unit_rows(points)
    distances = functools.partial(_distances, points, spherical=spherical)
    keys = jax.random.split(key, k)
    centroids = jnp.zeros((k, points.shape[1]), jnp.float32).at[0].set(
        points[jax.random.randint(keys[0], (), 0, points.shape[0])])
    for i in range(1, k):
        nearest = jnp.min(distances(centroids[:i]), axis=-1)
        weights = jnp.maximum(nearest, 0.0) ** (2 if spherical else 1)  # squared distance (Euclidean: already)
        index = jax.random.choice(keys[i], points.shape[0], p=weights / jnp.maximum(jnp.sum(weights), 1e-30))
        centroids = centroids.at[i].set(points[index])

    def lloyd(_, centroids):
        assign = jnp.argmin(distances(centroids), axis=-1)
        sums = jax.ops.segment_sum(points, assign, num_segments=k)
        counts = jax.ops.segment_sum(jnp.ones(points.shape[0]), assign, num_segments=k)[:, None]
        means = sums / jnp.maximum(counts, 1.0)
        means = unit_rows(means) if spherical else means
        return jnp.where(counts > 0, means, centroids)

    return jax.lax.fori_loop(0, iters, lloyd, centroids)


def _distances(points, centroids, *, spherical: bool):
    """`[N, k]`: `1 - cos` between unit rows (`spherical`), else the squared Euclidean distance (without an
    `[N, k, d]` difference)."""
    if spherical:
        return 1.0 - points @ centroids.T
    return jnp.maximum(jnp.sum(points**2, axis=-1, keepdims=True) - 2.0 * points @ centroids.T
                       + jnp.sum(centroids**2, axis=-1), 0.0)


def _fit_summary(points, centroids, *, spherical: bool) -> str:
    """How well `centroids [k, d]` fit `points [N, d]`, in words: the mean cosine (`spherical`) or squared distance
    to the nearest centroid, and the largest cluster's share of the points."""
    points = jnp.asarray(points, jnp.float32)
    distances = _distances(unit_rows(points) if spherical else points, centroids, spherical=spherical)
    nearest = np.bincount(np.asarray(jnp.argmin(distances, axis=-1)), minlength=centroids.shape[0])
    closest = float(jnp.mean(jnp.min(distances, axis=-1)))
    fit = (f"mean cosine to the nearest centroid {1.0 - closest:.3f}" if spherical
           else f"mean squared distance to the nearest centroid {closest:.4g}")
    return f"{points.shape[0]:,} points, {fit}, largest cluster {nearest.max() / points.shape[0]:.0%} of them"


def _on_host(x) -> np.ndarray:
    """A numpy copy of the whole of `x`, also of a jax array spread over several processes' devices."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def kmeans_centroids(model, batches, *, key, iters: int = KMEANS_ITERS, progress=None, dtype=None):
    """FOCUS_SPEC OQ-6's optional initialisation (as the Routing Transformer's): set each Focus layer's centroids to
    the k-means of its routing inputs projected by its `w_g`, `x W_g` at the real tokens of `batches`, in place.

    Layer by layer, in order: layer l's inputs are recorded in a forward pass that already routes layers < l by
    their new centroids (one compiled forward serves every layer). Spherical k-means (`kmeans`, unit centroids) for
    cosine routing (`focus_normalize`), plain k-means of `x W_g` for the raw dot product; `w_g` keeps its values.

    The forward runs where the parameters and batches are: with arrays sharded over a mesh (the trainer's), it is
    a sharded forward, and only the projected inputs `[B, T, d_g]` come to the host (from every process, in a
    multi-process run). The k-means itself runs on this process's default device.

    Args:
      model: a `Llama` or `GPT2` with Focus attention (after `retrofit`).
      batches: a list of token arrays `[B, T]`, or of batch dicts (`inputs [B, T]`, optional `positions`,
        `segment_ids`: tokens of segment 0 are padding and left out); numpy or (global) jax arrays.
      key: PRNG key of the k-means++ seeding (one per layer is split from it).
      iters: Lloyd iterations.
      progress: None, or a function called with one line per layer once its centroids are fitted (how many
        points, how well the centroids fit them, the largest cluster's share), e.g. `print`.
      dtype: None (the forward runs in the parameters' own dtypes), or the dtype the forward casts every floating
        parameter to but the `Centroid` and `Temperature` ones, as a training step does with its `compute_dtype`
        (`focal_jax.train.trainer.make_steps`): the routing inputs are then those the first step sees.

    Returns:
      `model`.

    Raises:
      ValueError: a model without Focus layers, no batches, a token outside the vocabulary (or a GPT-2 position
        past `n_positions`), fewer real tokens than groups, or a `dtype` that is not a floating dtype.
    """
    layers_of = lambda model: [attn for _, attn in attention_modules(model) if attn.config.kind in FOCUS_KINDS]
    layers = layers_of(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Focus attention layers to set centroids for")
    batches = [b if isinstance(b, dict) else {"inputs": b} for b in batches]
    if not batches:
        raise ValueError("kmeans_centroids needs at least one batch of tokens")
    dtype = None if dtype is None else float_dtype(dtype)
    kept = (Centroid, Temperature)
    graphdef, _, _ = nnx.split(model, kept, ...)
    cast = lambda x: x.astype(dtype) if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x

    @jax.jit
    def routing_inputs(routing, rest, batch, layer_index):  # Focus layer `layer_index`'s x W_g [B, T, d_g]
        recording = nnx.merge(graphdef, routing, jax.tree.map(cast, rest))
        if getattr(recording.config, "remat", False):  # (records hold the outer trace's values only)
            recording.config = dataclasses.replace(recording.config, remat=False)
        with record_attention() as records:
            recording(batch["inputs"], positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))
        focus_records = [r for r in records if r["config"].kind in FOCUS_KINDS]
        projected = [r["x"].astype(jnp.float32) @ attn.w_g[...].astype(jnp.float32)
                     for r, attn in zip(focus_records, layers_of(recording))]
        return jnp.stack(projected)[layer_index]  # (a traced index: one compile for all layers)

    # (inside the jitted forward a token or position out of range would be a NaN row, and every centroid NaN)
    n_positions = getattr(model.config, "n_positions", None)  # GPT-2's learned position table
    for i, batch in enumerate(batches):
        check_ids(_on_host(batch["inputs"]), model.config.vocab_size, f"the tokens of batch {i}")
        if n_positions is not None:
            positions = batch.get("positions")
            positions = np.arange(np.shape(batch["inputs"])[-1]) if positions is None else _on_host(positions)
            check_ids(positions, n_positions, f"the positions of batch {i} (GPT-2's n_positions)")
    reals = [np.ones(np.shape(batch["inputs"]), bool) if batch.get("segment_ids") is None
             else _on_host(batch["segment_ids"]) != 0 for batch in batches]  # [B, T] each: not padding
    for layer_index, (attn, layer_key) in enumerate(zip(layers, jax.random.split(key, len(layers)))):
        points = [_on_host(routing_inputs(*nnx.state(model, kept, ...), batch, layer_index))[real]
                  for batch, real in zip(batches, reals)]
        c, points = attn.config, np.concatenate(points)
        centroids = kmeans(points, c.focus_groups, key=layer_key, iters=iters, spherical=c.focus_normalize)
        attn.centroids[...] = centroids.astype(attn.centroids[...].dtype)
        if progress is not None:
            progress(f"k-means centroids of Focus layer {layer_index + 1} of {len(layers)}: "
                     f"{_fit_summary(points, centroids, spherical=c.focus_normalize)}")
    return model


def trainable_filter(kind: str = "centroids"):
    """The nnx filter of the parameters to train (the types `optim.trainable` selects): 'centroids' (`Centroid`: a
    Focus retrofit), 'temperature' (`Temperature`: a learned Focal retrofit), 'centroids+temperature' (either),
    'lora' (`LoRA`: the LoRA baseline), 'all' (`nnx.Param`: full fine-tuning)."""
    if kind not in TRAINABLE:
        raise ValueError(f"kind={kind!r} is not one of {tuple(TRAINABLE)}")
    return TRAINABLE[kind]


def count_params(model, filter=nnx.Param) -> int:
    """Number of scalars in the parameters of `model` selected by the nnx `filter` (works on abstract models from
    `nnx.eval_shape` too: only shapes are read)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, filter)))
