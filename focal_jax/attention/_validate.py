"""Argument checks shared by the attention functions; each error names the argument and its value."""

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = 2 ** 31 - 1  # the largest window or sink: positions are int32


def is_concrete(x) -> bool:
    """True when `x` holds values we can inspect now (not a tracer under jit / grad / vmap)."""
    return not isinstance(x, jax.core.Tracer)


NUMBERS = (int, float, np.floating, np.integer)


def _shown(name, value) -> str:
    """What a message says was given as `name`: `name=repr (a type)` when the repr is short, else the type."""
    text, kind = repr(value), type(value).__name__
    return f"{name}={text} (a {kind})" if len(text) <= 60 else f"a {kind} as {name}"


def is_array(x) -> bool:
    """A jax or numpy array, or a tracer of one (it has a shape, ndim and dtype); not a list or a number."""
    return all(hasattr(x, attr) for attr in ("shape", "ndim", "dtype"))


def check_array(name, x, layout):
    """Refuses anything but an array (`is_array`) by name, as JAX's own functions refuse lists (a list read by
    `.ndim` raised AttributeError); `layout` is its expected shape in words, e.g. '[batch, seq, K]'."""
    if not is_array(x):
        raise ValueError(f"{name} must be an array {layout} (a jax or numpy array: convert a list with "
                         f"jnp.asarray), got {_shown(name, x)}")


def check_qkv(q, k, v):
    """Checks q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv] with Hk dividing H. Returns (B, T, H, Hk)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, "[batch, seq, heads, head_dim]")
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [batch, seq, heads, head_dim], got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
        if 0 in x.shape:
            raise ValueError(f"{name} must have no empty axis (at least one batch row, token, head and head_dim "
                             f"entry), got shape {x.shape}")
    b, t, h, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same sequence length, got k {k.shape} and v {v.shape}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of heads, got k {k.shape} and v {v.shape}")
    if k.shape[3] != d:
        raise ValueError(f"q and k must have the same head_dim, got q {q.shape} and k {k.shape}")
    hk = k.shape[2]
    if hk == 0 or h % hk:
        raise ValueError(f"the heads of k and v (kv heads) must divide the heads of q (GQA), got q heads={h} "
                         f"and k heads={hk}")
    return b, t, h, hk


def check_self_attention(q, k):
    """Masks built from token positions need queries and keys to be the same tokens."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal, windowed and segmented attention need q and k of the same length, "
            f"got q seq={q.shape[1]} and k seq={k.shape[1]}")


def static_hint(name, value) -> str:
    """What an error about the setting `name` adds when `value` is traced (an argument of a `jax.jit`ed function):
    such settings shape the program, so they must be Python values."""
    if not isinstance(value, jax.core.Tracer):
        return ""
    return (f"; it is traced: {name} shapes the program, so pass it as a Python value (mark it static, e.g. "
            f"jax.jit(f, static_argnames='{name}'), or close over it)")


def check_window(window, *, allow_none=True):
    if window is None and allow_none:
        return
    if (window is None or isinstance(window, bool) or not isinstance(window, (int, np.integer))
            or not 0 <= window <= INT32_MAX):  # (larger ones overflowed the int32 position arithmetic)
        raise ValueError(f"window must be an integer in [0, 2**31 - 1] (keys j with 0 <= i - j <= window), got "
                         f"window={window!r}{static_hint('window', window)}")


def check_segment_ids(segment_ids, batch, seq, name="segment_ids"):
    if segment_ids is None:
        return
    if not hasattr(segment_ids, "shape"):
        raise ValueError(f"{name} must be an integer array [batch, seq], got a {type(segment_ids).__name__}")
    if tuple(segment_ids.shape) != (batch, seq):
        raise ValueError(f"{name} must have shape [batch, seq] = {(batch, seq)}, got shape {segment_ids.shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {segment_ids.dtype}")


