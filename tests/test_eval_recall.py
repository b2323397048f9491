"""focal_jax.eval.decode and focal_jax.eval.recall on tiny models and a tokenizer trained in-process.

`greedy_decode` equals a naive loop (argmax of the full forward, one token at a time, one prompt at a time) for a
dense model (KV cache), a soft non-causal Focus model (full forward with padding) and a hard causal Focus model
(KV cache), with prompts of different lengths in one batch, eos and `stop`; length-matched prompts fit their target
as stated; the suite's accuracy is `score` of the decoded text (an oracle decoder gives 1.0, a wrong one 0.0);
`plot_recall` writes a PNG; `with_topk` equals a model built with `focus_topk`; the CLI writes its files, removes an
earlier run's plot when it writes none, logs each decoded batch, and refuses bad `--lengths` / `--topk` naming the flag
before the model loads (or, for a `--topk` the model cannot take, before decoding); bad input raises naming the value.
"""

import json
import re
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focal_jax.data import make_examples, score, train_tokenizer
from focal_jax.eval import recall
from focal_jax.eval.decode import can_cache, greedy_decode
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from helpers import stub_run_workdir, usage_error

pytestmark = pytest.mark.usefixtures("fast_compiles")

VOCAB = 61
FOCUS = dict(kind="focus", focus_window=2, focus_groups=4, focus_dim=8, focus_iters=2)
MODELS = {
    "dense": ({}, True),
    "soft_focus_noncausal": (FOCUS, False),
    "hard_focus_causal": ({**FOCUS, "focus_topk": 1, "focus_causal": True}, True),
    # the RoPE base grows past 4 tokens: each prompt's own, whatever the others in its batch
    "dense_dynamic_ntk": ({"rope_ntk_factor": 4.0, "rope_trained_len": 4}, False),
}


def _llama(attn, vocab=VOCAB, seed=0):
    config = LlamaConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=32,
                         rope_theta=500.0, attn=attn)
    return Llama(config, rngs=nnx.Rngs(seed))


_forward = nnx.jit(lambda model, tokens: model(tokens))


