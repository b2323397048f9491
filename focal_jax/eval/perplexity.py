"""Perplexity of a model on held-out batches; for Focus models, the soft-gated form and the hard top-k forms.

The Focus paper's Table 7 (FOCUS_SPEC §4.1, OQ-11): for a Focus model, the perplexity of the training form (soft
gate) and of hard top-k inference for k = 1..K, each with the fraction of pairs the hard mask retains and the group
dominance. A row per form:

  | form | k | loss | perplexity | pairs retained | distant pairs retained | dominance |

- loss: mean next-token NLL over the target tokens (`loss_mask`), as the trainer's `evaluate`; segment ids and
  positions of packed rows are honoured. perplexity = exp(loss).
- pairs retained: of the causal pairs (query i, key j <= i, same segment, both real tokens), the fraction the hard
  mask keeps (local, i - j <= w, sharing one of their top-k groups, or j a sink key: `focus_sink`), pooled over
  batches and averaged over layers; every layer is counted from its own routing in that forward pass. distant pairs
  retained: the same among the pairs with i - j > w only (the share the routing decides, and the sink; App. C's
  "about 50% of distant pairs"). Counted from per-group prefix counts, without a [T, T] array (`pair_counts`).
- dominance: share of real tokens in the largest group (argmax of g), averaged over layers; 1/K is perfect balance.

  python -m focal_jax.eval.perplexity --workdir DIR [--batches N] [--topk all|1,2] [--seq-len N]
      [--rope-ntk-factor F] [--impl xla|decomposed|pallas|cudnn] [--out FILE.json]
"""

import argparse
import functools
import itertools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focal_jax._validation import output_file_error
from focal_jax.attention import topk_membership
from focal_jax.attention.sink import sink_key_mask
from focal_jax.eval._cli import MESH_HELP, evaluation_mesh, mesh_shape, on_mesh, positive_int, rope_ntk_factor
from focal_jax.eval.diagnostics import (attention_configs, attention_view, batches_line, check_batch, distant_sums,
                                        forward, is_focus, load_run, prefix_sums, real_tokens, routed_layers,
                                        untrained_positions_note)
from focal_jax.nn.attention import IMPLS, record_attention
from focal_jax.train.trainer import masked_nll

PAIR_METHODS = ("auto", "patterns", "blocks")
MAX_PATTERNS = 256  # 'auto' counts by membership pattern up to this many k-subsets of K groups, else by blocks
BLOCK_ELEMENTS = 1 << 22  # 'blocks': query rows per block such that a block holds about this many pairs


# ----------------------------------------------------------------------------------------------------------------
# Pairs retained by the hard top-k mask
# ----------------------------------------------------------------------------------------------------------------