def check_number_or_array(name, value):
    """Refuses by name what is neither a number nor an array (a string, a list: the bare TypeError of jnp), and a
    bool (an int to Python: `temperature=True` would read as 1)."""
    if isinstance(value, (bool, np.bool_)) or not (isinstance(value, NUMBERS) or is_array(value)):
        raise ValueError(f"{name} must be a number or an array (a list: convert it with jnp.asarray), got "
                         f"{_shown(name, value)}")


def check_positive(name, value):
    """Checks a float > 0, or an array whose values are all > 0 when they can be inspected."""
    check_number_or_array(name, value)
    if isinstance(value, NUMBERS):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {name}={value!r}")
    elif is_concrete(value):
        with jax.ensure_compile_time_eval():  # a concrete array captured by a jit or checkpoint being traced
            smallest = float(jnp.min(value)) if jnp.size(value) else 1.0
        if not smallest > 0:
            raise ValueError(f"{name} must be > 0 everywhere, got an array with minimum {smallest}")


def check_finite(name, value):
    """Checks a number, or an array whose values can be inspected now, is finite (inf or NaN: NaN outputs)."""
    check_number_or_array(name, value)
    if isinstance(value, NUMBERS):
        finite = bool(np.isfinite(value))
    elif is_concrete(value):
        with jax.ensure_compile_time_eval():
            finite = bool(jnp.all(jnp.isfinite(value)))
    else:
        return
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {name}={value!r}")


def check_scalar(name, value):
    """A real number, or a 0-d real array (traced under `jax.jit` too: its value is then checked by nothing here)."""
    if isinstance(value, bool) or not (isinstance(value, NUMBERS) or (
            is_array(value) and value.ndim == 0 and (jnp.issubdtype(value.dtype, jnp.floating)
                                                     or jnp.issubdtype(value.dtype, jnp.integer)))):
        shown = (f"{name} of shape {value.shape} and dtype {value.dtype}" if is_array(value)
                 else _shown(name, value))
        raise ValueError(f"{name} must be a number (a Python or numpy number, or a 0-d array, traced or not), got "
                         f"{shown}")


def check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {name}={value!r}")


