"""`focal_jax.eval.perplexity`: loss and perplexity against a naive per-document computation, hard top-k against
dense attention, pairs retained against the naive dense mask of `focal_jax.attention.reference` (with an attention
sink, plus the first tokens of each document), bad arguments, and the command line against the trainer's own
held-out loss."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax import attention as fa
from focal_jax.attention import reference
from focal_jax.eval import perplexity
from focal_jax.eval.diagnostics import attention_configs, attention_view, forward, load_run
from focal_jax.eval.perplexity import evaluate_model, format_table, main, pair_counts, topk_table
from focal_jax.nn.attention import record_attention
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.train import train
from focal_jax.train.config import default_config
from focal_jax.train.metrics import read_metrics
from focal_jax.train.trainer import load_model

VOCAB, DOC_LEN, K, WINDOW = 32, 10, 4, 3


def topk_numpy(g, k):
    """bool [B, T, K]: the k largest entries of each row (numpy argsort; random g has no ties)."""
    top = np.argsort(-np.asarray(g), axis=-1, kind="stable")[..., :k]
    membership = np.zeros(np.shape(g), bool)
    np.put_along_axis(membership, top, True, axis=-1)
    return membership


def causal_pairs(segment_ids, valid):
    """bool [B, T, T]: j <= i, same segment, both real (numpy)."""
    t = segment_ids.shape[1]
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    return (j <= i)[None] & (segment_ids[:, :, None] == segment_ids[:, None, :]) & valid[:, :, None] & valid[:, None]


@pytest.fixture(scope="module")
def model():
    """A 2-layer Focus LLaMA (soft gate, GQA, RoPE) with random parameters, K=4 groups, window 3."""
    config = LlamaConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate=64,
                         attn={"kind": "focus", "focus_groups": K, "focus_dim": 8, "focus_window": WINDOW,
                               "focus_iters": 3})
    return jit_init(lambda: Llama(config, rngs=nnx.Rngs(0)))


def jit_init(make):
    """`make()` with its parameters initialised by one compiled function (much faster than eagerly on CPU)."""
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1])())


def packed(docs, masked=()):
    """The trainer's batch of 3 documents [3, DOC_LEN] packed into 2 rows of 2 * DOC_LEN: docs 0 and 1 in row 0,
    doc 2 then padding in row 1. `masked`: (doc, position) pairs whose target is left out of the loss."""
    t = 2 * DOC_LEN
    batch = {key: np.zeros((2, t), np.int32) for key in ("inputs", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = np.zeros((2, t), np.float32)
    for doc, (row, start) in enumerate([(0, 0), (0, DOC_LEN), (1, 0)]):
        cols = slice(start, start + DOC_LEN)
        batch["inputs"][row, cols] = docs[doc]
        batch["targets"][row, start:start + DOC_LEN - 1] = docs[doc][1:]
        batch["segment_ids"][row, cols] = 1 + start // DOC_LEN
        batch["positions"][row, cols] = np.arange(DOC_LEN)
        batch["loss_mask"][row, start:start + DOC_LEN - 1] = 1.0
        for d, p in masked:
            if d == doc:
                batch["loss_mask"][row, start + p] = 0.0
    return batch


def test_loss_and_perplexity_equal_a_naive_per_document_computation(model):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, VOCAB, (3, DOC_LEN)).astype(np.int32) for _ in range(2)]
    masked = [(), [(0, 2), (2, 0), (2, 5), (1, 8)]]  # the second batch also leaves some targets out
    graphdef, state = nnx.split(model)
    alone = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))  # each document as its own row

    total, count = 0.0, 0
    for doc_set, drop in zip(docs, masked):
        logits = np.asarray(alone(state, jnp.asarray(doc_set)), np.float64)  # [3, DOC_LEN, V]
        log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                           keepdims=True)) - logits.max(-1, keepdims=True)
        for d in range(3):
            for p in range(DOC_LEN - 1):
                if (d, p) not in drop:
                    total -= log_probs[d, p, doc_set[d, p + 1]]
                    count += 1
    result = evaluate_model(model, [packed(d, m) for d, m in zip(docs, masked)])
    assert result["tokens"] == count == 2 * 27 - 4
    np.testing.assert_allclose(result["loss"], total / count, rtol=1e-5)
    np.testing.assert_allclose(result["perplexity"], np.exp(total / count), rtol=1e-5)
    assert "pairs_retained" not in result and 0.25 <= result["dominance"] <= 1.0  # soft gate: no hard mask


def test_topk_table_hard_k_equals_K_is_dense_and_pairs_retained_match_the_dense_mask(model):
    rng = np.random.default_rng(1)
    batch = packed(rng.integers(1, VOCAB, (3, DOC_LEN)).astype(np.int32))
    rows = topk_table(model, [batch], topk=[1, K])
    assert [(r["form"], r["k"]) for r in rows] == [("soft", None), ("hard", 1), ("hard", K)]
    soft, hard1, hard_all = rows

    # Every group shared: the hard mask is the causal mask, so the loss is dense attention's with the same weights.
    dense = evaluate_model(attention_view(model, kind="dense"), [batch])
    np.testing.assert_allclose(hard_all["loss"], dense["loss"], rtol=1e-5)
    assert hard_all["pairs_retained"] == hard_all["distant_retained"] == 1.0
    assert soft["pairs_retained"] is None and hard1["loss"] != pytest.approx(dense["loss"], rel=1e-4)

    # k = 1: count each layer's retained pairs with the naive dense mask, from the routing of the hard forward.
    segment_ids = batch["segment_ids"]
    valid = segment_ids != 0
    causal = causal_pairs(segment_ids, valid)
    distant = causal & (np.arange(2 * DOC_LEN)[:, None] - np.arange(2 * DOC_LEN)[None, :] > WINDOW)[None]
    retained, distant_retained, dominance = [], [], []
    for g in layer_routings(attention_view(model, focus_topk=1), batch):
        mask = np.asarray(reference.focus_hard_mask(topk_numpy(g, 1), window=WINDOW, segment_ids=segment_ids))
        retained.append((mask & causal).sum() / causal.sum())
        distant_retained.append((mask & distant).sum() / distant.sum())
        sizes = np.bincount(np.argmax(np.asarray(g), -1)[valid], minlength=K)
        dominance.append(sizes.max() / sizes.sum())
    np.testing.assert_allclose(hard1["pairs_retained"], np.mean(retained), rtol=1e-12)
    np.testing.assert_allclose(hard1["distant_retained"], np.mean(distant_retained), rtol=1e-12)
    np.testing.assert_allclose(hard1["dominance"], np.mean(dominance), rtol=1e-12)
    assert hard1["pairs_retained"] < 1.0

    table = format_table(rows).splitlines()
    assert len(table) == 5 and table[3].startswith("| hard | 1 |") and "100.0%" in table[4]


def layer_routings(model, batch):
    """Each layer's routing g `[B, T, K]` in `model`'s forward on `batch` (`record_attention`)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def routing(state, batch):
        with record_attention() as records:
            forward(nnx.merge(graphdef, state), batch)
        return [r["g"] for r in records]

    return routing(state, batch)