def _naive_greedy(model, prompt, max_new_tokens):
    """Argmax of the full forward of the prompt alone, one token at a time (no cache, no padding)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(jnp.argmax(_forward(model, jnp.asarray([tokens], jnp.int32))[0, -1])))
    return tokens[len(prompt):]


def _cut_after(tokens, eos):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_decode_equals_naive_loop(name):
    attn, cached = MODELS[name]
    model = _llama(attn)
    assert can_cache(model) == cached  # each path of greedy_decode is exercised
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (4, 2, 3)]  # two batches of 2, the last one padded
    expected = [_naive_greedy(model, p, 4) for p in prompts]
    assert greedy_decode(model, prompts, max_new_tokens=4, batch_size=2) == expected
    eos = expected[1][1]  # a token the second prompt generates second: it stops there, the others where they meet it
    got = greedy_decode(model, prompts, max_new_tokens=4, eos_id=eos, batch_size=2)
    assert got == [_cut_after(e, eos) for e in expected] and len(got[1]) <= 2
    if name == "dense":
        seen = []

        def stop(new):
            seen.append(list(new))
            return len(new) == 3

        assert greedy_decode(model, prompts, max_new_tokens=4, stop=stop, batch_size=2) == [e[:3] for e in expected]
        assert sorted(seen) == sorted(e[:k] for e in expected for k in (1, 2, 3))  # every prefix once


def test_greedy_decode_errors():
    model = _llama({})
    gpt2 = GPT2(GPT2Config(vocab_size=VOCAB, n_positions=8, d_model=16, n_layers=1, n_heads=2), rngs=nnx.Rngs(0))
    cases = [
        (lambda: greedy_decode(model, [[1, 2], []], max_new_tokens=2), "prompts[1] is empty"),
        (lambda: greedy_decode(model, [[1, VOCAB]], max_new_tokens=2), f"token id {VOCAB}"),
        (lambda: greedy_decode(model, [[1, 2]], max_new_tokens=0), "max_new_tokens=0"),
        (lambda: greedy_decode(model, [[1, 2]], max_new_tokens=2, batch_size=0), "batch_size=0"),
        (lambda: greedy_decode(model, [[1, 2]], max_new_tokens=2, eos_id=VOCAB), f"eos_id={VOCAB}"),
        (lambda: greedy_decode(model, [[1, 2]], max_new_tokens=2, stop="</s>"), "stop='</s>'"),
        (lambda: greedy_decode(model, "hello", max_new_tokens=2), "list of token lists"),
        (lambda: greedy_decode(gpt2, [[1] * 6], max_new_tokens=3), "n_positions=8"),
        (lambda: greedy_decode(object(), [[1]], max_new_tokens=2), "Llama or GPT2"),
    ]
    for fn, needle in cases:
        with pytest.raises(ValueError, match=re.escape(needle)):
            fn()
    assert greedy_decode(model, [], max_new_tokens=2) == []


@pytest.mark.parametrize("attn", [{}, {"kind": "focus", "focus_groups": 4, "focus_dim": 8, "focus_window": 2,
                                   "focus_iters": 2}], ids=["dense_cached", "soft_focus_full_forward"])
def test_a_gpt2_prompt_that_fills_its_position_table_exactly_decodes(attn):
    """A prompt of n tokens with max_new_tokens = n_positions - n fits GPT-2's learned position table exactly: it is
    decoded (equal to the naive loop; the full-forward buffer, bucketed to 10 slots, is cut to the 9 positions the
    table has), not refused; one token more is refused."""
    gpt2 = GPT2(GPT2Config(vocab_size=VOCAB, n_positions=9, d_model=16, n_layers=1, n_heads=2, **attn),
                rngs=nnx.Rngs(0))
    assert can_cache(gpt2) == (not attn)
    prompt = [1, 5, 9, 2]
    assert greedy_decode(gpt2, [prompt], max_new_tokens=5) == [_naive_greedy(gpt2, prompt, 5)]
    with pytest.raises(ValueError, match=re.escape("n_positions=9")):
        greedy_decode(gpt2, [prompt + [3]], max_new_tokens=5)


# ----------------------------------------------------------------------------------------------------------------
# The recall suite


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    documents = [ex.prompt + ex.answer for spec in recall.TASKS.values()
                 for ex in make_examples(spec.task, 40, seed=5, **dict(spec.options), **{spec.knob: 6})]
    return train_tokenizer(documents, 400, tmp_path_factory.mktemp("tok") / "recall.model")


@pytest.mark.parametrize("task", list(recall.TASKS))
def test_length_matched_prompts_fit_the_target_within_one_knob_unit(task, tokenizer):
    spec = recall.TASKS[task]
    for length in (128, 300):
        samples = recall.length_matched(task, tokenizer, length, 4, seed=3)
        assert len(samples) == 4
        for i, sample in enumerate(samples):
            seed = recall._example_seed(3, task, length, i)

            def example(knob):
                return make_examples(spec.task, 1, seed, **dict(spec.options), **{spec.knob: knob})[0]

            assert sample.example == example(sample.knob)
            assert sample.tokens == [tokenizer.bos_id] + tokenizer.encode(sample.example.prompt)
            assert len(sample.tokens) <= length
            assert len(tokenizer.encode(example(sample.knob + 1).prompt)) + 1 > length
        assert np.mean([len(s.tokens) for s in samples]) > 0.8 * length
    with pytest.raises(ValueError, match=r"length=5 is too short for task"):
        recall.length_matched(task, tokenizer, 5, 1, seed=0)


def _oracle(tokenizer, answers, wrong=()):
    """A stand-in for greedy_decode: each prompt's answer (then eos), except for the prompts whose index is in
    `wrong` (in call order), which get a wrong one."""
    calls = []

    def decode(model, prompts, *, max_new_tokens, eos_id=None, stop=None, batch_size=8):
        calls.append(dict(prompts=prompts, max_new_tokens=max_new_tokens, eos_id=eos_id))
        out = []
        for i, prompt in enumerate(prompts):
            answer = answers[tokenizer.decode(prompt)]
            text = "x" + answer if i in wrong else answer
            out.append(tokenizer.encode(text)[:max_new_tokens - 1] + [eos_id])
        return out

    return decode, calls


def test_recall_suite_accuracy_is_the_score_of_the_decoded_answers(tokenizer, monkeypatch):
    tasks, lengths = list(recall.TASKS), [128, 256]
    answers = {s.example.prompt: s.example.answer for task in tasks for length in lengths
               for s in recall.length_matched(task, tokenizer, length, 4, seed=7)}
    model = _llama({}, vocab=tokenizer.vocab_size)
    decode, calls = _oracle(tokenizer, answers)
    monkeypatch.setattr(recall, "greedy_decode", decode)
    rows = recall.recall_suite(model, tokenizer, tasks=tasks, lengths=lengths, n_examples=4, seed=7)
    assert [(r["task"], r["length"]) for r in rows] == [(t, n) for t in tasks for n in lengths]
    assert all(r["accuracy"] == 1.0 and r["n"] == 4 for r in rows)
    for row, call in zip(rows, calls):
        assert row["prompt_tokens"] == np.mean([len(p) for p in call["prompts"]])
        assert row["length"] - 40 < row["prompt_tokens"] <= row["length"]
        assert call["eos_id"] == tokenizer.eos_id
    decode, _ = _oracle(tokenizer, answers, wrong=range(4))
    monkeypatch.setattr(recall, "greedy_decode", decode)
    rows = recall.recall_suite(model, tokenizer, tasks=tasks, lengths=lengths, n_examples=4, seed=7)
    assert all(r["accuracy"] == 0.0 for r in rows)
    decode, _ = _oracle(tokenizer, answers, wrong=(1, 3))
    monkeypatch.setattr(recall, "greedy_decode", decode)
    rows = recall.recall_suite(model, tokenizer, tasks=["json_kv"], lengths=[128], n_examples=4, seed=7)
    assert rows[0]["accuracy"] == 0.5


def test_recall_suite_with_a_model_scores_what_it_decodes(tokenizer, monkeypatch):
    model = _llama({}, vocab=tokenizer.vocab_size)
    outputs = []

    def spy(*args, **kwargs):
        outputs.append(greedy_decode(*args, **kwargs))
        return outputs[-1]

    monkeypatch.setattr(recall, "greedy_decode", spy)
    rows = recall.recall_suite(model, tokenizer, tasks=["needle"], lengths=[80], n_examples=3, seed=2)
    examples = [s.example for s in recall.length_matched("needle", tokenizer, 80, 3, seed=2)]
    assert rows[0]["accuracy"] == score([tokenizer.decode(o) for o in outputs[0]], examples)
    answer_tokens = max(len(tokenizer.encode(ex.answer)) for ex in examples) + 1
    assert all(1 <= len(o) <= answer_tokens for o in outputs[0])


def test_plot_recall_and_table(tmp_path):
    rows = [{"task": t, "length": n, "prompt_tokens": n - 3.0, "accuracy": a, "n": 5}
            for t, accs in [("needle", (1.0, 0.6)), ("json_kv", (0.8, 0.2))] for n, a in zip((128, 512), accs)]
    png = recall.plot_recall(rows, str(tmp_path / "sub" / "recall.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = recall.format_table(rows)
    assert table.splitlines()[0] == "| task | 128 | 512 |"
    assert "| json_kv | 0.800 | 0.200 |" in table.splitlines()
    with pytest.raises(ValueError, match="at least one row"):
        recall.plot_recall([], str(tmp_path / "empty.png"))


def test_recall_errors(tokenizer):
    model = _llama({}, vocab=tokenizer.vocab_size)
    gpt2 = GPT2(GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=64, d_model=16, n_layers=1, n_heads=2),
                rngs=nnx.Rngs(0))
    cases = [
        (dict(tasks=["needle", "sorting"]), "unknown recall task 'sorting'"),
        (dict(tasks="needle"), "tasks='needle'"),
        (dict(lengths=[128, 0]), "length=0"),
        (dict(lengths=[]), "lengths=[]"),
        (dict(lengths=[64, 128, 64]), "lengths must be distinct, got lengths=[64, 128, 64]"),
        (dict(tasks=["needle", "needle"]), "tasks must be distinct"),
        (dict(n_examples=0), "n_examples=0"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=re.escape(needle)):
            recall.recall_suite(model, tokenizer, **{"tasks": ["needle"], "lengths": [64], **kwargs})
    logged = []
    rows = recall.recall_suite(model, tokenizer, tasks=["needle_multikey"], lengths=[20], log=logged.append)
    assert rows == [{"task": "needle_multikey", "length": 20, "prompt_tokens": None, "accuracy": None, "n": 0,
                     "skipped": rows[0]["skipped"]}]
    assert "length=20 is too short" in rows[0]["skipped"] and "skipped" in logged[0]
    assert recall.format_table(rows).splitlines()[-1] == "| needle_multikey | - |"
    with pytest.raises(ValueError, match=re.escape("length=64 leaves no room")):
        recall.recall_suite(gpt2, tokenizer, tasks=["needle"], lengths=[32, 64])
    with pytest.raises(ValueError, match=re.escape("topk=1 needs a Focus model")):
        recall.with_topk(model, 1)


def test_with_topk_equals_a_model_built_with_focus_topk():
    soft = _llama(FOCUS)
    hard = _llama({**FOCUS, "focus_topk": 2}, seed=1)
    nnx.update(hard, nnx.state(soft))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 12)), jnp.int32)
    soft_logits = _forward(soft, tokens)
    recall.with_topk(soft, 2)
    assert soft.config.attention.focus_topk == 2 and soft.layers[0].self_attn.config.focus_topk == 2
    np.testing.assert_allclose(_forward(soft, tokens), _forward(hard, tokens), atol=1e-6, rtol=0)
    assert not np.allclose(_forward(soft, tokens), soft_logits, atol=1e-3)  # the hard mask changed something
    with pytest.raises(ValueError, match="topk=5"):
        recall.with_topk(_llama(FOCUS), 5)


def test_with_rope_ntk_equals_a_model_built_with_it():
    plain = _llama({})
    scaled = _llama({"rope_ntk_factor": 2.0, "rope_trained_len": 8}, seed=1)
    nnx.update(scaled, nnx.state(plain))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (1, 20)), jnp.int32)
    before = _forward(plain, tokens)
    recall.with_rope_ntk(plain, 2.0, trained_len=8)
    np.testing.assert_allclose(_forward(plain, tokens), _forward(scaled, tokens), atol=1e-6, rtol=0)
    assert not np.allclose(_forward(plain, tokens), before, atol=1e-4)  # 20 tokens > 8: the base grew
    gpt2 = GPT2(GPT2Config(vocab_size=VOCAB, n_positions=8, d_model=16, n_layers=1, n_heads=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rope_ntk_factor=2.0 needs rotary embeddings"):
        recall.with_rope_ntk(gpt2, 2.0, trained_len=8)


def test_dynamic_ntk_gives_each_sequence_its_own_base():
    """A sequence's logits under dynamic NTK RoPE are those it has alone, when right-padded next to a longer one
    (padding a segment of its own) or packed with it; the base used to come from the batch's largest position."""
    model = _llama({"rope_ntk_factor": 4.0, "rope_trained_len": 4})
    rng = np.random.default_rng(3)
    short, long = rng.integers(0, VOCAB, 6), rng.integers(0, VOCAB, 11)
    alone = [model(jnp.asarray([doc], jnp.int32))[0] for doc in (short, long)]
    padded = np.stack([np.pad(short, (0, 5)), long]).astype(np.int32)
    positions = np.broadcast_to(np.arange(11), (2, 11))
    segment_ids = np.array([[1] * 6 + [0] * 5, [1] * 11])
    batched = model(jnp.asarray(padded), positions=jnp.asarray(positions), segment_ids=jnp.asarray(segment_ids))
    np.testing.assert_allclose(batched[0, :6], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(batched[1], alone[1], atol=1e-5, rtol=0)
    packed = model(jnp.asarray(np.concatenate([short, long])[None], jnp.int32),
                   positions=jnp.asarray(np.concatenate([np.arange(6), np.arange(11)])[None]),
                   segment_ids=jnp.asarray([[1] * 6 + [2] * 11]))
    np.testing.assert_allclose(packed[0, :6], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[0, 6:], alone[1], atol=1e-5, rtol=0)
    # without segment ids the row is one sequence of 11 positions: its base is a longer sequence's
    unsegmented = model(jnp.asarray(padded), positions=jnp.asarray(positions))
    assert not np.allclose(unsegmented[0, :6], alone[0], atol=1e-3)


def test_command_line_writes_json_and_png(tokenizer, tmp_path, monkeypatch, capsys):
    from focal_jax.train import checkpoint, trainer

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "tokenizer.model").write_bytes(open(tokenizer.path, "rb").read())
    tasks, lengths = ["needle", "frequent_words"], [96, 160]
    answers = {s.example.prompt: s.example.answer for task in tasks for length in lengths
               for s in recall.length_matched(task, tokenizer, length, 2, seed=0)}
    monkeypatch.setattr(trainer, "load_model",
                        lambda path, step=None, mesh=None: _llama({}, vocab=tokenizer.vocab_size))
    monkeypatch.setattr(checkpoint, "read_meta", lambda path, step=None: (7, {"config": {"data": {"seq_len": 64}}}))
    monkeypatch.setattr(recall, "greedy_decode", _oracle(tokenizer, answers)[0])
    recall.main(["--workdir", str(workdir), "--tasks", ",".join(tasks), "--lengths", "96,160", "--n", "2"])
    record = json.loads((workdir / "recall.json").read_text())
    assert record["step"] == 7 and [r["accuracy"] for r in record["rows"]] == [1.0] * 4
    assert (workdir / "recall.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "recall: needle at 96 tokens" in out and "| frequent_words | 1.000 | 1.000 |" in out
    assert "recall: note: lengths [96, 160] go past the 64 tokens the model was trained on" in out  # (no note before)
    loaded = []
    monkeypatch.setattr(trainer, "load_model",
                        lambda path, step=None, mesh=None: loaded.append(step) or _llama({}, vocab=VOCAB))
    recall.main(["--workdir", str(workdir), "--tasks", "needle", "--lengths", "96", "--n", "2", "--step", "7",
                 "--rope-ntk-factor", "2"])
    record = json.loads((workdir / "recall.json").read_text())
    assert loaded == [7] and record["rope_ntk_factor"] == 2.0
    assert "note: lengths" not in capsys.readouterr().out  # scaled: nothing to note
    with pytest.raises(SystemExit):
        recall.main(["--workdir", str(workdir), "--tasks", "needle,sorting"])
    assert "unknown recall task 'sorting'" in capsys.readouterr().err


def test_encode_prompt_starts_with_bos_else_eos():
    """The document-start token: bos when the tokenizer has one, else eos (as `focal_jax.data` starts documents)."""
    def tokenizer(bos_id):
        return types.SimpleNamespace(bos_id=bos_id, eos_id=3, encode=lambda text: [10 + len(text), 7])

    assert recall.encode_prompt(tokenizer(2), "abc") == [2, 13, 7]
    assert recall.encode_prompt(tokenizer(None), "abc") == [3, 13, 7]
    assert recall.encode_prompt(tokenizer(-1), "abc") == [3, 13, 7]  # SentencePiece's id for a missing token


def test_recall_suite_fills_a_gpt2_context_exactly(tokenizer, monkeypatch):
    """Prompts plus answer tokens that fill GPT-2's `n_positions` exactly are decoded (greedy_decode accepts
    them); one position fewer is refused, naming n_positions."""
    # A target length below what its prompts and answers need: the check of the length alone passes, this one decides.
    for length in range(96, 160):
        samples = recall.length_matched("needle", tokenizer, length, 2, seed=1)
        needed = max(len(s.tokens) for s in samples) + max(len(tokenizer.encode(s.example.answer))
                                                            for s in samples) + 1
        if needed > length:
            break
    else:
        pytest.fail("no length in [96, 160) whose prompts and answers exceed it")
    answers = {s.example.prompt: s.example.answer for s in samples}
    monkeypatch.setattr(recall, "greedy_decode", _oracle(tokenizer, answers)[0])

    def gpt2(n_positions):
        config = GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=n_positions, d_model=16, n_layers=1,
                            n_heads=2)
        return nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))  # shapes only: the oracle never runs it

    rows = recall.recall_suite(gpt2(needed), tokenizer, tasks=["needle"], lengths=[length], n_examples=2, seed=1)
    assert rows[0]["accuracy"] == 1.0 and rows[0]["n"] == 2
    with pytest.raises(ValueError, match=f"exceed the model's n_positions={needed - 1}"):
        recall.recall_suite(gpt2(needed - 1), tokenizer, tasks=["needle"], lengths=[length], n_examples=2, seed=1)


