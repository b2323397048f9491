"""The lm-evaluation-harness adapter (focal_jax.eval.harness) on tiny random LLaMAs and a SentencePiece tokenizer
trained here. References are written in the test: one plain forward (no segment ids, no positions) of the
window's tokens, log-softmax in numpy, sums over the continuation; lm_eval's tokenization and rolling windows
restated; repeated argmax for greedy decoding. Padding is checked on a soft, non-causal Focus model (Sinkhorn
column sums over the whole row: padding that leaked into them would change every score) against forwards of
exactly the request's tokens; the other tests use constant Focal attention (fast to compile), causal, whose
reference forward appends zeros after the tokens so that one compiled shape serves every length. An end-to-end
`lm_eval.simple_evaluate` runs a multiple-choice task defined here over a local JSONL file (no download), and a
one-step training run checks `from_workdir`."""

import json
import os
import types

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before datasets is imported: lm_eval may never reach the network
os.environ["HF_HUB_OFFLINE"] = "1"

import jax.numpy as jnp  # noqa: E402
import lm_eval  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from focal_jax.data.tokenizer import train_tokenizer  # noqa: E402
from focal_jax.eval.harness import (FocalJaxLM, cut_at_stop, generation_settings, padded_length,  # noqa: E402
                                     score_window)
from focal_jax.nn.gpt2 import GPT2, GPT2Config  # noqa: E402
from focal_jax.nn.llama import Llama, LlamaConfig  # noqa: E402
from focal_jax.train import train  # noqa: E402
from focal_jax.train.config import default_config  # noqa: E402
from focal_jax.train.trainer import load_model  # noqa: E402