def segments_and_padding(b, t, rng):
    """Segment ids with a non-contiguous id in row 0 (1 1 2 2 1 1 ...), packed segments elsewhere, and padding
    (id 0) at the end of the last row."""
    seg = np.ones((b, t), np.int32)
    seg[0] = np.where((np.arange(t) // 3) % 2 == 0, 1, 2)
    for row in range(1, b):
        for cut in np.sort(rng.choice(np.arange(1, t), size=2, replace=False)):
            seg[row, cut:] += 1
    seg[-1, t - 4:] = 0
    return seg


@pytest.mark.parametrize("k, method", [(1, "patterns"), (2, "patterns"), (3, "patterns"), (2, "blocks")])
def test_pair_counts_equal_counts_of_the_naive_dense_mask(k, method):
    rng = np.random.default_rng(k)
    b, t, window = 3, 17, 2
    g = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, t, K)) * 2.0, jnp.float32), axis=-1)
    segment_ids = segments_and_padding(b, t, rng)
    valid = segment_ids != 0
    counts = jax.jit(pair_counts, static_argnames=("k", "window", "method"))(
        g, k=k, window=window, segment_ids=segment_ids, valid=valid, method=method)

    causal = causal_pairs(segment_ids, valid)
    mask = np.asarray(reference.focus_hard_mask(topk_numpy(g, k), window=window, segment_ids=segment_ids)) & causal
    distant = causal & (np.arange(t)[:, None] - np.arange(t)[None, :] > window)[None]
    expected = {"causal": causal.sum(-1), "retained": mask.sum(-1), "distant": distant.sum(-1),
                "distant_retained": (mask & distant).sum(-1)}
    for name, value in expected.items():
        np.testing.assert_array_equal(np.asarray(counts[name]), value, err_msg=name)
    if 2 * k <= K:  # a non-trivial case: some distant pairs are dropped, some kept
        assert 0 < expected["distant_retained"].sum() < expected["distant"].sum()
    else:  # any two k-subsets of K < 2k groups intersect
        np.testing.assert_array_equal(expected["retained"], expected["causal"])


