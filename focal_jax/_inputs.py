"""Shared helpers for the demo and the benchmark (not public API).

* :func:`make_inputs` builds structured synthetic attention inputs: a "hidden state" sequence with repeated motifs and
  a smooth positional component, projected to q, k, v, plus random routing parameters (W_g, centroids) for Focus.
* :func:`route` runs Focus routing (``routing_scores`` then ``sinkhorn``) on the hidden states, and
  :func:`attention_variants` lists the compared attention functions (dense, Focal, Focus soft, Focus hard).
* :func:`count_focus_pairs` counts the pairs a hard Focus mask allows without materialising a [T, T] mask.
* :func:`compile_jit`, :func:`median_time`, :func:`interleaved_times` and :func:`memory_mib` measure jitted
  functions.
* :func:`markdown_table` and :func:`environment_header` format results.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from focal_jax import attention


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Inputs for one attention call plus the Focus routing parameters.

    Attributes:
      q, k, v: float arrays ``[B, T, H, D]``.
      h: the hidden states ``[B, T, d_model]`` the projections and the router read.
      w_g: routing projection ``[d_model, d_g]``.
      centroids: routing centroids ``[K, d_g]``.
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array
    h: jax.Array
    w_g: jax.Array
    centroids: jax.Array


def _hidden_states(rng: np.random.Generator, batch: int, seq_len: int, d_model: int, *, vocab: int = 256,
                   n_motifs: int = 8, motif_len: int = 16, motif_rate: float = 0.4, positional: float = 1.0,
                   noise: float = 0.3) -> np.ndarray:
    """A hidden-state sequence ``[B, T, d_model]`` with structure an attention map can show.

    Tokens are drawn from a small vocabulary with Zipf frequencies (similar states recur: vertical stripes in a map,
    diffuse for common tokens, sharp for rare ones), and about ``motif_rate`` of the sequence is copies of a few fixed
    n-grams ("motifs"), so consecutive tokens match consecutive earlier tokens: stripes parallel to the diagonal.
    A smooth positional component (sinusoids, periods 8 .. T) makes nearby tokens similar: a band along the
    diagonal. Each token's state also carries some noise.
    """
    embeddings = rng.standard_normal((vocab, d_model))
    zipf = 1.0 / np.arange(1, vocab + 1)
    motifs = rng.choice(vocab, size=(n_motifs, motif_len), p=zipf / zipf.sum())
    tokens = rng.choice(vocab, size=(batch, seq_len), p=zipf / zipf.sum())
    for b in range(batch):
        pos = int(rng.integers(motif_len))
        while pos < seq_len:
            if rng.random() < motif_rate:
                end = min(pos + motif_len, seq_len)
                tokens[b, pos:end] = motifs[int(rng.integers(n_motifs)), : end - pos]
                pos = end
            else:
                pos += motif_len
    h = embeddings[tokens] + noise * rng.standard_normal((batch, seq_len, d_model))
    n_freq = d_model // 4
    periods = np.geomspace(8.0, float(max(seq_len, 16)), n_freq)
    angles = 2 * np.pi * np.arange(seq_len)[:, None] / periods[None, :]
    pos_states = np.zeros((seq_len, d_model))
    pos_states[:, 0:2 * n_freq:2] = np.cos(angles)
    pos_states[:, 1:2 * n_freq:2] = np.sin(angles)
    h += positional * np.sqrt(2.0) * pos_states[None]  # |positional|^2 ~ positional^2 * d_model / 2
    return h / np.sqrt(d_model)  # roughly unit norm per token


def make_inputs(seq_len: int, heads: int = 8, head_dim: int = 64, *, batch: int = 1, d_model: int = 256,
                n_groups: int = 8, d_g: int = 16, sharpness: float = 2.2, seed: int = 0,
                dtype: Any = jnp.float32) -> AttentionInputs:
    """Structured inputs for attention demos and benchmarks.

    Args:
      seq_len: T.
      heads, head_dim: H and D of q, k, v (``[B, T, H, D]``).
      batch: B.
      d_model: width of the hidden states.
      n_groups, d_g: K centroids of dimension d_g for Focus routing; ``w_g`` is ``[d_model, d_g]``.
      sharpness: scales q and k; larger means more peaked attention (logits grow as ``sharpness**2``).
      seed: numpy seed; the same seed gives the same inputs.
      dtype: dtype of q, k, v and h.

    q and k use the same random projection per head (k adds a small perturbation) and k_j reads the hidden state of
    token j - 1, so q_i . k_j is large when token i resembles token j - 1: the next token after an earlier copy of
    token i (an induction pattern), or a nearby position.
    """
    rng = np.random.default_rng(seed)
    h = _hidden_states(rng, batch, seq_len, d_model)
    w_q = rng.standard_normal((d_model, heads, head_dim))
    w_k = w_q + 0.3 * rng.standard_normal(w_q.shape)
    w_v = rng.standard_normal((d_model, heads, head_dim)) / np.sqrt(d_model)
    # h has roughly unit-norm rows, so for matching states q.k / sqrt(D) is about sharpness**2 (random pairs: about
    # sharpness**2 / sqrt(D) in spread).
    qk_gain = sharpness / np.sqrt(np.sqrt(head_dim))
    q = qk_gain * np.einsum("btm,mhd->bthd", h, w_q)
    # Keys read the previous token's state (an "induction head"): query i matches the token after each earlier copy
    # of token i, so repeated motifs give stripes parallel to the diagonal and self is not special.
    h_prev = np.concatenate([np.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    k = qk_gain * np.einsum("btm,mhd->bthd", h_prev, w_k)
    v = np.einsum("btm,mhd->bthd", h, w_v)
    w_g = rng.standard_normal((d_model, d_g)) / np.sqrt(d_model)
    centroids = rng.standard_normal((n_groups, d_g))
    cast = lambda x: jnp.asarray(x, dtype)
    return AttentionInputs(q=cast(q), k=cast(k), v=cast(v), h=cast(h), w_g=jnp.asarray(w_g, jnp.float32),
                           centroids=jnp.asarray(centroids, jnp.float32))


def route(h: jax.Array, w_g: jax.Array, centroids: jax.Array, *, tau: float = 0.1, n_iters: int = 10) -> jax.Array:
    """Focus routing: ``sinkhorn(routing_scores(h, w_g, centroids))``, the soft assignment g ``[B, T, K]``."""
    scores = attention.routing_scores(h, w_g, centroids, tau=tau)
    return attention.sinkhorn(scores, n_iters=n_iters)


N_GROUPS = 8  # K
WINDOW = 128  # w
FOCAL_T = 0.4  # the Focal paper's best constant temperature


@dataclasses.dataclass
class Variant:
    """One attention variant: ``fn(q, k, v, *extra)``; hard Focus variants also carry their membership."""

    name: str
    fn: Callable[..., jax.Array]
    extra: tuple[Any, ...] = ()
    membership: jax.Array | None = None


def attention_variants(g: jax.Array, *, top_ks: Sequence[int] = (1,), block_size: int | None = None,
                       soft: bool = True) -> list[Variant]:
    """Dense causal, Focal (t = 0.4), Focus soft (gate 'paper') and Focus hard (``impl='decomposed'``) for each k in
    ``top_ks``, all with K = ``g.shape[-1]`` groups and window w = 128; ``soft=False`` leaves Focus soft out."""
    n_groups = g.shape[-1]
    out = [
        Variant("dense", functools.partial(attention.dot_product_attention, causal=True)),
        Variant(f"focal (t={FOCAL_T})", functools.partial(attention.focal_attention, temperature=FOCAL_T)),
    ]
    if soft:
        out.append(Variant(f"Focus soft (K={n_groups}, w={WINDOW}, gate=paper)",
                           functools.partial(attention.focus_attention, window=WINDOW, gate="paper"), (g,)))
    for top_k in top_ks:
        membership = attention.topk_membership(g, top_k)
        fn = functools.partial(attention.focus_sparse_attention, window=WINDOW, impl="decomposed",
                               block_size=block_size, max_groups=top_k)
        out.append(Variant(f"Focus hard k={top_k} (decomposed)", fn, (membership,), membership))
    return out


def count_focus_pairs(membership: np.ndarray | jax.Array, window: int) -> tuple[int, int]:
    """Count (allowed, causal) query-key pairs of the hard Focus mask, without a [T, T] array.

    A pair (i, j) is allowed iff ``j <= i`` and (``i - j <= window`` or tokens i and j share a group); this is
    ``focus_mask(membership, window=window).sum()`` (no segments). Cost O(B * (T * window + P^2)) for P distinct
    membership patterns:

    * pairs sharing a group: tokens with the same membership pattern S give ``n_S (n_S + 1) / 2`` causal pairs
      (self included); two patterns S != S' that intersect give ``n_S * n_S'`` (each unordered pair once, the later
      token being the query). For k = 1 this is ``sum_g c_g (c_g + 1) / 2``.
    * local pairs not sharing a group: a banded loop over offsets ``d = 1 .. window``.

    Args:
      membership: bool ``[B, T, K]``, e.g. from ``topk_membership``.
      window: the local window w.

    Returns:
      ``(allowed, causal)`` summed over the batch; ``causal = B * T (T + 1) / 2``.
    """
    m = np.asarray(membership, dtype=bool)
    batch, seq_len, n_groups = m.shape
    bits = (m.astype(np.int64) << np.arange(n_groups, dtype=np.int64)).sum(-1) if n_groups < 63 else None
    allowed = 0
    for b in range(batch):
        if bits is not None:
            patterns, counts = np.unique(bits[b], return_counts=True)
            overlap = (patterns[:, None] & patterns[None, :]) != 0
        else:  # many groups: compare membership rows directly
            patterns, inverse, counts = np.unique(m[b], axis=0, return_inverse=True, return_counts=True)
            overlap = (patterns.astype(np.int64) @ patterns.T.astype(np.int64)) > 0
        counts = counts.astype(np.int64)
        same = int((counts * (counts + 1) // 2).sum())
        cross = int(np.triu(np.outer(counts, counts) * overlap, k=1).sum())
        local_unshared = 0
        for d in range(1, min(window, seq_len - 1) + 1):
            local_unshared += int((~(m[b, d:] & m[b, :-d]).any(-1)).sum())
        allowed += same + cross + local_unshared
    causal = batch * seq_len * (seq_len + 1) // 2
    return allowed, causal


def block(x: Any) -> Any:
    """``block_until_ready`` on every array of a pytree."""
    return jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def median_time(fn: Callable[..., Any], *args: Any, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn(*args)`` (already jitted) after ``warmup`` calls, blocking on the result."""
    return statistics.median(interleaved_times([(fn, args)], repeats=repeats, warmup=warmup)[0])