FOCUS = dict(kind="focus", focus_groups=4, focus_dim=8, focus_window=2, focus_causal=False, focus_iters=3)
BATCH = 4  # one batch size for the Focal model's tests, so that they share compiled shapes
SENTENCES = [
    "the model routes every token to a group and attends to its local window.",
    "a sparse attention pattern keeps the keys of the same group and the nearby keys.",
    "focal attention sharpens the softmax with a temperature below one.",
    "the data pipeline packs documents into rows with segment ids and positions.",
    "question: which group does the token join? answer: the one its centroid is closest to.",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("harness") / "tokenizer.model"
    return train_tokenizer(SENTENCES * 4, 420, str(path))


def _llama(tokenizer, n_layers, attn):
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=n_layers, n_heads=4, intermediate=48,
                         qk_norm="head", attn=attn)
    return Llama(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model(tokenizer):
    return _llama(tokenizer, 2, dict(kind="focal", focal_t=0.5))


@pytest.fixture(scope="module")
def focus_model(tokenizer):
    return _llama(tokenizer, 1, FOCUS)


def requests(*args):
    """lm_eval requests as the adapter reads them (only `.args` is used)."""
    return [types.SimpleNamespace(args=a) for a in args]


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


def naive_logits(model, tokens):
    """Logits `[len(tokens), V]` of one forward of `tokens`, no segment ids. The causal (Focal) model gets the
    tokens followed by zeros up to 80 (later tokens cannot reach earlier positions), so that one compiled shape
    serves every length; the non-causal Focus model gets exactly the tokens (later tokens change its groups)."""
    causal = model.config.attention.kind != "focus"
    if causal and len(tokens) > 80:
        raise ValueError(f"naive_logits takes at most 80 tokens, got {len(tokens)}")
    inputs = np.zeros((1, 80 if causal else len(tokens)), np.int32)
    inputs[0, :len(tokens)] = tokens
    return np.asarray(_forward(model, jnp.asarray(inputs))[0, :len(tokens)], np.float64)


def naive_logprobs(model, tokens):
    """`(log p(tokens[i + 1] | tokens[: i + 1]), argmax)` for every i, each `[len(tokens) - 1]`, from a forward of
    `tokens[:-1]` (as lm_eval feeds a window: under non-causal routing the last token would change the groups)."""
    logits = naive_logits(model, tokens[:-1])
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return logp[np.arange(len(tokens) - 1), tokens[1:]], logits.argmax(-1)


def split_pair(tokenizer, context, continuation):
    """lm_eval's split of a (context, continuation) pair: the context's trailing spaces join the continuation, the
    whole text is encoded (after bos) and the continuation is whatever follows the context's own encoding."""
    bos = [tokenizer.bos_id]
    if not context:
        return bos, tokenizer.encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_tokens = bos + tokenizer.encode(context)
    return context_tokens, (bos + tokenizer.encode(context + continuation))[len(context_tokens):]


def naive_loglikelihood(model, tokenizer, context, continuation, max_length):
    context_tokens, continuation_tokens = split_pair(tokenizer, context, continuation)
    window = (context_tokens + continuation_tokens)[-(max_length + 1):]
    logp, argmax = naive_logprobs(model, window)
    n = len(continuation_tokens)
    return float(logp[-n:].sum()), bool(np.all(argmax[-n:] == window[-n:]))


def naive_greedy(model, prompt, n, eos_id):
    """Repeated argmax of the full forward: up to `n` new tokens, stopping after eos."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(naive_logits(model, tokens)[-1])))
        if tokens[-1] == eos_id:
            break
    return tokens[len(prompt):]


PAIRS = [
    ("the model routes every token", " to a group"),
    ("focal attention sharpens the softmax ", "with a temperature"),  # trailing space moves to the continuation
    ("", "question: which group"),  # empty context: conditioned on bos
    ("the data pipeline packs documents into rows with segment ids", " and positions."),
    ("a", " sparse"),
]


def test_loglikelihood_equals_naive_forward_in_mixed_batches(model, tokenizer):
    lm = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=64)  # 5 requests of mixed lengths: 2 batches
    got = lm.loglikelihood(requests(*PAIRS), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, got):
        want, want_greedy = naive_loglikelihood(model, tokenizer, context, continuation, 64)
        assert abs(logprob - want) < 1e-3, (context, continuation, logprob, want)
        assert greedy == want_greedy
        assert logprob < 0


def test_padding_cannot_change_focus_scores(focus_model, tokenizer):
    """Non-causal Sinkhorn: the scores of padded rows in a batch equal those of unpadded forwards, and the
    same request scores the same in different batches."""
    pairs = [PAIRS[3], (SENTENCES[4], " the one"), (SENTENCES[1], " focal attention")]  # 24 or 30 inputs
    lm = FocalJaxLM(focus_model, tokenizer, batch_size=2, max_length=64)
    got = lm.loglikelihood(requests(*pairs), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        want, want_greedy = naive_loglikelihood(focus_model, tokenizer, context, continuation, 64)
        assert abs(logprob - want) < 1e-3, (context, continuation, logprob, want)
        assert greedy == want_greedy
    alone = lm.loglikelihood(requests(pairs[2]), disable_tqdm=True)[0][0]
    assert abs(alone - got[2][0]) < 1e-4


def test_loglikelihood_left_truncates_long_contexts(model, tokenizer):
    context = " ".join(SENTENCES[:2])
    assert len(tokenizer.encode(context)) > 20
    lm = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=12)
    got = lm.loglikelihood(requests((context, " the model"), PAIRS[4]), disable_tqdm=True)
    for (c, x), (logprob, greedy) in zip([(context, " the model"), PAIRS[4]], got):
        want, want_greedy = naive_loglikelihood(model, tokenizer, c, x, 12)
        assert abs(logprob - want) < 1e-3 and greedy == want_greedy
    untruncated = naive_loglikelihood(model, tokenizer, context, " the model", 1000)[0]
    assert abs(got[0][0] - untruncated) > 1e-3  # the truncation changed the score: the test above is not vacuous


def test_is_greedy_on_a_greedy_continuation(model, tokenizer):
    lm = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=64)
    context = [tokenizer.bos_id] + tokenizer.encode("the model routes")
    greedy = naive_greedy(model, context, 4, eos_id=None)
    other = greedy[:2] + [(greedy[2] + 1) % tokenizer.vocab_size] + greedy[3:]
    (lp_greedy, is_greedy), (lp_other, is_other) = lm._loglikelihood_tokens(
        [(None, context, greedy), (None, context, other)], disable_tqdm=True)
    assert is_greedy and not is_other and lp_greedy > lp_other


def naive_rolling(model, tokens, bos, max_length):
    """Sum of log p over `tokens`, each predicted once: the first `max_length` after bos, then blocks of up to
    `max_length` tokens, each predicted from the `max_length` tokens before the block's last one."""
    logp, _ = naive_logprobs(model, [bos] + tokens[:max_length])
    total, done = float(logp.sum()), min(max_length, len(tokens))
    while done < len(tokens):
        end = min(done + max_length, len(tokens))
        window = tokens[end - max_length - 1:end]
        total += float(naive_logprobs(model, window)[0][-(end - done):].sum())
        done = end
    return total


def test_loglikelihood_rolling_whole_and_windowed(model, tokenizer):
    text = " ".join(SENTENCES[:2])
    tokens = tokenizer.encode(text)
    whole = float(naive_logprobs(model, [tokenizer.bos_id] + tokens)[0].sum())
    fits = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=64)
    assert len(tokens) <= 64
    assert abs(fits.loglikelihood_rolling(requests((text,)), disable_tqdm=True)[0] - whole) < 1e-3
    windowed = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=12)
    got = windowed.loglikelihood_rolling(requests((text,), (SENTENCES[2],)), disable_tqdm=True)
    assert abs(got[0] - naive_rolling(model, tokens, tokenizer.bos_id, 12)) < 1e-3
    assert abs(got[1] - naive_rolling(model, tokenizer.encode(SENTENCES[2]), tokenizer.bos_id, 12)) < 1e-3
    assert abs(got[0] - whole) > 1e-3  # shorter windows change the sum