def test_bad_arguments_name_the_value(model):
    batch = packed(np.ones((3, DOC_LEN), np.int32))
    with pytest.raises(ValueError, match=r"K=4.*got k=5"):
        topk_table(model, [batch], topk=[1, 5])
    with pytest.raises(ValueError, match=r"topk='all' needs a Focus model.*'dense'"):
        topk_table(attention_view(model, kind="dense"), [batch], topk="all")
    with pytest.raises(ValueError, match=r"topk='one'"):
        topk_table(model, [batch], topk="one")
    with pytest.raises(ValueError, match=r"k must be an integer with 1 <= k <= K=4, got k=0"):
        pair_counts(jnp.ones((1, 4, K)), 0, window=1)
    with pytest.raises(ValueError, match=r"method=.fast."):
        pair_counts(jnp.ones((1, 4, K)), 1, window=1, method="fast")
    with pytest.raises(ValueError, match=r"sink must be an integer >= 0, got sink=-1"):
        pair_counts(jnp.ones((1, 4, K)), 1, window=1, sink=-1)
    with pytest.raises(ValueError, match=r"method='patterns' counts at most K=30 groups, got K=32"):  # int32 bits
        pair_counts(jnp.ones((1, 4, 32)), 1, window=1, method="patterns")
    with pytest.raises(ValueError, match=r"lacks key\(s\) \['targets'\]"):
        evaluate_model(model, [{"inputs": batch["inputs"], "loss_mask": batch["loss_mask"]}])
    # ids outside the vocabulary: NaN logits in the jitted forward; a target scored as the logits' log-sum-exp
    for key, value in (("inputs", VOCAB), ("targets", VOCAB), ("targets", -1)):
        bad = {**batch, key: batch[key].copy()}
        bad[key][0, 1] = value
        with pytest.raises(ValueError, match=rf"batch\['{key}'\] holds token id {value}, outside .*\[0, {VOCAB}\)"):
            evaluate_model(model, [bad])
    with pytest.raises(ValueError, match="no target tokens"):  # no batches: a ValueError, not a ZeroDivisionError
        evaluate_model(model, [])
    unscored = {**batch, "targets": batch["targets"].copy()}
    unscored["targets"][1, -1] = -1  # a target the loss mask leaves out may be anything
    assert unscored["loss_mask"][1, -1] == 0
    evaluate_model(model, [unscored])


def gpt2_batch(t, positions=None, segment_ids=None):
    """A batch of 2 random rows of `t` tokens for `tiny_gpt2`, every next token scored."""
    tokens = np.random.default_rng(8).integers(0, VOCAB, (2, t)).astype(np.int32)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1), "loss_mask": np.ones((2, t), np.float32)}
    for key, value in (("positions", positions), ("segment_ids", segment_ids)):
        if value is not None:
            batch[key] = np.broadcast_to(np.asarray(value, np.int32), (2, t)).copy()
    return batch


def tiny_gpt2(n_positions=16):
    """A 1-layer GPT-2 with random parameters and a position table of `n_positions` rows."""
    return jit_init(lambda: GPT2(GPT2Config(vocab_size=VOCAB, n_positions=n_positions, d_model=16, n_layers=1,
                                            n_heads=2), rngs=nnx.Rngs(0)))


def test_positions_past_gpt2s_position_table_are_refused():
    """GPT-2's learned position table has n_positions rows: a position past it (given, or derived from the segment
    ids) would be a NaN embedding in the jitted forward and a NaN loss (perplexity reported as inf); refused,
    naming the position. Packed documents of at most n_positions tokens each, in a longer row, are evaluated."""
    gpt2, t = tiny_gpt2(16), 20
    one_document = np.arange(t) >= 3  # 3 padding tokens, then a document of 17 tokens at positions 0..16
    for batch in (gpt2_batch(t, positions=np.arange(t)), gpt2_batch(t, segment_ids=one_document)):
        with pytest.raises(ValueError, match=r"position 16, outside .*\[0, n_positions=16\)"):
            evaluate_model(gpt2, [batch])
    packed_docs = np.arange(t) >= 10  # two documents of 10 tokens
    result = evaluate_model(gpt2, [gpt2_batch(t, positions=np.arange(t) % 10, segment_ids=1 + packed_docs)])
    assert np.isfinite(result["loss"]) and result["tokens"] == 2 * t


