"""The `Attention` module: MHA / GQA projections, optional QK-norm and qkv bias, RoPE, and a pluggable kind
(`dense`, `focal`, `focal_learned`, `focus`, `focal+focus`) and implementation (`xla`, `cudnn`, `decomposed`,
`pallas`) taken from an `AttentionConfig`. All the math lives in `focal_jax.attention`; this module holds
parameters and picks the function. `record_attention()` lets diagnostics see each layer's inputs and routing.
"""

import contextlib
import contextvars
import dataclasses
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from focal_jax import attention as fa
from focal_jax._validation import plain_numbers
from focal_jax.attention import _validate
from focal_jax.attention.focal import TAU_MODES, attend, attention_logits, clip_tau, tau_logits
from focal_jax.attention.masks import causal_mask, group_mask, local_mask, segment_mask
from focal_jax.kernels import focus_sparse
from focal_jax.kernels.focus_sparse import dot_product_pallas
from focal_jax.nn.layers import RMSNorm, dynamic_ntk_theta, rope
from focal_jax.nn.variables import Centroid, Temperature

KINDS = ("dense", "focal", "focal_learned", "focus", "focal+focus")
# Attention functions registered by name with `register_attention` (kinds beyond KINDS, for prototyping).
CUSTOM_KINDS: dict = {}
IMPLS = ("xla", "cudnn", "decomposed", "pallas")
QK_NORMS = (None, "head", "full")
GATES = ("paper", "log")
TAU_CLIPS = ("hard", "straight_through", "smooth")
TAU_GRANULARITIES = ("layer", "head")
TAU_INPUTS = ("normed", "residual")
ASSIGNMENTS = ("sinkhorn", "softmax")
FOCUS_KINDS = ("focus", "focal+focus")

# The list each Attention call appends its record to while `record_attention()` is active (None otherwise).
_RECORDS = contextvars.ContextVar("focal_jax_attention_records", default=None)


@contextlib.contextmanager
def record_attention():
    """Records what every `Attention` layer computes, for diagnostics (`focal_jax.eval.diagnostics`).

    Inside `with record_attention() as records:`, each call of an `Attention` module without a KV cache appends
    one dict to `records`, in call order (layer order for a forward pass):
      config: the layer's `AttentionConfig`;
      attend: the layer's attention function `(x, q, k, v, segment_ids, tau_x=tau_x) -> [B, T, H, Dv]`, the path
        the forward used (with one-hot values `v [B, T, Hk, T]` it returns the attention probabilities
        `[B, T, H, T]`);
      x `[B, T, d_model]` (the layer input), q `[B, T, H, D]`, k, v `[B, T, Hk, D]` (after QK-norm and RoPE),
      segment_ids `[B, T]` or None;
      tau_x `[B, T, d_model]`: the learned temperature's input (x, or the residual stream with
        `tau_input='residual'`);
      g `[B, T, K]` (the Sinkhorn assignment), for the Focus kinds only;
      tau `[B, T]` (`[B, T, H]` per head: the learned temperature), for 'focal_learned' only.
    The values belong to the current trace: under `jax.jit`, use them inside the jitted function; call the model
    without rematerialisation (`remat=False`), whose blocks run in an inner trace. Outside the context nothing is
    recorded and the computation is unchanged.
    """
    records = []
    token = _RECORDS.set(records)
    try:
        yield records
    finally:
        _RECORDS.reset(token)


def _new_record(layer, **values):
    """The dict this call of `layer` records into (appended to the active records), or None when not recording."""
    records = _RECORDS.get()
    if records is None:
        return None
    records.append({"config": layer.config, "attend": layer._attend, **values})
    return records[-1]


