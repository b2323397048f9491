"""GPT-2 in Flax NNX, with pluggable Focal / Focus attention.

Architecture (as Hugging Face's `GPT2LMHeadModel`): token + learned position embeddings, pre-LayerNorm blocks
(attention with qkv and output biases, no rotary; MLP `c_fc -> GELU -> c_proj` with biases), a final LayerNorm and an
lm head tied to the token embedding (`logits = h @ wte.T`).

Parameter layout: every projection is an `nnx.Linear` with kernel `[in, out]`, which is the layout of Hugging Face's
GPT-2 `Conv1D` weights, so a checkpoint loads without transposes (`focal_jax/convert/gpt2.py`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> config = GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4)
  >>> model = GPT2(config, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 50)
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from focal_jax._axes import explicit_as_auto
from focal_jax._validation import plain_numbers
from focal_jax.attention.focal import einsum_f32
from focal_jax.nn.attention import Attention, AttentionConfig, check_cache, warn_unread_fields
from focal_jax.nn.layers import apply_block, embed, model_output_spec, rows_at
from focal_jax.nn.llama import segment_positions

ACTIVATIONS = {
    # Hugging Face names -> jax.nn.gelu's `approximate` flag.
    "gelu_new": True,           # tanh approximation, GPT-2's own
    "gelu_pytorch_tanh": True,
    "gelu_fast": True,
    "gelu": False,              # exact (erf)
}

# Fields of GPT2Config passed as they are to AttentionConfig.
ATTENTION_FIELDS = ("kind", "impl", "focal_t", "tau_min", "tau_max", "tau_mode", "tau_clip", "tau_granularity",
                    "tau_bias", "tau_input", "focus_groups", "focus_dim", "focus_window", "focus_tau", "focus_iters",
                    "focus_gate", "focus_lam", "focus_topk", "focus_causal", "focus_assign", "focus_normalize",
                    "focus_sink", "window", "softcap")


def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"GPT2Config.{name} must be an integer >= {minimum}, got {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 hyperparameters (Hugging Face names in brackets) plus the attention kind and its settings.

    vocab_size [vocab_size], n_positions [n_positions], d_model [n_embd], n_layers [n_layer], n_heads [n_head],
    layer_norm_eps [layer_norm_epsilon], d_ff [n_inner; None = 4 * d_model], activation [activation_function].
    remat: recompute each block in the backward pass instead of keeping its activations (training memory).
    The attention fields (kind ... softcap, `ATTENTION_FIELDS`) have the meaning of
    `focal_jax.nn.attention.AttentionConfig` and are checked by it (an error names the field), e.g. `window=w`: a
    sliding window, key j visible to query i iff `0 <= i - j <= w` (kinds dense / focal / focal_learned; None = full
    causal attention); `tau_mode`, `tau_clip`, `tau_granularity`, `tau_bias`, `tau_input` for 'focal_learned';
    `focus_assign`, `focus_normalize`, `focus_sink` for the Focus kinds; `softcap` on the logits.
    Hugging Face's GPT-2 has none of these (`focal_jax.convert.gpt2` keeps their defaults).
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    layer_norm_eps: float = 1e-5
    d_ff: int | None = None
    activation: str = "gelu_new"
    remat: bool = False
    # Attention kind and settings (passed through to AttentionConfig).
    kind: str = "dense"
    impl: str = "xla"
    focal_t: float = 0.4
    tau_min: float = 5.0
    tau_max: float = 10.0
    focus_groups: int = 8
    focus_dim: int = 16
    focus_window: int = 128
    focus_tau: float = 0.1
    focus_iters: int = 10
    focus_gate: str = "paper"
    focus_lam: float = 10.0
    focus_topk: int | None = None
    focus_causal: bool = False
    focus_assign: str = "sinkhorn"
    focus_normalize: bool = True
    focus_sink: int = 0
    tau_mode: str = "prefix"
    tau_clip: str = "hard"
    tau_granularity: str = "layer"
    tau_bias: bool = True
    tau_input: str = "normed"
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self):
        plain_numbers(self)
        for name in ("vocab_size", "n_positions", "d_model", "n_layers", "n_heads"):
            _check_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(f"GPT2Config.d_model must be divisible by n_heads, got d_model={self.d_model}, "
                             f"n_heads={self.n_heads}")
        if self.d_ff is not None:
            _check_int("d_ff", self.d_ff)
        eps = self.layer_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"GPT2Config.layer_norm_eps must be a number > 0, got layer_norm_eps={eps!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"GPT2Config.activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got activation={self.activation!r}")
        try:
            self.attention_config()  # AttentionConfig validates the attention fields, naming the bad one
        except ValueError as e:
            raise ValueError(f"GPT2Config: {e}") from None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def attention(self) -> AttentionConfig:
        """`attention_config()`, under the name `LlamaConfig` uses."""
        return self.attention_config()

    @property
    def ff_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def attention_config(self) -> AttentionConfig:
        """The `AttentionConfig` of every layer: GPT-2's shape (MHA, qkv and output biases, no rotary embedding)
        and the attention fields of this config."""
        return AttentionConfig(d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_heads,
                               head_dim=self.head_dim, qkv_bias=True, out_bias=True, rope_theta=None,
                               **{name: getattr(self, name) for name in ATTENTION_FIELDS})


def _normal(stddev=0.02):
    return nnx.initializers.normal(stddev)


class GPT2MLP(nnx.Module):
    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(config.d_model, config.ff_dim, kernel_init=_normal(), rngs=rngs)
        self.c_proj = nnx.Linear(config.ff_dim, config.d_model, kernel_init=_normal(), rngs=rngs)
        self.approximate = ACTIVATIONS[config.activation]

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=self.approximate))


class GPT2Block(nnx.Module):
    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(config.d_model, epsilon=config.layer_norm_eps, rngs=rngs)
        self.attn = Attention(config.attention_config(), rngs=rngs)
        self.ln_2 = nnx.LayerNorm(config.d_model, epsilon=config.layer_norm_eps, rngs=rngs)
        self.mlp = GPT2MLP(config, rngs=rngs)

    def __call__(self, x, *, positions, segment_ids=None, cache=None, cache_index=None):
        if cache is None:
            x = x + self.attn(self.ln_1(x), positions=positions, segment_ids=segment_ids, residual=x)
            return x + self.mlp(self.ln_2(x))
        attn, cache = self.attn(self.ln_1(x), positions=positions, cache=cache, cache_index=cache_index, residual=x)
        x = x + attn
        return x + self.mlp(self.ln_2(x)), cache


class GPT2(nnx.Module):
    """GPT-2 language model: `model(tokens [B, T], positions=None, segment_ids=None) -> float32 logits [B, T, V]`.

    `positions [B, T]` (default `0..T-1`, restarting at each segment when `segment_ids` is given, as in `Llama`)
    index the learned position table and must be `< n_positions`; `segment_ids [B, T]` keep packed documents apart
    in attention.
    """

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        if not isinstance(config, GPT2Config):
            raise ValueError(f"config must be a GPT2Config, got {type(config).__name__}")
        self.config = config
        warn_unread_fields(config.attention_config())
        self.wte = nnx.Embed(config.vocab_size, config.d_model, embedding_init=_normal(), rngs=rngs)
        self.wpe = nnx.Embed(config.n_positions, config.d_model, embedding_init=_normal(0.01), rngs=rngs)
        self.h = nnx.List([GPT2Block(config, rngs=rngs) for _ in range(config.n_layers)])
        self.ln_f = nnx.LayerNorm(config.d_model, epsilon=config.layer_norm_eps, rngs=rngs)

    @explicit_as_auto(model_output_spec)
    def __call__(self, tokens, positions=None, segment_ids=None, cache=None, logits_at=None):
        """Logits `[B, T, V]`; with a `cache` (`focal_jax.nn.generate.init_cache`), `(logits, new_cache)`: the
        tokens continue the cached ones, at positions `cache['index'] + 0..T-1` unless `positions` is given.
        `logits_at [B, P]` (sequence indices) returns the logits of those rows only, `[B, P, V]`.
        A token id outside `[0, V)` or a position outside `[0, n_positions)` is a ValueError when concrete; under
        `jax.jit` (traced, so unchecked) its embedding row, and so its logits, are NaN."""
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or 0 in tokens.shape:
            raise ValueError(f"tokens must be integers of shape [batch, seq] (both >= 1), got shape {tokens.shape} "
                             f"dtype {tokens.dtype}")
        b, t = tokens.shape
        if cache is not None:
            check_cache(cache, len(self.h), tokens.shape[1])
            if segment_ids is not None:
                raise ValueError("segment_ids must be None when decoding with a cache (one sequence per row)")
            max_len = cache["layers"][0]["k"].shape[1]
            if max_len > self.config.n_positions:
                raise ValueError(f"cache max_len={max_len} exceeds n_positions={self.config.n_positions}")
            if positions is None:
                positions = jnp.broadcast_to(cache["index"] + jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids)
        if segment_ids is not None and jnp.shape(segment_ids) != (b, t):
            raise ValueError(f"segment_ids must have shape [batch, seq] = {(b, t)}, got shape "
                             f"{jnp.shape(segment_ids)}")
        if positions is None and segment_ids is not None:
            positions = segment_positions(segment_ids)  # restarting at each document, as Llama's
        elif positions is None:
            if t > self.config.n_positions:
                raise ValueError(f"sequence length {t} exceeds n_positions={self.config.n_positions}")
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        else:
            positions = jnp.asarray(positions)
            if positions.shape != (b, t):
                raise ValueError(f"positions must have shape [batch, seq] = {(b, t)}, got shape {positions.shape}")
            if not jnp.issubdtype(positions.dtype, jnp.integer):
                raise ValueError(f"positions must be integers, got dtype {positions.dtype}")
        x = embed(self.wte, tokens) + embed(self.wpe, positions, what="positions")
        layer_caches = []
        for i, block in enumerate(self.h):
            if cache is None:
                x = apply_block(block, x, positions=positions, segment_ids=segment_ids, remat=self.config.remat)
            else:
                x, layer_cache = block(x, positions=positions, cache=cache["layers"][i], cache_index=cache["index"])
                layer_caches.append(layer_cache)
        x = self.ln_f(rows_at(x, logits_at))
        logits = einsum_f32("...d,vd->...v", x, self.wte.embedding[...].astype(x.dtype))  # float32 logits
        if cache is None:
            return logits
        return logits, {"index": cache["index"] + t, "layers": tuple(layer_caches)}