def test_eos_predicted_at_a_prompt_position_does_not_stop_a_row():
    """KV cache: a row longer than the batch's prefill reads its prompt one token per step while a shorter row
    generates; the model predicting eos after one of its prompt tokens (a prediction nobody writes) neither stops
    nor changes it."""
    model = _llama({})
    rng = np.random.default_rng(5)
    short, long = rng.integers(0, VOCAB, 2).tolist(), rng.integers(0, VOCAB, 12).tolist()
    from_short = _naive_greedy(model, short, 12)
    # predictions after prompt tokens 2..11 of the long row: past the prefill (1 token), before the prompt's end
    within_prompt = jnp.argmax(_forward(model, jnp.asarray([long], jnp.int32))[0, 1:-1], -1).tolist()
    candidates = [t for t in within_prompt if t not in from_short]  # the short row still runs when the long one ends
    assert candidates, "precondition: a token predicted within the long prompt that the short row never generates"
    eos = candidates[0]
    expected = [from_short, _cut_after(_naive_greedy(model, long, 12), eos)]
    assert greedy_decode(model, [short, long], max_new_tokens=12, eos_id=eos, batch_size=2) == expected


def test_a_prompt_as_long_as_the_prefill_takes_its_first_token_from_it():
    """KV cache: the prefill covers the bucket floor of the batch's shortest prompt (1 below 8 tokens, then 8, 10,
    ...); a prompt of exactly that length gets its first new token from the prefill's logits."""
    model = _llama({})
    rng = np.random.default_rng(6)
    for lengths in ((1, 3), (8, 9)):
        prompts = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
        expected = [_naive_greedy(model, p, 3) for p in prompts]
        assert greedy_decode(model, prompts, max_new_tokens=3, batch_size=2) == expected, lengths