def test_progress_lines_end_with_the_last_batch(model, capsys):
    """Every tenth of the batches, and the last one whatever the count (21 batches: 2, 4, ..., 20, 21)."""
    batch = packed(np.ones((3, DOC_LEN), np.int32))
    whole = evaluate_model(model, [batch] * 21, progress="eval")
    lines = [line for line in capsys.readouterr().out.splitlines() if "eval: batch" in line]
    assert [line.split("batch ")[1].split(",")[0] for line in lines] == [f"{i}/21" for i in (*range(2, 21, 2), 21)]
    assert f"loss so far {whole['loss']:.4f}" in lines[-1]


def test_a_nan_loss_has_a_nan_perplexity():
    """A model with NaN parameters (a diverged run): its perplexity is NaN, not infinite (a finite, huge loss)."""
    gpt2 = tiny_gpt2(16)
    nnx.update(gpt2, jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), nnx.state(gpt2, nnx.Param)))
    result = evaluate_model(gpt2, [gpt2_batch(10)])
    assert np.isnan(result["loss"]) and np.isnan(result["perplexity"])


def test_rows_within_the_window_report_no_distant_share(model):
    """Rows of at most window + 1 tokens hold no distant pair: the share retained is undefined ('-'), not 0%."""
    tokens = np.random.default_rng(4).integers(1, VOCAB, (2, WINDOW + 1)).astype(np.int32)
    batch = {"inputs": tokens, "targets": np.roll(tokens, -1, axis=1),
             "loss_mask": np.ones(tokens.shape, np.float32)}
    rows = topk_table(model, [batch], topk=[1])
    hard = rows[1]
    assert hard["pairs_retained"] == 1.0 and hard["distant_retained"] is None
    assert hard["distant_retained_per_layer"] == [None, None]
    assert format_table(rows).splitlines()[3].split(" | ")[5] == "-"


FOCUS_ATTN = {"kind": "focus", "focus_groups": 3, "focus_window": 8, "focus_iters": 3}


def tiny_focus_run(tmp_path, attn=FOCUS_ATTN, steps=1) -> str:
    """A training run (`steps` steps, a checkpoint and a held-out loss at every step) of a 1-layer LLaMA (Focus
    unless `attn` says otherwise) on synthetic documents (the smallest config that compiles quickly); returns the
    workdir."""
    config = default_config()
    config.update(total_steps=steps, batch_size=8, log_every=1, eval_every=1, eval_batches=1, ckpt_every=1,
                  compute_dtype="float32")
    config.model = {"family": "llama", "vocab_size": 320, "d_model": 32, "n_layers": 1, "n_heads": 2,
                    "intermediate": 64, "attn": attn}
    config.data.update(source="synthetic", n_synthetic=100, eval_fraction=0.2, vocab_size=320, seq_len=32,
                       cache_dir=str(tmp_path / "tokenizers"))
    workdir = str(tmp_path / "run")
    train(config, workdir)
    return workdir


def test_command_line_on_a_training_workdir_matches_the_trainers_eval_loss(tmp_path):
    workdir = tiny_focus_run(tmp_path)
    trainer_loss = read_metrics(workdir, kind="eval")[-1]["loss"]  # the trainer's evaluate on the same batch

    out = str(tmp_path / "ppl.json")
    rows = main(["--workdir", workdir, "--batches", "1", "--topk", "1", "--out", out])
    assert [(r["form"], r["k"]) for r in rows] == [("soft", None), ("hard", 1)]
    np.testing.assert_allclose(rows[0]["loss"], trainer_loss, rtol=1e-5)
    assert 0 < rows[1]["pairs_retained"] < 1
    with open(out) as f:
        saved = json.load(f)
    assert saved["rows"][1]["loss"] == rows[1]["loss"] and saved["settings"]["seq_len"] == 32
    assert saved["settings"]["impl"] is None  # the model's own
    assert saved["settings"]["topk"] == "1" and saved["settings"]["batch_size"] == 8
    assert saved["settings"]["workdir"] == os.path.abspath(workdir)