def test_generate_until_honours_stop_strings_and_max_gen_toks(model, tokenizer):
    lm = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=64)
    context = "the model routes"
    new = naive_greedy(model, [tokenizer.bos_id] + tokenizer.encode(context), 12, tokenizer.eos_id)
    text = tokenizer.decode(new)
    assert len(new) == 12 and len(text) >= 4, f"precondition: 12 tokens before eos, got {new} = {text!r}"
    stop = text[len(text) // 2:len(text) // 2 + 2]
    got = lm.generate_until(requests((context, {"until": [stop], "max_gen_toks": 12}),
                                     (context, {"max_gen_toks": 12, "do_sample": False})), disable_tqdm=True)
    assert got == [text[:text.index(stop)], text]  # cut before the stop string; exactly 12 tokens without one


def test_simple_evaluate_on_a_local_multiple_choice_task(model, tokenizer, tmp_path):
    """4 questions; the labels are set so that the model's own choice is right on exactly two."""
    questions = ["which group does the token join?", "what does focal attention sharpen?",
                 "what do rows hold?", "what does the model attend to?"]
    choices = ["the softmax", "its local window", "segment ids", "a temperature"]
    lm = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=64)
    prompts = [f"Question: {q}\nAnswer:" for q in questions]
    scores = lm.loglikelihood(requests(*[(p, " " + c) for p in prompts for c in choices]), disable_tqdm=True)
    best = [int(np.argmax([s for s, _ in scores[4 * i:4 * i + 4]])) for i in range(4)]
    labels = [best[0], best[1], (best[2] + 1) % 4, (best[3] + 2) % 4]
    rows = [{"question": q, "choices": choices, "label": label} for q, label in zip(questions, labels)]
    data = tmp_path / "local_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = dict(task="focal_jax_local_mc", dataset_path="json", test_split="train", output_type="multiple_choice",
                dataset_kwargs={"data_files": {"train": str(data)}, "cache_dir": str(tmp_path / "hf")},
                doc_to_text="Question: {{question}}\nAnswer:", doc_to_choice="{{choices}}",
                doc_to_target="{{label}}", metric_list=[{"metric": "acc", "aggregation": "mean",
                                                         "higher_is_better": True}])
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=0, bootstrap_iters=0, log_samples=False,
                                      task_manager=TaskManager(include_defaults=False))  # skip indexing 1000s
    accuracy = results["results"]["focal_jax_local_mc"]["acc,none"]
    own = float(np.mean([b == label for b, label in zip(best, labels)]))
    assert own == 0.5 and 0.0 <= accuracy <= 1.0 and accuracy == own