# ----------------------------------------------------------------------------------------------------------------
# The command line: stale plots, progress, flags refused before the model loads


def _stub_workdir(tmp_path, tokenizer, monkeypatch, attn=None):
    """A run directory with the tokenizer; loading it gives a fresh tiny Llama of attention `attn` (step 7)."""
    return stub_run_workdir(tmp_path, tokenizer, monkeypatch,
                            lambda: _llama(attn or {}, vocab=tokenizer.vocab_size), step=7)


def _usage_error(capsys, argv, needle):
    usage_error(capsys, recall.main, argv, needle)


def test_a_rerun_without_a_plot_removes_the_earlier_runs_plot(tokenizer, tmp_path, monkeypatch, capsys):
    """A rerun whose every cell is skipped writes its JSON and no plot: an earlier run's recall.png, which would show
    results the new JSON does not hold, is removed, and the printed line says so."""
    workdir = _stub_workdir(tmp_path, tokenizer, monkeypatch)
    png = workdir / "recall.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n an earlier run's plot")
    monkeypatch.setattr(recall, "greedy_decode", lambda *args, **kwargs: pytest.fail("decoded a skipped cell"))
    rows = recall.main(["--workdir", str(workdir), "--tasks", "needle", "--lengths", "20", "--n", "1"])
    assert rows[0]["n"] == 0 and json.loads((workdir / "recall.json").read_text())["rows"] == rows
    assert not png.exists()
    assert f"no plot; removed {png}, an earlier run's plot" in capsys.readouterr().out
    recall.main(["--workdir", str(workdir), "--tasks", "needle", "--lengths", "20", "--n", "1"])
    assert capsys.readouterr().out.count("no plot\n") == 1  # nothing left to remove


