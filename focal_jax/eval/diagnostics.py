"""Group diagnostics of Focus models, and the attention entropy of any model.

Per Focus layer, from the routing assignment `g [B, T, K]` (the Sinkhorn output) of the real (non-padding) tokens:
  - sizes: the share of tokens whose top group (argmax g) is each group; dominance: the largest share, the Focus
    paper's collapse measure (App. B, §4; 1/K is perfect balance, 1 is collapse);
  - mass: the share of the soft assignment mass in each group (what Sinkhorn balances);
  - confidence: the mean of max_k g_i (paper §5 reports 0.89);
  - long-range affinity: the mean of g_i . g_j over causal same-segment pairs farther apart than the window
    (i - j > w), exact, from prefix sums (no [T, T] array); unrelated tokens give `sum_k mass_k^2` (1/K when
    balanced), reported next to it as `affinity_chance`;
  - top tokens: the token ids most often assigned (argmax) to each group, the paper's §5 interpretability table.
Per layer and head, for every attention kind (dense, focal, focal_learned, Focus soft or hard): the attention
entropy, the mean over real queries of `-sum_j p_ij log p_ij` in nats, next to the entropy of uniform attention over
the causal keys. It needs the dense `[T, H, T]` probabilities of one row at a time: use modest lengths.

  python -m focal_jax.eval.diagnostics --workdir DIR [--batches N] [--topk K] [--out FILE.json] [--png FILE.png]

`routing_metrics(model, batch)` is the cheap form for a training loop: dominance and confidence from one batch.
Padding follows `focal_jax.data.pack`: segment id 0 (without segment ids every token is real).
"""

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from focal_jax._validation import output_file_error
from focal_jax.data import build_data, tokenizer_file
from focal_jax.eval._cli import MESH_HELP, evaluation_mesh, mesh_shape, on_mesh, positive_int
from focal_jax.nn.attention import FOCUS_KINDS, record_attention
from focal_jax.nn.llama import segment_positions
from focal_jax.nn.models import attention_layers, check_model
from focal_jax.nn.retrofit import replace_attention
from focal_jax.train import checkpoint
from focal_jax.train.config import check_config
from focal_jax.train.sharding import check_batch_layout, shard_batch
from focal_jax.train.trainer import load_model

# ----------------------------------------------------------------------------------------------------------------
# Models and data of a run
# ----------------------------------------------------------------------------------------------------------------


def attention_view(model, **changes):
    """A second model object over the same parameter arrays as `model` (`Llama` or `GPT2`), whose every `Attention`
    config has `changes` applied (AttentionConfig fields, e.g. `focus_topk=2`, `impl='xla'`, `window=128` for the
    pretrained weights under a sliding window, `kind='dense'` on a Focus model) by
    `focal_jax.nn.retrofit.replace_attention` (with `allow_unused=True`: a kind may leave parameters unused), and
    with block rematerialisation off (evaluation needs no backward pass). `model` itself is left unchanged.

    Raises ValueError for another model type, or naming the field when a change is invalid (e.g. `focus_topk`
    larger than `focus_groups`, a `window` on a Focus kind, a field GPT-2's config does not carry, a kind that
    needs parameters the model lacks).
    """
    check_model(model)
    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state)
    replace_attention(view, allow_unused=True, **changes)
    view.config = dataclasses.replace(view.config, remat=False)
    return view


def attention_configs(model) -> list:
    """The `AttentionConfig` of each layer of `model` (`Llama` or `GPT2`), in layer order."""
    return [attn.config for attn in attention_layers(model)]


def is_focus(model) -> bool:
    """Whether `model`'s attention layers route tokens to groups (kind 'focus' or 'focal+focus')."""
    return all(c.kind in FOCUS_KINDS for c in attention_configs(model))


@dataclasses.dataclass
class Run:
    """A trained run ready to evaluate (`load_run`): the model with its latest parameters, the tokenizer it was
    trained with, held-out batches (the trainer's format, `focal_jax.data.pack` keys, each `[batch, seq_len]`),
    the evaluation and training sequence lengths, and the checkpoint step."""

    model: object
    tokenizer: object
    batches: list
    seq_len: int
    trained_seq_len: int
    step: int