def pair_counts(g, k: int, *, window: int, segment_ids=None, valid=None, sink: int = 0,
                method: str = "auto") -> dict:
    """Per query, its causal keys and those the hard top-k Focus mask retains, counted without a `[T, T]` array.

    The hard mask (`focal_jax.attention.focus_mask`): query i sees key j iff j <= i, same segment, and
    (i - j <= window or i and j share one of their top-k groups of g or j is a sink key).

    Args:
      g: `[B, T, K]` routing assignments (Sinkhorn output); each token's groups are `topk_membership(g, k)`.
      k: groups per token, 1 <= k <= K.
      window: the local window w >= 0.
      segment_ids: optional int `[B, T]`; pairs never cross segments.
      valid: optional bool `[B, T]`; False marks padding, counted neither as query nor as key.
      sink: the attention sink (FOCUS_SPEC OQ-12): the first `sink` tokens of each segment (of the row without
        segment ids, padding included) are kept for every later query of their segment; 0 (default) for none.
      method: 'patterns' (prefix counts per membership pattern, one of the C(K, k) k-subsets: O(T C(K, k))),
        'blocks' (query blocks against all keys: O(T^2 K) work, O(block T) memory), or 'auto' (patterns when
        C(K, k) <= 256 and K <= 30, else blocks). Both are exact.

    Returns:
      dict of int32 `[B, T]` (zero at padding queries): `causal` (keys j <= i of i's segment), `retained` (those the
      mask keeps), `distant` (those with i - j > window), `distant_retained` (distant ones sharing a group or
      sink keys).
    """
    g = jnp.asarray(g)
    if g.ndim != 3 or g.shape[-1] < 1:
        raise ValueError(f"g must have shape [batch, seq, K] with K >= 1, got shape {g.shape}")
    n_groups = g.shape[-1]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n_groups:
        raise ValueError(f"k must be an integer with 1 <= k <= K={n_groups}, got k={k!r}")
    if method not in PAIR_METHODS:
        raise ValueError(f"method must be one of {PAIR_METHODS}, got method={method!r}")
    if isinstance(sink, bool) or not isinstance(sink, (int, np.integer)) or sink < 0:
        raise ValueError(f"sink must be an integer >= 0, got sink={sink!r}")
    for name, x in (("segment_ids", segment_ids), ("valid", valid)):
        if x is not None and tuple(np.shape(x)) != g.shape[:2]:
            raise ValueError(f"{name} must have shape [batch, seq] = {g.shape[:2]}, got shape {np.shape(x)}")
    valid = jnp.ones(g.shape[:2], bool) if valid is None else jnp.asarray(valid, bool)
    keys = valid.astype(jnp.int32)
    membership = topk_membership(g, int(k))
    sinks = sink_key_mask(segment_ids, sink, *g.shape[:2]) if sink else None
    if method == "auto":
        method = "patterns" if n_groups <= 30 and math.comb(n_groups, k) <= MAX_PATTERNS else "blocks"
    if method == "patterns" and n_groups > 30:  # its patterns are int32 bitmasks of the groups
        raise ValueError(f"method='patterns' counts at most K=30 groups, got K={n_groups}: use 'blocks' or 'auto'")
    if method == "patterns":
        distant_shared = _shared_by_patterns(membership, int(k), keys, window, segment_ids, sinks)
    else:
        distant_shared = _shared_by_blocks(membership, keys, window, segment_ids, sinks)
    causal = prefix_sums(keys[..., None], segment_ids)[..., 0] * keys
    distant = distant_sums(keys[..., None], window=window, segment_ids=segment_ids)[..., 0] * keys
    distant_shared = distant_shared * keys
    return {"causal": causal, "retained": causal - distant + distant_shared, "distant": distant,
            "distant_retained": distant_shared}


def _shared_by_patterns(membership, k, keys, window, segment_ids, sinks=None):
    """Per query, its distant keys sharing a group or sink keys (`sinks`: bool `[B, T]` or None): prefix counts
    `[B, T, P]` of each membership pattern (the C(K, k) k-subsets of groups), summed over the patterns that
    intersect the query's own, plus those of the sink keys over the others."""
    n_groups = membership.shape[-1]
    patterns = np.array([sum(1 << g for g in subset) for subset in itertools.combinations(range(n_groups), k)],
                        np.int32)  # [P] bit masks
    intersect = jnp.asarray((patterns[:, None] & patterns[None, :]) != 0, jnp.int32)  # [P, P]
    bits = jnp.sum(membership.astype(jnp.int32) << jnp.arange(n_groups, dtype=jnp.int32), axis=-1)  # [B, T]
    is_pattern = bits[..., None] == jnp.asarray(patterns)  # [B, T, P], one True per token
    counts = distant_sums(is_pattern.astype(jnp.int32) * keys[..., None], window=window, segment_ids=segment_ids)
    own = intersect[jnp.argmax(is_pattern, axis=-1)]  # [B, T, P]: patterns sharing a group with the token's
    shared = jnp.sum(counts * own, axis=-1)
    if sinks is None:
        return shared
    sink_counts = distant_sums(is_pattern.astype(jnp.int32) * (keys * sinks)[..., None], window=window,
                               segment_ids=segment_ids)
    return shared + jnp.sum(sink_counts * (1 - own), axis=-1)


