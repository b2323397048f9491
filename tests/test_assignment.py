"""The reproduction features: learned-temperature mean mode (prefix / sequence), softmax group assignment, the
balance loss, dominance in the trainer's eval records, and the Focus attention sink of the model layer."""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax import attention as fa
from focal_jax.attention import reference
from focal_jax.nn.attention import Attention, AttentionConfig, check_decodable, record_attention
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, focal_config
from focal_jax.nn.retrofit import FocalConfig, FocusConfig, replace_attention, retrofit
from focal_jax.train import train
from focal_jax.train.config import check_config, config_differences
from focal_jax.train.metrics import read_metrics
from focal_jax.train.optimizer import OptimConfig, make_optimizer, split_trainable
from focal_jax.train.trainer import balance_loss, group_counts, make_steps, real_token_mask, routing_param_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llama(**attn):
    return Llama(focal_config("tiny", vocab_size=64, attn=attn), rngs=nnx.Rngs(0))


def _learned_model(mode):
    model = _llama(kind="focal_learned", tau_mode=mode)
    # A non-zero w_tau, so that tau varies with the tokens (it starts at zero).
    for layer in model.layers:
        w = layer.self_attn.w_tau
        w[...] = 2.0 * jax.random.normal(jax.random.key(1), w[...].shape)
    return model


@pytest.mark.parametrize("mode", ["prefix", "sequence"])
def test_tau_mode_causality(mode):
    """FOCAL_SPEC §10: perturbing tokens after position i leaves outputs <= i unchanged in prefix mode; the
    paper's sequence mean changes them (the leak)."""
    model = _learned_model(mode)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
    i = 7
    perturbed = tokens.at[:, i + 1:].set((tokens[:, i + 1:] + 17) % 64)
    a, b = model(tokens), model(perturbed)
    diff = float(jnp.max(jnp.abs(a[:, :i + 1] - b[:, :i + 1])))
    if mode == "prefix":
        assert diff < 1e-5
    else:
        assert diff > 1e-4
    assert float(jnp.max(jnp.abs(a[:, i + 1:] - b[:, i + 1:]))) > 1e-4  # the perturbation does reach later outputs


def test_sequence_mode_cannot_decode_and_is_a_retrofit_option():
    config = AttentionConfig(d_model=8, n_heads=2, n_kv_heads=2, head_dim=4, kind="focal_learned",
                             tau_mode="sequence")
    with pytest.raises(ValueError, match="tau_mode='sequence'"):
        check_decodable(config)
    check_decodable(dataclasses.replace(config, tau_mode="prefix"))
    check_decodable(dataclasses.replace(config, tau_mode="token"))
    with pytest.raises(ValueError, match="tau_mode='window'"):
        dataclasses.replace(config, tau_mode="window")
    model = retrofit(_llama(), FocalConfig(learned=True, tau_mode="sequence"))
    assert {layer.self_attn.config.tau_mode for layer in model.layers} == {"sequence"}
    with pytest.raises(ValueError, match="tau_mode"):
        FocalConfig(t=0.4, tau_mode="sequence")


def test_tau_clip_is_a_layer_and_retrofit_option():
    """FOCAL_SPEC OQ-F4: with tau past tau_max the paper's hard clip passes no gradient to the temperature
    parameters; 'straight_through' computes the same forward with the identity gradient, 'smooth' another forward
    that is never flat. (The pure function had `clip=`; the layers always clipped hard.)"""
    tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, 64)

    def loss_and_grad(clip):
        model = _llama(kind="focal_learned", tau_min=1.0, tau_max=2.0, tau_clip=clip)
        for layer in model.layers:
            layer.self_attn.tau_bias[...] = jnp.asarray(3.0)  # every tau above tau_max
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(params):
            return jnp.mean(nnx.merge(graphdef, params, rest)(tokens) ** 2)
        value, grads = jax.value_and_grad(loss)(params)
        return value, float(jnp.abs(grads["layers"][0]["self_attn"]["tau_bias"][...]))

    (hard, hard_grad), (straight, straight_grad), (smooth, smooth_grad) = map(
        loss_and_grad, ("hard", "straight_through", "smooth"))
    assert hard == straight and hard_grad == 0 and straight_grad > 0
    assert smooth != hard and smooth_grad > 0
    with pytest.raises(ValueError, match=r"tau_clip='soft' is not one of \('hard', 'straight_through', 'smooth'\)"):
        AttentionConfig(d_model=8, n_heads=2, n_kv_heads=2, head_dim=4, kind="focal_learned", tau_clip="soft")
    model = retrofit(_llama(), FocalConfig(learned=True, tau_clip="smooth"))
    assert {layer.self_attn.config.tau_clip for layer in model.layers} == {"smooth"}
    with pytest.raises(ValueError, match="tau_clip='smooth' is for the learned temperature"):
        FocalConfig(t=0.4, tau_clip="smooth")


