"""The Focal paper's optimizer recipe and trainable-parameter selection.

AdamW (b1 0.9, b2 0.95, weight decay 0.05 on matrices only: none on norms, biases, w_tau and tau_bias; OQ-F8),
global-norm clipping at 1.0, linear warmup then cosine decay to 10% of the peak (FOCAL_SPEC.md section 3.1). Trainable
parameters are chosen by parameter type (`Centroid` for a Focus retrofit, `LoRA` for the LoRA baseline, every
`nnx.Param` for full training) and optionally by a regex on the parameter path; frozen parameters are not part of the
optimizer's pytree, so they carry no optimizer state.
"""

import dataclasses
import math
import numbers
import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from focal_jax._validation import is_integer
from focal_jax.nn.retrofit import TRAINABLE


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings (defaults: the Focal paper's recipe; `lr` is the 400M model's peak).

    trainable: a key of `focal_jax.nn.retrofit.TRAINABLE` (parameter types that train). trainable_regex: if set, of
    those only the parameters whose path (e.g. 'layers/3/self_attn/q_proj/kernel') matches it (`re.search`) train.
    decay_steps: length of warmup + cosine; None = the run's total_steps.
    """

    lr: float = 4e-3
    warmup_steps: int = 2000
    final_lr_fraction: float = 0.1
    decay_steps: int | None = None
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.05
    clip: float | None = 1.0
    trainable: str = "all"
    trainable_regex: str | None = None

    def __post_init__(self):
        for name in ("lr", "final_lr_fraction", "b1", "b2", "eps", "weight_decay", "clip"):
            value = getattr(self, name)
            if name == "clip" and value is None:  # no clipping
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"optim.{name} must be a number, got {name}={value!r}")
        for name in ("lr", "eps"):  # lr = inf makes every parameter NaN; eps = inf every Adam update 0
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"optim.{name} must be a finite number > 0, got {name}={getattr(self, name)!r}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"optim.final_lr_fraction must be in [0, 1], got "
                             f"final_lr_fraction={self.final_lr_fraction!r}")
        for name in ("b1", "b2"):  # Adam's bias correction divides by 1 - b ** step
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optim.{name} must be in [0, 1), got {name}={getattr(self, name)!r}")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"optim.weight_decay must be a finite number >= 0, got weight_decay={self.weight_decay!r}")
        if not is_integer(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be an integer >= 0, got warmup_steps={self.warmup_steps!r}")
        if self.decay_steps is not None and (not is_integer(self.decay_steps) or self.decay_steps < 1):
            raise ValueError(f"optim.decay_steps must be None or an integer >= 1, got "
                             f"decay_steps={self.decay_steps!r}")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"optim.clip must be None or > 0, got clip={self.clip!r}")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"optim.trainable={self.trainable!r} is not one of {tuple(TRAINABLE)}")
        if self.trainable_regex is not None:
            try:
                re.compile(self.trainable_regex)
            except re.error as e:
                raise ValueError(f"optim.trainable_regex={self.trainable_regex!r} is not a valid regex: {e}") from None


def learning_rate_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr` over `warmup_steps`, then cosine decay to `final_lr_fraction * lr` at
    `decay_steps` (default `total_steps`), constant after. A warmup longer than `decay_steps` is cut to it (the peak
    at `decay_steps`, the final rate one step later); `focal_jax.train.train` warns of it
    (`focal_jax.train.config.warmup_note`).

    Example:
      >>> s = learning_rate_schedule(OptimConfig(lr=1.0, warmup_steps=10, final_lr_fraction=0.1), 110)
      >>> [round(float(s(i)), 3) for i in (0, 5, 10, 60, 110, 200)]
      [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    """
    decay_steps = config.decay_steps or total_steps
    warmup = min(config.warmup_steps, decay_steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=config.lr, warmup_steps=warmup, decay_steps=max(decay_steps, warmup + 1),
        end_value=config.final_lr_fraction * config.lr)


def path_str(path) -> str:
    """'layers/3/self_attn/q_proj/kernel' for a pytree key path (the trailing Variable 'value' dropped)."""
    s = jax.tree_util.keystr(tuple(path), simple=True, separator="/")
    return s[: -len("/value")] if s.endswith("/value") else s


NO_DECAY = ("w_tau", "tau_bias")  # the learned temperature's parameters (`Temperature`), whatever their ndim


def decay_mask(params) -> dict:
    """True for the leaves that get weight decay: matrices (ndim >= 2: the embeddings and projections, and W_g and C
    of Focus); norms' scales, biases and the learned temperature's w_tau and tau_bias get none (FOCAL_SPEC OQ-F8:
    decaying w_tau pulls tau toward the clip floor), also per head (`tau_granularity='head'`: w_tau
    `[d_model, n_heads]`)."""
    def decayed(path, x):
        return jnp.ndim(x) >= 2 and path_str(path).rsplit("/", 1)[-1] not in NO_DECAY
    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with the warmup-cosine schedule and decay only on matrices. Applied to the
    trainable parameters only (a pure dict pytree)."""
    parts = [] if config.clip is None else [optax.clip_by_global_norm(config.clip)]
    parts.append(optax.adamw(learning_rate_schedule(config, total_steps), b1=config.b1, b2=config.b2,
                             eps=config.eps, weight_decay=config.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def trainable_filter(config: OptimConfig):
    """An NNX filter selecting the trainable parameters: by type (`config.trainable`) and, if set, by path regex."""
    types = TRAINABLE[config.trainable]
    by_type = nnx.Any(*map(nnx.OfType, types if isinstance(types, tuple) else (types,)))
    if config.trainable_regex is None:
        return by_type
    pattern = re.compile(config.trainable_regex)
    return nnx.All(by_type, lambda path, _: bool(pattern.search(path_str(path))))


def split_trainable(model, config: OptimConfig):
    """`(graphdef, trainable, frozen)`: pure dicts of arrays, the trainable parameters (what the optimizer sees)
    and everything else. Raises ValueError when the selection is empty."""
    graphdef, trainable, frozen = nnx.split(model, trainable_filter(config), ...)
    trainable, frozen = nnx.to_pure_dict(trainable), nnx.to_pure_dict(frozen)
    if not jax.tree.leaves(trainable):
        raise ValueError(f"no parameter is trainable with optim.trainable={config.trainable!r}, "
                         f"optim.trainable_regex={config.trainable_regex!r}")
    return graphdef, trainable, frozen


def merge_params(a: dict, b: dict) -> dict:
    """The nested pure dicts `a` and `b` (e.g. the trainable and frozen parts of `split_trainable`) as one."""
    merged = dict(a)
    for key, value in b.items():
        merged[key] = merge_params(merged[key], value) if key in merged and isinstance(value, dict) else value
    return merged


def select_params(tree: dict, like: dict) -> dict:
    """The part of the nested pure dict `tree` at the paths of `like` (the inverse of `merge_params`)."""
    return {key: select_params(tree[key], value) if isinstance(value, dict) else tree[key]
            for key, value in like.items()}


def param_paths(tree) -> list[str]:
    """Sorted parameter paths of a (pure dict or State) pytree."""
    return sorted(path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