def register_attention(name: str, fn):
    """Make `fn` an attention kind: `AttentionConfig(kind=name)` (and `model.attn.kind=name` in a training config)
    then calls it in every layer, in place of the built-in kinds. For prototyping a variant in-process (a
    notebook, a script that then calls `focal_jax.train.train`); register it again in any process that rebuilds
    the model.

    fn: `fn(q, k, v, *, segment_ids) -> out`, q `[B, T, H, D]` (after QK-norm and RoPE), k, v `[B, T, Hk, D]`,
      segment_ids int `[B, T]` or None -> `[B, T, H, D]`; causal, like every kind. The layer adds no parameters.
    Returns `fn`, so it can decorate. Re-registering a name replaces its function; built-in names are refused.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if name in KINDS:
        raise ValueError(f"{name!r} is a built-in attention kind; choose another name (built-in: {KINDS})")
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # (a builtin or C function without a signature: taken as it is)
        parameters = None
    if parameters is not None and not any(p.name == "segment_ids" or p.kind == p.VAR_KEYWORD for p in parameters):
        raise ValueError(f"fn must take the keyword argument segment_ids (fn(q, k, v, *, segment_ids)), which "
                         f"every layer passes; {getattr(fn, '__name__', fn)!r} takes "
                         f"{[p.name for p in parameters]}")
    CUSTOM_KINDS[name] = fn
    return fn


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {choices}")


def _int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}")


def softer_tau_note(tau_max: float, head_dim: int) -> str:
    """Why a learned temperature's clip range whose `tau_max` is above sqrt(head_dim) is likely a mistake: tau
    replaces sqrt(head_dim), so tau > sqrt(head_dim) attends more softly than dense attention. The paper's [5, 10]
    is tuned for head_dim 128 (sqrt = 11.3); FOCAL_SPEC OQ-F6 rescales it by sqrt(head_dim / 128)."""
    factor = math.sqrt(head_dim / 128)
    return (f"kind='focal_learned' with tau_max={tau_max:g} > sqrt(head_dim={head_dim}) = {math.sqrt(head_dim):.3g}: "
            f"the learned temperature tau replaces sqrt(head_dim), so it may attend more softly than dense attention. "
            f"The paper's range [5, 10] is tuned for head_dim 128; for head_dim {head_dim} it is "
            f"tau_min={5 * factor:.4g}, tau_max={10 * factor:.4g} (FOCAL_SPEC OQ-F6; "
            f"focal_jax.configs.common.rescaled_tau_range)")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Settings of one attention layer; every field is checked at construction.

    kind: 'dense' | 'focal' (constant temperature focal_t) | 'focal_learned' (Temperature params, tau in
      [tau_min, tau_max], causal prefix mean) | 'focus' (Centroid params; soft gate, or hard top-k when
      focus_topk is set) | 'focal+focus' (focus with the focal_t temperature applied first) | a name registered
      with `register_attention` (a function of q, k, v; impl 'xla').
    impl: 'xla' (the pure functions; the dense masked reference for hard Focus) | 'cudnn' (dense / focal only,
      GPU only, bf16 / fp16 inputs; segment ids become a dense `[B, 1, T, T]` mask, which cuDNN takes as a bias) |
      'decomposed' (hard Focus only: the exact blockwise path) | 'pallas' (the block-sparse Pallas kernels of
      `focal_jax.kernels.focus_sparse`: dense / focal / focal_learned, and hard Focus; not the soft gate).
    qk_norm: None | 'head' (Qwen3: RMSNorm over head_dim, per head) | 'full' (OLMo-2: RMSNorm over all heads'
      q and k before reshaping).
    rope_theta: None for no rotary embedding (GPT-2 uses learned positions).
    softcap: None, or cap the (temperature-scaled) logits as `softcap * tanh(logits / softcap)` before any Focus
      gate or mask (Gemma-2 style; FOCUS_SPEC OQ-13).
    rope_ntk_factor, rope_trained_len: dynamic NTK scaling of the RoPE base past `rope_trained_len` tokens
      (`layers.dynamic_ntk_theta`, Hugging Face's 'dynamic' rope type); both None (the default) for plain RoPE.
    rope_linear_factor: Hugging Face's 'linear' rope type: every rotary frequency divided by this factor.
    rope_llama3: Hugging Face's 'llama3' rope type (LLaMA 3.1 and later): `(factor, low_freq_factor,
      high_freq_factor, original_max_position_embeddings)`, e.g. `(8.0, 1.0, 4.0, 8192)`
      (`layers.rope_inverse_frequencies`). At most one of the three scalings is set.
    tau_mode: the mean of 'focal_learned' (`learned_temperature(mode=...)`, FOCAL_SPEC OQ-F2): 'prefix' (default,
      causal: the running mean over tokens <= i) | 'sequence' (the paper's literal mean over the whole row: tau_i
      sees later tokens, a fidelity ablation; such a layer cannot decode with a KV cache) | 'token' (no mean: tau_i
      from token i alone).
    tau_granularity: 'layer' (default, the paper's: `w_tau [d_model]`, one tau per token shared by the heads) |
      'head' (FOCAL_SPEC OQ-F1's extension: `w_tau [d_model, n_heads]`, `tau_bias [n_heads]`, one tau per head).
    tau_bias: True (default, FOCAL_SPEC OQ-F4's flagged deviation): `tau_bias` starts at the midpoint of
      [tau_min, tau_max] and `w_tau` at zeros, so tau starts inside the clip | False (the literal Eq. 6): no bias,
      `w_tau ~ N(0, 0.02^2)`, so tau starts near 0 and a 'hard' clip holds it at tau_min with no gradient (pair
      it with tau_clip='straight_through' or 'smooth').
    tau_input: the x of `mean(x @ w_tau)` (FOCAL_SPEC OQ-F3): 'normed' (default: the attention input, after the
      pre-norm) | 'residual' (the block's input, the residual stream, before the pre-norm).
    tau_clip: how 'focal_learned' clips tau to [tau_min, tau_max] (`learned_temperature(clip=...)`, FOCAL_SPEC
      OQ-F4): 'hard' (default, the paper's: no gradient outside the range) | 'straight_through' (clipped forward,
      identity gradient) | 'smooth' (a sigmoid of slope 1 at the midpoint, never flat).
    focus_assign: how the Focus kinds turn routing scores into the assignment g: 'sinkhorn' (default, the paper's
      balanced assignment) | 'softmax' (a softmax over the K scores of each token, no balancing: the collapse
      baseline of FOCUS_SPEC section 7; pair it with the trainer's `balance_weight`).
    focus_normalize: the routing scores (`routing_scores(normalize=...)`, FOCUS_SPEC OQ-2): True (default) the
      cosine of `x W_g` and each centroid, / focus_tau | False the raw dot product / focus_tau.
    focus_sink: an attention sink for the Focus kinds (FOCUS_SPEC OQ-12): the first `focus_sink` tokens of each
      document (segment; of the row without segment ids) are visible to every later query of that document,
      ungated in the soft form, always allowed in the hard form and in KV-cache decoding (cache slots <
      focus_sink). Default 0: off, the paper's.
    window: sliding window (Mistral) for 'dense' / 'focal' / 'focal_learned': key j is visible iff
      `0 <= i - j <= window` (Hugging Face's `sliding_window` is window + 1). None = full causal attention.
    """

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: str | None = None
    norm_eps: float = 1e-6
    rope_theta: float | None = 10000.0
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
    rope_ntk_factor: float | None = None
    rope_trained_len: int | None = None
    rope_linear_factor: float | None = None
    rope_llama3: tuple[float, float, float, int] | None = None
    softcap: float | None = None

    def __post_init__(self):
        plain_numbers(self)
        for name in ("d_model", "n_heads", "n_kv_heads", "head_dim", "focus_groups", "focus_dim", "focus_iters"):
            _int(name, getattr(self, name), 1)
        _int("focus_window", self.focus_window, 0)
        _int("focus_sink", self.focus_sink, 0)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (GQA)")
        for name in ("qkv_bias", "out_bias", "focus_causal", "focus_normalize", "tau_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")
        _choice("qk_norm", self.qk_norm, QK_NORMS)
        if self.kind not in KINDS and self.kind not in CUSTOM_KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {KINDS} nor registered with register_attention "
                             f"(registered: {tuple(CUSTOM_KINDS)})")
        if self.kind in CUSTOM_KINDS and self.impl != "xla":
            raise ValueError(f"kind={self.kind!r} is a registered function: it takes impl='xla', got "
                             f"impl={self.impl!r}")
        for name in ("window", "softcap"):
            if self.kind in CUSTOM_KINDS and getattr(self, name) is not None:
                raise ValueError(f"kind={self.kind!r} is a registered function, which {name}={getattr(self, name)!r} "
                                 f"would not reach: it gets q, k, v and segment_ids only")
        _choice("impl", self.impl, IMPLS)
        _choice("focus_gate", self.focus_gate, GATES)
        _choice("focus_assign", self.focus_assign, ASSIGNMENTS)
        _choice("tau_mode", self.tau_mode, TAU_MODES)
        _choice("tau_clip", self.tau_clip, TAU_CLIPS)
        _choice("tau_granularity", self.tau_granularity, TAU_GRANULARITIES)
        _choice("tau_input", self.tau_input, TAU_INPUTS)
        for name in ("norm_eps", "focal_t", "focus_tau", "focus_lam"):
            _positive(name, getattr(self, name))
        if self.rope_theta is not None:
            _positive("rope_theta", self.rope_theta)
            if self.head_dim % 2:
                raise ValueError(f"rotary embeddings need an even head_dim, got head_dim={self.head_dim}")
        if (self.rope_ntk_factor is None) != (self.rope_trained_len is None):
            raise ValueError(f"rope_ntk_factor and rope_trained_len go together, got rope_ntk_factor="
                             f"{self.rope_ntk_factor!r}, rope_trained_len={self.rope_trained_len!r}")
        self._check_rope_scaling()
        if self.rope_ntk_factor is not None:
            if isinstance(self.rope_ntk_factor, bool) or not isinstance(self.rope_ntk_factor, (int, float)) or not (
                    1 <= self.rope_ntk_factor < math.inf):  # (Hugging Face's 'dynamic' rope type: >= 1 too)
                raise ValueError(f"rope_ntk_factor={self.rope_ntk_factor!r}: the dynamic NTK scaling factor must be a "
                                 f"finite number >= 1")
            _int("rope_trained_len", self.rope_trained_len, 1)
        if self.softcap is not None:
            _positive("softcap", self.softcap)
            if self.impl == "cudnn":
                raise ValueError(f"softcap={self.softcap!r} is not available with impl='cudnn'; use impl='xla'")
        for name in ("tau_min", "tau_max"):  # tau_bias starts at their midpoint
            _positive(name, getattr(self, name))
        if not self.tau_min < self.tau_max:
            raise ValueError(f"tau_min must be < tau_max, got tau_min={self.tau_min}, tau_max={self.tau_max}")
        if self.kind == "focal_learned" and self.tau_max > math.sqrt(self.head_dim):
            warnings.warn(softer_tau_note(self.tau_max, self.head_dim), stacklevel=3)
        if self.window is not None:
            _int("window", self.window, 0)
            if self.kind in FOCUS_KINDS:
                raise ValueError(f"window={self.window} is for the non-Focus kinds; kind={self.kind!r} uses "
                                 f"focus_window")
        if self.focus_topk is not None:
            _int("focus_topk", self.focus_topk, 1)
            if self.focus_topk > self.focus_groups:
                raise ValueError(f"focus_topk={self.focus_topk} must be <= focus_groups={self.focus_groups}")
        if self.impl == "cudnn" and self.kind not in ("dense", "focal"):
            raise ValueError(f"impl='cudnn' supports kind 'dense' and 'focal', got kind={self.kind!r}")
        if self.impl == "pallas" and self.kind in FOCUS_KINDS and self.focus_topk is None:
            raise ValueError(f"impl='pallas' computes hard Focus (focus_topk set) or the non-Focus kinds; kind="
                             f"{self.kind!r} with focus_topk=None is the soft gate: use impl='xla'")
        if self.impl == "decomposed" and (self.kind not in FOCUS_KINDS or self.focus_topk is None):
            raise ValueError(f"impl='decomposed' is the hard Focus path: it needs kind in {FOCUS_KINDS} and "
                             f"focus_topk set, got kind={self.kind!r}, focus_topk={self.focus_topk!r}")

    def _check_rope_scaling(self):
        scalings = [name for name in ("rope_ntk_factor", "rope_linear_factor", "rope_llama3")
                    if getattr(self, name) is not None]
        if scalings and self.rope_theta is None:
            raise ValueError(f"{scalings[0]}={getattr(self, scalings[0])!r} needs rotary embeddings (rope_theta)")
        if len(scalings) > 1:
            raise ValueError(f"at most one RoPE scaling can be set, got {', '.join(scalings)}")
        if self.rope_linear_factor is not None:
            _positive("rope_linear_factor", self.rope_linear_factor)
        if self.rope_llama3 is not None:
            llama3 = self.rope_llama3
            if (not isinstance(llama3, (tuple, list)) or len(llama3) != 4
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in llama3)
                    or not llama3[1] < llama3[2]):
                raise ValueError(f"rope_llama3 must be (factor, low_freq_factor, high_freq_factor, "
                                 f"original_max_position_embeddings), positive numbers with low_freq_factor < "
                                 f"high_freq_factor, got rope_llama3={llama3!r}")
            object.__setattr__(self, "rope_llama3", tuple(llama3))  # a list from a config file stays hashable