def test_command_line_step_and_window(tmp_path, capsys):
    """`--step` evaluates an intermediate checkpoint (the trainer's held-out loss at that step); `--window` the
    weights under a sliding window (a model built with that window and given the same parameters)."""
    workdir = tiny_focus_run(tmp_path, attn={"kind": "dense"}, steps=2)
    trainer_losses = {r["step"]: r["loss"] for r in read_metrics(workdir, kind="eval")}
    assert trainer_losses[1] != trainer_losses[2]
    for step in (1, 2):
        rows = main(["--workdir", workdir, "--batches", "1", "--step", str(step)])
        np.testing.assert_allclose(rows[0]["loss"], trainer_losses[step], rtol=1e-5)
    with pytest.raises(SystemExit):
        main(["--workdir", workdir, "--step", "5"])

    windowed = main(["--workdir", workdir, "--batches", "1", "--window", "3"])[0]["loss"]
    assert main(["--workdir", workdir, "--batches", "1", "--window", "40"])[0]["loss"] == pytest.approx(
        trainer_losses[2], rel=1e-5)  # a window longer than the rows changes nothing
    loaded = load_model(workdir)
    built = Llama(dataclasses.replace(loaded.config, attn={"kind": "dense", "window": 3}), rngs=nnx.Rngs(1))
    nnx.update(built, nnx.state(loaded))
    batches = load_run(workdir, n_batches=1).batches
    np.testing.assert_allclose(windowed, evaluate_model(built, batches)["loss"], rtol=1e-5)
    assert abs(windowed - trainer_losses[2]) > 1e-3
    # at another length the default batch keeps the tokens per batch of training (8 rows of 32 -> 16 rows of 16)
    half = load_run(workdir, n_batches=2, seq_len=16)
    assert [b["inputs"].shape for b in half.batches] == [(16, 16)] * 2 and half.trained_seq_len == 32
    assert load_run(workdir, n_batches=1, seq_len=16, batch_size=3).batches[0]["inputs"].shape == (3, 16)
    # the held-out rows bound the batches; a batch size larger than them is refused
    rows = len(load_run(workdir, n_batches=10**6, batch_size=1).batches)  # one row per batch: every held-out row
    assert 8 < rows < 200
    with pytest.raises(ValueError, match=f"batch_size={rows + 1} is more than the held-out rows: the held-out "
                                         f"documents pack into {rows} rows of 32 tokens; give a batch size of at "
                                         f"most {rows}"):
        load_run(workdir, n_batches=1, batch_size=rows + 1)
    with pytest.raises(ValueError, match=f"batch_size={10**6} is more than the held-out rows"):  # (than the training
        load_run(workdir, n_batches=1, batch_size=10**6)  # rows too, which an evaluation does not need to fill)
    capsys.readouterr()
    main(["--workdir", workdir, "--batches", "1000"])
    assert f"{-(-rows // 8)} batches of (8, 32) tokens (trained at 32); the held-out rows fill {-(-rows // 8)} of " \
           f"the 1000 batches asked" in capsys.readouterr().out


def test_topk_table_rows_evaluate_the_forms_they_name(model, monkeypatch):
    """Which attention each row evaluates (the view's config when `evaluate_model` is called, stubbed): 'all' is
    k = 1..K; the soft row is the training form (focus_topk=None, 'xla') even for a model configured hard; `impl`
    applies to the hard rows, which default to the model's own hard path."""
    seen = []

    def stub(view, batches, **kwargs):
        config = attention_configs(view)[0]
        seen.append((config.focus_topk, config.impl))
        return {"loss": 1.0, "perplexity": float(np.e), "tokens": 1}

    monkeypatch.setattr(perplexity, "evaluate_model", stub)
    batch = packed(np.ones((3, DOC_LEN), np.int32))
    rows = topk_table(model, [batch], topk="all")
    assert [(r["form"], r["k"]) for r in rows] == [("soft", None)] + [("hard", k) for k in range(1, K + 1)]
    assert seen == [(None, "xla")] + [(k, "xla") for k in range(1, K + 1)]
    hard = attention_view(model, focus_topk=2, impl="decomposed")
    for impl, want in ((None, "decomposed"), ("xla", "xla")):
        seen.clear()
        topk_table(hard, [batch], topk="3,1", impl=impl)
        assert seen == [(None, "xla"), (1, want), (3, want)], impl


def sink_keys_numpy(segment_ids, sink):
    """bool [B, 1, T]: key j is among the first `sink` tokens of its segment (FOCUS_SPEC OQ-12; numpy)."""
    t = segment_ids.shape[1]
    earlier = np.arange(t)[None, :] < np.arange(t)[:, None]  # [T, T]: token i, earlier token j
    earlier_same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & earlier
    return (earlier_same.sum(-1) < sink)[:, None, :]


