"""LoRA (Hu et al., arXiv 2106.09685) on the attention projections: the baseline a Focus centroid-only retrofit is
compared against (FOCUS_SPEC.md section 6.1, Tables 3 and 4).

`add_lora(model, LoRAConfig(rank, alpha, targets))` replaces the targeted projections (`q_proj`, `k_proj`, `v_proj`,
`o_proj`) of every `Attention` module of the model, in place, by a `LoRALinear`:

    y = x @ kernel + bias + (alpha / rank) * (x @ lora_a) @ lora_b,    lora_a [in, rank], lora_b [rank, out]

`lora_a` is drawn as `peft` does (uniform in +-1/sqrt(in), i.e. torch's kaiming_uniform with a = sqrt(5)) and
`lora_b` is zero, so the model's outputs are unchanged until `lora_b` is trained. Both are `LoRA` parameters
(`focal_jax.nn.variables`); train only them with `optim.trainable='lora'`. A `LoRALinear` is an `nnx.Linear` that
keeps the projection's own `kernel` and `bias` variables, so their parameter paths (`layers/0/self_attn/q_proj/kernel`)
and sharding rules do not change and a pretrained checkpoint still loads. `merge_lora(model)` folds the update into
the kernels and puts plain `nnx.Linear`s back (for export with `focal_jax.convert.hf.to_hf`, which does not know
LoRA: merge first).

  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from focal_jax.nn.gpt2 import GPT2, GPT2Config
  >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4), rngs=nnx.Rngs(0))
  >>> model = add_lora(model, LoRAConfig(rank=4, alpha=8.0, targets='qv'), rngs=0)
  >>> sum(x.size for x in jax.tree.leaves(nnx.state(model, LoRA)))  # 2 layers x 2 projections x 4 x (32 + 32)
  1024
  >>> merge_lora(model)(jnp.zeros((1, 6), jnp.int32)).shape
  (1, 6, 50)
"""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from focal_jax._validation import plain_numbers
from focal_jax.nn.layers import as_rngs
from focal_jax.nn.models import attention_modules
from focal_jax.nn.variables import LoRA

# Target letter -> the `Attention` attribute it adapts.
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}

# The `nnx.Linear` attributes its `__call__` reads (besides `kernel` and `bias`), copied into a `LoRALinear`.
_LINEAR_SETTINGS = ("in_features", "out_features", "use_bias", "dtype", "param_dtype", "precision", "dot_general",
                    "promote_dtype", "preferred_element_type")


def _target_letter(name) -> str:
    """'q' for 'q' or 'q_proj'; raises ValueError naming anything else."""
    for letter, attribute in TARGETS.items():
        if name in (letter, attribute):
            return letter
    raise ValueError(f"LoRAConfig: unknown target {name!r}; targets are some of {tuple(TARGETS)} (or "
                     f"{tuple(TARGETS.values())}), e.g. targets='qv'")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA to add to every attention layer: `rank` r >= 1, scale `alpha` (the update is multiplied by
    alpha / r), `targets`: the projections to adapt, a string of letters ('qkvo', 'qv') or a tuple of letters or
    attribute names (('q_proj', 'v_proj')). Stored as a tuple of letters in q, k, v, o order; checked at
    construction."""

    rank: int
    alpha: float
    targets: tuple[str, ...] | str = ("q", "k", "v", "o")

    def __post_init__(self):
        plain_numbers(self)
        if isinstance(self.rank, bool) or not isinstance(self.rank, numbers.Integral) or self.rank < 1:
            raise ValueError(f"LoRAConfig: rank must be an integer >= 1, got rank={self.rank!r}")
        if (isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real) or not self.alpha > 0
                or not math.isfinite(self.alpha)):  # inf: the update inf * 0 (lora_b starts at 0) is NaN
            raise ValueError(f"LoRAConfig: alpha must be a finite number > 0, got alpha={self.alpha!r}")
        targets = self.targets
        if isinstance(targets, str):
            targets = (targets,) if targets in TARGETS.values() else tuple(targets)
        if not isinstance(targets, (tuple, list)) or not targets:
            raise ValueError(f"LoRAConfig: targets must name at least one of {tuple(TARGETS)}, got "
                             f"targets={self.targets!r}")
        letters = [_target_letter(name) for name in targets]
        if len(set(letters)) != len(letters):
            raise ValueError(f"LoRAConfig: targets={self.targets!r} names a projection twice")
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in letters))

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of the low-rank update."""
        return self.alpha / self.rank


