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

New parameters are created by `Attention.__init__` itself: a fresh `Attention` with the new config is built under
`jax.jit` for each layer, and only its `Centroid` / `Temperature` leaves are returned (XLA drops the unused
projections), so their initialisation cannot drift from the module's.
"""

import dataclasses
import functools
import re

import jax
from flax import nnx

from focal_jax.nn.attention import Attention, AttentionConfig
from focal_jax.nn.gpt2 import GPT2, ATTENTION_FIELDS
from focal_jax.nn.llama import Llama
from focal_jax.nn.lora import LoRAConfig, add_lora
from focal_jax.nn.variables import Centroid, LoRA, Temperature

NEW_TYPES = (Centroid, Temperature, LoRA)
TRAINABLE = {"centroids": Centroid, "centroids+temperature": (Centroid, Temperature), "lora": LoRA,
             "all": nnx.Param}

# A minimal valid AttentionConfig whose focus / focal fields are replaced to validate the retrofit configs.
_PROBE = dict(d_model=1, n_heads=1, n_kv_heads=1, head_dim=2, rope_theta=None)


def _validate(cls_name, fields, renames):
    """Build an AttentionConfig with `fields`; re-raise its ValueError with our field names (`renames`)."""
    try:
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
    baseline). Fields mean `AttentionConfig.focus_*`; checked at construction."""

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

    def __post_init__(self):
        renames = {f"focus_{f.name}": f.name for f in dataclasses.fields(self)}
        _validate("FocusConfig", {"kind": "focus", **self.attention_fields()}, renames)

    def attention_fields(self) -> dict:
        """The `AttentionConfig` fields this config sets (all `focus_*` ones)."""
        return {f"focus_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class FocalConfig:
    """Focal attention (arXiv 2511.06818) to retrofit: a constant temperature `t` (logits `q.k * scale / t`;
    t < 1 sharpens, t = 1 is dense), or `learned=True`: per-layer `Temperature` parameters with tau clipped to
    [tau_min, tau_max], averaged as `tau_mode` says ('prefix': causal running mean, the default; 'sequence': the
    paper's whole-row mean). With `learned=True`, `t` must be left unset (it becomes None)."""

    t: float | None = 0.4
    learned: bool = False
    tau_min: float = 5.0
    tau_max: float = 10.0
    tau_mode: str = "prefix"

    def __post_init__(self):
        if not isinstance(self.learned, bool):
            raise ValueError(f"FocalConfig: learned must be a bool, got learned={self.learned!r}")
        if self.learned:
            if self.t is not None and self.t != 0.4:
                raise ValueError(f"FocalConfig: t={self.t!r} is the constant temperature; learned=True learns it "
                                 f"within [tau_min, tau_max], so leave t unset")
            object.__setattr__(self, "t", None)
            _validate("FocalConfig", dict(kind="focal_learned", tau_min=self.tau_min, tau_max=self.tau_max,
                                          tau_mode=self.tau_mode), {})
        else:
            if self.tau_mode != "prefix":
                raise ValueError(f"FocalConfig: tau_mode={self.tau_mode!r} is for the learned temperature; set "
                                 f"learned=True or leave tau_mode unset")
            if self.t is None:
                raise ValueError("FocalConfig: t=None needs learned=True (give a constant temperature t > 0, or "
                                 "learned=True)")
            _validate("FocalConfig", dict(kind="focal", focal_t=self.t, tau_min=self.tau_min,
                                          tau_max=self.tau_max), {"focal_t": "t"})

    def attention_fields(self) -> dict:
        if self.learned:
            return {"tau_min": self.tau_min, "tau_max": self.tau_max, "tau_mode": self.tau_mode}
        return {"focal_t": self.t}


def _new_kind(current: str, config) -> str:
    """The attention kind after retrofitting `config` onto a layer of kind `current`."""
    if isinstance(config, FocusConfig):
        table = {"dense": "focus", "focal": "focal+focus", "focus": "focus", "focal+focus": "focal+focus"}
    elif config.learned:
        table = {"dense": "focal_learned", "focal": "focal_learned", "focal_learned": "focal_learned"}
    else:
        table = {"dense": "focal", "focal": "focal", "focus": "focal+focus", "focal+focus": "focal+focus"}
    if current not in table:
        if isinstance(config, FocusConfig) or config.learned:
            why = "there is no kind with both a learned Focal temperature and Focus"
        else:
            why = "a constant temperature would drop the learned Temperature parameters"
        name = f"{type(config).__name__}{'(learned=True)' if getattr(config, 'learned', False) else ''}"
        raise ValueError(f"cannot retrofit {name} onto attention kind={current!r} ({why}); it combines with kind "
                         f"in {tuple(table)}")
    return table[current]


def _attention_modules(model):
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Attention)]


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
        # GPT2Config carries the paper's attention fields only: a field it lacks may only take its default.
        defaults = {f.name: f.default for f in dataclasses.fields(AttentionConfig)}
        for name in sorted(set(changes) - set(ATTENTION_FIELDS)):
            if changes[name] != defaults[name]:
                raise ValueError(f"{name}={changes[name]!r} is not available for GPT-2 models (GPT2Config has no "
                                 f"{name} field; only the default {defaults[name]!r}); use a LLaMA-family model")
        changes = {k: v for k, v in changes.items() if k in ATTENTION_FIELDS}
        config = dataclasses.replace(model.config, **changes)
        return config, config.attention_config()
    raise ValueError(f"retrofit supports focal_jax Llama and GPT2 models, got {type(model).__name__}")