def interleaved_times(calls: Sequence[tuple[Callable[..., Any], Sequence[Any]]], *, repeats: int = 5, warmup: int = 1,
                      budget_s: float | None = None, min_repeats: int = 3,
                      progress: Callable[[str], None] | None = None) -> list[list[float]]:
    """Wall times in seconds of several jitted calls ``fn(*args)``, timed round-robin.

    Each call is warmed up ``warmup`` times, then every round times each call once (blocking on its result), in an
    order rotated by one each round, so load drift on a shared machine affects all calls alike and their ratios stay
    meaningful. Each timed call is preceded by one untimed call of the same function: a call that follows a variant
    with gigabytes of temporaries otherwise pays for faulting memory back in and refilling caches (measured here:
    the decomposed path at 8K took 0.7-0.8 s right after dense attention, 0.4 s on its second call). Rounds stop
    after
    ``repeats``, or after ``min_repeats`` once the timed rounds took ``budget_s`` seconds in all.

    Returns one list of times per call.
    """
    for fn, args in calls:
        for _ in range(warmup):
            block(fn(*args))
    times: list[list[float]] = [[] for _ in calls]
    elapsed = 0.0
    for round_index in range(repeats):
        if budget_s is not None and round_index >= min_repeats and elapsed >= budget_s:
            break
        for offset in range(len(calls)):  # each round starts one call later: no call always runs first
            index = (round_index + offset) % len(calls)
            fn, args = calls[index]
            block(fn(*args))
            start = time.perf_counter()
            block(fn(*args))
            times[index].append(time.perf_counter() - start)
            elapsed += times[index][-1]
        if progress is not None:
            progress(f"round {round_index + 1}: {elapsed:.1f} s so far")
    return times


