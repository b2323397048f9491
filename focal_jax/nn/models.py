"""The model families as the tools see them: which models they take, and each model's attention layers.

  >>> from flax import nnx
  >>> from focal_jax.nn.gpt2 import GPT2, GPT2Config
  >>> model = GPT2(GPT2Config(vocab_size=64, n_positions=32, d_model=32, n_layers=2, n_heads=2), rngs=nnx.Rngs(0))
  >>> [path for path, _ in attention_modules(model)]
  [('h', 0, 'attn'), ('h', 1, 'attn')]
"""

import jax
from flax import nnx

from focal_jax.nn.attention import Attention
from focal_jax.nn.gpt2 import GPT2
from focal_jax.nn.llama import Llama


def check_model(model) -> None:
    """Raises ValueError naming the type of `model` unless it is a focal_jax `Llama` or `GPT2`."""
    if not isinstance(model, (Llama, GPT2)):
        raise ValueError(f"model must be a focal_jax Llama or GPT2, got {type(model).__name__}")


def unfilled_paths(model) -> list[tuple]:
    """Paths of the variables of `model` that still hold an abstract `jax.ShapeDtypeStruct` (a model built by
    `nnx.eval_shape` that a checkpoint was to fill), e.g. `[('layers', 0, 'mlp', 'up_proj', 'kernel')]`."""
    return [path for path, x in nnx.to_flat_state(nnx.state(model)) if isinstance(x.get_value(), jax.ShapeDtypeStruct)]


def attention_modules(model) -> list[tuple[tuple, Attention]]:
    """Every `Attention` module inside `model` (any flax nnx.Module) with its path, e.g. `('layers', 3,
    'self_attn')`, in layer order; [] when it has none. Raises ValueError when `model` is not an nnx.Module."""
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be a flax nnx.Module (a focal_jax Llama or GPT2), got {type(model).__name__}")
    return [(path, module) for path, module in nnx.iter_modules(model) if isinstance(module, Attention)]


def attention_layers(model) -> list[Attention]:
    """The `Attention` module of each layer of `model` (a focal_jax `Llama` or `GPT2`), in layer order. Raises
    ValueError for another model type."""
    check_model(model)
    return [module for _, module in attention_modules(model)]
