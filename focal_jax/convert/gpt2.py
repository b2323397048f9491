"""Load a Hugging Face GPT-2 checkpoint (config.json + *.safetensors, never pickle) into `focal_jax.nn.gpt2.GPT2`,
and the tensors and config.json that write one back (`gpt2_tensors`, `gpt2_hf_config`, for
`focal_jax.convert.hf.to_hf`).

Hugging Face's GPT-2 uses `Conv1D`, whose weights are stored `[in, out]`, the layout of `nnx.Linear`'s kernel, so no
transposes are needed. The fused `attn.c_attn` (`[d, 3d]`, bias `[3d]`) is split into q, k, v in that order. Tensor
names may carry the `transformer.` prefix (`GPT2LMHeadModel`) or not (`GPT2Model`, the original checkpoints); the
`attn.bias` / `attn.masked_bias` mask buffers and a tied `lm_head.weight` (equal to `wte.weight`) are ignored.

Parameters that the checkpoint cannot hold (Focus `Centroid`, `Temperature`) keep their fresh initialisation.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx

from focal_jax._validation import float_field
from focal_jax.convert.safetensors_io import (StoredTensors, TensorsInMemory, tensors_equal, to_array,
                                              variable_paths)
from focal_jax.nn.gpt2 import ACTIVATIONS, GPT2, GPT2Config
from focal_jax.nn.variables import Centroid, Temperature

_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


REQUIRED_KEYS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")  # of a GPT-2 config.json


def config_from_hf(config_json: dict, **overrides) -> GPT2Config:
    """`GPT2Config` from a Hugging Face GPT-2 `config.json` dict; `overrides` set any GPT2Config field
    (e.g. `kind='focus', focus_groups=4`)."""
    if not isinstance(config_json, dict):
        raise ValueError(f"config_json must be a dict (the parsed config.json), got {type(config_json).__name__}")
    model_type = config_json.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ValueError(f"load_gpt2 reads model_type 'gpt2', got model_type={model_type!r}")
    unsupported = {"scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                   "scale_attn_weights": True, "add_cross_attention": False, "tie_word_embeddings": True}
    for key, expected in unsupported.items():
        if config_json.get(key, expected) != expected:
            raise ValueError(f"GPT-2 config.json {key}={config_json[key]!r} is not supported (only {expected})")
    activation = config_json.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise ValueError(f"GPT-2 config.json activation_function={activation!r} is not supported; choices "
                         f"{sorted(ACTIVATIONS)}")
    missing = [key for key in REQUIRED_KEYS if key not in config_json]
    if missing:
        raise ValueError(f"GPT-2 config.json lacks {missing}")
    fields = dict(vocab_size=config_json["vocab_size"], n_positions=config_json["n_positions"],
                  d_model=config_json["n_embd"], n_layers=config_json["n_layer"], n_heads=config_json["n_head"],
                  layer_norm_eps=float_field(config_json, "layer_norm_epsilon", 1e-5, "GPT-2 config.json"),
                  d_ff=config_json.get("n_inner"), activation=activation)
    known = {f.name for f in dataclasses.fields(GPT2Config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown GPT2Config field(s) {unknown}; choices {sorted(known)}")
    fields.update(overrides)
    return GPT2Config(**fields)


def _strip_prefix(stored) -> tuple[dict, str]:
    """`{name without the 'transformer.' prefix: stored name}` of the tensors of `stored` (mask buffers and a tied
    lm_head dropped), and the prefix the checkpoint uses ('' or 'transformer.'), so that errors name tensors as the
    checkpoint does."""
    prefix = "transformer." if any(name.startswith("transformer.") for name in stored) else ""
    names = {}
    for name in stored:
        key = name[len("transformer."):] if name.startswith("transformer.") else name
        if not key.endswith(_IGNORED_SUFFIXES):
            names[key] = name
    head = names.pop("lm_head.weight", None)
    if head is not None and "wte.weight" in names and not tensors_equal(stored, head, names["wte.weight"]):
        raise ValueError("the checkpoint's lm_head.weight differs from its wte.weight, which a tied GPT-2 uses as "
                         "its output head (untied GPT-2 heads are not supported)")
    return names, prefix


def _columns(read, offset: int, width: int, ndim: int):
    """The reader of the columns `offset:offset + width` of the tensor `read` reads (the fused c_attn, whose last
    dimension holds q, k and v): the slice `[..., a:b]` of the part is `[..., offset + a:offset + b]` of the whole."""
    def part(index):
        index = tuple(index) + (slice(None),) * (ndim - len(index))
        start, stop, step = index[-1].indices(width)
        return read(index[:-1] + (slice(offset + start, offset + stop, step),))
    return part


def load_gpt2(directory, config_json: dict, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
              **overrides) -> GPT2:
    """Build a `GPT2` from a Hugging Face GPT-2 directory.

    Args:
      directory: folder holding `*.safetensors` (config.json is passed already parsed as `config_json`).
      config_json: the parsed config.json.
      dtype: dtype of the loaded parameters (new Focus / Focal parameters too); logits stay float32.
      rngs: initialises parameters the checkpoint does not hold (default `nnx.Rngs(0)`).
      **overrides: GPT2Config fields, e.g. `kind='focus', focus_groups=4, focus_dim=16`.

    Raises:
      ValueError: a tensor is missing (named) or has the wrong shape (named, with both shapes).

    Usage: `load_gpt2(path, json.load(open(path / "config.json")), kind="focus", focus_groups=4, focus_dim=16)`
    gives the checkpoint's GPT-2 with Focus attention (fresh Centroids) in every layer.
    """
    return build_gpt2(config_json, StoredTensors(directory), dtype=dtype, rngs=rngs, source=os.fspath(directory),
                      **overrides)


def build_gpt2(config_json: dict, tensors, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None,
               source: str = "the checkpoint", sharding=None, **overrides) -> GPT2:
    """`load_gpt2` on tensors already read (a dict name -> numpy array, e.g. from `read_safetensors`), or on a
    `StoredTensors` (read on demand).

    The model is built abstractly (`nnx.eval_shape`) and filled from the tensors; only when the config adds
    parameters the checkpoint cannot hold (Focus `Centroid`, Focal `Temperature`) is a model initialised for them.
    sharding: None, or a function `(path, shape) -> Sharding` into which each checkpoint parameter is read, slice by
    slice (`focal_jax.convert.hf.from_hf`).
    """
    config = config_from_hf(config_json, **overrides)
    stored = tensors if isinstance(tensors, StoredTensors) else TensorsInMemory(tensors, source)
    names, prefix = _strip_prefix(stored)
    model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    paths = variable_paths(model)
    d = config.d_model
    used = set()

    def take(name, expected_shape):
        """The reader `index -> numpy` of tensor `name`, checked against `expected_shape`."""
        if name not in names:
            raise ValueError(f"tensor {prefix + name!r} (expected shape {tuple(expected_shape)}) is missing from "
                             f"{source!r}")
        shape = stored.shape(names[name])
        if shape != tuple(expected_shape):
            raise ValueError(f"tensor {prefix + name!r} in {source!r} has shape {shape}, expected "
                             f"{tuple(expected_shape)}")
        used.add(name)
        return lambda index: stored.read(names[name], index)

    def put(variable, read):
        shape = tuple(variable.get_value().shape)
        place = None if sharding is None else sharding(paths[id(variable)], shape)
        variable.set_value(to_array(read, shape, dtype, place))

    def load(variable, name):
        put(variable, take(name, variable.get_value().shape))

    load(model.wte.embedding, "wte.weight")
    load(model.wpe.embedding, "wpe.weight")
    for i, block in enumerate(model.h):
        p = f"h.{i}."
        load(block.ln_1.scale, p + "ln_1.weight")
        load(block.ln_1.bias, p + "ln_1.bias")
        load(block.ln_2.scale, p + "ln_2.weight")
        load(block.ln_2.bias, p + "ln_2.bias")
        attn = block.attn
        c_attn_w = take(p + "attn.c_attn.weight", (d, 3 * d))
        c_attn_b = take(p + "attn.c_attn.bias", (3 * d,))
        for j, proj in enumerate((attn.q_proj, attn.k_proj, attn.v_proj)):
            put(proj.kernel, _columns(c_attn_w, j * d, d, 2))
            put(proj.bias, _columns(c_attn_b, j * d, d, 1))
        load(attn.o_proj.kernel, p + "attn.c_proj.weight")
        load(attn.o_proj.bias, p + "attn.c_proj.bias")
        load(block.mlp.c_fc.kernel, p + "mlp.c_fc.weight")
        load(block.mlp.c_fc.bias, p + "mlp.c_fc.bias")
        load(block.mlp.c_proj.kernel, p + "mlp.c_proj.weight")
        load(block.mlp.c_proj.bias, p + "mlp.c_proj.bias")
    load(model.ln_f.scale, "ln_f.weight")
    load(model.ln_f.bias, "ln_f.bias")

    unused = sorted(prefix + name for name in set(names) - used)
    if unused:
        raise ValueError(f"tensors in {source!r} not used by GPT2 (n_layer={config.n_layers}): {unused[:8]}"
                         f"{' ...' if len(unused) > 8 else ''}")
    missing = {path: type(x) for path, x in nnx.to_flat_state(nnx.state(model))
               if isinstance(x.get_value(), jax.ShapeDtypeStruct)}
    not_new = sorted(".".join(map(str, path)) for path, kind in missing.items()
                     if not issubclass(kind, (Centroid, Temperature)))
    if not_new:  # a base-model parameter the mapping above does not fill: never leave it at random init
        raise ValueError(f"GPT2 parameters not filled from {source!r}: {not_new[:8]}")
    if missing:
        # Parameters the checkpoint does not hold (Centroid, Temperature): freshly initialised in the requested
        # dtype. One jitted init, of which XLA keeps only these outputs (no throwaway copy of the base weights).
        is_missing = lambda path, _: tuple(path) in missing

        @nnx.jit
        def init(rngs):
            fresh = nnx.state(GPT2(config, rngs=rngs), is_missing)
            return jax.tree.map(lambda x: x.astype(dtype), fresh)

        nnx.update(model, init(rngs if rngs is not None else nnx.Rngs(0)))
    return model


def gpt2_tensors(model: GPT2) -> list[tuple[str, list]]:
    """`(Hugging Face tensor name, [variables])` for every parameter of a dense `GPT2`, named as
    `GPT2LMHeadModel` saves them (`transformer.` prefix; the head is tied to `wte`, so not written). A tensor is its
    variables' values concatenated along the last axis: the fused `attn.c_attn` holds q, k and v, in that order."""
    rows = [("wte.weight", [model.wte.embedding]), ("wpe.weight", [model.wpe.embedding])]
    for i, block in enumerate(model.h):
        p, attn = f"h.{i}.", block.attn
        rows += [(p + "ln_1.weight", [block.ln_1.scale]), (p + "ln_1.bias", [block.ln_1.bias]),
                 (p + "attn.c_attn.weight", [attn.q_proj.kernel, attn.k_proj.kernel, attn.v_proj.kernel]),
                 (p + "attn.c_attn.bias", [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
                 (p + "attn.c_proj.weight", [attn.o_proj.kernel]), (p + "attn.c_proj.bias", [attn.o_proj.bias]),
                 (p + "ln_2.weight", [block.ln_2.scale]), (p + "ln_2.bias", [block.ln_2.bias]),
                 (p + "mlp.c_fc.weight", [block.mlp.c_fc.kernel]), (p + "mlp.c_fc.bias", [block.mlp.c_fc.bias]),
                 (p + "mlp.c_proj.weight", [block.mlp.c_proj.kernel]),
                 (p + "mlp.c_proj.bias", [block.mlp.c_proj.bias])]
    rows += [("ln_f.weight", [model.ln_f.scale]), ("ln_f.bias", [model.ln_f.bias])]
    return [("transformer." + name, variables) for name, variables in rows]


def gpt2_hf_config(config: GPT2Config, dtype: str) -> dict:
    """The config.json of `GPT2LMHeadModel` for a `GPT2Config` (`config_from_hf` reads it back), parameters in
    `dtype` ('float32', 'bfloat16', ...)."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": config.vocab_size,
            "n_positions": config.n_positions, "n_embd": config.d_model, "n_layer": config.n_layers,
            "n_head": config.n_heads, "n_inner": config.d_ff, "activation_function": config.activation,
            "layer_norm_epsilon": config.layer_norm_eps, "tie_word_embeddings": True, "torch_dtype": dtype,
            "dtype": dtype}