def _records(model, tokens):
    with record_attention() as records:
        logits = model(tokens)
    return logits, records


def test_a_per_head_temperature_with_equal_columns_is_the_per_layer_one():
    """FOCAL_SPEC OQ-F1: `tau_granularity='head'` has `w_tau [d_model, H]` and `tau_bias [H]`, one tau per token and
    head; with every column the per-layer weights (and the same bias) it computes the per-layer model's logits,
    and with columns of their own the heads' taus differ."""
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, 64)
    layer_model, head_model = _learned_model("prefix"), _llama(kind="focal_learned", tau_granularity="head")
    n_heads = head_model.config.attention.n_heads
    for i, (a, b) in enumerate(zip(layer_model.layers, head_model.layers)):
        a.self_attn.w_tau[...] = 0.2 * jax.random.normal(jax.random.key(20 + i), a.self_attn.w_tau.shape)
        assert b.self_attn.w_tau.shape == a.self_attn.w_tau.shape + (n_heads,)
        assert b.self_attn.tau_bias.shape == (n_heads,)
        b.self_attn.w_tau[...] = jnp.repeat(a.self_attn.w_tau[...][:, None], n_heads, axis=1)
    nnx.update(head_model, nnx.state(layer_model, nnx.Not(nnx.Any(nnx.PathContains("w_tau"),
                                                                   nnx.PathContains("tau_bias")))))
    (want, want_records), (got, got_records) = _records(layer_model, tokens), _records(head_model, tokens)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert got_records[0]["tau"].shape == (2, 12, n_heads)
    tau = want_records[0]["tau"]
    assert float(jnp.std(tau)) > 0.05 and float(tau.min()) > 5.0 and float(tau.max()) < 10.0  # inside the clip
    np.testing.assert_allclose(got_records[0]["tau"], jnp.repeat(want_records[0]["tau"][..., None], n_heads, -1),
                               atol=1e-6)
    w = head_model.layers[0].self_attn.w_tau
    w[...] = w[...] * jnp.arange(1.0, n_heads + 1)
    tau = _records(head_model, tokens)[1][0]["tau"]
    assert float(jnp.min(jnp.std(tau, axis=-1))) > 0.01


def test_the_residual_stream_feeds_tau_with_tau_input_residual():
    """FOCAL_SPEC OQ-F3: `tau_input='residual'` computes tau from the block's input (the first layer's: the token
    embeddings) rather than the normed attention input."""
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 0, 64)
    normed, residual = _learned_model("prefix"), _learned_model("prefix")
    residual = retrofit(residual, FocalConfig(learned=True, tau_input="residual"))  # the same parameters
    nnx.update(residual, nnx.state(normed))
    embeddings = normed.embed_tokens(tokens)
    layer = normed.layers[0].self_attn
    (_, normed_records), (_, residual_records) = _records(normed, tokens), _records(residual, tokens)
    for x, records in ((normed.layers[0].input_layernorm(embeddings), normed_records), (embeddings, residual_records)):
        want = reference.learned_temperature(x, layer.w_tau[...], tau_min=5.0, tau_max=10.0, mode="prefix",
                                             bias=float(layer.tau_bias[...]))
        np.testing.assert_allclose(records[0]["tau"], want, atol=1e-5)
    assert float(jnp.max(jnp.abs(normed_records[0]["tau"] - residual_records[0]["tau"]))) > 0.1
    layer = residual.layers[0].self_attn
    with pytest.raises(ValueError, match="tau_input='residual' computes tau from the residual stream: pass "
                                         "residual"):
        layer(embeddings, positions=jnp.broadcast_to(jnp.arange(12), (2, 12)))