@pytest.mark.parametrize("k, method", [(1, "patterns"), (2, "patterns"), (1, "blocks")])
def test_pair_counts_keep_the_sink_keys_of_each_segment(k, method):
    """`sink=2`: the first 2 tokens of each segment are retained for every later query of their segment, local or
    not, sharing a group or not: the counts of a naive numpy mask, which keeps more distant pairs than without the
    sink; without segment ids, those of `focus_mask(sink=2)` (the first 2 tokens of the row)."""
    rng = np.random.default_rng(10 + k)
    b, t, window, sink = 3, 17, 2, 2
    g = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, t, K)) * 2.0, jnp.float32), axis=-1)
    segment_ids = segments_and_padding(b, t, rng)
    valid = segment_ids != 0
    count = jax.jit(pair_counts, static_argnames=("k", "window", "sink", "method"))
    membership = topk_numpy(g, k)
    for ids, real in ((segment_ids, valid), (None, None)):
        seg = np.ones((b, t), np.int32) if ids is None else ids
        causal = causal_pairs(seg, np.ones((b, t), bool) if real is None else real)
        plain = np.asarray(reference.focus_hard_mask(membership, window=window, segment_ids=ids)) & causal
        if ids is None:
            mask = np.asarray(fa.focus_mask(jnp.asarray(membership), window=window, sink=sink)) & causal
        else:
            mask = (plain | sink_keys_numpy(seg, sink)) & causal
        distant = causal & (np.arange(t)[:, None] - np.arange(t)[None, :] > window)[None]
        expected = {"causal": causal.sum(-1), "retained": mask.sum(-1), "distant": distant.sum(-1),
                    "distant_retained": (mask & distant).sum(-1)}
        counts = count(g, k=k, window=window, segment_ids=ids, valid=real, sink=sink, method=method)
        for name, value in expected.items():
            np.testing.assert_array_equal(np.asarray(counts[name]), value, err_msg=f"{ids is None}: {name}")
        assert expected["distant_retained"].sum() > (plain & distant).sum()


def test_a_hard_model_with_a_sink_counts_the_pairs_its_sink_keeps(model):
    """`evaluate_model` counts a hard Focus model's pairs with its own `focus_sink`: those of the naive mask of each
    layer's routing plus the first 2 tokens of each document, more than the same model without a sink keeps."""
    batch = packed(np.random.default_rng(6).integers(1, VOCAB, (3, DOC_LEN)).astype(np.int32))
    view = attention_view(model, focus_topk=1, focus_sink=2)
    result = evaluate_model(view, [batch])
    segment_ids = batch["segment_ids"]
    causal = causal_pairs(segment_ids, segment_ids != 0)
    retained = []
    for g in layer_routings(view, batch):
        mask = np.asarray(reference.focus_hard_mask(topk_numpy(g, 1), window=WINDOW, segment_ids=segment_ids))
        retained.append(((mask | sink_keys_numpy(segment_ids, 2)) & causal).sum() / causal.sum())
    np.testing.assert_allclose(result["pairs_retained"], np.mean(retained), rtol=1e-12)
    assert result["pairs_retained"] > evaluate_model(attention_view(model, focus_topk=1), [batch])["pairs_retained"]


def test_pair_counts_leave_out_padding_marked_by_valid_alone():
    """`valid` without segment ids (padding inside one segment, as a caller may pass it): a padding query counts no
    pair of any kind and no query counts a padding key, for both counting methods."""
    rng = np.random.default_rng(7)
    b, t, window = 2, 13, 2
    g = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, t, K)) * 2.0, jnp.float32), axis=-1)
    valid = np.ones((b, t), bool)
    valid[0, 9:] = False
    valid[1, [0, 5, 6]] = False
    one_segment = np.ones((b, t), np.int32)
    causal = causal_pairs(one_segment, valid)
    mask = np.asarray(reference.focus_hard_mask(topk_numpy(g, 1), window=window)) & causal
    distant = causal & (np.arange(t)[:, None] - np.arange(t)[None, :] > window)[None]
    expected = {"causal": causal.sum(-1), "retained": mask.sum(-1), "distant": distant.sum(-1),
                "distant_retained": (mask & distant).sum(-1)}
    assert expected["distant_retained"].sum() > 0
    for method in ("patterns", "blocks"):
        counts = jax.jit(pair_counts, static_argnames=("k", "window", "method"))(g, k=1, window=window, valid=valid,
                                                                                  method=method)
        for name, value in expected.items():
            np.testing.assert_array_equal(np.asarray(counts[name]), value, err_msg=f"{method}: {name}")