def test_from_workdir_loads_the_run_and_its_tokenizer(tokenizer, tmp_path):
    """A one-step run of a 1-layer LLaMA: the adapter takes its parameters, its tokenizer (the workdir's copy) and
    its sequence length; lm_eval's `model_args` string builds the same."""
    for i, sentence in enumerate(SENTENCES * 4):
        (tmp_path / f"doc{i}.txt").write_text(sentence)
    config = default_config()
    config.model = {"family": "llama", "vocab_size": tokenizer.vocab_size, "d_model": 32, "n_layers": 1,
                    "n_heads": 4, "intermediate": 48}
    config.data.update(source="text", paths=(str(tmp_path / "doc*.txt"),), tokenizer=tokenizer.path, seq_len=32)
    config.update(batch_size=8, total_steps=1, eval_batches=0, compute_dtype="float32", log_every=1)
    workdir = str(tmp_path / "run")
    train(config, workdir)
    lm = FocalJaxLM.from_workdir(workdir, batch_size=BATCH)
    assert lm.max_length == 32 and lm.tokenizer.path == os.path.join(workdir, "tokenizer.model")
    assert lm.tokenizer.encode(SENTENCES[0]) == tokenizer.encode(SENTENCES[0])
    (logprob, greedy), = lm.loglikelihood(requests(PAIRS[0]), disable_tqdm=True)
    want, want_greedy = naive_loglikelihood(load_model(workdir), tokenizer, *PAIRS[0], 32)
    assert abs(logprob - want) < 1e-3 and greedy == want_greedy
    from_args = get_model("focal_jax").create_from_arg_string(f"workdir={workdir},max_length=24", {"batch_size": 2})
    assert (from_args.max_length, from_args.batch_size) == (24, 2)


def test_helpers_and_bad_input(model, tokenizer):
    assert [padded_length(n, 100) for n in (1, 16, 17, 33, 70, 100)] == [16, 16, 32, 64, 100, 100]
    assert cut_at_stop("abc\n\nQ: x", ["Q:", "\n\n"]) == "abc" and cut_at_stop("abc", ["z"]) == "abc"
    assert generation_settings({"until": "\n"}, 7) == (["\n"], 7)
    with pytest.raises(ValueError, match="greedily"):
        generation_settings({"do_sample": True}, 7)
    with pytest.raises(ValueError, match="max_gen_toks"):
        generation_settings({"max_gen_toks": 0}, 7)
    with pytest.raises(ValueError, match="batch_size"):
        FocalJaxLM(model, tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="model must be"):
        FocalJaxLM("gpt2", tokenizer)
    gpt2 = GPT2(GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=32, d_model=16, n_layers=1, n_heads=2),
                rngs=nnx.Rngs(0))
    assert FocalJaxLM(gpt2, tokenizer).max_length == 32
    with pytest.raises(ValueError, match="n_positions=32"):
        FocalJaxLM(gpt2, tokenizer, max_length=64)
    with pytest.raises(ValueError, match="workdir"):
        FocalJaxLM.create_from_arg_string("batch_size=4")
    lm = FocalJaxLM(model, tokenizer, max_length=16, max_gen_toks=16)
    with pytest.raises(ValueError, match="no room"):
        lm.generate_until(requests(("hi", {})), disable_tqdm=True)
    with pytest.raises(ValueError, match="does not fit max_length=16"):
        lm.loglikelihood(requests(("a", " " + SENTENCES[0])), disable_tqdm=True)


