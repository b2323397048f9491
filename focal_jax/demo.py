"""Attention demo (what `make attention-demo` runs): dense vs Focal vs Focus on a real computation.

    python -m focal_jax.demo [--lengths 1024 2048] [--heads 8] [--out demo_out]

For each length T it builds structured inputs (a hidden-state sequence with repeated motifs and a smooth positional
component, see ``focal_jax._inputs``), routes the tokens into K = 8 groups with ``routing_scores`` + ``sinkhorn``, and
prints one table:

* rows: dense causal attention, Focal (t = 0.4), Focus soft (w = 128, gate 'paper'), Focus hard k = 1 and k = 2
  (``impl='decomposed'``);
* columns: mean attention entropy over query rows (nats), fraction of causal pairs computed, wall time of the jitted
  forward pass (median of a few rounds, variants timed round-robin; routing excluded: ``python -m focal_jax.bench
  attention`` times it).

The attention probabilities behind the entropy are read out of each function itself: attention is linear in v, so
feeding one-hot value vectors (v = columns of the identity) returns the probability matrix P. The metric therefore
measures the code under test, not a re-derivation of it.

It then writes ``<out>/attention_maps.png``: for one head on a 256-token crop, the dense map, the Focal (t = 0.4)
map (the sharpening picture of the Focal paper's Figure 1), the Focus hard mask (k = 1) and the Focus hard map.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from focal_jax import _inputs
from focal_jax import attention

CROP = 256
N_GROUPS, WINDOW, FOCAL_T = _inputs.N_GROUPS, _inputs.WINDOW, _inputs.FOCAL_T


def hard_pair_fraction(membership: jax.Array) -> float:
    """Allowed pairs of ``focus_mask(membership, window=128)`` over all causal pairs."""
    mask = attention.focus_mask(membership, window=WINDOW)
    batch, seq_len = mask.shape[0], mask.shape[-1]
    return int(jnp.sum(mask)) / (batch * seq_len * (seq_len + 1) // 2)


def attention_probs(fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array, *extra: Any,
                    chunk: int = 256) -> jax.Array:
    """The attention probabilities ``P [B, H, T, T]`` of ``fn(q, k, v, *extra)``, read out with one-hot values.

    Attention output is ``P @ v`` per head, so with ``v[:, j, :, c] = (j == c)`` the output is P itself. The identity
    is fed ``chunk`` columns at a time (``lax.map``) to bound memory.
    """
    batch, seq_len, heads, _ = q.shape
    n_chunks = -(-seq_len // chunk)
    eye = jnp.eye(seq_len, n_chunks * chunk, dtype=q.dtype)  # padded with zero columns

    def columns(start):
        v = jax.lax.dynamic_slice_in_dim(eye, start, chunk, axis=1)  # [T, chunk]
        v = jnp.broadcast_to(v[None, :, None, :], (batch, seq_len, k.shape[2], chunk))
        return fn(q, k, v, *extra)  # [B, T, H, chunk]

    out = jax.lax.map(columns, jnp.arange(n_chunks) * chunk)  # [n, B, T, H, chunk]
    probs = jnp.moveaxis(out, 0, 3).reshape(batch, seq_len, heads, n_chunks * chunk)[..., :seq_len]
    return jnp.transpose(probs, (0, 2, 1, 3))


def row_entropy(probs: jax.Array) -> jax.Array:
    """Entropy in nats of each row of ``probs [..., T]`` (zeros contribute nothing)."""
    p = jnp.clip(probs, 0.0, None)
    return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)


def entropy_and_map(variant: _inputs.Variant, x: _inputs.AttentionInputs) -> tuple[float, np.ndarray]:
    """Mean row entropy (nats, over batch, heads and queries) of one variant, and its map ``[T, T]`` (batch 0,
    head 0)."""
    probs = jax.jit(functools.partial(attention_probs, variant.fn))(x.q, x.k, *variant.extra)
    return float(jnp.mean(row_entropy(probs))), np.asarray(probs[0, 0])


def save_maps(path: str, probs: dict[str, np.ndarray], entropies: dict[str, float], mask: np.ndarray,
              membership: np.ndarray, start: int, head: int) -> None:
    """Writes the four panels (dense, focal, hard mask, hard map) for one head on the crop ``[start, start + CROP)``
    of ``[T, T]`` maps (rows: queries, columns: keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, LogNorm

    end = min(start + CROP, mask.shape[-1])
    crop = slice(start, end)
    extent = (start - 0.5, end - 0.5, end - 0.5, start - 0.5)
    fig, axes = plt.subplots(1, 4, figsize=(20, 5.6), constrained_layout=True)
    names = list(probs)
    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    for ax, name in zip(axes[[0, 1, 3]], names):
        shown = np.ma.masked_less_equal(probs[name][crop, crop], 0.0)  # exactly 0: masked pair, drawn white
        image = ax.imshow(np.maximum(shown, 1e-6), norm=LogNorm(vmin=1e-4, vmax=1.0), cmap=cmap, extent=extent,
                          interpolation="nearest")
        ax.set_title(f"{name}\nentropy {entropies[name]:.2f} nats (rows shown)")
    fig.colorbar(image, ax=axes[[0, 1, 3]].tolist(), shrink=0.8, label="attention probability (log scale)")
    # Mask panel: 0 = masked, 1 = local window, 2 = distant but same group.
    i, j = np.meshgrid(np.arange(start, end), np.arange(start, end), indexing="ij")
    local = (i - j >= 0) & (i - j <= WINDOW)
    kinds = np.where(mask[crop, crop], np.where(local, 1, 2), 0)
    groups = np.argmax(membership[crop], axis=-1)
    axes[2].imshow(kinds, cmap=ListedColormap(["#202020", "#6baed6", "#fd8d3c"]), vmin=0, vmax=2, extent=extent,
                   interpolation="nearest")
    axes[2].set_title(f"Focus hard mask (k=1, K={N_GROUPS}, w={WINDOW})\n"
                      f"blue: local window, orange: same group; {len(np.unique(groups))} groups in crop")
    for ax in axes:
        ax.set_xlabel("key position")
    axes[0].set_ylabel("query position")
    fig.suptitle(f"head {head}, tokens {start}..{end - 1} of T={mask.shape[-1]} (each row is the crop of a "
                 "full causal row)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_length(seq_len: int, heads: int, repeats: int, seed: int) -> tuple[list[list[str]], dict[str, Any]]:
    """Runs all variants at one length; returns the table rows and what the figure needs.

    Entropies first (one variant at a time), then wall times of all variants timed round-robin, so that load on a
    shared machine affects them alike.
    """
    x = _inputs.make_inputs(seq_len, heads, 64, seed=seed)
    g = jax.jit(_inputs.route)(x.h, x.w_g, x.centroids)
    variants = _inputs.attention_variants(g, top_ks=(1, 2))
    maps, entropies = {}, {}
    for variant in variants:
        start = time.perf_counter()
        entropies[variant.name], maps[variant.name] = entropy_and_map(variant, x)
        print(f"  T={seq_len} {variant.name}: entropy {entropies[variant.name]:.3f} nats "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"  T={seq_len} timing {len(variants)} variants ({repeats} rounds)", flush=True)
    calls = [(jax.jit(v.fn), (x.q, x.k, x.v, *v.extra)) for v in variants]
    times = _inputs.interleaved_times(calls, repeats=repeats)
    rows = []
    for variant, variant_times in zip(variants, times):
        fraction = 1.0 if variant.membership is None else hard_pair_fraction(variant.membership)
        rows.append([str(seq_len), variant.name, f"{entropies[variant.name]:.3f}", f"{fraction:.3f}",
                     f"{1e3 * statistics.median(variant_times):.1f}"])
    hard = next(v for v in variants if v.membership is not None)  # k = 1
    figure = dict(maps=maps, membership=np.asarray(hard.membership), names=[v.name for v in variants],
                  mask=np.asarray(attention.focus_mask(hard.membership, window=WINDOW)))
    return rows, figure


def write_figure(out_dir: str, figure: dict[str, Any]) -> str:
    """Writes ``attention_maps.png`` from the first length's results; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "attention_maps.png")
    names = figure["names"]
    dense, focal, hard = names[0], names[1], names[3]
    seq_len = figure["mask"].shape[-1]
    start = max(0, seq_len - CROP)
    crop_entropy = {n: float(np.mean(row_entropy(jnp.asarray(figure["maps"][n][start:]))))
                    for n in (dense, focal, hard)}
    save_maps(path, {n: figure["maps"][n] for n in (dense, focal, hard)}, crop_entropy,
              figure["mask"][0], figure["membership"][0], start, head=0)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m focal_jax.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="sequence lengths T")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (head_dim 64)")
    parser.add_argument("--out", default="demo_out", help="directory for attention_maps.png")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds per variant (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    print(f"focal_jax demo: B=1, H={args.heads}, D=64, float32, K={N_GROUPS}, w={WINDOW}, "
          f"jax {jax.__version__} on {jax.default_backend()}", flush=True)
    rows, first_figure = [], None
    for seq_len in args.lengths:
        print(f"T={seq_len}:", flush=True)
        length_rows, figure = run_length(seq_len, args.heads, args.repeats, args.seed)
        rows += length_rows
        first_figure = first_figure or figure
    print()
    print(_inputs.markdown_table(["T", "attention", "entropy (nats)", "pairs computed", "time (ms)"], rows))
    print("\nentropy: mean over heads and query rows of the attention probabilities (hard: masked probabilities);\n"
          "pairs computed: fraction of causal pairs (hard: allowed by focus_mask); time: jitted forward, median, "
          "routing excluded.")
    path = write_figure(args.out, first_figure)
    print(f"\nwrote {path}  (total {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