def test_the_literal_temperature_has_no_bias_and_starts_clipped():
    """FOCAL_SPEC OQ-F4's literal mode, `tau_bias=False`: no offset, `w_tau ~ N(0, 0.02^2)`, so tau starts near 0
    and the hard clip holds it at tau_min (the dead zone the default's mid-range bias avoids)."""
    model = _llama(kind="focal_learned", tau_bias=False)
    d_model = model.config.d_model
    for layer in model.layers:
        assert not hasattr(layer.self_attn, "tau_bias") and layer.self_attn.w_tau.shape == (d_model,)
    w = jnp.concatenate([layer.self_attn.w_tau[...] for layer in model.layers])
    assert 0.015 < float(jnp.std(w)) < 0.025 and float(jnp.abs(jnp.mean(w))) < 0.005
    assert len(set(float(layer.self_attn.w_tau[0]) for layer in model.layers)) == len(model.layers)  # own draws
    tau = _records(model, jax.random.randint(jax.random.key(6), (2, 12), 0, 64))[1][0]["tau"]
    assert float(jnp.max(tau)) == 5.0
    literal = retrofit(_llama(), FocalConfig(learned=True, tau_bias=False, tau_granularity="head",
                                             tau_clip="straight_through"))
    assert literal.layers[0].self_attn.w_tau.shape == (d_model, model.config.attention.n_heads)
    assert not hasattr(literal.layers[0].self_attn, "tau_bias")
    for name, value in (("tau_granularity", "head"), ("tau_bias", False), ("tau_input", "residual")):
        with pytest.raises(ValueError, match=f"{name}={value!r} is for the learned temperature"):
            FocalConfig(t=0.4, **{name: value})
    for name, value, message in (("tau_granularity", "token", r"tau_granularity='token' is not one of \('layer', "
                                  r"'head'\)"), ("tau_bias", 1, "tau_bias must be a bool"),
                                 ("tau_input", "embeddings", r"tau_input='embeddings' is not one of \('normed', "
                                  r"'residual'\)")):
        with pytest.raises(ValueError, match=message):
            AttentionConfig(d_model=8, n_heads=2, n_kv_heads=2, head_dim=4, kind="focal_learned", **{name: value})


@pytest.mark.parametrize("normalize", [True, False])
def test_focus_routing_scores_are_cosine_or_raw_dot_products(normalize):
    """FOCUS_SPEC OQ-2: `focus_normalize=False` routes on the raw dot product `(x W_g) . c_k / tau` (the flag the
    spec asks for beside the cosine default); the layer's assignment is the reference Sinkhorn of those scores."""
    config = AttentionConfig(d_model=16, n_heads=2, n_kv_heads=2, head_dim=8, kind="focus", focus_groups=4,
                             focus_dim=8, focus_window=2, focus_normalize=normalize)
    layer = Attention(config, rngs=nnx.Rngs(0))
    layer.w_g[...] = 3.0 * layer.w_g[...]  # raw scores of another scale than the cosine ones
    x = jax.random.normal(jax.random.key(3), (2, 12, 16))
    with record_attention() as records:
        layer(x, positions=jnp.broadcast_to(jnp.arange(12), (2, 12)))
    scores = {n: reference.routing_scores(x, layer.w_g[...], layer.centroids[...], tau=0.1, normalize=n)
              for n in (True, False)}
    np.testing.assert_allclose(records[0]["g"], reference.sinkhorn(scores[normalize]), atol=1e-5)
    assert not np.allclose(records[0]["g"], reference.sinkhorn(scores[not normalize]), atol=1e-2)
    model = retrofit(_llama(), FocusConfig(groups=4, dim=8, window=4, normalize=normalize))
    assert {layer.self_attn.config.focus_normalize for layer in model.layers} == {normalize}
    with pytest.raises(ValueError, match="FocusConfig: normalize must be a bool, got normalize=1"):
        FocusConfig(groups=4, dim=8, window=4, normalize=1)