# The fields that some kinds read only, with those kinds: set on a layer of another kind, one changes nothing.
FIELD_KINDS = {"focal_t": ("focal", "focal+focus"), "tau_min": ("focal_learned",), "tau_max": ("focal_learned",),
               **{name: ("focal_learned",) for name in ("tau_mode", "tau_clip", "tau_granularity", "tau_bias",
                                                         "tau_input")},
               "window": ("dense", "focal", "focal_learned"), "softcap": KINDS,
               **{f.name: FOCUS_KINDS for f in dataclasses.fields(AttentionConfig) if f.name.startswith("focus_")}}


def unread_fields(config: AttentionConfig) -> dict:
    """`{field: value}` of the fields of `config` set away from their defaults that its kind does not read
    (`FIELD_KINDS`), e.g. `{'focal_t': 0.3}` for kind 'dense'."""
    defaults = {f.name: f.default for f in dataclasses.fields(AttentionConfig)}
    return {name: getattr(config, name) for name, kinds in FIELD_KINDS.items()
            if config.kind not in kinds and getattr(config, name) != defaults[name]}


def unread_fields_message(config: AttentionConfig) -> str:
    """What `unread_fields(config)` holds, as a sentence naming each field and the kinds that read it; '' when
    none."""
    unread = unread_fields(config)
    if not unread:
        return ""
    settings = ", ".join(f"{name}={value!r} (read by kinds {FIELD_KINDS[name]})" for name, value in unread.items())
    return f"attention kind={config.kind!r} does not read {settings}"