def retrofit(model, config, *, rngs: nnx.Rngs | int | None = None, impl: str | None = None, dtype=None):
    """Put Focus or Focal attention into `model` (a `Llama` or `GPT2`) in place and return it.

    Args:
      model: a loaded model, e.g. from `focal_jax.convert.hf.from_hf`.
      config: `FocusConfig` or `FocalConfig`; a `focal_jax.nn.lora.LoRAConfig` is handed to `add_lora` (the LoRA
        baseline: `LoRA` parameters on the attention projections, the attention kind unchanged).
      rngs: `nnx.Rngs` or an integer seed for the new parameters (default seed 0). One key per layer is drawn
        from `rngs.params()`.
      impl: optionally also switch the attention implementation (e.g. 'decomposed' for hard top-k Focus).
      dtype: dtype of the new parameters; None keeps `Attention`'s own (float32, also under a bf16 model, so
        that the trained routing parameters keep full precision).

    Returns:
      `model`, whose `Attention` modules have the new kind and config (`Centroid` / `Temperature` parameters added,
      every other parameter untouched) and whose `config` matches them.

    Raises:
      ValueError: an unsupported model type, a combination no attention kind expresses (learned Focal with Focus),
        a change that would drop parameters (constant Focal onto learned Focal), a Focus retrofit onto a model
        with a sliding window (Mistral's `window`) or with different `groups` / `dim` than the Focus it already
        has, or any invalid resulting `AttentionConfig` field (named).
    """
    if not isinstance(config, (FocusConfig, FocalConfig, LoRAConfig)):
        raise ValueError(f"config must be a FocusConfig or FocalConfig (or a LoRAConfig), got "
                         f"{type(config).__name__}")
    if not isinstance(model, (Llama, GPT2)):
        raise ValueError(f"retrofit supports focal_jax Llama and GPT2 models, got {type(model).__name__}")
    if rngs is None or isinstance(rngs, int):
        rngs = nnx.Rngs(params=0 if rngs is None else rngs)
    if isinstance(config, LoRAConfig):
        return add_lora(model, config, rngs=rngs)
    modules = _attention_modules(model)
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
        plans.append((attn, changes, new, {n: new_params[n][0] for n in new_params if n not in old_params}))

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
    return model


def trainable_filter(kind: str = "centroids"):
    """The nnx filter of the parameters to train: 'centroids' (`Centroid`: a Focus retrofit),
    'centroids+temperature' (`Centroid` or `Temperature`), 'lora' (`LoRA`: the LoRA baseline), 'all' (`nnx.Param`:
    full fine-tuning)."""
    if kind not in TRAINABLE:
        raise ValueError(f"kind={kind!r} is not one of {tuple(TRAINABLE)}")
    return TRAINABLE[kind]


def count_params(model, filter=nnx.Param) -> int:
    """Number of scalars in the parameters of `model` selected by the nnx `filter` (works on abstract models from
    `nnx.eval_shape` too: only shapes are read)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, filter)))