def test_softmax_assignment_rows_are_the_softmax_of_the_scores():
    config = AttentionConfig(d_model=16, n_heads=2, n_kv_heads=2, head_dim=8, kind="focus", focus_groups=4,
                             focus_dim=8, focus_window=2, focus_assign="softmax")
    layer = Attention(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (2, 12, 16))
    with record_attention() as records:
        layer(x, positions=jnp.broadcast_to(jnp.arange(12), (2, 12)))
    g = np.asarray(records[0]["g"])
    # Independent reference: cosine of the projected token and each centroid, / tau, softmax over groups (numpy).
    h = np.asarray(x) @ np.asarray(layer.w_g[...])
    c = np.asarray(layer.centroids[...])
    cos = (h / np.linalg.norm(h, axis=-1, keepdims=True)) @ (c / np.linalg.norm(c, axis=-1, keepdims=True)).T
    logits = cos / config.focus_tau
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(g.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(g, expected, atol=2e-5)
    # Sinkhorn balances the columns; the softmax does not (it equals the softmax, not a balanced matrix).
    sinkhorn = dataclasses.replace(config, focus_assign="sinkhorn")
    with record_attention() as records:
        layer.config = sinkhorn
        layer(x, positions=jnp.broadcast_to(jnp.arange(12), (2, 12)))
    assert not np.allclose(np.asarray(records[0]["g"]), expected, atol=1e-3)
    with pytest.raises(ValueError, match="focus_assign='hard'"):
        dataclasses.replace(config, focus_assign="hard")


def test_softmax_focus_decodes_without_causal_routing():
    config = AttentionConfig(d_model=8, n_heads=2, n_kv_heads=2, head_dim=4, kind="focus", focus_topk=1,
                             focus_assign="softmax")
    check_decodable(config)  # its rows depend on their own token only
    with pytest.raises(ValueError, match="focus_causal=False"):
        check_decodable(dataclasses.replace(config, focus_assign="sinkhorn"))


def test_balance_loss_equals_a_numpy_computation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 9, 4)) * 3
    g = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    valid = np.ones((2, 9))
    valid[1, 6:] = 0  # padding
    total, f, p = valid.sum(), np.zeros(4), np.zeros(4)
    for b in range(2):
        for t in range(9):
            if valid[b, t]:
                f[np.argmax(g[b, t])] += 1 / total
                p += g[b, t] / total
    expected = 4 * np.sum(f * p)
    np.testing.assert_allclose(float(balance_loss(jnp.asarray(g), jnp.asarray(valid))), expected, rtol=1e-5)
    # Bounds of the form: 1 at perfect balance (a uniform one-hot split), K when one group holds every token.
    even = np.eye(4)[np.arange(8) % 4][None]
    np.testing.assert_allclose(float(balance_loss(jnp.asarray(even), jnp.ones((1, 8)))), 1.0, rtol=1e-6)
    collapsed = np.eye(4)[np.zeros(8, int)][None]
    np.testing.assert_allclose(float(balance_loss(jnp.asarray(collapsed), jnp.ones((1, 8)))), 4.0, rtol=1e-6)