def _shared_by_blocks(membership, keys, window, segment_ids, sinks=None):
    """Per query, its distant keys sharing a group or sink keys (`sinks`: bool `[B, T]` or None), by blocks of
    queries against all keys: `[B, block, T]` at a time."""
    b, t, _ = membership.shape
    block = int(max(1, min(t, BLOCK_ELEMENTS // max(b * t, 1))))
    n_blocks = -(-t // block)
    pad = n_blocks * block - t
    members = membership.astype(jnp.int32)
    segments = jnp.zeros((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    padded_members = jnp.pad(members, ((0, 0), (0, pad), (0, 0)))
    padded_segments = jnp.pad(segments, ((0, 0), (0, pad)))
    key_pos = jnp.arange(t)

    def one_block(start):
        query_members = jax.lax.dynamic_slice_in_dim(padded_members, start, block, axis=1)  # [B, C, K]
        query_segments = jax.lax.dynamic_slice_in_dim(padded_segments, start, block, axis=1)  # [B, C]
        query_pos = start + jnp.arange(block)
        share = jnp.einsum("bck,btk->bct", query_members, members) > 0
        if sinks is not None:
            share = share | sinks[:, None, :]
        distant = (query_pos[:, None] - key_pos[None, :]) > window  # also j < i
        same = query_segments[:, :, None] == segments[:, None, :]
        return jnp.sum(share & distant[None] & same & (keys[:, None, :] > 0), axis=-1, dtype=jnp.int32)  # [B, C]

    blocks = jax.lax.map(one_block, jnp.arange(n_blocks) * block)  # [n_blocks, B, C]
    return jnp.moveaxis(blocks, 0, 1).reshape(b, n_blocks * block)[:, :t]


# ----------------------------------------------------------------------------------------------------------------
# Evaluation of one form
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "pair_method"))
def _eval_batch(graphdef, state, batch, *, pair_method):
    """NLL sum and target count of one batch; per Focus layer, its argmax group counts, and under a hard top-k
    mask its pair counts per query."""
    model = nnx.merge(graphdef, state)
    with record_attention() as records:
        logits = forward(model, batch)
    total, count = masked_nll(logits, jnp.asarray(batch["targets"]), jnp.asarray(batch["loss_mask"]))
    out = {"nll": total, "tokens": count}
    valid = real_tokens(batch)
    g, config = routed_layers(records)
    if g is not None:
        top = jax.nn.one_hot(jnp.argmax(g, -1), config.focus_groups, dtype=jnp.int32) * valid[..., None]
        out["group_counts"] = jnp.sum(top, axis=(1, 2))  # [L, K]
        if config.focus_topk is not None:
            out["pairs"] = jax.lax.map(lambda g: pair_counts(g, config.focus_topk, window=config.focus_window,
                                                             segment_ids=batch.get("segment_ids"), valid=valid,
                                                             sink=config.focus_sink, method=pair_method),
                                       g)  # [L, B, T] each, layer by layer
    return out


def evaluate_model(model, batches, *, pair_method: str = "auto", progress: str | None = None) -> dict:
    """Held-out loss and perplexity of `model` as configured, over `batches`.

    Args:
      model: a focal_jax `Llama` or `GPT2`.
      batches: iterable of dicts with `inputs`, `targets` int `[B, T]`, `loss_mask [B, T]` and optional
        `positions`, `segment_ids` (padding = segment id 0), as `focal_jax.data` makes them.
      pair_method: how `pair_counts` counts (hard top-k models only).
      progress: a label; when given, prints the running loss about ten times over the batches.

    Returns:
      dict: `loss` (mean NLL over the target tokens), `perplexity` (exp(loss)), `tokens`; for Focus models
      `dominance` (mean over layers) and `dominance_per_layer`; under a hard top-k mask also `pairs_retained`,
      `distant_retained` (means over layers; None when no pair is farther apart than the window) and their
      `_per_layer` lists.
    """
    if pair_method not in PAIR_METHODS:
        raise ValueError(f"pair_method must be one of {PAIR_METHODS}, got pair_method={pair_method!r}")
    graphdef, state = nnx.split(attention_view(model))
    nll, tokens, group_counts, pairs = 0.0, 0.0, None, None
    n_batches = len(batches) if hasattr(batches, "__len__") else None
    every, start = max(1, (n_batches or 10) // 10), time.perf_counter()
    for i, batch in enumerate(batches):
        check_batch(batch, required=("inputs", "targets", "loss_mask"), vocab_size=model.config.vocab_size,
                    n_positions=getattr(model.config, "n_positions", None))
        out = jax.device_get(_eval_batch(graphdef, state, dict(batch), pair_method=pair_method))
        nll, tokens = nll + float(out["nll"]), tokens + float(out["tokens"])
        if "group_counts" in out:
            counts = np.asarray(out["group_counts"], np.int64)
            group_counts = counts if group_counts is None else group_counts + counts
        if "pairs" in out:
            sums = {name: np.asarray(v, np.int64).sum(axis=(1, 2)) for name, v in out["pairs"].items()}  # [L]
            pairs = sums if pairs is None else {name: pairs[name] + sums[name] for name in sums}
        if progress and ((i + 1) % every == 0 or i + 1 == n_batches):
            print(f"  {progress}: batch {i + 1}{'' if n_batches is None else f'/{n_batches}'}, loss so far "
                  f"{nll / max(tokens, 1.0):.4f} ({time.perf_counter() - start:.1f}s)", flush=True)
    if not tokens:
        raise ValueError("the batches hold no target tokens (loss_mask is 0 everywhere, or there are no batches)")
    loss = nll / tokens
    result = {"loss": loss, "perplexity": math.inf if loss >= 700 else math.exp(loss), "tokens": int(tokens)}
    if group_counts is not None:
        dominance = group_counts.max(axis=1) / np.maximum(group_counts.sum(axis=1), 1)
        result.update(dominance=float(dominance.mean()), dominance_per_layer=dominance.tolist())
    if pairs is not None:
        retained = pairs["retained"] / np.maximum(pairs["causal"], 1)
        result.update(pairs_retained=float(retained.mean()), pairs_retained_per_layer=retained.tolist(),
                      distant_retained=None, distant_retained_per_layer=[None] * len(retained))
        if pairs["distant"].all():  # (none when every row is within the window: nothing to report, not 0%)
            distant = pairs["distant_retained"] / pairs["distant"]
            result.update(distant_retained=float(distant.mean()), distant_retained_per_layer=distant.tolist())
    return result


# ----------------------------------------------------------------------------------------------------------------
# The top-k table
# ----------------------------------------------------------------------------------------------------------------


def _parse_ks(ks, n_groups):
    """'all' | an int | a list of ints | a comma-separated string -> sorted ints in [1, K]."""
    if isinstance(ks, str):
        if ks == "all":
            return list(range(1, n_groups + 1))
        try:
            ks = [int(part) for part in ks.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"topk must be 'all' or comma-separated integers, got topk={ks!r}") from None
    elif isinstance(ks, (int, np.integer)) and not isinstance(ks, bool):
        ks = [ks]
    ks = list(ks)
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n_groups:
            raise ValueError(f"top-k must be an integer with 1 <= k <= K={n_groups} (the model's focus_groups), "
                             f"got k={k!r}")
    if not ks:
        raise ValueError("topk selects no k; give 'all' or integers in [1, K]")
    return sorted(set(int(k) for k in ks))


def _topk_flag(text: str) -> str:
    """`--topk`: 'all' or comma-separated integers >= 1 (checked against the model's groups once it loads)."""
    if text != "all":
        try:
            ks = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            ks = []
        if not ks or min(ks) < 1:
            raise argparse.ArgumentTypeError(f"expected 'all' or comma-separated integers >= 1, got {text!r}")
    return text


def topk_table(model, batches, *, topk="all", impl: str | None = None, pair_method: str = "auto",
               progress: bool = False) -> list[dict]:
    """The Focus paper's Table 7 for `model`: soft-gated and hard top-k perplexity, pairs retained, dominance.

    Args:
      model: a focal_jax `Llama` or `GPT2`. A Focus model gives a 'soft' row (the training form, `focus_topk=None`)
        and a 'hard' row per k; any other model one row of its own kind (then `topk` must be None).
      batches: as `evaluate_model` (a list: it is read once per row).
      topk: 'all' (k = 1..K), an int, a list of ints or a comma-separated string; None for non-Focus models.
      impl: attention implementation of the hard rows: 'xla' (dense masked reference), 'decomposed', 'pallas';
        default the model's own when it is a hard path ('decomposed' / 'pallas'), else 'xla'. The soft row always
        uses 'xla' (the only soft-gate path). For a non-Focus model, its row's implementation (default its own).
      pair_method: see `pair_counts`. progress: print a line per row.

    Returns:
      list of dicts, one per row: `form` ('soft' | 'hard' | the attention kind), `k` (None unless hard), `loss`,
      `perplexity`, `tokens`, `pairs_retained`, `distant_retained` (None unless hard), `dominance` (None unless
      Focus), plus the per-layer lists of `evaluate_model`.
    """
    configs = attention_configs(model)
    batches = list(batches)
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got impl={impl!r}")
    if not is_focus(model):
        if topk is not None:
            raise ValueError(f"topk={topk!r} needs a Focus model (kind 'focus' or 'focal+focus'); this model has "
                             f"kind {sorted({c.kind for c in configs})}: leave topk unset (None)")
        forms = [(configs[0].kind, None, {} if impl is None else {"impl": impl})]
    else:
        ks = [] if topk is None else _parse_ks(topk, configs[0].focus_groups)
        hard_impl = impl or (configs[0].impl if configs[0].impl in ("decomposed", "pallas") else "xla")
        if hard_impl == "cudnn":
            raise ValueError("impl='cudnn' has no hard Focus path; use 'xla', 'decomposed' or 'pallas'")
        forms = [("soft", None, dict(focus_topk=None, impl="xla"))]
        forms += [("hard", k, dict(focus_topk=k, impl=hard_impl)) for k in ks]
    rows = []
    for form, k, changes in forms:
        start = time.perf_counter()
        label = f"{form}{'' if k is None else f' top-{k}'}"
        result = evaluate_model(attention_view(model, **changes), batches, pair_method=pair_method,
                                progress=label if progress else None)
        row = {"form": form, "k": k, "pairs_retained": None, "distant_retained": None, "dominance": None, **result}
        rows.append(row)
        if progress:
            print(f"{label}: loss {row['loss']:.4f}, perplexity "
                  f"{row['perplexity']:.3f} ({time.perf_counter() - start:.1f}s)", flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    """Markdown rendering of `topk_table` rows: form, k, loss, perplexity, pairs retained (all causal pairs and
    distant ones), dominance."""
    def percent(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = ["| form | k | loss | perplexity | pairs retained | distant pairs retained | dominance |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['form']} | {'-' if r['k'] is None else r['k']} | {r['loss']:.4f} | "
                     f"{r['perplexity']:.3f} | {percent(r['pairs_retained'])} | {percent(r['distant_retained'])} | "
                     f"{percent(r['dominance'])} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def main(argv=None) -> list[dict]:
    """`python -m focal_jax.eval.perplexity --workdir DIR [--step S] [--batches N] [--topk all|1,2] [--seq-len N]
    [--batch-size N] [--rope-ntk-factor F] [--window W] [--impl xla|decomposed|pallas|cudnn] [--mesh AXIS=N,...]
    [--out FILE.json]`: the perplexity table of a trained run on its held-out data (soft and hard top-k rows for a
    Focus model); prints it and returns the rows."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.eval.perplexity", description=main.__doc__)
    parser.add_argument("--workdir", required=True, help="a focal_jax training run directory")
    parser.add_argument("--step", type=int, default=None,
                        help="a saved checkpoint step (default: the latest), e.g. for a curve over training")
    parser.add_argument("--batches", type=positive_int, default=8, help="held-out batches (default 8)")
    parser.add_argument("--topk", type=_topk_flag, default=None,
                        help="hard top-k rows: 'all' (the default for Focus models) or comma-separated k, e.g. 1,2")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per row (default: the trained length)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="rows per batch (default: the run's, scaled to keep the tokens per batch)")
    parser.add_argument("--rope-ntk-factor", type=rope_ntk_factor, default=None,
                        help="dynamic NTK scaling (>= 1) of RoPE past the trained length (models with RoPE only)")
    parser.add_argument("--window", type=int, default=None,
                        help="evaluate under a sliding window: key j visible iff 0 <= i - j <= WINDOW (dense / focal "
                             "models; e.g. pretrained weights zero-shot, the Focus paper's Table 1 baseline)")
    parser.add_argument("--impl", choices=IMPLS, default=None,
                        help="attention implementation of the hard rows (of the one row of a non-Focus model)")
    parser.add_argument("--mesh", type=mesh_shape, default=None, help=MESH_HELP)
    parser.add_argument("--out", help="write the rows (and the settings) as JSON here")
    args = parser.parse_args(argv)
    if args.out and (problem := output_file_error("--out", args.out, make_folder=True)):
        parser.error(problem)  # now, not after the evaluation
    mesh = evaluation_mesh(parser, args.mesh)
    try:
        run = load_run(args.workdir, n_batches=args.batches, seq_len=args.seq_len, batch_size=args.batch_size,
                       step=args.step, mesh=mesh)
    except ValueError as e:
        parser.error(str(e))
    model = run.model
    if args.rope_ntk_factor is not None:
        if any(c.rope_theta is None for c in attention_configs(model)):
            parser.error(f"--rope-ntk-factor={args.rope_ntk_factor} needs rotary embeddings; this "
                         f"{type(model).__name__} model has none")
        try:
            model = attention_view(model, rope_ntk_factor=args.rope_ntk_factor,
                                   rope_trained_len=run.trained_seq_len)
        except ValueError as e:
            parser.error(str(e))
    if args.window is not None:
        try:
            model = attention_view(model, window=args.window)
        except ValueError as e:
            parser.error(f"--window={args.window}: {e}")
    if args.topk is not None and not is_focus(model):
        parser.error(f"--topk={args.topk} needs a Focus model (kind 'focus' or 'focal+focus'); this model's attention "
                     f"kind is {sorted({c.kind for c in attention_configs(model)})}: leave --topk out")
    topk = args.topk if args.topk is not None else ("all" if is_focus(model) else None)
    if topk is not None:
        try:
            _parse_ks(topk, attention_configs(model)[0].focus_groups)
        except ValueError as e:
            parser.error(f"--topk={topk}: {e}")
    print(f"perplexity of {args.workdir} (step {run.step}): {batches_line(run, args.batches)}", flush=True)
    if note := untrained_positions_note(model, [run.seq_len], run.trained_seq_len, args.rope_ntk_factor):
        print(f"perplexity: {note}", flush=True)
    try:
        with on_mesh(mesh):
            rows = topk_table(model, run.batches, topk=topk, impl=args.impl, progress=True)
    except ValueError as e:
        parser.error(str(e))
    print("\n" + format_table(rows))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        settings = dict(workdir=os.path.abspath(args.workdir), step=run.step, seq_len=run.seq_len,
                        trained_seq_len=run.trained_seq_len, batches=len(run.batches),
                        batch_size=int(np.shape(run.batches[0]["inputs"])[0]), topk=topk,
                        rope_ntk_factor=args.rope_ntk_factor, window=args.window, impl=args.impl, mesh=args.mesh)
        with open(args.out, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
