"""Hugging Face import and export: `from_hf(directory)` builds a focal_jax model from config.json +
*.safetensors; `to_hf(model, directory)` writes a LLaMA-family model back for `transformers`.

No network and never pickle: tensors are read by `focal_jax.convert.safetensors_io.StoredTensors` (memory-mapped
safetensors files, whole or one device's shard at a time) and written with the `safetensors` package. Each supported
`model_type` is one entry of `LOADERS` (a function `(hf_config, tensors, dtype) -> model`); add an architecture by
adding an entry. RoPE: Hugging Face stores q and k projections for the "rotate_half" layout, which is the layout of
`focal_jax.nn.layers.rope`, so no permutation is applied (the parity tests against transformers check this).
"""

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from focal_jax._validation import float_field
from focal_jax.convert.gpt2 import REQUIRED_KEYS as GPT2_REQUIRED_KEYS
from focal_jax.convert.gpt2 import build_gpt2, gpt2_hf_config, gpt2_tensors
from focal_jax.convert.safetensors_io import StoredTensors, tensors_equal, to_array, variable_paths
from focal_jax.nn.gpt2 import GPT2
from focal_jax.nn.layers import float_dtype
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.nn.models import attention_layers, unfilled_paths
from focal_jax.nn.variables import LoRA


class _Tensors:
    """Hands out checkpoint tensors by name, checking shapes, and reports any left unused. With a `sharding`
    function (`from_hf`), each parameter is read straight into its sharding: this process reads only the slices of
    each tensor that its own devices hold."""

    def __init__(self, stored: StoredTensors, *, sharding=None):
        self.stored, self.directory, self.sharding, self.used = stored, stored.directory, sharding, set()
        self.paths = {}

    def bind(self, model):
        """Learn the parameter paths of `model`, whose variables `assign` then fills."""
        self.paths = variable_paths(model)

    def sharding_of(self, variable):
        """The sharding `variable` is read into (None: whole, onto the default device)."""
        if self.sharding is None:
            return None
        return self.sharding(self.paths[id(variable)], tuple(variable.get_value().shape))

    def assign(self, variable, name, *, transpose=False, dtype=jnp.float32):
        expected = tuple(variable.get_value().shape)
        if name not in self.stored:
            raise ValueError(f"checkpoint {self.directory!r} has no tensor {name!r} (expected shape {expected})")
        stored_shape = self.stored.shape(name)
        if (stored_shape[::-1] if transpose else stored_shape) != expected:
            want = expected[::-1] if transpose else expected
            raise ValueError(f"tensor {name!r} in {self.directory!r} has shape {stored_shape}, expected {want}")
        self.used.add(name)
        if transpose:  # the slice [i, j] of the parameter is the slice [j, i] of the stored tensor, transposed
            read = lambda index: self.stored.read(name, tuple(index)[::-1]).T
        else:
            read = lambda index: self.stored.read(name, index)
        variable.set_value(to_array(read, expected, dtype, self.sharding_of(variable)))

    def check_all_used(self, ignore=()):
        unused = sorted(n for n in self.stored if n not in self.used and not any(s in n for s in ignore))
        if unused:
            raise ValueError(f"checkpoint {self.directory!r} has tensors the model does not use: {unused[:8]}"
                             f"{' ...' if len(unused) > 8 else ''}")