def warn_unread_fields(config: AttentionConfig):
    """A UserWarning from a model's constructor when `config` sets fields its kind does not read
    (`unread_fields_message`). Models warn; `Attention` itself does not, as the shape probes of evaluation views
    (a Focus model's 'dense' view keeps its focus_* fields) build it."""
    if unread := unread_fields_message(config):
        warnings.warn(f"{unread}: set the kind that uses them, or leave them out", stacklevel=2)


def check_decodable(config: AttentionConfig):
    """Raises ValueError unless a layer of `config` can decode token by token with a KV cache.

    Decodable: 'dense', 'focal', 'focal_learned' with `tau_mode` 'prefix' (its causal prefix mean is a running
    sum) or 'token', and hard Focus ('focus' / 'focal+focus' with `focus_topk` set) with causal routing
    (`focus_causal=True`, or `focus_assign='softmax'`, whose rows depend on their own token only). Not with dynamic
    NTK RoPE (`rope_ntk_factor`): its base grows with the sequence, so keys cached under a shorter one's base go
    stale.
    """
    if config.kind in CUSTOM_KINDS:
        raise ValueError(f"kind={config.kind!r} (registered with register_attention) has no KV-cache form")
    if config.rope_ntk_factor is not None:
        raise ValueError(f"rope_ntk_factor={config.rope_ntk_factor!r} (dynamic NTK RoPE) cannot decode with a KV "
                         f"cache: the RoPE base grows with the sequence, so keys cached under a shorter sequence's "
                         f"base differ from the full forward's; use focal_jax.eval.decode.greedy_decode (full "
                         f"forwards) or plain RoPE")
    if config.kind == "focal_learned" and config.tau_mode == "sequence":
        raise ValueError(f"kind='focal_learned' with tau_mode={config.tau_mode!r} cannot decode with a KV cache: the "
                         f"whole-sequence mean makes every token's temperature depend on tokens not generated yet; "
                         f"use tau_mode='prefix' (the causal running mean) or 'token'")
    if config.kind not in FOCUS_KINDS:
        return
    if not config.focus_causal and config.focus_assign == "sinkhorn":
        raise ValueError(f"kind={config.kind!r} with focus_causal=False cannot decode with a KV cache: the paper's "
                         f"Sinkhorn normalises each group's column over the whole sequence, so a token's groups "
                         f"depend on tokens not generated yet; use focus_causal=True (prefix column sums)")
    if config.focus_topk is None:
        raise ValueError(f"kind={config.kind!r} with focus_topk=None (the soft gate) cannot decode with a KV cache: "
                         f"the soft gate is the training form; set focus_topk for hard top-k inference")