def load_run(workdir: str, *, n_batches: int, seq_len: int | None = None, batch_size: int | None = None,
             step: int | None = None, mesh=None) -> Run:
    """The model of a focal_jax training workdir (latest checkpoint, or checkpoint `step`: an intermediate one), its
    tokenizer, and `n_batches` held-out batches of the run's data, packed at `seq_len` tokens per row (default: the
    trained length).

    batch_size: rows per batch; default the run's `batch_size`, scaled by trained / evaluated length so that a
    batch holds about as many tokens as in training (at least one row). A given one larger than the held-out rows
    is a ValueError: its batch would be mostly padding. Fewer than `n_batches` batches come back when the held-out
    rows fill fewer (the last one completed with padding rows).
    mesh: place the model's parameters on this mesh (`focal_jax.train.trainer.load_model`) and split each batch's
    rows over its 'data' and 'fsdp' axes (`focal_jax.train.sharding.shard_batch`; ValueError, before the model
    loads, unless they divide the batch size); evaluate under `jax.set_mesh(mesh)`.
    """
    for name, value in (("n_batches", n_batches), ("seq_len", seq_len), ("batch_size", batch_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {name}={value!r}")
    checkpoint.require_step(workdir, step)  # first: it names the saved steps when `step` is not one
    step, meta = checkpoint.read_meta(workdir, step)
    run = check_config(ml_collections.ConfigDict(checkpoint.stored_config(meta)))
    trained = run.data.seq_len
    seq_len = seq_len or trained
    given_batch_size = batch_size is not None
    if batch_size is None:
        batch_size = max(1, run.batch_size * trained // seq_len)
    if mesh is not None:
        check_batch_layout(mesh, batch_size, process_count=1)
    data_config = dataclasses.replace(run.data, seq_len=seq_len)
    try:  # the exact tokenizer the run trained with (its workdir copy, of either kind)
        data_config = dataclasses.replace(data_config, tokenizer=tokenizer_file(workdir))
    except FileNotFoundError:
        pass
    data = build_data(data_config, global_batch=batch_size, seed=run.seed, process_index=0, process_count=1,
                      training=False)
    if given_batch_size and (held_out := data.held_out_rows(batch_size)) < batch_size:
        raise ValueError(f"batch_size={batch_size} is more than the held-out rows: the held-out documents pack into "
                         f"{held_out} rows of {seq_len} tokens; give a batch size of at most {held_out}")
    batches = data.eval_batches(n_batches)
    model = load_model(workdir, step=step, mesh=mesh)
    if mesh is not None:
        batches = [shard_batch(batch, mesh) for batch in batches]
    return Run(model=model, tokenizer=data.tokenizer, batches=batches, seq_len=seq_len, trained_seq_len=trained,
               step=step)


def batches_line(run: Run, asked: int) -> str:
    """`run`'s held-out batches, for an evaluation's header: their count and shape, the trained length, and how
    many of the `asked` batches the held-out rows fill when fewer."""
    line = (f"{len(run.batches)} batches of {np.shape(run.batches[0]['inputs'])} tokens (trained at "
            f"{run.trained_seq_len})")
    if len(run.batches) < asked:
        line += f"; the held-out rows fill {len(run.batches)} of the {asked} batches asked"
    return line


def untrained_positions_note(model, lengths, trained_len: int, rope_ntk_factor=None, *, flag: bool = True) -> str:
    """A note for an evaluation at `lengths` (input lengths) past `trained_len` on a model with RoPE and no
    `rope_ntk_factor`: its rotary positions there were never trained (with `flag`: the command's
    --rope-ntk-factor scales them). '' otherwise."""
    past = sorted(length for length in lengths if length > trained_len)
    if not past or rope_ntk_factor is not None or any(c.rope_theta is None for c in attention_configs(model)):
        return ""
    hint = " (--rope-ntk-factor scales them, as the Focal paper's 64K evaluation)" if flag else ""
    return (f"note: lengths {past} go past the {trained_len} tokens the model was trained on; its rotary positions "
            f"there were never trained{hint}")


def check_batch(batch, required=("inputs",), vocab_size: int | None = None, n_positions: int | None = None):
    """Checks a batch dict (the trainer's format: `inputs`, `targets` int `[B, T]`, `loss_mask [B, T]`, optional
    `positions`, `segment_ids` int `[B, T]`); raises ValueError naming a missing key, a wrong shape, (given
    `vocab_size`) an input or scored target id outside `[0, vocab_size)` (in a jitted forward an input gives NaN
    logits; a target would be scored as the log-sum-exp of the logits), or (given `n_positions`, GPT-2's learned
    position table) a position outside `[0, n_positions)`: the batch's `positions`, else those the model derives
    (restarting at each segment, else `0..T-1`); in a jitted forward such a position gives NaN logits, which reach
    every loss through padding too."""
    if not isinstance(batch, dict):
        raise ValueError(f"a batch must be a dict of [batch, seq] arrays, got {type(batch).__name__}")
    missing = [k for k in required if k not in batch]
    if missing:
        raise ValueError(f"the batch lacks key(s) {missing}; it has {sorted(batch)}")
    shape = np.shape(batch["inputs"])
    if len(shape) != 2:
        raise ValueError(f"batch['inputs'] must have shape [batch, seq], got shape {shape}")
    for key in ("targets", "loss_mask", "positions", "segment_ids"):
        if batch.get(key) is not None and np.shape(batch[key]) != shape:
            raise ValueError(f"batch[{key!r}] must have the shape of batch['inputs'] {shape}, got "
                             f"{np.shape(batch[key])}")
    if vocab_size is not None:
        for key in ("inputs", "targets"):
            if key not in batch:
                continue
            ids = np.asarray(batch[key])
            if key == "targets" and "loss_mask" in batch:
                ids = ids[np.asarray(batch["loss_mask"]) > 0]
            bad = ids[(ids < 0) | (ids >= vocab_size)]
            if bad.size:
                raise ValueError(f"batch[{key!r}] holds token id {int(bad[0])}, outside the model's vocabulary "
                                 f"[0, {vocab_size})")
    if n_positions is not None:
        positions = batch.get("positions")
        if positions is None:
            positions = (np.arange(shape[1]) if batch.get("segment_ids") is None
                         else segment_positions(jnp.asarray(batch["segment_ids"])))
        positions = np.asarray(positions)
        bad = positions[(positions < 0) | (positions >= n_positions)]
        if bad.size:
            raise ValueError(f"the batch holds position {int(bad[0])}, outside the model's learned position table "
                             f"[0, n_positions={n_positions}): use rows (or documents) of at most {n_positions} "
                             f"tokens")


def real_tokens(batch) -> jax.Array:
    """bool `[B, T]`: the non-padding tokens of a batch (segment id != 0; all tokens without segment ids)."""
    segment_ids = batch.get("segment_ids")
    if segment_ids is None:
        return jnp.ones(jnp.shape(batch["inputs"]), bool)
    return jnp.asarray(segment_ids) != 0


def forward(model, batch):
    """Logits `[B, T, V]` of `model` on a batch (its positions and segment ids, when given)."""
    return model(jnp.asarray(batch["inputs"]), positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))


# ----------------------------------------------------------------------------------------------------------------
# Pure statistics of one routing assignment g [B, T, K]
# ----------------------------------------------------------------------------------------------------------------


def _check_g(g, valid, segment_ids=None):
    g = jnp.asarray(g)
    if g.ndim != 3 or g.shape[-1] < 1:
        raise ValueError(f"g must have shape [batch, seq, K] with K >= 1, got shape {g.shape}")
    for name, x in (("valid", valid), ("segment_ids", segment_ids)):
        if x is not None and tuple(np.shape(x)) != g.shape[:2]:
            raise ValueError(f"{name} must have shape [batch, seq] = {g.shape[:2]}, got shape {np.shape(x)}")
    return g.astype(jnp.float32), (jnp.ones(g.shape[:2], bool) if valid is None else jnp.asarray(valid, bool))


def _segment_cumsum(x, ids):
    """Per token i, the sum of `x [T, C]` over tokens j <= i with `ids[j] == ids[i]`: stable-sort by id (each
    segment becomes a run, in order), cumsum, subtract the cumsum before the run, unsort."""
    order = jnp.argsort(ids, stable=True)
    cum = jnp.cumsum(x[order], axis=0)
    sorted_ids = ids[order]
    index = jnp.arange(ids.shape[0])
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    first = jax.lax.cummax(jnp.where(starts, index, 0), axis=0)  # where each token's run starts
    before = jnp.where((first > 0)[:, None], cum[jnp.maximum(first - 1, 0)], 0)
    return jnp.zeros_like(cum).at[order].set(cum - before)


def prefix_sums(values, segment_ids=None):
    """Per token i, the sum of `values [B, T, C]` over tokens j <= i of i's segment (any layout of the ids)
    -> `[B, T, C]` in values' dtype (exact for integers)."""
    if segment_ids is None:
        return jnp.cumsum(values, axis=1)
    return jax.vmap(_segment_cumsum)(values, jnp.asarray(segment_ids))


def distant_sums(values, *, window: int, segment_ids=None):
    """Per token i, the sum of `values [B, T, C]` over the tokens j of i's segment with `i - j > window` (the
    distant keys of query i under a local window w) -> `[B, T, C]` in values' dtype (exact for integers).

    Without a `[T, T]` array: with segment ids, the values are shifted by w + 1 positions and interleaved with the
    queries (entry j just before query j + w + 1), and one segment-aware prefix sum over the 2T items, keyed by
    each item's segment id, sums for query i exactly the entries j <= i - w - 1 of its own segment, whatever the
    layout of the segment ids.
    """
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window must be an integer >= 0, got window={window!r}")
    values = jnp.asarray(values)
    if values.ndim != 3:
        raise ValueError(f"values must have shape [batch, seq, C], got shape {values.shape}")
    b, t, c = values.shape
    shift = window + 1
    if shift >= t:
        return jnp.zeros_like(values)
    entries = jnp.pad(values[:, :t - shift], ((0, 0), (shift, 0), (0, 0)))  # entries[m] = values[m - shift]
    if segment_ids is None:
        return jnp.cumsum(entries, axis=1)
    segment_ids = jnp.asarray(segment_ids)
    entry_ids = jnp.pad(segment_ids[:, :t - shift], ((0, 0), (shift, 0)))  # the padded entries hold zeros
    items = jnp.stack([entries, jnp.zeros_like(entries)], axis=2).reshape(b, 2 * t, c)
    ids = jnp.stack([entry_ids, segment_ids], axis=2).reshape(b, 2 * t)
    return prefix_sums(items, ids)[:, 1::2]


@functools.partial(jax.jit, static_argnums=(3, 5))
def _routing_sums(g, valid, segment_ids, window, tokens=None, vocab_size=None):
    """Additive statistics of one layer's routing (summed over tokens, so batches add up): see `group_stats`."""
    g, valid = _check_g(g, valid, segment_ids)
    weight = valid.astype(jnp.float32)
    n_groups = g.shape[-1]
    top = jnp.argmax(g, axis=-1)
    top_onehot = jax.nn.one_hot(top, n_groups, dtype=jnp.float32) * weight[..., None]
    sums = {"tokens": jnp.sum(weight), "counts": jnp.sum(top_onehot, axis=(0, 1)),
            "mass": jnp.sum(g * weight[..., None], axis=(0, 1)), "confidence": jnp.sum(jnp.max(g, -1) * weight)}
    if window is not None:
        keys = g * weight[..., None]
        distant_g = distant_sums(keys, window=window, segment_ids=segment_ids)
        distant_n = distant_sums(weight[..., None], window=window, segment_ids=segment_ids)[..., 0]
        sums["affinity"] = jnp.sum(jnp.sum(g * distant_g, -1) * weight)
        sums["pairs"] = jnp.sum(distant_n * weight)
    if tokens is not None:
        flat = top * vocab_size + jnp.asarray(tokens)
        sums["token_counts"] = jnp.zeros((n_groups * vocab_size,), jnp.int32).at[flat.reshape(-1)].add(
            valid.reshape(-1).astype(jnp.int32)).reshape(n_groups, vocab_size)
    return sums


def _summarize(sums, top=None) -> dict:
    """Ratios from (host-summed) `_routing_sums`: sizes, mass, dominance, confidence, affinity, top tokens."""
    n = float(sums["tokens"])
    out = {"tokens": int(n)}
    if n == 0:
        return out
    sizes = np.asarray(sums["counts"], np.float64) / n
    mass = np.asarray(sums["mass"], np.float64) / n
    out.update(sizes=sizes.tolist(), mass=mass.tolist(), dominance=float(sizes.max()),
               confidence=float(sums["confidence"]) / n)
    if "pairs" in sums:
        pairs = float(sums["pairs"])
        out.update(affinity=float(sums["affinity"]) / pairs if pairs else float("nan"),
                   affinity_chance=float(np.sum(mass ** 2)), long_range_pairs=int(pairs))
    if top is not None and "token_counts" in sums:
        out["top_tokens"] = _top_of_counts(np.asarray(sums["token_counts"]), top)
    return out


def _top_of_counts(counts, n):
    """`counts [K, V]` -> per group the `n` most frequent `[token_id, count]` (count > 0; ties: lower id first)."""
    result = []
    for row in counts:
        order = np.lexsort((np.arange(row.size), -row))[:n]
        result.append([[int(i), int(row[i])] for i in order if row[i] > 0])
    return result


def group_stats(g, valid=None) -> dict:
    """Group sizes, dominance and confidence of one layer's routing.

    Args:
      g: `[B, T, K]` soft assignments (rows of `sinkhorn`). valid: optional bool `[B, T]` (False = padding, left
        out).

    Returns:
      dict: `tokens` (real tokens counted), `sizes [K]` (share of tokens whose argmax group is k), `mass [K]`
      (mean of g_ik), `dominance` (max of sizes), `confidence` (mean of max_k g_ik). Only `tokens` when none.
    """
    return _summarize(_routing_sums(g, valid, None, None))


def long_range_affinity(g, *, window: int, segment_ids=None, valid=None) -> dict:
    """Mean affinity `g_i . g_j` over the long-range causal pairs: j < i - window, same segment, both real.

    Args:
      g: `[B, T, K]`. window: the local window w (pairs with i - j <= w are local). segment_ids: optional int
        `[B, T]`. valid: optional bool `[B, T]`.

    Returns:
      dict: `affinity` (nan when there is no such pair), `long_range_pairs` (their number), `affinity_chance`
      (`sum_k mass_k^2`, the mean affinity of unrelated tokens).
    """
    out = _summarize(_routing_sums(g, valid, segment_ids, window))
    return {k: out[k] for k in ("affinity", "long_range_pairs", "affinity_chance") if k in out}


def top_tokens(g, tokens, valid=None, *, n: int = 8) -> list:
    """The token ids most often assigned (argmax of g) to each group: the Focus paper's §5 table.

    Args:
      g: `[B, T, K]`. tokens: int `[B, T]` (the input ids). valid: optional bool `[B, T]`. n: tokens per group.

    Returns:
      K lists of up to n `[token_id, count]`, most frequent first.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got n={n!r}")
    tokens = np.asarray(tokens)
    if tokens.shape != np.shape(g)[:2]:
        raise ValueError(f"tokens must have shape [batch, seq] = {np.shape(g)[:2]}, got shape {tokens.shape}")
    vocab_size = int(tokens.max()) + 1 if tokens.size else 1
    return _summarize(_routing_sums(g, valid, None, None, tokens, vocab_size), top=n).get("top_tokens", [])


# ----------------------------------------------------------------------------------------------------------------
# Attention entropy
# ----------------------------------------------------------------------------------------------------------------


def _entropy_sums(record, valid):
    """Sum over real queries of the attention entropy of one recorded layer -> `[H]`, one row at a time."""
    config = record["config"]
    x, q, k, segment_ids, tau_x = record["x"], record["q"], record["k"], record["segment_ids"], record["tau_x"]
    b, t = q.shape[:2]
    one_hot_values = jnp.broadcast_to(jnp.eye(t, dtype=jnp.float32)[:, None, :], (1, t, config.n_kv_heads, t))

    def row(i):
        pick = lambda a: None if a is None else jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0)
        probs = record["attend"](pick(x), pick(q), pick(k), one_hot_values, pick(segment_ids),
                                 tau_x=pick(tau_x))  # [1, T, H, T]
        entropy = -jnp.sum(jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0), -1)
        return jnp.sum(entropy[0] * pick(valid)[0, :, None], axis=0)  # [H]

    return jnp.sum(jax.lax.map(row, jnp.arange(b)), axis=0)


def _uniform_entropy_sum(batch, valid):
    """Sum over real queries of log(number of real causal keys of the same segment): uniform attention's entropy."""
    keys = prefix_sums(valid[..., None].astype(jnp.int32), batch.get("segment_ids"))[..., 0]
    return jnp.sum(jnp.where(valid, jnp.log(jnp.maximum(keys, 1).astype(jnp.float32)), 0.0))


# ----------------------------------------------------------------------------------------------------------------
# One batch through the model
# ----------------------------------------------------------------------------------------------------------------


def routed_layers(records):
    """The Focus layers of recorded attention calls: their assignments stacked `[L, B, T, K]` and their config
    (one for all: the layers of a focal_jax model share their attention settings), or `(None, None)`."""
    routed = [r for r in records if "g" in r]
    if not routed:
        return None, None
    config = routed[0]["config"]
    if any(r["config"] != config for r in routed):
        raise ValueError("the Focus layers of this model have different attention configs; diagnostics expect "
                         "one config for all layers")
    return jnp.stack([r["g"] for r in routed]), config


@functools.partial(jax.jit, static_argnames=("graphdef", "entropy", "vocab_size"))
def _batch_sums(graphdef, state, batch, *, entropy: bool, vocab_size: int | None):
    """The additive routing statistics (stacked over Focus layers) and entropy sums (per layer) of one batch."""
    model = nnx.merge(graphdef, state)
    with record_attention() as records:
        forward(model, batch)
    valid = real_tokens(batch)
    out = {"tokens": jnp.sum(valid.astype(jnp.float32)), "uniform_entropy": _uniform_entropy_sum(batch, valid)}
    g, config = routed_layers(records)
    if g is not None:
        tokens = jnp.asarray(batch["inputs"]) if vocab_size else None
        out["routing"] = jax.lax.map(lambda g: _routing_sums(g, valid, batch.get("segment_ids"),
                                                             config.focus_window, tokens, vocab_size), g)
    if entropy:
        out["entropy"] = jnp.stack([_entropy_sums(record, valid) for record in records])  # [L, H]
    return out


def _add(total, new):
    """Elementwise sum of two nested dicts / lists of arrays (host float64 / int64)."""
    if total is None:
        return jax.tree.map(lambda x: np.asarray(x, np.int64 if np.issubdtype(x.dtype, np.integer) else np.float64),
                            new)
    return jax.tree.map(lambda a, b: a + np.asarray(b), total, new)


def diagnose(model, batches, *, top: int = 8, entropy: bool = True, progress: bool = False) -> dict:
    """Group diagnostics and attention entropy of `model` over `batches`.

    Args:
      model: a focal_jax `Llama` or `GPT2` (any attention kind; the routing statistics need a Focus kind). It runs
        as configured (soft gate, or hard top-k when `focus_topk` is set), with the dense `'xla'` attention path.
      batches: iterable of dicts with `inputs` int `[B, T]` and optional `positions`, `segment_ids` (padding = 0).
      top: tokens per group in the top-token table. entropy: also compute the attention entropy (dense per row).
      progress: print a line per batch.

    Returns:
      dict (JSON-ready): `tokens`, `uniform_entropy` (mean over real queries of log #causal keys), `layers`: one
      dict per attention layer with `kind`, `entropy [H]` (mean over real queries, nats) when computed, and for
      Focus layers `routing` (see `group_stats` and `long_range_affinity`, plus `top_tokens`: K lists of
      `[token_id, count]`).
    """
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an integer >= 1, got top={top!r}")
    view = attention_view(model, impl="xla")
    graphdef, state = nnx.split(view)
    vocab_size = view.config.vocab_size if is_focus(view) else None
    total, start = None, time.perf_counter()
    for i, batch in enumerate(batches):
        check_batch(batch, vocab_size=view.config.vocab_size,
                    n_positions=getattr(view.config, "n_positions", None))
        sums = jax.device_get(_batch_sums(graphdef, state, dict(batch), entropy=entropy, vocab_size=vocab_size))
        total = _add(total, sums)
        if progress:
            print(f"diagnostics: batch {i + 1} ({time.perf_counter() - start:.1f}s)", flush=True)
    if total is None:
        raise ValueError("diagnose needs at least one batch, got none")
    n = float(total["tokens"])
    layers = []
    for i, config in enumerate(attention_configs(view)):
        layer = {"layer": i, "kind": config.kind, "topk": config.focus_topk}
        if "entropy" in total:
            layer["entropy"] = (total["entropy"][i] / max(n, 1.0)).tolist()
        if "routing" in total:
            layer["routing"] = _summarize({name: value[i] for name, value in total["routing"].items()}, top=top)
            layer["routing"]["groups"] = config.focus_groups
        layers.append(layer)
    return {"tokens": int(n), "uniform_entropy": float(total["uniform_entropy"]) / max(n, 1.0), "layers": layers}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _routing_only(graphdef, state, batch):
    model = nnx.merge(graphdef, state)
    with record_attention() as records:
        forward(model, batch)
    g, _ = routed_layers(records)
    return jax.lax.map(lambda g: _routing_sums(g, real_tokens(batch), None, None), g)


def routing_metrics(model, batch) -> dict[str, float]:
    """Cheap routing health for a training loop or a reproduction script: one forward pass on one batch.

    Args:
      model: a focal_jax Focus model (`Llama` / `GPT2`). batch: a dict with `inputs [B, T]` and optional
        `positions`, `segment_ids`.

    Returns:
      `{'dominance': mean over layers, 'dominance_max': max over layers, 'confidence': mean over layers,
      'dominance_l0': layer 0, ...}` (floats, ready for `MetricWriter.write`).
    """
    if not is_focus(model):
        kinds = sorted({c.kind for c in attention_configs(model)})
        raise ValueError(f"routing_metrics needs a Focus model (kind 'focus' or 'focal+focus'), got kind {kinds}")
    check_batch(batch, vocab_size=model.config.vocab_size, n_positions=getattr(model.config, "n_positions", None))
    graphdef, state = nnx.split(attention_view(model))
    sums = jax.device_get(_routing_only(graphdef, state, dict(batch)))
    if not sums["tokens"].any():
        raise ValueError("the batch holds no real tokens (segment_ids are 0 everywhere)")
    layers = [_summarize({name: value[i] for name, value in sums.items()}) for i in range(len(sums["tokens"]))]
    dominance = [layer["dominance"] for layer in layers]
    out = {"dominance": float(np.mean(dominance)), "dominance_max": float(np.max(dominance)),
           "confidence": float(np.mean([layer["confidence"] for layer in layers]))}
    out.update({f"dominance_l{i}": d for i, d in enumerate(dominance)})
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tables and figure
# ----------------------------------------------------------------------------------------------------------------


def _token_text(token_id, tokenizer):
    if tokenizer is None:
        return str(token_id)
    text = tokenizer.decode([token_id])
    return json.dumps(text, ensure_ascii=False)[1:-1].replace("|", "\\|").replace("`", "'") or f"<{token_id}>"


def format_routing_table(result: dict) -> str:
    """Markdown: one row per Focus layer with dominance, confidence, group sizes, long-range affinity and the mean
    attention entropy."""
    lines = ["| layer | dominance | 1/K | confidence | group sizes (%) | long-range affinity | chance | "
             "entropy (nats) |", "|---|---|---|---|---|---|---|---|"]
    for layer in result["layers"]:
        r = layer.get("routing")
        if not r or "sizes" not in r:
            continue
        sizes = " ".join(f"{100 * s:.0f}" for s in r["sizes"])
        entropy = f"{np.mean(layer['entropy']):.3f}" if "entropy" in layer else "-"
        lines.append(f"| {layer['layer']} | {r['dominance']:.3f} | {1 / r['groups']:.3f} | {r['confidence']:.3f} | "
                     f"{sizes} | {r.get('affinity', float('nan')):.3f} | {r.get('affinity_chance', float('nan')):.3f}"
                     f" | {entropy} |")
    return "\n".join(lines)


def format_top_tokens(result: dict, tokenizer=None, layers=None) -> str:
    """Markdown, the Focus paper's §5 table per Focus layer: each group's share of tokens and its most frequent
    tokens (decoded when a tokenizer is given) with counts; `layers` selects layer indices (default all)."""
    blocks = []
    for layer in result["layers"]:
        r = layer.get("routing")
        if not r or "top_tokens" not in r or (layers is not None and layer["layer"] not in layers):
            continue
        lines = [f"layer {layer['layer']}", "", "| group | share | top tokens |", "|---|---|---|"]
        for group, (share, tokens) in enumerate(zip(r["sizes"], r["top_tokens"])):
            listed = " ".join(f"`{_token_text(t, tokenizer)}` (x{c})" for t, c in tokens) or "-"
            lines.append(f"| G{group} | {100 * share:.1f}% | {listed} |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_entropy_table(result: dict) -> str:
    """Markdown: attention entropy (nats) per layer (rows) and head (columns), with the row mean and the entropy of
    uniform attention over the causal keys."""
    layers = [layer for layer in result["layers"] if "entropy" in layer]
    if not layers:
        return ""
    n_heads = len(layers[0]["entropy"])
    lines = ["| layer | kind | " + " | ".join(f"h{h}" for h in range(n_heads)) + " | mean |",
             "|---|---|" + "---|" * (n_heads + 1)]
    for layer in layers:
        kind = layer["kind"] + (f" top-{layer['topk']}" if layer.get("topk") else "")
        values = " | ".join(f"{e:.3f}" for e in layer["entropy"])
        lines.append(f"| {layer['layer']} | {kind} | {values} | {np.mean(layer['entropy']):.3f} |")
    lines.append(f"\nuniform attention over the causal keys: {result['uniform_entropy']:.3f} nats")
    return "\n".join(lines)


def plot_diagnostics(result: dict, path: str) -> str:
    """PNG: attention entropy per layer and head (heatmap) and, for Focus models, dominance per layer against
    perfect balance 1/K. Returns `path`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    entropy = [layer["entropy"] for layer in result["layers"] if "entropy" in layer]
    routed = [layer for layer in result["layers"] if layer.get("routing", {}).get("sizes")]
    panels = bool(entropy) + bool(routed)
    if not panels:
        raise ValueError("nothing to plot: the result has neither entropy nor routing statistics")
    fig = Figure(figsize=(6 * panels, 4.5))
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, panels, squeeze=False)[0])
    if entropy:
        ax = axes.pop(0)
        image = ax.imshow(np.asarray(entropy), aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(entropy[0])))
        ax.set_yticks(range(len(entropy)))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"attention entropy (nats; uniform {result['uniform_entropy']:.2f})")
        fig.colorbar(image, ax=ax)
    if routed:
        ax = axes.pop(0)
        ax.bar([layer["layer"] for layer in routed], [layer["routing"]["dominance"] for layer in routed])
        ax.set_xticks([layer["layer"] for layer in routed])
        ax.axhline(1 / routed[0]["routing"]["groups"], color="k", linestyle="--", label="1/K (balanced)")
        ax.set_ylim(0, 1)
        ax.set_xlabel("layer")
        ax.set_ylabel("share of the largest group")
        ax.set_title("group dominance")
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    """`python -m focal_jax.eval.diagnostics --workdir DIR [--step S] [--batches N] [--seq-len N] [--batch-size N]
    [--topk K] [--top N] [--no-entropy] [--mesh AXIS=N,...] [--out FILE.json] [--png FILE.png]`: group
    diagnostics and attention entropy of a trained run on held-out batches; prints the tables and returns the
    result."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.eval.diagnostics", description=main.__doc__)
    parser.add_argument("--workdir", required=True, help="a focal_jax training run directory")
    parser.add_argument("--step", type=int, default=None, help="a saved checkpoint step (default: the latest)")
    parser.add_argument("--batches", type=positive_int, default=4, help="held-out batches (default 4)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per row (default: the trained length)")
    parser.add_argument("--batch-size", type=positive_int, default=None,
                        help="rows per batch (default: the run's, scaled to keep the tokens per batch)")
    parser.add_argument("--topk", type=positive_int, default=None,
                        help="analyse the hard top-k form of a Focus model (default: as configured)")
    parser.add_argument("--top", type=positive_int, default=8, help="tokens per group in the top-token table")
    parser.add_argument("--no-entropy", action="store_true", help="skip the attention entropy")
    parser.add_argument("--mesh", type=mesh_shape, default=None, help=MESH_HELP)
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--png", help="write the entropy heatmap and dominance plot here")
    args = parser.parse_args(argv)
    for flag, path in (("--out", args.out), ("--png", args.png)):  # checked now, not after the evaluation
        if path and (problem := output_file_error(flag, path, make_folder=True)):
            parser.error(problem)
    mesh = evaluation_mesh(parser, args.mesh)
    try:
        run = load_run(args.workdir, n_batches=args.batches, seq_len=args.seq_len, batch_size=args.batch_size,
                       step=args.step, mesh=mesh)
    except ValueError as e:
        parser.error(str(e))
    model = run.model
    if args.topk is not None:
        if not is_focus(model):
            parser.error(f"--topk={args.topk} needs a Focus model; this one has attention kind "
                         f"{sorted({c.kind for c in attention_configs(model)})}")
        try:
            model = attention_view(model, focus_topk=args.topk)
        except ValueError as e:
            parser.error(f"--topk={args.topk}: {e}")
    if args.png and args.no_entropy and not is_focus(model):
        parser.error("--png with --no-entropy has nothing to plot for a model without Focus routing")
    if args.no_entropy and not is_focus(model):  # the routing tables below are all there is without the entropy
        parser.error(f"--no-entropy leaves nothing to report for a model without Focus layers (attention kind "
                     f"{sorted({c.kind for c in attention_configs(model)})}): drop --no-entropy for the entropy")
    print(f"diagnostics of {args.workdir} (step {run.step}): {batches_line(run, args.batches)}", flush=True)
    if note := untrained_positions_note(model, [run.seq_len], run.trained_seq_len, flag=False):
        print(f"diagnostics: {note}", flush=True)
    with on_mesh(mesh):
        result = diagnose(model, run.batches, top=args.top, entropy=not args.no_entropy, progress=True)
    result.update(workdir=args.workdir, step=run.step, seq_len=run.seq_len)
    if is_focus(model):
        print("\n" + format_routing_table(result) + "\n\n" + format_top_tokens(result, run.tokenizer))
    if not args.no_entropy:
        print("\n" + format_entropy_table(result))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    if args.png:
        print(f"wrote {plot_diagnostics(result, args.png)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