def compile_jit(fn: Callable[..., Any], *args: Any) -> Any:
    """``jax.jit(fn)`` lowered and compiled for ``args``: call it as ``compiled(*args)``; no buffers are allocated."""
    return jax.jit(fn).lower(*args).compile()


def memory_mib(compiled: Any) -> float | None:
    """Peak memory estimate in MiB of a compiled executable: temp + output + argument sizes from its memory analysis
    (minus bytes aliased between arguments and outputs); None when the backend gives no analysis."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - the analysis is optional on some backends
        return None
    if stats is None:
        return None
    total = (stats.temp_size_in_bytes + stats.output_size_in_bytes + stats.argument_size_in_bytes
             - getattr(stats, "alias_size_in_bytes", 0))
    return total / 2**20


def available_memory_mib() -> float | None:
    """MemAvailable from /proc/meminfo in MiB (None where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table with padded columns (readable in a terminal, pasteable into BENCHMARKS.md)."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def _cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, else ``platform.processor()`` or the machine type."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_header(command: str) -> str:
    """Markdown bullet lines: the command, date, jax version and backend, CPU info."""
    import datetime
    import os
    import platform

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return "\n".join([
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- jax {jax.__version__}, backend {jax.default_backend()}, Python {platform.python_version()}",
        f"- CPU: {_cpu_model()} ({platform.processor() or platform.machine()}), os.cpu_count() = {os.cpu_count()}, "
        f"usable = {usable}",
    ])