def test_score_window_of_a_continuation_as_long_as_max_length():
    """A continuation of exactly `max_length` tokens fits: one context token conditions its first target, the
    older context is dropped; one token longer does not fit."""
    assert score_window([1, 2, 3], [4, 5, 6, 7], 4) == ([3, 4, 5, 6], [4, 5, 6, 7])
    assert score_window([1, 2], [3], 4) == ([1, 2], [2, 3])
    with pytest.raises(ValueError, match="does not fit max_length=4"):
        score_window([1], [2, 3, 4, 5, 6], 4)


@pytest.fixture
def local_task(tmp_path, monkeypatch):
    """The path of a task YAML file in its own directory, `tmp_path/tasks`; lm_eval's TaskManager indexes only
    `--include_path`'s tasks (its 14,000 built-in ones take 20 s or more)."""
    import functools

    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(TaskManager, include_defaults=False))
    (tmp_path / "tasks").mkdir()
    yaml = tmp_path / "tasks" / "focal_jax_qa.yaml"
    yaml.write_text("task: focal_jax_qa\ndataset_path: json\noutput_type: multiple_choice\n")
    return yaml


def test_command_line_refuses_a_directory_that_is_not_a_run(tmp_path, local_task, capsys):
    from focal_jax.eval import harness

    with pytest.raises(SystemExit) as info:  # a usage error, not a FileNotFoundError traceback
        harness.main(["--workdir", str(tmp_path), "--tasks", "focal_jax_qa", "--include_path", str(local_task.parent)])
    assert info.value.code == 2 and "tokenizer.model" in capsys.readouterr().err


