"""`focal_jax.eval.diagnostics`: routing statistics against numpy on hand-made assignments, attention entropy
against the probabilities of `focal_jax.attention.reference`, the evaluation view, bad arguments, the command line."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax.attention import reference
from focal_jax.eval import diagnostics
from focal_jax.eval.diagnostics import (Run, attention_view, diagnose, format_entropy_table, format_routing_table,
                                        format_top_tokens, forward, group_stats, long_range_affinity, main,
                                        routing_metrics, top_tokens)
from focal_jax.nn.attention import record_attention
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig

from test_eval_perplexity import jit_init, segments_and_padding

VOCAB, K = 24, 3
FOCUS = {"focus_groups": K, "focus_dim": 4, "focus_window": 2, "focus_iters": 3}
ATTENTION = {  # the attention settings the model tests use, by name
    "dense": {"kind": "dense"},
    "focal_learned": {"kind": "focal_learned"},
    "focus_soft": {"kind": "focus", **FOCUS},
    "focal+focus_hard_top2": {"kind": "focal+focus", **FOCUS, "focus_topk": 2, "focal_t": 0.5},
}


def numpy_affinity(g, window, segment_ids, valid):
    """Mean g_i . g_j over pairs j < i - window of one segment, both valid, by a double loop; and their number."""
    total, pairs = 0.0, 0
    for b in range(g.shape[0]):
        for i in range(g.shape[1]):
            for j in range(i - window):
                if valid[b, i] and valid[b, j] and segment_ids[b, i] == segment_ids[b, j]:
                    total += float(np.dot(g[b, i], g[b, j]))
                    pairs += 1
    return total / pairs, pairs


def test_group_stats_on_a_hand_made_assignment():
    g = np.array([[[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6], [0.0, 0.0, 1.0]]])
    valid = np.array([[True, True, True, True, False]])  # the last token is padding
    stats = group_stats(g, valid)
    assert stats["tokens"] == 4
    np.testing.assert_allclose(stats["sizes"], [0.5, 0.25, 0.25])
    np.testing.assert_allclose(stats["dominance"], 0.5)
    np.testing.assert_allclose(stats["confidence"], (0.7 + 0.6 + 0.8 + 0.6) / 4, rtol=1e-6)
    np.testing.assert_allclose(stats["mass"], [0.4, 0.375, 0.225], rtol=1e-6)
    assert group_stats(g)["dominance"] == pytest.approx(0.4)  # with the padding token: 2 of 5 in groups 0 and 2


def test_long_range_affinity_and_top_tokens_equal_numpy():
    rng = np.random.default_rng(0)
    b, t, window = 3, 19, 2
    g = rng.dirichlet(np.full(K, 0.5), size=(b, t)).astype(np.float32)
    segment_ids = segments_and_padding(b, t, rng)
    valid = segment_ids != 0
    out = long_range_affinity(g, window=window, segment_ids=segment_ids, valid=valid)
    expected, pairs = numpy_affinity(g, window, segment_ids, valid)
    assert out["long_range_pairs"] == pairs > 0
    np.testing.assert_allclose(out["affinity"], expected, rtol=1e-5)
    np.testing.assert_allclose(out["affinity_chance"], np.sum(g[valid].mean(0) ** 2), rtol=1e-5)

    tokens = rng.integers(0, 6, (b, t))
    groups = np.argmax(g, -1)
    top = top_tokens(g, tokens, valid, n=2)
    for group in range(K):
        counts = np.bincount(tokens[valid & (groups == group)], minlength=6)
        best = sorted(range(6), key=lambda token: (-counts[token], token))[:2]
        assert top[group] == [[token, int(counts[token])] for token in best if counts[token] > 0]


def llama_config(name):
    """A 1-layer LLaMA with 2 heads (1 kv head, GQA, for 'focal_learned') and the attention `ATTENTION[name]`."""
    return LlamaConfig(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, intermediate=32,
                       n_kv_heads=1 if name == "focal_learned" else 2, attn=ATTENTION[name])


@functools.lru_cache(maxsize=None)
def small_llama(name):
    """The model of `llama_config(name)` with random parameters; built once per test module."""
    model = jit_init(lambda: Llama(llama_config(name), rngs=nnx.Rngs(1)))
    if name == "focal_learned":  # a temperature that varies with the tokens
        layer = model.layers[0].self_attn
        layer.w_tau[...] = jnp.asarray(np.random.default_rng(0).normal(size=layer.w_tau.shape) * 20.0, jnp.float32)
    return model


def abstract_llama(name):
    """The model of `llama_config(name)` with shapes only (nothing computed): for tests that never run it."""
    return nnx.eval_shape(lambda: Llama(llama_config(name), rngs=nnx.Rngs(1)))


def packed_batch(rng, b=2, t=14):
    segment_ids = np.ones((b, t), np.int32)
    segment_ids[0, 6:] = 2
    segment_ids[1, 10:] = 0  # padding
    positions = np.zeros((b, t), np.int32)
    for row in range(b):
        for seg in np.unique(segment_ids[row]):
            where = segment_ids[row] == seg
            positions[row, where] = np.arange(where.sum())
    return {"inputs": rng.integers(1, VOCAB, (b, t)).astype(np.int32), "segment_ids": segment_ids,
            "positions": positions}


def reference_probabilities(config, layer, record, segment_ids):
    """Attention probabilities `[B, T, H, T]` of one recorded layer from the naive references, attending one-hot
    values (each reference compiled as one function: faster than op by op)."""
    q, k, x = record["q"], record["k"], record["x"]
    b, t = q.shape[:2]
    eye = jnp.broadcast_to(jnp.eye(t)[:, None, :], (b, t, config.n_kv_heads, t))
    temperature = config.focal_t if config.kind == "focal+focus" else 1.0
    if config.kind == "focal_learned":
        tau = reference.learned_temperature(x, layer.w_tau[...], tau_min=config.tau_min, tau_max=config.tau_max,
                                            mode="prefix", bias=float(layer.tau_bias[...]), segment_ids=segment_ids)
        attend = functools.partial(reference.attention, scale=1.0)
        return jax.jit(attend)(q, k, eye, temperature=tau[:, :, None], segment_ids=segment_ids)
    if config.focus_topk is None:
        attend = functools.partial(reference.focus_soft_attention, window=config.focus_window,
                                   gate=config.focus_gate, lam=config.focus_lam, temperature=temperature)
        return jax.jit(attend)(q, k, eye, record["g"], segment_ids=segment_ids)
    top = np.argsort(-np.asarray(record["g"]), -1, kind="stable")[..., :config.focus_topk]
    membership = np.zeros(record["g"].shape, bool)
    np.put_along_axis(membership, top, True, -1)
    attend = functools.partial(reference.focus_hard_attention, window=config.focus_window, temperature=temperature)
    return jax.jit(attend)(q, k, eye, membership, segment_ids=segment_ids)


def recorded_layers(model, batch):
    """Each attention layer's recorded input `x`, `q`, `k` and (Focus) assignment `g` in a jitted forward of
    `batch`: a list, one dict per layer."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def recorded(state, batch):
        with record_attention() as records:
            forward(nnx.merge(graphdef, state), batch)
        return [{name: r[name] for name in ("x", "q", "k", "g") if name in r} for r in records]

    return recorded(state, batch)