def check_cache(cache, n_layers: int, n_tokens: int):
    """Checks a model-level KV cache `{'index': int scalar, 'layers': n_layers layer caches}` before `n_tokens`
    more tokens are written to it (the overflow check runs when the index is concrete, i.e. outside jit)."""
    if not isinstance(cache, dict) or set(cache) != {"index", "layers"}:
        raise ValueError(f"cache must be a dict with keys 'index' and 'layers' (see focal_jax.nn.generate."
                         f"init_cache), got {type(cache).__name__}"
                         f"{' with keys ' + str(sorted(cache)) if isinstance(cache, dict) else ''}")
    if len(cache["layers"]) != n_layers:
        raise ValueError(f"cache['layers'] holds {len(cache['layers'])} layer caches, the model has {n_layers} layers")
    if jnp.ndim(cache["index"]) != 0:
        raise ValueError(f"cache['index'] must be a scalar, got shape {jnp.shape(cache['index'])}")
    max_len = cache["layers"][0]["k"].shape[1] if n_layers else None
    try:
        index = int(cache["index"])
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return  # under jit: the caller (e.g. generate) sizes the cache
    if max_len is not None and index + n_tokens > max_len:
        raise ValueError(f"the cache holds {index} tokens and max_len={max_len} slots: {n_tokens} more do not fit")


def _normal_rows(key, shape):
    c = jax.random.normal(key, shape, jnp.float32)
    return c / jnp.linalg.norm(c, axis=-1, keepdims=True)