def test_balance_weight_enters_the_gradient_not_the_logged_loss():
    """With balance_weight > 0 the train step differentiates the LM loss plus the weighted balance loss: the same
    parameters and batch give the same logged loss and balance_loss at weights 1e-6 and 1, but other gradients."""
    model = retrofit(_llama(), FocusConfig(groups=4, dim=8, window=4, assign="softmax"))
    optim = OptimConfig(trainable="centroids", warmup_steps=0)
    graphdef, trainable, frozen = split_trainable(model, optim)
    tx = make_optimizer(optim, 10)
    b, t = 2, 16
    tokens = jax.random.randint(jax.random.key(0), (b, t + 1), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.tile(jnp.arange(t), (b, 1)),
             "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.float32)}
    metrics = {}
    for weight in (1e-6, 1.0):
        train_step, _ = make_steps(graphdef, tx, jnp.float32, balance_weight=weight)
        metrics[weight] = jax.jit(train_step)(trainable, tx.init(trainable), frozen, batch)[2]
    for name in ("loss", "balance_loss"):
        np.testing.assert_allclose(metrics[1.0][name], metrics[1e-6][name], rtol=1e-6, err_msg=name)
    assert abs(float(metrics[1.0]["grad_norm"]) - float(metrics[1e-6]["grad_norm"])) > 1e-4


def test_bf16_steps_keep_the_routing_and_temperature_parameters_in_float32(monkeypatch):
    """With bf16 compute the step cast every parameter to bf16, W_g, C, w_tau and tau_bias too: their products are
    float32 (`routing_scores`, `learned_temperature`), but from bf16-rounded values (routing scores up to 0.036
    off, tau up to 0.28%). They stay float32 now; the activations they multiply, and the other weights, are bf16."""
    from focal_jax import attention as fa
    seen = []
    routing_scores, learned_temperature = fa.routing_scores, fa.learned_temperature
    monkeypatch.setattr(fa, "routing_scores", lambda h, w_g, c, **kw: seen.append(
        ("routing", h.dtype, w_g.dtype, c.dtype)) or routing_scores(h, w_g, c, **kw))
    monkeypatch.setattr(fa, "learned_temperature", lambda x, w, **kw: seen.append(
        ("tau", x.dtype, w.dtype, kw["bias"].dtype)) or learned_temperature(x, w, **kw))
    b, t = 2, 16
    tokens = jax.random.randint(jax.random.key(0), (b, t + 1), 0, 64)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": jnp.tile(jnp.arange(t), (b, 1)),
             "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.float32)}
    focus = retrofit(_llama(), FocusConfig(groups=4, dim=8, window=4))
    for model, keep in [(focus, True), (_llama(kind="focal_learned"), True), (focus, False)]:
        optim = OptimConfig(trainable="all", warmup_steps=0)
        graphdef, trainable, frozen = split_trainable(model, optim)
        tx = make_optimizer(optim, 10)
        kept = routing_param_paths(model) if keep else frozenset()
        assert len(kept) == (2 * len(model.layers) if keep else 0)
        train_step, _ = make_steps(graphdef, tx, jnp.bfloat16, keep_float32=kept)
        seen.clear()
        metrics = jax.jit(train_step)(trainable, tx.init(trainable), frozen, batch)[2]
        assert np.isfinite(float(metrics["loss"])) and len(seen) == len(model.layers)
        weights = jnp.dtype(jnp.float32 if keep else jnp.bfloat16)
        assert {entry[1:] for entry in seen} == {(jnp.dtype(jnp.bfloat16), weights, weights)}, seen


def test_padding_is_left_out_of_the_group_counts():
    """Padding (segment id 0) is no real token: the group counts of the eval dominance (and the balance loss) see
    real tokens only; a batch without segment ids is all real."""
    g = jnp.asarray(np.eye(2)[[0, 0, 1, 1]][None], jnp.float32)  # [1, 4, 2]: tokens 0, 1 in group 0; 2, 3 in 1
    valid = real_token_mask({"inputs": jnp.zeros((1, 4), jnp.int32), "segment_ids": jnp.array([[1, 1, 2, 0]])})
    np.testing.assert_array_equal(valid, [[1, 1, 1, 0]])
    np.testing.assert_array_equal(group_counts([{"x": None}, {"g": g}], valid), [[2, 1]])  # one routing layer
    np.testing.assert_array_equal(real_token_mask({"inputs": jnp.zeros((1, 4), jnp.int32)}), [[1, 1, 1, 1]])


def _quickstart_runlocal():
    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "experiments", "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("runlocal")


def test_two_steps_with_balance_loss_log_dominance(tmp_path):
    config = _quickstart_runlocal()
    config.model.attn = {"kind": "focus", "focus_groups": 4, "focus_dim": 8, "focus_window": 8,
                         "focus_assign": "softmax"}
    config.model.remat = True  # the trainer turns it off where it records the assignments
    config.data.cache_dir = str(tmp_path / "tok")
    config.update(total_steps=2, eval_every=2, eval_batches=1, batch_size=8, balance_weight=0.5)
    train(config, str(tmp_path / "run"))
    records = read_metrics(str(tmp_path / "run"))
    train_records = [r for r in records if r["kind"] == "train"]
    assert len(train_records) == 2 and all(1.0 <= r["balance_loss"] <= 4.0 for r in train_records)
    assert all(np.isfinite(r["loss"]) for r in train_records)
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 1 and 0.25 <= evals[0]["dominance"] <= evals[0]["dominance_max"] <= 1.0
    n_layers = check_config(config).model.n_layers
    layers = [evals[0][f"dominance/layer_{i}"] for i in range(n_layers)]  # each layer's, their mean and max
    assert n_layers == 2 and f"dominance/layer_{n_layers}" not in evals[0]
    np.testing.assert_allclose([np.mean(layers), np.max(layers)], [evals[0]["dominance"], evals[0]["dominance_max"]],
                               rtol=1e-6)


def test_balance_weight_key_is_checked_and_old_configs_resume():
    assert config_differences({"seed": 0}, {"seed": 0, "balance_weight": 0.0}) == []
    assert config_differences({"seed": 0}, {"seed": 0, "balance_weight": 0.1}) != []
    stored = {"data": {"seq_len": 8}, "mesh": {"data": 8}}  # a run stored before the streaming keys existed
    now = {"data": {"seq_len": 8, "streaming": False, "eval_paths": (), "prefetch": 4}, "mesh": {"data": 4}}
    assert config_differences(stored, now) == []
    assert config_differences(stored, {**now, "data": {**now["data"], "streaming": True}}) == [
        "data.streaming: False (stored) vs True (now)"]
    config = _quickstart_runlocal()
    config.balance_weight = -1.0
    with pytest.raises(ValueError, match="balance_weight=-1.0"):
        train(config, "/nonexistent/never_created")


def test_focus_retrofit_assign_option():
    model = retrofit(_llama(), FocusConfig(groups=4, dim=8, window=4, assign="softmax"))
    assert {layer.self_attn.config.focus_assign for layer in model.layers} == {"softmax"}


# ------------------------------------------------------------------------------ the Focus attention sink


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("topk, impl", [(None, "xla"), (1, "xla"), (1, "decomposed")])
def test_a_focus_layer_with_a_sink_computes_the_pure_functions_with_that_sink(topk, impl, packed):
    """FOCUS_SPEC OQ-12: `focus_sink=2` reaches the soft gate (`focus_attention`) and hard top-k
    (`focus_sparse_attention`, with the layer's impl) on the layer's own q, k, v and g, with packed documents'
    segment ids too; the same functions with sink=0 give another output, so the comparison can fail."""
    b, t, d = 2, 12, 16
    config = AttentionConfig(d_model=d, n_heads=2, n_kv_heads=2, head_dim=8, kind="focus", focus_groups=4,
                             focus_dim=8, focus_window=2, focus_topk=topk, impl=impl, focus_sink=2)
    layer = Attention(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(3), (b, t, d))
    segment_ids = jnp.asarray([[1] * 5 + [2] * 7, [1] * 12]) if packed else None

    @nnx.jit
    def outputs(layer, x, segment_ids):  # the layer's, and the pure functions' with sink 2 and 0, [B, T, d_model]
        with record_attention() as records:
            out = layer(x, positions=jnp.broadcast_to(jnp.arange(t), (b, t)), segment_ids=segment_ids)
        r = records[0]
        if topk is None:
            heads = [fa.focus_attention(r["q"], r["k"], r["v"], r["g"], window=2, segment_ids=segment_ids, sink=sink)
                     for sink in (2, 0)]
        else:
            heads = [fa.focus_sparse_attention(r["q"], r["k"], r["v"], fa.topk_membership(r["g"], topk), window=2,
                                               segment_ids=segment_ids, sink=sink,
                                               impl="reference" if impl == "xla" else impl) for sink in (2, 0)]
        return [out] + [layer.o_proj(h.reshape(b, t, d)) for h in heads]

    out, with_sink, without = outputs(layer, x, segment_ids)
    np.testing.assert_allclose(out, with_sink, atol=1e-5)
    assert float(jnp.abs(out - without).max()) > 1e-3


@pytest.mark.parametrize("topk", [None, 1])
def test_the_focus_sink_changes_a_models_logits_only_past_the_window(topk):
    """A tiny Focus LLaMA with `focus_sink=2` against the same parameters with the sink off (`replace_attention`):
    the queries whose keys are all local (i <= window) are untouched, later ones change (soft gate and hard top-1);
    a GPT-2 config carries the field to its layers."""
    window = 3
    model = _llama(kind="focus", focus_groups=4, focus_dim=8, focus_window=window, focus_iters=3, focus_topk=topk,
                   focus_sink=2)
    assert {layer.self_attn.config.focus_sink for layer in model.layers} == {2}
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 64)
    forward = nnx.jit(lambda model, tokens: model(tokens))
    with_sink = forward(model, tokens)
    without = forward(replace_attention(model, focus_sink=0), tokens)
    diff = np.abs(np.asarray(with_sink) - np.asarray(without))
    assert diff[:, :window + 1].max() <= 1e-6
    assert diff[:, window + 1:].max() > 1e-3
    gpt2 = nnx.eval_shape(lambda: GPT2(GPT2Config(vocab_size=50, n_positions=16, d_model=32, n_layers=2, n_heads=4,
                                                  kind="focus", focus_sink=3), rngs=nnx.Rngs(0)))
    assert {block.attn.config.focus_sink for block in gpt2.h} == {3}