def _rope(hf):
    """RoPE base and the extra attention fields of the checkpoint's rope type: 'default', 'dynamic' (dynamic NTK
    scaling past max_position_embeddings), 'linear' or 'llama3' (LLaMA 3.1 and later)."""
    # As transformers: a non-empty rope_scaling (the older name, the only one 4.x reads) replaces rope_parameters
    # whole (5.x), and keys neither holds, rope_theta among them, come from the top level.
    rope = {**hf, **(hf.get("rope_scaling") or hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float_field(rope, "rope_theta", 10000.0, "config.json")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={rope['partial_rotary_factor']!r} is not supported (rotary "
                         f"embeddings over the whole head only)")
    if rope_type == "default":
        return theta, {}

    def factor(key):
        return float_field(rope, key, None, f"config.json rope_scaling of rope_type {rope_type!r}:")

    if rope_type == "dynamic":
        return theta, {"rope_ntk_factor": factor("factor"), "rope_trained_len": int(hf["max_position_embeddings"])}
    if rope_type == "linear":
        return theta, {"rope_linear_factor": factor("factor")}
    if rope_type == "llama3":
        # As transformers: a top-level original_max_position_embeddings wins, then the rope dict's, then max_position.
        original_len = (hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                        or hf["max_position_embeddings"])
        return theta, {"rope_llama3": (factor("factor"), factor("low_freq_factor"), factor("high_freq_factor"),
                                       int(original_len))}
    raise ValueError(f"rope type {rope_type!r} is not supported (only 'default', 'dynamic', 'linear' and 'llama3' "
                     f"RoPE)")


LLAMA_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def llama_config_from_hf(hf) -> LlamaConfig:
    """The `LlamaConfig` of a Hugging Face llama / mistral / qwen2 / qwen3 / olmo2 config dict, one that
    `read_hf_config` has checked (its `LLAMA_REQUIRED_KEYS` present)."""
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    if model_type in ("llama", "mistral", "qwen3", "olmo2") and hf.get("attention_bias", False):
        raise ValueError(f"{model_type} with attention_bias=True (a bias on o_proj too) is not supported")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window", False):
        raise ValueError(f"{model_type} with use_sliding_window=True (per-layer windows) is not supported")
    n_heads = hf["num_attention_heads"]
    window = hf.get("sliding_window", 4096) if model_type == "mistral" else None  # transformers' defaults here
    layer_types = hf.get("layer_types") if model_type == "mistral" else None
    if layer_types is not None:  # transformers loads such a config as Ministral: the window on 'sliding_attention' only
        if set(layer_types) == {"full_attention"}:
            window = None
        elif set(layer_types) != {"sliding_attention"}:
            raise ValueError(f"mistral with layer_types={layer_types!r} (a sliding window on some layers only, which "
                             f"transformers loads as Ministral) is not supported")
    rope_theta, rope_fields = _rope(hf)
    attn = dict(rope_fields) if window is None else {"window": int(window) - 1, **rope_fields}
    return LlamaConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        intermediate=hf["intermediate_size"], n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, rope_theta=rope_theta,
        norm_eps=float_field(hf, "rms_norm_eps", 1e-5 if model_type == "olmo2" else 1e-6, "config.json"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2", qk_norm={"qwen3": "head", "olmo2": "full"}.get(model_type),
        post_norm=model_type == "olmo2", attn=attn)


def llama_tensors(model):
    """`(variable, Hugging Face tensor name, transpose)` for every parameter of a dense `Llama` (HF stores linear
    weights as `[out, in]`, ours are `[in, out]`)."""
    config = model.config
    yield model.embed_tokens.embedding, "model.embed_tokens.weight", False
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(attn, proj)
            yield linear.kernel, f"{p}self_attn.{proj}.weight", True
            if linear.bias is not None:
                yield linear.bias, f"{p}self_attn.{proj}.bias", False
        if config.qk_norm is not None:
            yield attn.q_norm.scale, f"{p}self_attn.q_norm.weight", False
            yield attn.k_norm.scale, f"{p}self_attn.k_norm.weight", False
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield getattr(layer.mlp, proj).kernel, f"{p}mlp.{proj}.weight", True
        norms = (("post_attention_layernorm", "post_feedforward_layernorm") if config.post_norm
                 else ("input_layernorm", "post_attention_layernorm"))
        for norm in norms:
            yield getattr(layer, norm).scale, f"{p}{norm}.weight", False
    yield model.norm.scale, "model.norm.weight", False
    if not config.tie_embeddings:
        yield model.lm_head.kernel, "lm_head.weight", True


def load_llama(hf, tensors: _Tensors, dtype):
    """LLaMA, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (per-head QK-norm), OLMo-2 (post-norm, full
    QK-norm)."""
    config = llama_config_from_hf(hf)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    tensors.bind(model)
    for variable, name, transpose in llama_tensors(model):
        tensors.assign(variable, name, transpose=transpose, dtype=dtype)
    ignore = ("rotary_emb.inv_freq",)
    if config.tie_embeddings and "lm_head.weight" in tensors.stored:  # a tied checkpoint may still store the copy
        if not tensors_equal(tensors.stored, "lm_head.weight", "model.embed_tokens.weight"):
            raise ValueError(f"{tensors.directory!r} has tie_word_embeddings=true but an lm_head.weight that differs "
                             f"from model.embed_tokens.weight; set tie_word_embeddings=false in config.json if the "
                             f"separate head is meant")
        ignore += ("lm_head.weight",)
    tensors.check_all_used(ignore)
    return model


# model_type -> loader(hf_config dict, _Tensors, dtype) -> model.
LOADERS = {
    "gpt2": lambda hf, tensors, dtype: build_gpt2(hf, tensors.stored, dtype=dtype, source=tensors.directory,
                                                  sharding=tensors.sharding),
    "llama": load_llama,
    "mistral": load_llama,
    "qwen2": load_llama,
    "qwen3": load_llama,
    "olmo2": load_llama,
}


def read_hf_config(directory) -> dict:
    """The parsed config.json of a Hugging Face model directory, checked as far as `from_hf` can tell without its
    tensors: `directory` is a directory, holds config.json, which is a JSON object whose `model_type` is one of
    `LOADERS`. The trainer calls it to refuse a bad `init_from` before it builds any data.

    Raises:
      ValueError naming the directory or its config.json and what is wrong (and the supported model types).
    """
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory (expected a Hugging Face model directory)")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{directory!r} has no config.json")
    with open(config_path) as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path!r} is not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path!r} holds a JSON {_JSON_KINDS.get(type(hf), type(hf).__name__)}; expected a "
                         f"JSON object (the model's settings, with its model_type)")
    model_type = hf.get("model_type")
    if model_type not in LOADERS:
        raise ValueError(f"unsupported model_type={model_type!r} in {config_path!r}; supported: {sorted(LOADERS)}")
    required = GPT2_REQUIRED_KEYS if model_type == "gpt2" else LLAMA_REQUIRED_KEYS
    if missing := [key for key in required if key not in hf]:
        raise ValueError(f"{config_path!r} (model_type {model_type!r}) lacks {missing}")
    return hf


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def from_hf(directory, *, dtype=jnp.float32, sharding=None, progress=None):
    """Build a focal_jax model from a Hugging Face model directory (config.json + *.safetensors), no network.

    Args:
      directory: a directory written by `save_pretrained(..., safe_serialization=True)`.
      dtype: the parameter dtype (float32 by default; e.g. jnp.bfloat16). Logits are float32 either way.
      sharding: None (every parameter whole on the default device), or a function `(path, shape) -> Sharding`
        of a parameter's path ('layers/0/self_attn/q_proj/kernel') and shape, e.g.
        `focal_jax.train.sharding.param_sharding(mesh)`: each parameter is then read straight into its sharding,
        this process reading from disk only the slices its own devices hold (a model larger than one process's
        memory loads on a mesh).
      progress: None, or a function given one line when the tensors are read (how many bytes, how long).

    Returns:
      The model (e.g. `focal_jax.nn.llama.Llama`), dense attention; retrofit Focal / Focus afterwards.

    Raises:
      ValueError naming the directory or its config.json when `read_hf_config` refuses them (not a directory, no
      config.json, not a JSON object, a model_type that is not supported), a file that is not safetensors, a
      missing tensor with its expected shape, or a tensor of the wrong shape with both shapes.
    """
    dtype = float_dtype(dtype)
    hf = read_hf_config(directory)
    start = time.perf_counter()
    stored = StoredTensors(directory)
    model = LOADERS[hf["model_type"]](hf, _Tensors(stored, sharding=sharding), dtype)
    if abstract := unfilled_paths(model):
        raise ValueError(f"parameters not filled from the checkpoint: {abstract[:8]}")
    if progress is not None:
        progress(f"read {stored.bytes_read / 2**20:,.1f} MiB ({100 * stored.bytes_read / max(stored.nbytes, 1):.0f}%) "
                 f"of the {stored.nbytes / 2**20:,.1f} MiB of tensors in {directory} in "
                 f"{time.perf_counter() - start:.1f} s"
                 + (" (the shards this process's devices hold)" if sharding is not None else ""))
    return model


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "olmo2": "Olmo2ForCausalLM"}


