"""The LLaMA-family decoder (LLaMA, Mistral, Qwen2, Qwen3, OLMo-2 by config) and the Focal paper's model sizes.

Pre-norm blocks `h = x + attn(norm(x)); h = h + mlp(norm(h))`, or OLMo-2's post-norm
`h = x + norm(attn(x)); h = h + norm(mlp(h))`; RMSNorm, SwiGLU, RoPE; attention kind and implementation from
`LlamaConfig.attn` (any `AttentionConfig` field except the shape ones). Parameter names follow Hugging Face
(`embed_tokens`, `layers[i].self_attn.q_proj`, `input_layernorm`, `mlp.gate_proj`, `norm`, `lm_head`).
"""

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from focal_jax._axes import explicit_as_auto
from focal_jax._validation import plain_numbers
from focal_jax.attention.focal import einsum_f32
from focal_jax.attention.segments import segment_prefix
from focal_jax.nn.attention import Attention, AttentionConfig, check_cache, warn_unread_fields
from focal_jax.nn.layers import RMSNorm, SwiGLU, apply_block, embed, model_output_spec, rows_at

# The AttentionConfig fields that LlamaConfig.attention derives from its own fields (`attn` may not set them).
DERIVED_ATTENTION_FIELDS = ("d_model", "n_heads", "n_kv_heads", "head_dim", "qkv_bias", "out_bias", "qk_norm",
                            "norm_eps", "rope_theta")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """LLaMA-family model settings.

    n_kv_heads: None = n_heads (MHA). head_dim: None = d_model // n_heads.
    qk_norm: None | 'head' (Qwen3, the Focal paper) | 'full' (OLMo-2). post_norm: OLMo-2's norm placement.
    attn: extra `AttentionConfig` fields, e.g. `{'kind': 'focal', 'focal_t': 0.4}` (the shape fields are derived
      from this config and may not be given). Kept as a sorted tuple of (key, value) pairs.
    remat: recompute each decoder block in the backward pass instead of keeping its activations (training memory).
    init_std: None: Flax's initialisers (truncated LeCun normal kernels, an embedding table of std 1/sqrt(d_model));
      a number: every projection kernel, the embedding table and `lm_head` drawn from N(0, init_std^2) (LLaMA's
      0.02, FOCAL_SPEC's choice, which our Focal paper experiments set). Norm gains start at 1, biases at 0, and
      the Focus / Focal parameters (`Centroid`, `Temperature`) as their modules draw them, either way.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    intermediate: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: str | None = None
    post_norm: bool = False
    attn: Mapping[str, Any] | tuple = ()
    remat: bool = False
    init_std: float | None = None

    def __post_init__(self):
        plain_numbers(self)
        # Stored as sorted (key, value) pairs so that the config stays hashable (NNX keeps it as static data).
        if not isinstance(self.attn, (Mapping, tuple)):
            raise ValueError(f"attn must be a dict of AttentionConfig fields, got attn={self.attn!r}")
        object.__setattr__(self, "attn", tuple(sorted((key, tuple(value) if isinstance(value, list) else value)
                                                      for key, value in dict(self.attn).items())))
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}")
        for name in ("tie_embeddings", "post_norm", "remat"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
        std = self.init_std
        if std is not None and (isinstance(std, bool) or not isinstance(std, (int, float)) or not 0 < std < math.inf):
            raise ValueError(f"init_std must be None or a finite number > 0, got init_std={self.init_std!r}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"head_dim=None needs n_heads={self.n_heads} to divide d_model={self.d_model}")
        fields = {f.name for f in dataclasses.fields(AttentionConfig)}
        for key, _ in self.attn:
            if key in DERIVED_ATTENTION_FIELDS:
                raise ValueError(f"attn[{key!r}] is derived from the LlamaConfig fields; set those instead")
            if key not in fields:
                raise ValueError(f"attn[{key!r}] is not an AttentionConfig field; choices: "
                                 f"{sorted(fields - set(DERIVED_ATTENTION_FIELDS))}")
        _ = self.attention  # builds the AttentionConfig now, so a bad attention field fails here

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig(
            d_model=self.d_model, n_heads=self.n_heads,
            n_kv_heads=self.n_heads if self.n_kv_heads is None else self.n_kv_heads,
            head_dim=self.d_model // self.n_heads if self.head_dim is None else self.head_dim,
            qkv_bias=self.qkv_bias, out_bias=False, qk_norm=self.qk_norm, norm_eps=self.norm_eps,
            rope_theta=self.rope_theta, **dict(self.attn))


class DecoderBlock(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.post_norm = config.post_norm
        eps = config.norm_eps
        if config.post_norm:
            self.post_attention_layernorm = RMSNorm(config.d_model, eps=eps)
            self.post_feedforward_layernorm = RMSNorm(config.d_model, eps=eps)
        else:
            self.input_layernorm = RMSNorm(config.d_model, eps=eps)
            self.post_attention_layernorm = RMSNorm(config.d_model, eps=eps)
        self.self_attn = Attention(config.attention, rngs=rngs)
        self.mlp = SwiGLU(config.d_model, config.intermediate, rngs=rngs)

    def __call__(self, x, *, positions, segment_ids=None, cache=None, cache_index=None):
        """`[B, T, d]`, or `(out, new_cache)` when a layer `cache` is given (see `Attention`)."""
        kwargs = {} if cache is None else dict(cache=cache, cache_index=cache_index)
        if self.post_norm:  # OLMo-2
            attn = self.self_attn(x, positions=positions, segment_ids=segment_ids, residual=x, **kwargs)
        else:
            attn = self.self_attn(self.input_layernorm(x), positions=positions, segment_ids=segment_ids, residual=x,
                                  **kwargs)
        if cache is not None:
            attn, cache = attn
        if self.post_norm:
            x = x + self.post_attention_layernorm(attn)
            x = x + self.post_feedforward_layernorm(self.mlp(x))
        else:
            x = x + attn
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x if cache is None else (x, cache)


def segment_positions(segment_ids):
    """Int32 `[B, T]`: each token's position in its segment of `segment_ids [B, T]` (the tokens with its id, as the
    attention masks define segments, contiguous or not): 0 for the segment's first token, then 1, 2, ..."""
    ones = jnp.ones(segment_ids.shape + (1,), jnp.int32)
    return jax.vmap(lambda x, ids: segment_prefix(x, ids, "sum"))(ones, segment_ids)[..., 0] - 1