def test_recall_suite_logs_each_decoded_batch(tokenizer, monkeypatch):
    """With 5 prompts in batches of 2: three decoder calls of 2 prompts (the last one filled with a copy of its
    first prompt, as greedy_decode fills it), a progress line after each, and the outputs back in example order
    (the oracle's answers all score)."""
    samples = recall.length_matched("needle", tokenizer, 128, 5, seed=4)
    answers = {s.example.prompt: s.example.answer for s in samples}
    decode, calls = _oracle(tokenizer, answers)
    monkeypatch.setattr(recall, "greedy_decode", decode)
    logged = []
    rows = recall.recall_suite(_llama({}, vocab=tokenizer.vocab_size), tokenizer, tasks=["needle"], lengths=[128],
                               n_examples=5, seed=4, batch_size=2, log=logged.append)
    assert rows[0]["accuracy"] == 1.0 and rows[0]["n"] == 5
    assert [len(c["prompts"]) for c in calls] == [2, 2, 2] and calls[2]["prompts"][1] == calls[2]["prompts"][0]
    decoded = [p for c in calls for p in c["prompts"][:2]][:5]
    assert sorted(decoded) == sorted(s.tokens for s in samples)
    assert [len(p) for p in decoded] == sorted(len(s.tokens) for s in samples)  # greedy_decode's batches
    assert [re.sub(r"\(\d+\.\ds\)", "(T)", line) for line in logged[:3]] == [
        f"recall: needle at 128 tokens: batch {i}/3 (T)" for i in (1, 2, 3)]
    assert logged[3].startswith("recall: needle at 128 tokens (mean prompt") and len(logged) == 4
    logged.clear()
    recall.recall_suite(_llama({}, vocab=tokenizer.vocab_size), tokenizer, tasks=["needle"], lengths=[128],
                        n_examples=2, seed=4, batch_size=2, log=logged.append)
    assert len(logged) == 1  # one batch: the cell's line only