def test_command_line_names_an_unknown_task_before_loading_the_model(tmp_path, local_task, capsys):
    """A misspelt task fails at once with the closest names (it used to end in lm_eval's KeyError after the model
    loaded); a task YAML file given by path passes the check."""
    from focal_jax.eval import harness

    with pytest.raises(SystemExit) as info:
        harness.main(["--workdir", str(tmp_path), "--tasks", f"focal_jax_qa,focal_jax_q,{local_task}",
                      "--include_path", str(local_task.parent)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "unknown lm_eval task 'focal_jax_q'; closest: focal_jax_qa" in err, err
    assert err.count("unknown lm_eval task") == 1 and "tokenizer.model" not in err  # the model was not loaded
    assert harness.unknown_tasks(["focal_jax_qa", str(local_task)], ["focal_jax_qa"]) == ""
    assert harness.unknown_tasks(["zzz"], ["arc_easy"]) == ("unknown lm_eval task 'zzz' (--include_path DIR adds a "
                                                           "directory of task YAML files)")
    with pytest.raises(SystemExit):
        harness.main(["--workdir", str(tmp_path), "--tasks", ",", "--include_path", str(local_task.parent)])
    assert "--tasks names no task: ','" in capsys.readouterr().err


def test_command_line_refuses_an_output_it_cannot_write_before_loading_the_model(tmp_path, local_task, capsys):
    """--output is written once every task has run: a directory, or a file in a missing directory, used to fail
    only then, the results lost. (tmp_path is not a run: had the model loaded, the error would name its tokenizer.)"""
    from focal_jax.eval import harness

    for output, needle in ((tmp_path, f"--output={tmp_path} is a directory; expected the path of a file"),
                           (tmp_path / "missing" / "res.json", f"its directory {tmp_path / 'missing'} does not exist")):
        with pytest.raises(SystemExit) as info:
            harness.main(["--workdir", str(tmp_path), "--tasks", "focal_jax_qa", "--include_path",
                          str(local_task.parent), "--output", str(output)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and needle in err and "tokenizer.model" not in err, err


def test_generate_until_keeps_the_end_of_a_long_prompt(model, tokenizer):
    """A prompt longer than `max_length - max_gen_toks` loses its first tokens (the end of the context, next to
    what is generated, is kept): the output is the greedy continuation of the last 20 prompt tokens."""
    lm = FocalJaxLM(model, tokenizer, batch_size=BATCH, max_length=24)
    context = " ".join(SENTENCES[:2])
    prompt = [tokenizer.bos_id] + tokenizer.encode(context)
    assert len(prompt) > 24
    kept = naive_greedy(model, prompt[-20:], 4, tokenizer.eos_id)
    assert kept != naive_greedy(model, prompt[:20], 4, tokenizer.eos_id)  # which end is kept matters
    got = lm.generate_until(requests((context, {"max_gen_toks": 4})), disable_tqdm=True)
    assert got == [tokenizer.decode(kept)]


def test_command_line_evaluates_a_hugging_face_directory_on_a_mesh(tokenizer, tmp_path, local_task, monkeypatch):
    """`--hf DIR --mesh data=2,tensor=4`: the model is placed on the mesh (`harness.hf_model`), each batch's rows
    are split over data (2 of the 4 on each device), and lm_eval's scores, and the log-likelihoods under them, equal
    those on one device."""
    from focal_jax.convert.hf import to_hf
    from focal_jax.eval import harness

    directory = tmp_path / "hf"
    to_hf(_llama(tokenizer, 1, {"kind": "dense"}), str(directory))
    rows = [{"question": q, "choices": ["the softmax", "segment ids"], "label": i % 2}
            for i, q in enumerate(["what does focal attention sharpen?", "what do rows hold?"])]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    local_task.write_text(
        "task: focal_jax_qa\ndataset_path: json\ntest_split: train\noutput_type: multiple_choice\n"
        f"dataset_kwargs:\n  data_files:\n    train: {tmp_path / 'mc.jsonl'}\n  cache_dir: {tmp_path / 'cache'}\n"
        "doc_to_text: 'Question: {{question}}\nAnswer:'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n")
    models, scores, rows = [], [], []
    hf_model, loglikelihood, score_batch = harness.hf_model, FocalJaxLM.loglikelihood, harness._score_batch
    monkeypatch.setattr(harness, "_score_batch", lambda *a: rows.append((out := score_batch(*a))[0]
                                                                        .addressable_shards[0].data.shape) or out)
    monkeypatch.setattr(harness, "hf_model", lambda d, mesh=None: models.append(hf_model(d, mesh=mesh)) or models[-1])
    monkeypatch.setattr(FocalJaxLM, "loglikelihood",
                        lambda self, *a, **k: scores.append(loglikelihood(self, *a, **k)) or scores[-1])
    args = ["--hf", str(directory), "--tokenizer", tokenizer.path, "--tasks", "focal_jax_qa", "--include_path",
            str(local_task.parent), "--bootstrap_iters", "0", "--batch_size", str(BATCH)]
    want = harness.main(args)
    assert set(rows) == {(BATCH,)}
    rows.clear()
    got = harness.main([*args, "--mesh", "data=2,tensor=4"])
    assert got["results"] == want["results"] and len(scores[1]) == 4 and set(rows) == {(BATCH // 2,)}
    np.testing.assert_allclose([s for s, _ in scores[1]], [s for s, _ in scores[0]], rtol=1e-5)
    q = nnx.to_pure_dict(nnx.state(models[1]))["layers"][0]["self_attn"]["q_proj"]["kernel"]
    assert len(q.sharding.device_set) == 8 and q.sharding.spec == P(None, "tensor")