def redraw_normal(module, std: float, rngs: nnx.Rngs):
    """Redraw, in place, the kernel of every `nnx.Linear` and the table of every `nnx.Embed` in `module` from
    N(0, std^2), in its dtype. Only plain `nnx.Param`s: a `Centroid` or `Temperature` keeps its own draw."""
    for _, node in nnx.iter_graph(module):
        variable = (node.kernel if isinstance(node, nnx.Linear) else node.embedding if isinstance(node, nnx.Embed)
                    else None)
        if type(variable) is nnx.Param:
            value = variable.get_value()
            variable.set_value(std * jax.random.normal(rngs.params(), value.shape, value.dtype))


class Llama(nnx.Module):
    """`model(tokens [B, T], positions=None, segment_ids=None) -> float32 logits [B, T, vocab]`.

    positions default to `0..T-1`, restarting at each segment when `segment_ids` (packed documents) is given.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        warn_unread_fields(config.attention)
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.layers = nnx.List([DecoderBlock(config, rngs=rngs) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, rngs=rngs)
        if config.init_std is not None:
            redraw_normal(self, config.init_std, rngs)

    @explicit_as_auto(model_output_spec)
    def __call__(self, tokens, positions=None, segment_ids=None, cache=None, logits_at=None):
        """Logits `[B, T, vocab]`; with a `cache` (`focal_jax.nn.generate.init_cache`), `(logits, new_cache)`: the
        tokens continue the cached ones, at positions `cache['index'] + 0..T-1` unless `positions` is given.
        `logits_at [B, P]` (sequence indices) returns the logits of those rows only, `[B, P, vocab]`.
        A token id outside `[0, vocab)` is a ValueError when the tokens are concrete; under `jax.jit` (traced, so
        unchecked) its embedding row, and so its logits, are NaN."""
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or 0 in tokens.shape:
            raise ValueError(f"tokens must be an integer array [batch, seq] (both >= 1), got shape {tokens.shape} "
                             f"dtype {tokens.dtype}")
        if positions is not None:
            positions = jnp.asarray(positions)
            if tuple(positions.shape) != tokens.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
                raise ValueError(f"positions must be integers of the shape of tokens {tokens.shape}, got shape "
                                 f"{positions.shape} dtype {positions.dtype}")
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids)
        if segment_ids is not None and tuple(jnp.shape(segment_ids)) != tokens.shape:
            raise ValueError(f"segment_ids must have the shape of tokens {tokens.shape}, got shape "
                             f"{jnp.shape(segment_ids)}")
        if cache is not None:
            check_cache(cache, len(self.layers), tokens.shape[1])
            if segment_ids is not None:
                raise ValueError("segment_ids must be None when decoding with a cache (one sequence per row)")
            index = cache["index"]
            if positions is None:
                positions = jnp.broadcast_to(index + jnp.arange(tokens.shape[1]), tokens.shape)
        elif positions is None:
            positions = (jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if segment_ids is None
                         else segment_positions(segment_ids))
        x = embed(self.embed_tokens, tokens)
        layer_caches = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = apply_block(layer, x, positions=positions, segment_ids=segment_ids, remat=self.config.remat)
            else:
                x, layer_cache = layer(x, positions=positions, cache=cache["layers"][i], cache_index=index)
                layer_caches.append(layer_cache)
        x = self.norm(rows_at(x, logits_at))
        w = self.embed_tokens.embedding[...].T if self.config.tie_embeddings else self.lm_head.kernel[...]
        logits = einsum_f32("...d,dv->...v", x, w.astype(x.dtype))  # in the compute dtype, float32 logits
        if cache is None:
            return logits
        return logits, {"index": index + tokens.shape[1], "layers": tuple(layer_caches)}


# The Focal paper's sizes (FOCAL_SPEC.md, Table 3): hidden, intermediate, heads, layers; vocab 32000, untied,
# MHA, head_dim 128, per-head QK-norm, no biases, RoPE theta 10K. 'tiny' is for tests and smoke runs.
FOCAL_SIZES = {
    "tiny": (64, 172, 4, 2),
    "400M": (1024, 3072, 8, 24),
    "777M": (1536, 4096, 12, 24),
    "1.3B": (2048, 5504, 16, 24),
    "2.7B": (2560, 6912, 20, 32),
    "6.7B": (4096, 11008, 32, 32),
    "9.5B": (4608, 12288, 36, 36),
}


def focal_config(size: str, **overrides) -> LlamaConfig:
    """The Focal paper's model of `size` (a key of `FOCAL_SIZES`), with any `LlamaConfig` field overridden, e.g.
    `focal_config('400M', attn={'kind': 'focal', 'focal_t': 0.4})`. 'tiny' uses a 1000-token vocabulary and
    head_dim 16. RMSNorm eps 1e-6 and Flax's initialisers unless overridden (runs stored with a `size` build from
    these); the experiments' pretraining runs set FOCAL_SPEC's `norm_eps=1e-5, init_std=0.02`."""
    if size not in FOCAL_SIZES:
        raise ValueError(f"size={size!r} is not one of {tuple(FOCAL_SIZES)}")
    d, inter, heads, layers = FOCAL_SIZES[size]
    base = dict(vocab_size=32000 if size != "tiny" else 1000, d_model=d, intermediate=inter, n_heads=heads,
                n_layers=layers, n_kv_heads=heads, head_dim=d // heads, rope_theta=10000.0, norm_eps=1e-6,
                tie_embeddings=False, qkv_bias=False, qk_norm="head")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(LlamaConfig)}
    if unknown:
        raise ValueError(f"unknown LlamaConfig fields {sorted(unknown)}")
    return LlamaConfig(**{**base, **overrides})


def param_count(config: LlamaConfig, param_type=nnx.Param) -> int:
    """Number of parameters of type `param_type` in `Llama(config)`, from shapes only (nothing is allocated)."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(abstract, param_type)))