def check_bool(name, value):
    """True or False (numpy's bool too): a string or None is refused rather than read by its truth value."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {name}={value!r}{static_hint(name, value)}")


def _number_if_concrete(value):
    """A concrete (untraced) 0-d real array as the Python float it holds, which multiplies the float32 logits as a
    number does (a traced one cannot be read, and scales q); anything else as it is."""
    if (is_array(value) and is_concrete(value) and np.ndim(value) == 0
            and (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer))):
        with jax.ensure_compile_time_eval():  # a concrete array captured by a jit being traced
            return float(value)
    return value


def logit_multiplier(q, scale, temperature):
    """The factor the logits q.k are multiplied by: scale / temperature, shaped [B, T, H] or a scalar (a number
    when both are numbers or concrete 0-d arrays)."""
    b, t, h, d = q.shape
    scale, temperature = _number_if_concrete(scale), _number_if_concrete(temperature)
    if scale is None:
        scale = 1.0 / np.sqrt(d)
    check_positive("scale", scale)
    check_finite("scale", scale)  # (inf: every output NaN)
    check_positive("temperature", temperature)
    if not isinstance(scale, NUMBERS) and jnp.ndim(scale) > 0:
        scale = _per_query("scale", scale, (b, t, h))
    if isinstance(temperature, NUMBERS):
        return scale / temperature
    return scale / _per_query("temperature", temperature, (b, t, h))


def _per_query(name, value, shape):
    """An array `value` broadcast to `shape` = [B, T, H] as float32; ValueError naming `name` otherwise."""
    value = jnp.asarray(value)
    if value.ndim == 2:  # [B, T] (what learned_temperature returns) would broadcast against [T, H]
        raise ValueError(f"{name} of shape {value.shape} is ambiguous: give a per-query {name} as "
                         f"[batch, seq, 1] ({name}[:, :, None]) or [batch, seq, heads] = {shape}")
    try:
        value = jnp.broadcast_to(value, shape)
    except ValueError:
        raise ValueError(f"{name} must be a float or broadcastable to [batch, seq, heads] = {shape}, "
                         f"got shape {value.shape}") from None
    return value.astype(jnp.float32)


def check_softcap(softcap):
    """None (off) or a finite number > 0."""
    if softcap is not None:
        if (isinstance(softcap, bool) or not isinstance(softcap, NUMBERS)
                or not 0 < softcap < np.inf):  # inf or NaN: every logit NaN
            raise ValueError(f"softcap must be None or a finite number > 0 (logits -> softcap * tanh(logits / "
                             f"softcap)), got softcap={softcap!r}{static_hint('softcap', softcap)}")


def check_sink(sink):
    """An integer in [0, 2**31 - 1]: the number of keys every query sees."""
    if isinstance(sink, bool) or not isinstance(sink, (int, np.integer)) or not 0 <= sink <= INT32_MAX:
        raise ValueError(f"sink must be an integer in [0, 2**31 - 1] (the first `sink` keys are always visible), got "
                         f"sink={sink!r}{static_hint('sink', sink)}")


def check_membership_dtype(membership):
    """Membership is bool (or integers 0 / 1): a floating-point array, such as the assignment g itself, would
    count every nonzero score as membership."""
    if jnp.issubdtype(membership.dtype, jnp.floating):
        raise ValueError(f"membership must be a bool array (e.g. topk_membership(g, k)), got dtype "
                         f"{membership.dtype}: every nonzero score would count as membership")


def check_valid(valid, batch, seq):
    """None, or a bool (or integer 0 / 1) array `[batch, seq]` of the tokens that count."""
    if valid is None:
        return
    check_array("valid", valid, f"[batch, seq] = {(batch, seq)}")
    if tuple(valid.shape) != (batch, seq):
        raise ValueError(f"valid must have shape [batch, seq] = {(batch, seq)}, got shape {valid.shape}")
    if not (jnp.issubdtype(valid.dtype, jnp.bool_) or jnp.issubdtype(valid.dtype, jnp.integer)):
        raise ValueError(f"valid must be a bool array [batch, seq] (True: the token counts), got dtype "
                         f"{valid.dtype}: every nonzero value would count as valid")


def check_focus_inputs(q, k, v, groups_like, name, window, segment_ids, sink):
    """The arguments every Focus path shares: q, k, v (self-attention), `groups_like` `[B, T, K]` (named `name`:
    the assignment g or a membership), window, segment_ids and sink; returns `(B, T)`."""
    b, t, _, _ = check_qkv(q, k, v)
    check_self_attention(q, k)
    check_window(window, allow_none=False)
    check_sink(sink)
    check_array(name, groups_like, "[batch, seq, K]")
    if groups_like.ndim != 3 or groups_like.shape[:2] != (b, t):
        raise ValueError(f"{name} must have shape [batch, seq, K] = [{b}, {t}, K], got shape {groups_like.shape}")
    if groups_like.shape[2] < 1:
        raise ValueError(f"{name} must have at least one group (K >= 1), got K={groups_like.shape[2]}")
    check_segment_ids(segment_ids, b, t)
    return b, t


def check_max_groups(membership, max_groups):
    """`max_groups` is None or an integer >= 1; with a concrete membership, no token is in more groups."""
    if max_groups is None:
        return
    if isinstance(max_groups, bool) or not isinstance(max_groups, (int, np.integer)) or max_groups < 1:
        raise ValueError(f"max_groups must be None or an integer >= 1, got max_groups={max_groups!r}"
                         f"{static_hint('max_groups', max_groups)}")
    if isinstance(membership, jax.core.Tracer):
        return
    most = int(np.max(np.sum(np.asarray(membership), axis=-1), initial=0))  # numpy: also inside a jit trace
    if most > max_groups:
        raise ValueError(f"max_groups={max_groups} but a token of membership is in {most} groups; pass "
                         f"max_groups >= {most} (or None)")