def reference_entropy(layer, record, segment_ids):
    """The attention entropy `[B, T, H]` (float64, nats) of `layer`'s reference probabilities for `record`."""
    probs = np.asarray(reference_probabilities(layer.config, layer, record, segment_ids), np.float64)
    return -np.sum(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1.0)), 0.0), -1)


@pytest.mark.parametrize("name", ["focal_learned", "focus_soft", "focal+focus_hard_top2"])
def test_entropy_and_routing_of_a_model_equal_reference_computations(name):
    model = small_llama(name)
    layer = model.layers[0].self_attn
    batch = packed_batch(np.random.default_rng(2))
    result = diagnose(model, [batch], top=3)

    record = recorded_layers(model, batch)[0]
    valid = batch["segment_ids"] != 0
    entropy = reference_entropy(layer, record, batch["segment_ids"])
    np.testing.assert_allclose(result["layers"][0]["entropy"], entropy[valid].mean(0), rtol=1e-4, atol=1e-5)
    keys = [np.log(np.sum((batch["segment_ids"][b, :i + 1] == batch["segment_ids"][b, i])))
            for b, i in zip(*np.nonzero(valid))]
    np.testing.assert_allclose(result["uniform_entropy"], np.mean(keys), rtol=1e-5)
    assert "| layer | kind | h0 | h1 | mean |" in format_entropy_table(result)

    if "g" not in record:
        assert "routing" not in result["layers"][0]
        return
    g = np.asarray(record["g"])[valid]
    sizes = np.bincount(np.argmax(g, -1), minlength=K) / len(g)
    routing = result["layers"][0]["routing"]
    np.testing.assert_allclose(routing["sizes"], sizes, rtol=1e-6)
    np.testing.assert_allclose(routing["dominance"], sizes.max(), rtol=1e-6)
    np.testing.assert_allclose(routing["confidence"], g.max(-1).mean(), rtol=1e-5)
    affinity, _ = numpy_affinity(np.asarray(record["g"]), 2, batch["segment_ids"], valid)
    np.testing.assert_allclose(routing["affinity"], affinity, rtol=1e-5)
    assert len(routing["top_tokens"]) == K and "| G0 |" in format_top_tokens(result)
    assert format_routing_table(result).splitlines()[2].startswith(f"| 0 | {sizes.max():.3f} |")
    metrics = routing_metrics(model, batch)
    np.testing.assert_allclose([metrics["dominance"], metrics["dominance_l0"]], sizes.max(), rtol=1e-6)