class Attention(nnx.Module):
    """Causal self-attention. `x [B, T, d_model]` (the normed attention input), `positions int [B, T]`,
    optional `segment_ids int [B, T]` (packed documents), optional `residual [B, T, d_model]` (the block's input
    before the pre-norm: the learned temperature's input with `tau_input='residual'`) -> `[B, T, d_model]`.

    Parameters: `q_proj`, `k_proj`, `v_proj`, `o_proj` (`nnx.Linear`, kernel `[in, out]`); `q_norm`, `k_norm`
    with QK-norm; `w_tau` `[d_model]` (or `[d_model, n_heads]`) and, with `tau_bias`, `tau_bias` `[]` (or
    `[n_heads]`) (`Temperature`) for 'focal_learned'; `w_g [d_model, focus_dim]`, `centroids [focus_groups,
    focus_dim]` (`Centroid`) for the Focus kinds.
    """

    def __init__(self, config: AttentionConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        self.config = c = config
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.q_proj = nnx.Linear(c.d_model, q_dim, use_bias=c.qkv_bias, rngs=rngs)
        self.k_proj = nnx.Linear(c.d_model, kv_dim, use_bias=c.qkv_bias, rngs=rngs)
        self.v_proj = nnx.Linear(c.d_model, kv_dim, use_bias=c.qkv_bias, rngs=rngs)
        self.o_proj = nnx.Linear(q_dim, c.d_model, use_bias=c.out_bias, rngs=rngs)
        if c.qk_norm == "head":
            self.q_norm = RMSNorm(c.head_dim, eps=c.norm_eps)
            self.k_norm = RMSNorm(c.head_dim, eps=c.norm_eps)
        elif c.qk_norm == "full":
            self.q_norm = RMSNorm(q_dim, eps=c.norm_eps)
            self.k_norm = RMSNorm(kv_dim, eps=c.norm_eps)
        if c.kind == "focal_learned":
            heads = (c.n_heads,) if c.tau_granularity == "head" else ()
            if c.tau_bias:
                self.w_tau = Temperature(jnp.zeros((c.d_model,) + heads, jnp.float32))
                self.tau_bias = Temperature(jnp.full(heads, (c.tau_min + c.tau_max) / 2, jnp.float32))
            else:
                self.w_tau = Temperature(0.02 * jax.random.normal(rngs.params(), (c.d_model,) + heads, jnp.float32))
        if c.kind in FOCUS_KINDS:
            self.w_g = Centroid(0.02 * jax.random.normal(rngs.params(), (c.d_model, c.focus_dim), jnp.float32))
            self.centroids = Centroid(_normal_rows(rngs.params(), (c.focus_groups, c.focus_dim)))

    def init_cache(self, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
        """An empty KV cache for this layer (a dict of arrays): `k`, `v` `[B, max_len, Hk, D]` in `dtype`; for
        'focal_learned' `tau_sum [B]` (`[B, n_heads]` per head: the running sum of `x . w_tau`); for hard Focus
        `scores [B, max_len, K]` (float32 routing scores of the cached tokens, from which the causal Sinkhorn and
        the membership of every cached token are recomputed). Raises ValueError for kinds that cannot decode
        (`check_decodable`)."""
        c = self.config
        check_decodable(c)
        cache = {"k": jnp.zeros((batch_size, max_len, c.n_kv_heads, c.head_dim), dtype),
                 "v": jnp.zeros((batch_size, max_len, c.n_kv_heads, c.head_dim), dtype)}
        if c.kind == "focal_learned":
            cache["tau_sum"] = jnp.zeros((batch_size,) + self.w_tau.shape[1:], jnp.float32)
        if c.kind in FOCUS_KINDS:
            cache["scores"] = jnp.zeros((batch_size, max_len, c.focus_groups), jnp.float32)
        return cache

    def __call__(self, x, *, positions, segment_ids=None, cache=None, cache_index=None, residual=None):
        """Without `cache`: `[B, T, d_model]`. With `cache` (from `init_cache`) and `cache_index` (int scalar: the
        number of tokens already cached): the T tokens of x sit at slots `cache_index .. cache_index + T - 1`;
        returns `(out, new_cache)`."""
        c = self.config
        if x.ndim != 3 or x.shape[-1] != c.d_model:
            raise ValueError(f"x must have shape [batch, seq, d_model={c.d_model}], got shape {x.shape}")
        b, t, _ = x.shape
        tau_x = x
        if c.kind == "focal_learned" and c.tau_input == "residual":
            if residual is None:
                raise ValueError("tau_input='residual' computes tau from the residual stream: pass residual (the "
                                 "block's input before the pre-norm)")
            if residual.shape != x.shape:
                raise ValueError(f"residual must have the shape of x {x.shape}, got shape {residual.shape}")
            tau_x = residual
        positions = jnp.asarray(positions)  # (a list, as the models take)
        if tuple(positions.shape) != (b, t):
            raise ValueError(f"positions must have shape [batch, seq] = {(b, t)}, got shape {positions.shape}")
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if c.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, c.n_heads, c.head_dim)
        k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
        v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
        if c.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if c.rope_theta is not None:
            theta = c.rope_theta
            if c.rope_ntk_factor is not None:
                theta = dynamic_ntk_theta(theta, positions, c.head_dim, factor=c.rope_ntk_factor,
                                          trained_len=c.rope_trained_len, segment_ids=segment_ids)
            scaling = dict(linear_factor=c.rope_linear_factor, llama3=c.rope_llama3)
            q, k = rope(q, positions, theta, **scaling), rope(k, positions, theta, **scaling)
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids must be None when decoding with a cache (one sequence per row)")
            if cache_index is None:
                raise ValueError("cache_index (the number of cached tokens) is required with cache")
            out, cache = self._attend_cached(x, tau_x, q, k, v, cache, cache_index)
            return self.o_proj(out.reshape(b, t, c.n_heads * c.head_dim)), cache
        record = _new_record(self, x=x, q=q, k=k, v=v, segment_ids=segment_ids, tau_x=tau_x)
        out = self._attend(x, q, k, v, segment_ids, record, tau_x=tau_x)
        return self.o_proj(out.reshape(b, t, c.n_heads * c.head_dim))

    def _attend_cached(self, x, tau_x, q, k, v, cache, index):
        """Attention of the T new queries (absolute slots `index + 0..T-1`) over the cache after writing their k, v:
        the same masks and temperatures as `_attend` (the dense masked reference path whatever the impl)."""
        c = self.config
        check_decodable(c)
        b, t = x.shape[:2]
        if tuple(cache["k"].shape[:1]) != (b,) or cache["k"].shape[2:] != k.shape[2:]:
            raise ValueError(f"cache k has shape {cache['k'].shape}, expected [batch={b}, max_len, "
                             f"{k.shape[2]}, {k.shape[3]}]")
        max_len = cache["k"].shape[1]
        if t > max_len:
            raise ValueError(f"{t} tokens do not fit a cache of max_len={max_len}")
        index = jnp.asarray(index, jnp.int32)
        new = dict(cache)
        new["k"] = k_all = jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), (0, index, 0, 0))
        new["v"] = v_all = jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), (0, index, 0, 0))
        q_pos, k_pos = index + jnp.arange(t), jnp.arange(max_len)
        mask = causal_mask(q_pos, k_pos)  # [T, S]; slots past the written ones are never visible
        scale = None
        temperature = c.focal_t if c.kind in ("focal", "focal+focus") else 1.0
        if c.kind in ("dense", "focal", "focal_learned") and c.window is not None:
            mask = mask & local_mask(q_pos, k_pos, c.window)
        if c.kind == "focal_learned":
            # 'prefix': the mean of x . w_tau over tokens <= i, from the running sum of the tokens already cached.
            z = tau_logits(tau_x, self.w_tau[...])  # [B, T] or [B, T, H]
            mean = z
            if c.tau_mode == "prefix":
                sums = cache["tau_sum"][:, None] + jnp.cumsum(z, axis=1)
                mean = sums / (q_pos + 1).astype(jnp.float32).reshape((t,) + (1,) * (z.ndim - 2))
            tau = clip_tau(mean + self._tau_bias(), c.tau_min, c.tau_max, c.tau_clip)
            new["tau_sum"] = cache["tau_sum"] + jnp.sum(z, axis=1)
            scale, temperature = 1.0, _per_query_tau(tau)
        mask = jnp.broadcast_to(mask, (b, t, max_len))
        if c.kind in FOCUS_KINDS:
            # Causal Sinkhorn over every cached token's scores: token i's row depends only on tokens <= i, so the
            # cached tokens keep the groups they had, and the new rows equal the full-sequence forward's.
            scores = self._routing_scores(x)
            new["scores"] = all_scores = jax.lax.dynamic_update_slice(cache["scores"], scores, (0, index, 0))
            g = _assign(c, all_scores, causal=True)
            membership = fa.topk_membership(g, c.focus_topk)  # [B, S, K]
            q_membership = jax.lax.dynamic_slice(membership, (0, index, 0), (b, t, c.focus_groups))
            sink = (k_pos < c.focus_sink)[None, :]  # [1, S]: one sequence per row, so slot = position
            mask = mask & (local_mask(q_pos, k_pos, c.focus_window) | group_mask(q_membership, membership) | sink)
        multiplier = _validate.logit_multiplier(q, scale, temperature)
        return attend(attention_logits(q, k_all, multiplier, c.softcap), v_all, mask), new

    def _routing_scores(self, x):
        """The Focus routing scores `[B, T, K]` (float32) of the attention input `x [B, T, d_model]`."""
        c = self.config
        return fa.routing_scores(x, self.w_g[...], self.centroids[...], tau=c.focus_tau, normalize=c.focus_normalize)

    def _tau_bias(self):
        """`tau_bias` (its value), or 0 without one (`tau_bias=False`)."""
        return self.tau_bias[...] if self.config.tau_bias else 0.0

    def _attend(self, x, q, k, v, segment_ids, record=None, *, tau_x=None):
        """The attention output `[B, T, H, D]` of the layer's kind and impl; `tau_x`: the learned temperature's
        input when it is not `x` (`tau_input='residual'`)."""
        c = self.config
        tau_x = x if tau_x is None else tau_x
        if c.kind in CUSTOM_KINDS:
            out = CUSTOM_KINDS[c.kind](q, k, v, segment_ids=segment_ids)
            if getattr(out, "shape", None) != q.shape:  # (else a reshape error naming no kind, layers later)
                raise ValueError(f"the attention function registered as kind={c.kind!r} must return q's shape "
                                 f"[B, T, H, D] = {q.shape}, got {getattr(out, 'shape', type(out).__name__)}")
            return out
        if c.kind == "dense" or c.kind == "focal":
            temperature = 1.0 if c.kind == "dense" else c.focal_t
            if c.impl == "cudnn":
                return _cudnn_attention(q, k, v, temperature, c.window, segment_ids)
            if c.impl == "pallas":
                return dot_product_pallas(q, k, v, multiplier=1.0 / (c.head_dim ** 0.5 * temperature),
                                          window=c.window, segment_ids=segment_ids, softcap=c.softcap)
            return fa.focal_attention(q, k, v, temperature=temperature, window=c.window, segment_ids=segment_ids,
                                      softcap=c.softcap)
        if c.kind == "focal_learned":
            tau = fa.learned_temperature(tau_x, self.w_tau[...], tau_min=c.tau_min, tau_max=c.tau_max,
                                         mode=c.tau_mode, clip=c.tau_clip, bias=self._tau_bias(),
                                         segment_ids=segment_ids)
            if record is not None:
                record["tau"] = tau
            if c.impl == "pallas":
                multiplier = jnp.broadcast_to(1.0 / _per_query_tau(tau), q.shape[:3])
                return dot_product_pallas(q, k, v, multiplier=multiplier, window=c.window, segment_ids=segment_ids,
                                          softcap=c.softcap)
            return fa.focal_attention(q, k, v, scale=1.0, temperature=_per_query_tau(tau), window=c.window,
                                      segment_ids=segment_ids, softcap=c.softcap)
        # Focus: route on the attention input, balanced by Sinkhorn (or a plain softmax), then soft gate or hard
        # top-k mask.
        temperature = c.focal_t if c.kind == "focal+focus" else 1.0
        scores = self._routing_scores(x)
        g = _assign(c, scores, segment_ids=segment_ids, causal=c.focus_causal)
        if record is not None:
            record["g"] = g
        if c.focus_topk is None:
            return fa.focus_attention(q, k, v, g, window=c.focus_window, gate=c.focus_gate, lam=c.focus_lam,
                                      temperature=temperature, segment_ids=segment_ids, sink=c.focus_sink,
                                      softcap=c.softcap)
        membership = fa.topk_membership(g, c.focus_topk)
        return fa.focus_sparse_attention(q, k, v, membership, window=c.focus_window, temperature=temperature,
                                         segment_ids=segment_ids, sink=c.focus_sink, softcap=c.softcap,
                                         max_groups=c.focus_topk,
                                         impl=c.impl if c.impl in ("decomposed", "pallas") else "reference")