class LoRALinear(nnx.Linear):
    """An `nnx.Linear` plus a low-rank update: `x [..., in] -> x @ kernel + bias + scale * (x @ lora_a) @ lora_b`,
    `[..., out]`, with `lora_a [in, rank]`, `lora_b [rank, out]` (`LoRA` parameters) and `scale = alpha / rank`.

    Built by `add_lora` from an existing `base` Linear, whose `kernel` and `bias` variables it keeps (same objects,
    same parameter paths) together with its dtype settings. The update is computed in the promoted dtype of x and
    the LoRA parameters and added in the dtype of the base output, so a bf16 model stays bf16.
    """

    def __init__(self, base: nnx.Linear, *, rank: int, scale: float, key):
        if not isinstance(base, nnx.Linear) or isinstance(base, LoRALinear):
            raise ValueError(f"LoRALinear wraps a plain nnx.Linear, got {type(base).__name__}")
        for name in _LINEAR_SETTINGS:
            setattr(self, name, getattr(base, name))
        self.kernel = base.kernel
        self.bias = nnx.data(base.bias)
        bound = 1.0 / base.in_features ** 0.5
        self.lora_a = LoRA(jax.random.uniform(key, (base.in_features, rank), jnp.float32, -bound, bound))
        self.lora_b = LoRA(jnp.zeros((rank, base.out_features), jnp.float32))
        self.rank = rank
        self.scale = scale

    def delta(self, x):
        """The low-rank update alone: `[..., in] -> [..., out]`, in the promoted dtype of x and the LoRA params."""
        x, a, b = self.promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        return self.scale * jnp.matmul(jnp.matmul(x, a, precision=self.precision), b, precision=self.precision)

    def __call__(self, inputs, out_sharding=None):
        y = super().__call__(inputs, out_sharding=out_sharding)
        return y + self.delta(inputs).astype(y.dtype)

    def merged_kernel(self):
        """`kernel + scale * lora_a @ lora_b` `[in, out]`, computed in float32, in the kernel's dtype."""
        kernel = self.kernel[...]
        update = self.scale * jnp.matmul(self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32),
                                         precision=jax.lax.Precision.HIGHEST)
        return (kernel.astype(jnp.float32) + update).astype(kernel.dtype)


def _attention_modules(model):
    modules = attention_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no Attention modules to add LoRA to")
    return modules


def _where(path, attribute) -> str:
    return ".".join(map(str, (*path, attribute)))


def add_lora(model, config: LoRAConfig, *, rngs: nnx.Rngs | int | None = None):
    """Add LoRA to the attention projections of `model` (a `Llama`, `GPT2`, or any module holding `Attention`s)
    in place and return it.

    Args:
      model: e.g. a pretrained model from `focal_jax.convert.hf.from_hf`.
      config: `LoRAConfig` (rank, alpha, targets).
      rngs: `nnx.Rngs` or an integer seed for `lora_a` (default seed 0); one key per projection is drawn from
        `rngs.params()`.

    Returns:
      `model`, whose targeted projections are `LoRALinear`s: `config.rank * (in + out)` new float32 `LoRA`
      parameters each; the model's outputs are unchanged (every `lora_b` is zero) and no other parameter is touched.

    Raises:
      ValueError: `config` is not a `LoRAConfig`, the model has no `Attention` module, or a targeted projection
        already has LoRA (merge it first), naming the projection.
    """
    if not isinstance(config, LoRAConfig):
        raise ValueError(f"config must be a LoRAConfig, got {type(config).__name__}")
    rngs = as_rngs(rngs)
    plans = []
    for path, attn in _attention_modules(model):
        for letter in config.targets:
            base = getattr(attn, TARGETS[letter])
            if isinstance(base, LoRALinear):
                raise ValueError(f"{_where(path, TARGETS[letter])} already has LoRA; merge_lora the model before "
                                 f"adding LoRA again")
            plans.append((attn, TARGETS[letter], base))
    for attn, attribute, base in plans:
        setattr(attn, attribute, LoRALinear(base, rank=config.rank, scale=config.scale, key=rngs.params()))
    return model


def merge_lora(model):
    """Fold every `LoRALinear` of `model`'s attention layers into a plain `nnx.Linear` with kernel
    `kernel + (alpha / rank) * lora_a @ lora_b` `[in, out]` (the bias unchanged), in place; returns `model`, which
    then holds no `LoRA` parameter and computes the same function (up to rounding in the kernel's dtype). A model
    without LoRA is returned as it is."""
    for _, attn in _attention_modules(model):
        for attribute in TARGETS.values():
            lora = getattr(attn, attribute)
            if not isinstance(lora, LoRALinear):
                continue
            kernel, bias = lora.merged_kernel(), None if lora.bias is None else lora.bias[...]
            settings = {name: getattr(lora, name) for name in _LINEAR_SETTINGS}
            in_features, out_features = settings.pop("in_features"), settings.pop("out_features")
            setattr(attn, attribute, nnx.Linear(
                in_features, out_features, **settings, kernel_init=lambda *_, k=kernel: k,
                bias_init=lambda *_, b=bias: b, rngs=nnx.Rngs(0)))
    return model