def _hf_model_type(config: LlamaConfig):
    """The Hugging Face architecture that has exactly this config's features."""
    features = (config.qkv_bias, config.qk_norm, config.post_norm)
    if config.attention.window is not None:
        if features != (False, None, False):
            raise ValueError(f"a sliding window is exported only for Mistral (no qkv_bias, no qk_norm, no "
                             f"post_norm), got qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm!r}, "
                             f"post_norm={config.post_norm}")
        return "mistral"
    for model_type, wanted in (("llama", (False, None, False)), ("qwen2", (True, None, False)),
                               ("qwen3", (False, "head", False)), ("olmo2", (False, "full", True))):
        if features == wanted:
            return model_type
    raise ValueError(f"no Hugging Face architecture has qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm!r}, "
                     f"post_norm={config.post_norm}; supported: llama (none), qwen2 (qkv_bias), qwen3 "
                     f"(qk_norm='head'), olmo2 (qk_norm='full', post_norm)")


def _rope_parameters(config: LlamaConfig):
    attention = config.attention
    if attention.rope_ntk_factor is not None:
        return {"rope_type": "dynamic", "rope_theta": config.rope_theta, "factor": attention.rope_ntk_factor}
    if attention.rope_linear_factor is not None:
        return {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": attention.rope_linear_factor}
    if attention.rope_llama3 is not None:
        factor, low, high, original_len = attention.rope_llama3
        return {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": original_len}
    return {"rope_type": "default", "rope_theta": config.rope_theta}


# What `to_hf(..., source=...)` takes from the Hugging Face directory a model was loaded from: config.json fields
# the model's config does not hold, and the files that make the export a complete directory.
SOURCE_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
SOURCE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "tokenizer.model", "vocab.json", "merges.txt")


def _check_nothing_dropped(model, written: set[int]):
    """Raise ValueError naming every parameter of `model` whose variable's id is not in `written`."""
    dropped = [".".join(map(str, path)) for path, variable in nnx.iter_graph(model)
               if isinstance(variable, nnx.Param) and id(variable) not in written]
    if dropped:
        shown = dropped if len(dropped) <= 6 else dropped[:6] + [f"... {len(dropped) - 6} more"]
        raise ValueError(f"the model holds {len(dropped)} parameters a dense Hugging Face model has no place for, "
                         f"which to_hf would drop: {shown} (a Focus or Focal model viewed as dense?); pass "
                         f"allow_unused=True to write the dense model without them")


def _query_scales(model) -> set[int]:
    """The ids of the variables that scale every attention layer's queries: the q-norm gains in a model with
    QK-norm (a factor on the projection would be normalised away), else the q projection's kernel and bias."""
    ids = set()
    for attn in attention_layers(model):
        scales = [attn.q_norm.scale] if attn.config.qk_norm else [attn.q_proj.kernel, attn.q_proj.bias]
        ids |= {id(variable) for variable in scales if variable is not None}
    return ids


def _llama_hf_config(config: LlamaConfig, dtype: str) -> dict:
    """The config.json of the transformers architecture that has a `Llama`'s features (`_hf_model_type`)."""
    model_type = _hf_model_type(config)
    return {
        "model_type": model_type, "architectures": [_HF_ARCHITECTURES[model_type]],
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "intermediate_size": config.intermediate,
        "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.attention.n_kv_heads, "head_dim": config.attention.head_dim,
        "hidden_act": "silu", "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
        "rope_theta": config.rope_theta, "rope_parameters": _rope_parameters(config),
        "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None if config.attention.window is None else config.attention.window + 1,
        "torch_dtype": dtype, "dtype": dtype,
    }


def to_hf(model, directory, *, source=None, allow_unused=False):
    """Write a `Llama` (LLaMA family) or `GPT2` with dense or constant-temperature Focal attention as a Hugging Face
    directory (config.json + model.safetensors, parameters in their own dtype) that
    `transformers.AutoModelForCausalLM.from_pretrained` loads. The architecture is gpt2, or llama, mistral (when a
    sliding window is set), qwen2, qwen3 or olmo2, whichever has the model's features.

    Focal attention with a constant temperature t (`kind='focal'`, `focal_t`) is written as dense attention with
    the queries scaled by 1/t, which gives the same logits: `(q / t) . k * scale = q . k * scale / t` (RoPE is
    linear). The factor goes into the q projection's weight and bias, or, in a model with QK-norm, into the q-norm
    gains. In a bf16 model it rounds those parameters once more.

    source: the Hugging Face directory the model was loaded from (`from_hf`), or None. Its special token ids and
      `max_position_embeddings` (`SOURCE_FIELDS`) go into config.json, and its generation config and tokenizer
      files (`SOURCE_FILES`) are copied, so that `generate` stops at the right end-of-sequence token. Without it
      those fields take transformers' defaults.
    allow_unused: also write a model holding parameters its dense forward does not use (a Focus or learned-Focal
      model viewed as dense by `replace_attention(model, kind='dense', allow_unused=True)`); those parameters
      (`Centroid`s, routing projections, temperature weights) are left out of the directory.

    Raises ValueError for attention kinds other than 'dense' and 'focal' (transformers has no learned-Focal or Focus
    layers), for a logit softcap, for a sliding window on GPT-2, for a model holding LoRA parameters
    (`focal_jax.nn.lora.merge_lora` folds them into the kernels first), and, unless `allow_unused`, for a model
    holding parameters the export would drop (naming them).
    """
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"directory={directory!r} is a file; expected a directory to write the model into (it is "
                         f"created if missing)")
    source_config = {}
    if source is not None:
        if not os.path.isfile(os.path.join(source, "config.json")):
            raise ValueError(f"source={source!r} has no config.json (it should be the Hugging Face directory the "
                             f"model was loaded from)")
        with open(os.path.join(source, "config.json")) as f:
            source_config = {k: v for k, v in json.load(f).items() if k in SOURCE_FIELDS}
    if not isinstance(allow_unused, bool):
        raise ValueError(f"allow_unused must be a bool, got allow_unused={allow_unused!r}")
    if not isinstance(model, (Llama, GPT2)):
        raise ValueError(f"to_hf writes focal_jax.nn.llama.Llama and focal_jax.nn.gpt2.GPT2 models, got "
                         f"{type(model).__name__}")
    if jax.tree.leaves(nnx.state(model, LoRA)):
        raise ValueError("the model holds LoRA parameters, which to_hf would drop: merge_lora(model) first "
                         "(focal_jax.nn.lora.merge_lora)")
    config, attention = model.config, model.config.attention
    if attention.kind not in ("dense", "focal"):
        raise ValueError(f"to_hf needs attention kind 'dense' or 'focal' (a constant temperature, folded into the "
                         f"queries; transformers has no {attention.kind!r} attention), got kind={attention.kind!r}")
    if attention.softcap is not None:
        raise ValueError(f"to_hf cannot export softcap={attention.softcap!r}: transformers' "
                         f"{'GPT-2' if isinstance(model, GPT2) else 'LLaMA family'} has no logit softcap")
    scaled = _query_scales(model) if attention.kind == "focal" else set()

    def value(variable) -> np.ndarray:
        x = np.asarray(variable[...])
        return (x.astype(np.float32) * (1.0 / attention.focal_t)).astype(x.dtype) if id(variable) in scaled else x

    if isinstance(model, GPT2):
        if attention.window is not None:
            raise ValueError(f"to_hf cannot export GPT-2 with window={attention.window!r}: transformers' GPT-2 has "
                             f"no sliding window")
        rows = gpt2_tensors(model)
        tensors = {name: np.concatenate([value(v) for v in variables], axis=-1) for name, variables in rows}
        written = {id(v) for _, variables in rows for v in variables}
        hf = gpt2_hf_config(config, str(tensors["transformer.wte.weight"].dtype))
    else:
        rows = list(llama_tensors(model))
        tensors = {name: value(v).T if transpose else value(v) for v, name, transpose in rows}
        written = {id(v) for v, _, _ in rows}
        hf = _llama_hf_config(config, str(tensors["model.embed_tokens.weight"].dtype))
    if not allow_unused:
        _check_nothing_dropped(model, written)
    hf.update(source_config)
    if isinstance(model, Llama) and attention.rope_trained_len is not None:
        hf["max_position_embeddings"] = attention.rope_trained_len
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    for name in SOURCE_FILES if source is not None else ():
        path = os.path.join(source, name)
        if os.path.isfile(path) and not os.path.exists(os.path.join(directory, name)):
            shutil.copy(path, directory)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
