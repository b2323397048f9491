"""Autoregressive generation with a KV cache: prefill the prompt, then decode one token at a time.

The cache is a plain pytree, passed explicitly and returned updated:

  cache = {'index': int32 scalar (tokens cached so far),
           'layers': (one dict per layer: 'k', 'v' [B, max_len, Hk, D],
                      'tau_sum' [B] ([B, H] per head) for 'focal_learned' (running sum of x . w_tau: the
                      causal prefix mean),
                      'scores' [B, max_len, K] for hard Focus (routing scores of the cached tokens), ...)}

  logits, cache = model(tokens, cache=cache)   # tokens [B, T] continue the cached ones (RoPE / learned positions
                                               # at absolute positions cache['index'] + 0..T-1)

Without `cache` the models return logits only, as before. Decodable attention kinds: 'dense', 'focal', 'focal_learned'
(prefix or token mode) and hard Focus ('focus' / 'focal+focus' with `focus_topk` set) with causal routing
(`focus_causal=True`). Hard Focus keeps the routing scores of every cached token and re-runs the causal Sinkhorn over
them at each step (O(max_len * K * iters), small next to attention over the cache): with prefix column sums, token
i's assignment depends only on tokens <= i, so the cached tokens keep their groups and the new token's equals the
full-sequence forward's. The new token attends to cached keys that are local, share one of its top-k groups, or
sit in the first `focus_sink` slots (the attention sink). Non-causal Focus (the paper's Sinkhorn sees the future),
soft Focus (the training form) and dynamic NTK RoPE (`rope_ntk_factor`: the base grows with the sequence, so cached
keys would keep a shorter one's) raise ValueError.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from focal_jax.nn.gpt2 import GPT2, GPT2Config
  >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4), rngs=nnx.Rngs(0))
  >>> generate(model, jnp.zeros((2, 3), jnp.int32), max_new_tokens=4).shape
  (2, 7)
"""

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focal_jax._axes import explicit_axes, leading_spec
from focal_jax._validation import check_int
from focal_jax.nn.gpt2 import GPT2
from focal_jax.nn.models import attention_layers, check_model


def init_cache(model, batch_size: int, max_len: int, dtype=None) -> dict:
    """An empty KV cache for `model` (`Llama` or `GPT2`) holding up to `max_len` tokens per row.

    dtype: of k and v; None = the dtype of the model's k projection. Raises ValueError when an attention kind cannot
    decode (non-causal or soft Focus), naming the setting, or when `max_len` exceeds GPT-2's `n_positions`.
    """
    layers = attention_layers(model)
    check_int("batch_size", batch_size, 1)
    check_int("max_len", max_len, 1)
    if isinstance(model, GPT2) and max_len > model.config.n_positions:
        raise ValueError(f"max_len={max_len} exceeds the model's n_positions={model.config.n_positions}")
    if dtype is None:
        dtype = layers[0].k_proj.kernel[...].dtype
    return {"index": jnp.zeros((), jnp.int32),
            "layers": tuple(attn.init_cache(batch_size, max_len, dtype) for attn in layers)}