@pytest.mark.parametrize("argv, needle", [
    (["--lengths", "0"], "argument --lengths: expected comma-separated distinct integers >= 1, got '0'"),
    (["--lengths", ","], "argument --lengths: expected comma-separated distinct integers >= 1, got ','"),
    (["--lengths", "128,-5"], "argument --lengths: expected comma-separated distinct integers >= 1, got '128,-5'"),
    (["--lengths", "128,128"], "argument --lengths: expected comma-separated distinct integers >= 1, got '128,128'"),
    (["--lengths", "1e3"], "argument --lengths: expected comma-separated distinct integers >= 1, got '1e3'"),
    (["--topk", "0"], "argument --topk: expected an integer >= 1, got '0'"),
    (["--topk", "-2"], "argument --topk: expected an integer >= 1, got '-2'"),
])
def test_bad_lengths_and_topk_are_refused_before_the_model_loads(argv, needle, monkeypatch, capsys):
    monkeypatch.setattr(recall, "load_for_decoding", lambda *args, **kwargs: pytest.fail("loaded the model"))
    _usage_error(capsys, ["--workdir", "RUN", *argv], needle)


def test_a_topk_the_model_cannot_take_names_the_flag_before_decoding(tokenizer, tmp_path, monkeypatch, capsys):
    """`--topk 9` on a model of 4 Focus groups, and `--topk` on a model without Focus, are usage errors naming
    `--topk` and the model's groups (not `focus_topk` / `focus_groups` alone), raised before any decoding."""
    monkeypatch.setattr(recall, "greedy_decode", lambda *args, **kwargs: pytest.fail("decoded"))
    workdir = _stub_workdir(tmp_path, tokenizer, monkeypatch, attn=FOCUS)
    argv = ["--workdir", str(workdir), "--tasks", "needle", "--lengths", "128", "--n", "1"]
    _usage_error(capsys, [*argv, "--topk", "9"], "--topk=9 is more than the model's 4 Focus groups (focus_groups)")
    _usage_error(capsys, [*argv, "--topk", "5"], "--topk=5 is more than the model's 4 Focus groups")
    assert recall.topk_error(_llama(FOCUS), 4) == ""
    monkeypatch.setattr(recall, "greedy_decode", lambda model, prompts, **kwargs: [[tokenizer.eos_id]] * len(prompts))
    recall.main([*argv, "--topk", "4"])  # as many as the groups: accepted
    assert json.loads((workdir / "recall.json").read_text())["topk"] == 4
    monkeypatch.setattr(recall, "greedy_decode", lambda *args, **kwargs: pytest.fail("decoded"))
    dense = _stub_workdir(tmp_path / "dense", tokenizer, monkeypatch)
    _usage_error(capsys, ["--workdir", str(dense), "--tasks", "needle", "--lengths", "128", "--topk", "1"],
                 "--topk=1 needs a Focus model (attention kind in ")
    assert "this model's attention is ['dense']" in recall.topk_error(_llama({}), 1)