def test_attention_view_shares_parameters_and_leaves_the_model_alone():
    model = abstract_llama("focus_soft")
    view = attention_view(model, focus_topk=2, impl="decomposed")
    assert view.layers[0].self_attn.config.focus_topk == 2 and view.config.attention.impl == "decomposed"
    assert model.layers[0].self_attn.config.focus_topk is None and model.config.attention.impl == "xla"
    assert view.layers[0].self_attn.centroids.get_value() is model.layers[0].self_attn.centroids.get_value()
    with pytest.raises(ValueError, match=r"focus_topk=4 must be <= focus_groups=3"):
        attention_view(model, focus_topk=4)


def test_bad_arguments_name_the_value():
    dense = abstract_llama("dense")
    batch = packed_batch(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"needs a Focus model.*\['dense'\]"):
        routing_metrics(dense, batch)
    with pytest.raises(ValueError, match=r"g must have shape \[batch, seq, K\].*\(4, 3\)"):
        group_stats(np.ones((4, 3)))
    with pytest.raises(ValueError, match=r"valid must have shape.*\(1, 4\).*\(1, 5\)"):
        group_stats(np.ones((1, 4, 3)), np.ones((1, 5), bool))
    with pytest.raises(ValueError, match=r"n=0"):
        top_tokens(np.ones((1, 4, 3)), np.ones((1, 4), int), n=0)
    with pytest.raises(ValueError, match=r"window=-1"):
        long_range_affinity(np.ones((1, 4, 3)), window=-1)
    with pytest.raises(ValueError, match=r"at least one batch"):
        diagnose(dense, [])
    with pytest.raises(ValueError, match=r"batch\['inputs'\] must have shape \[batch, seq\]"):
        diagnose(dense, [{"inputs": np.ones(5, np.int32)}])
    gpt2 = nnx.eval_shape(lambda: GPT2(GPT2Config(vocab_size=VOCAB, n_positions=8, d_model=8, n_layers=1,
                                                  n_heads=2), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"position 8, outside .*\[0, n_positions=8\)"):  # else NaN statistics
        diagnose(gpt2, [{"inputs": np.ones((1, 9), np.int32), "segment_ids": np.ones((1, 9), np.int32)}])


def test_command_line_prints_and_writes_the_tables(tmp_path, capsys, monkeypatch):
    """The command line on a run (the model and batch of the tests above, so nothing new compiles); loading a
    training workdir is `load_run`, which tests/test_eval_perplexity.py runs on a real one."""
    model, batch = small_llama("focus_soft"), packed_batch(np.random.default_rng(2))
    run = Run(model=model, tokenizer=None, batches=[batch], seq_len=14, trained_seq_len=14, step=7)
    monkeypatch.setattr(diagnostics, "load_run", lambda workdir, **kwargs: run)
    out, png = str(tmp_path / "diag.json"), str(tmp_path / "diag.png")
    result = main(["--workdir", "RUN", "--batches", "1", "--out", out, "--png", png])
    printed = capsys.readouterr().out
    assert "| layer | dominance |" in printed and "| G0 |" in printed and "| h0 | h1 |" in printed
    routing = result["layers"][0]["routing"]
    assert 1 / K <= routing["dominance"] <= 1 and len(routing["top_tokens"]) == K and result["step"] == 7
    assert all(e <= result["uniform_entropy"] + 1e-6 for e in result["layers"][0]["entropy"])
    with open(out) as f:
        assert json.load(f)["layers"][0]["routing"]["dominance"] == routing["dominance"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_each_layer_is_reported_from_its_own_routing_and_attention():
    """A 2-layer Focus model: layer i's routing statistics and entropy come from layer i's recorded assignment and
    probabilities; `routing_metrics` gives the mean, the max and each layer's dominance."""
    config = dataclasses.replace(llama_config("focus_soft"), n_layers=2)
    model = jit_init(lambda: Llama(config, rngs=nnx.Rngs(3)))
    batch = packed_batch(np.random.default_rng(4))
    result = diagnose(model, [batch], top=2)
    valid = batch["segment_ids"] != 0
    dominance = []
    for i, record in enumerate(recorded_layers(model, batch)):
        entropy = reference_entropy(model.layers[i].self_attn, record, batch["segment_ids"])
        np.testing.assert_allclose(result["layers"][i]["entropy"], entropy[valid].mean(0), rtol=1e-4, atol=1e-5)
        g = np.asarray(record["g"])[valid]
        sizes = np.bincount(np.argmax(g, -1), minlength=K) / len(g)
        np.testing.assert_allclose(result["layers"][i]["routing"]["sizes"], sizes, rtol=1e-6)
        np.testing.assert_allclose(result["layers"][i]["routing"]["confidence"], g.max(-1).mean(), rtol=1e-5)
        dominance.append(sizes.max())
    assert dominance[0] != dominance[1]  # the layers can be told apart
    assert result["layers"][0]["entropy"] != result["layers"][1]["entropy"]
    metrics = routing_metrics(model, batch)
    np.testing.assert_allclose([metrics["dominance_l0"], metrics["dominance_l1"]], dominance, rtol=1e-6)
    np.testing.assert_allclose(metrics["dominance"], np.mean(dominance), rtol=1e-6)
    np.testing.assert_allclose(metrics["dominance_max"], np.max(dominance), rtol=1e-6)


def test_long_range_affinity_leaves_out_padding_marked_by_valid_alone():
    """`valid` without segment ids (padding inside one segment): padding tokens are neither queries nor keys of the
    long-range pairs."""
    rng = np.random.default_rng(1)
    b, t, window = 2, 15, 2
    g = rng.dirichlet(np.full(K, 0.5), size=(b, t)).astype(np.float32)
    valid = np.ones((b, t), bool)
    valid[0, 10:] = False
    valid[1, [0, 7, 8]] = False
    out = long_range_affinity(g, window=window, valid=valid)
    expected, pairs = numpy_affinity(g, window, np.ones((b, t), np.int32), valid)
    assert out["long_range_pairs"] == pairs > 0
    np.testing.assert_allclose(out["affinity"], expected, rtol=1e-5)