def _as_number(value):
    """A 0-d real numpy or jax array (a concrete one) as the Python number it holds; anything else as it is."""
    if isinstance(value, jax.core.Tracer):
        return value
    if hasattr(value, "ndim") and hasattr(value, "dtype") and value.ndim == 0 and (
            jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
        return value.item()
    return value


def _check_sampling(temperature, top_p):
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got temperature={temperature!r}")
    if 0 < temperature < jnp.finfo(jnp.float32).tiny:  # a float32 subnormal, which XLA flushes to 0: logits / 0
        raise ValueError(f"temperature must be 0 (greedy) or at least float32's smallest normal number "
                         f"{float(jnp.finfo(jnp.float32).tiny):.4g}, got temperature={temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1], got top_p={top_p!r}")


def sample_logits(logits, rng=None, *, temperature=0.0, top_p=1.0):
    """One token per row of `logits [..., V]`: argmax when `temperature == 0`, else a sample of
    `softmax(logits / temperature)` restricted to the nucleus (`top_p`): the most probable tokens whose probabilities,
    taken in decreasing order, reach `top_p` (the first token always; tokens tied with the last one included).

    Returns int32 `[...]`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
      >>> int(sample_logits(logits, jax.random.key(0), temperature=1.0, top_p=0.6)) in (0, 1)
      True
    """
    temperature, top_p = _as_number(temperature), _as_number(top_p)
    _check_sampling(temperature, top_p)
    if temperature > 0 and rng is None:
        raise ValueError(f"rng (a jax.random key) is required when sampling (temperature={temperature} > 0)")
    return _sample(logits, rng, temperature, top_p, sampling=temperature > 0, nucleus=top_p < 1)


def _sample(logits, rng, temperature, top_p, *, sampling: bool, nucleus: bool):
    """`sample_logits` with `temperature` and `top_p` possibly traced: only whether to sample at all and whether to
    cut a nucleus are Python bools (so one compiled generation serves every temperature and top_p)."""
    logits = jnp.asarray(logits, jnp.float32)
    if not sampling:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The row's largest logit moved to 0 first: as temperature -> 0 the others go to -inf, where logits / temperature
    # would leave float32's range (several tokens at +inf, the first of them drawn).
    peak = jnp.max(logits, axis=-1, keepdims=True)
    logits = (logits - jnp.where(jnp.isfinite(peak), peak, 0.0)) / temperature
    if nucleus:
        ordered = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability mass of the more probable tokens
        kept = before < top_p
        cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _bucket(n: int) -> int:
    """The smallest of 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (four values per octave) that is >= n."""
    if n <= 8:
        return 8
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def _bucket_floor(n: int) -> int:
    """The largest of 8, 10, 12, 14, 16, 20, ... that is <= n; 1 when n < 8."""
    if n < 8:
        return 1
    step = 1 << (n.bit_length() - 3)
    return n // step * step


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill", "sampling", "nucleus"))
def _generate(graphdef, state, tokens, prompt_len, total, rng, temperature, top_p, *, prefill, sampling, nucleus):
    """`tokens [B, W]` with the prompt in its first `prompt_len` columns, continued up to column `total` (< W: the
    rest stays 0). The cache has W slots; the first `prefill` (<= prompt_len) prompt tokens fill it at once, the
    others one per step, as the generated ones. W and `prefill` are static (bucketed by the caller); the lengths,
    temperature and top_p are traced, so one compiled function serves many prompts and settings."""
    model = nnx.merge(graphdef, state)
    b, width = tokens.shape
    keys = jax.random.split(rng, width)  # key j draws new token j (split(rng, n)[j] for any n > j: jax's threefry)

    def sample_into(tokens, logits, slot):  # the token at `slot` drawn from `logits` unless it is a prompt token
        nxt = _sample(logits, keys[jnp.maximum(slot - prompt_len, 0)], temperature, top_p, sampling=sampling,
                      nucleus=nucleus)
        old = jax.lax.dynamic_slice_in_dim(tokens, slot, 1, axis=1)[:, 0]
        return jax.lax.dynamic_update_slice_in_dim(tokens, jnp.where(slot >= prompt_len, nxt, old)[:, None], slot,
                                                   axis=1)

    cache = init_cache(model, b, width)
    logits, cache = model(tokens[:, :prefill], cache=cache, logits_at=jnp.full((b, 1), prefill - 1))  # last row only
    tokens = sample_into(tokens, logits[:, -1], prefill)

    def step(slot, carry):  # feed the token at `slot`, write the one at slot + 1
        tokens, cache = carry
        logits, cache = model(jax.lax.dynamic_slice_in_dim(tokens, slot, 1, axis=1), cache=cache)
        return sample_into(tokens, logits[:, -1], slot + 1), cache

    tokens, _ = jax.lax.fori_loop(prefill, total - 1, step, (tokens, cache))
    return tokens


def generate(model, prompt, *, max_new_tokens, temperature=0.0, top_p=1.0, rng=None):
    """Continue `prompt [B, T0]` (int tokens) by `max_new_tokens` tokens: `[B, T0 + max_new_tokens]` int32.

    One jitted function: prefill the prompt into a KV cache, then a `fori_loop` decodes one token per step. It is
    compiled once per model structure, cache size and prefill length, which are bucketed (8, 10, 12, 14, 16, 20, 24,
    ...: four per octave): the cache holds `T0 + max_new_tokens` rounded up, the prefill takes `T0` rounded down (1
    below 8) and the rest of the prompt goes through the cache one token per step. Temperature and top_p are traced:
    only greedy versus sampling and top_p < 1 versus 1 compile anew.

    Args:
      model: a focal_jax `Llama` or `GPT2` whose attention kind decodes (see the module docstring).
      max_new_tokens: integer >= 1.
      temperature: 0 (default) = greedy argmax; > 0 samples from `softmax(logits / temperature)`.
      top_p: nucleus sampling, in (0, 1]; 1 = the full distribution (see `sample_logits`).
      rng: a jax.random key or an integer seed; required when temperature > 0.
    """
    check_model(model)
    prompt = jnp.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt must be integer tokens of shape [batch, seq >= 1], got shape {prompt.shape} "
                         f"dtype {prompt.dtype}")
    vocab_size = model.config.vocab_size
    if prompt.size and (int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size):  # (in the jit: NaN logits)
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got values from {int(prompt.min())} to "
                         f"{int(prompt.max())}")
    check_int("max_new_tokens", max_new_tokens, 1)
    temperature, top_p = _as_number(temperature), _as_number(top_p)
    _check_sampling(temperature, top_p)
    if temperature > 0 and rng is None:
        raise ValueError(f"rng (a jax.random key or an integer seed) is required when sampling "
                         f"(temperature={temperature} > 0)")
    total = prompt.shape[1] + max_new_tokens
    if isinstance(model, GPT2) and total > model.config.n_positions:
        raise ValueError(f"prompt length {prompt.shape[1]} + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"n_positions={model.config.n_positions}")
    init_cache(model, 1, 1)  # raises for attention kinds that cannot decode, before tracing
    if rng is None:
        rng = jax.random.key(0)
    elif isinstance(rng, numbers.Integral) and not isinstance(rng, bool):
        rng = jax.random.key(int(rng))
    elif not (isinstance(rng, jax.Array) and (jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 0
                                              or rng.dtype == jnp.uint32 and rng.shape == (2,))):
        raise ValueError(f"rng must be a jax.random key (jax.random.key(seed), or a legacy PRNGKey) or an integer "
                         f"seed, got rng={rng!r}")
    b, t0 = prompt.shape
    width = _bucket(total)
    if isinstance(model, GPT2):
        width = min(width, model.config.n_positions)
    tokens = np.zeros((b, width), np.int32)
    tokens[:, :t0] = np.asarray(prompt)
    graphdef, state = nnx.split(model)
    run = functools.partial(_generate, graphdef)
    if explicit_axes():  # the model's parameters, arguments here, are resharded onto the mesh made Auto
        run = jax.sharding.auto_axes(run, axes=explicit_axes(), out_sharding=leading_spec(prompt, 1, 2))
    out = run(state, tokens, jnp.int32(t0), jnp.int32(total), rng, jnp.float32(temperature), jnp.float32(top_p),
              prefill=_bucket_floor(t0), sampling=temperature > 0, nucleus=top_p < 1)
    return out[:, :total]