def _per_query_tau(tau):
    """A learned tau `[B, T]` (one per token) or `[B, T, H]` (per head) as the `[B, T, 1 or H]` temperature."""
    return tau[:, :, None] if tau.ndim == 2 else tau


def _assign(config: AttentionConfig, scores, *, segment_ids=None, causal=False):
    """The Focus assignment g `[B, T, K]` (float32, rows summing to 1) of routing scores `[B, T, K]`: Sinkhorn
    (segment- and causality-aware) or, for `focus_assign='softmax'`, a softmax over each token's K scores (which
    depends on the token alone, so segments and causality do not matter)."""
    if config.focus_assign == "softmax":
        return jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    return fa.sinkhorn(scores, n_iters=config.focus_iters, segment_ids=segment_ids, causal=causal)


def _cudnn_attention(q, k, v, temperature, window, segment_ids):
    """Causal (segment-masked) attention through cuDNN's fused kernel: GPU only, bf16 / fp16 inputs."""
    if focus_sparse.platform() != "gpu":  # jax's platform, or the target of `compile_only.compile_for`
        raise ValueError(f"impl='cudnn' needs a GPU backend, but jax runs on {focus_sparse.platform()!r}; "
                         f"use impl='xla'")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"impl='cudnn' needs bfloat16 or float16 activations, got {q.dtype}; use impl='xla' "
                         f"for float32")
    return _jax_nn_causal_attention(q, k, v, temperature, window, segment_ids, implementation="cudnn")


def _jax_nn_causal_attention(q, k, v, temperature, window, segment_ids, implementation):
    """`jax.nn.dot_product_attention`, causal, with the segment mask and the window, `[B, T, H, D]` -> `[B, T, H,
    Dv]`. An odd T gets one padding token at the end, which no query sees (it comes after all of them) and whose
    output is dropped: cuDNN's fused attention trains only on even lengths."""
    t = q.shape[1]
    if t % 2:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.concatenate([segment_ids, segment_ids[:, -1:]], axis=1)
    mask = None if segment_ids is None else segment_mask(segment_ids, segment_ids)[:, None]
    scale = 1.0 / (q.shape[-1] ** 0.5 * temperature)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=True,
                                       local_window_size=None if window is None else (window, 0),
                                       implementation=implementation)
    return out[:, :t]
