"""Command lines of focal_jax.eval: a bad argument or a run that cannot give what is asked ends in a usage error
(SystemExit 2, the message naming the value), never a traceback; a recall command whose every cell is skipped still
writes its JSON. Runs are stubbed (no training, no forward pass)."""

import json

import pytest
from flax import nnx

from focal_jax.eval import diagnostics, perplexity, recall
from focal_jax.eval.diagnostics import Run
from focal_jax.nn.llama import Llama, LlamaConfig

FOCUS = dict(kind="focus", focus_groups=4, focus_dim=8, focus_window=2, focus_iters=2)


def _llama(attn):
    config = LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=32, attn=attn)
    return Llama(config, rngs=nnx.Rngs(0))


def _stub_run(monkeypatch, module, attn):
    run = Run(model=_llama(attn), tokenizer=None, batches=[], seq_len=16, trained_seq_len=16, step=1)
    monkeypatch.setattr(module, "load_run", lambda workdir, **kwargs: run)


def _usage_error(capsys, main, argv, needle):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_diagnostics_bad_topk_and_top_are_usage_errors(monkeypatch, capsys):
    _stub_run(monkeypatch, diagnostics, FOCUS)
    _usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--topk", "5"], "focus_topk=5")
    _usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--topk", "0"], "focus_topk=0")
    _usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--top", "0"], "--top=0")
    _stub_run(monkeypatch, diagnostics, {"kind": "dense"})
    _usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--no-entropy", "--png", "x.png"], "nothing to plot")


def test_perplexity_bad_rope_ntk_factor_is_a_usage_error(monkeypatch, capsys):
    _stub_run(monkeypatch, perplexity, {"kind": "dense"})
    _usage_error(capsys, perplexity.main, ["--workdir", "RUN", "--rope-ntk-factor", "0"], "rope_ntk_factor=0.0")
    _usage_error(capsys, perplexity.main, ["--workdir", "RUN", "--rope-ntk-factor", "-1"], "rope_ntk_factor=-1.0")


def test_recall_with_every_cell_skipped_writes_json_and_no_plot(tmp_path, monkeypatch, capsys):
    from focal_jax.data.synthetic import make_examples
    from focal_jax.data.tokenizer import train_tokenizer
    from focal_jax.train import checkpoint, trainer

    workdir = tmp_path / "run"
    workdir.mkdir()
    documents = [ex.prompt + ex.answer for ex in make_examples("needle", 20, seed=0, n_sentences=4)]
    train_tokenizer(documents, 400, str(workdir / "tokenizer.model"))
    monkeypatch.setattr(trainer, "load_model", lambda path, step=None: _llama({"kind": "dense"}))
    monkeypatch.setattr(checkpoint, "read_meta", lambda path, step=None: (3, {"config": {"data": {"seq_len": 16}}}))
    rows = recall.main(["--workdir", str(workdir), "--tasks", "needle", "--lengths", "8,16", "--n", "1"])
    assert [r["n"] for r in rows] == [0, 0]  # both lengths are below needle's shortest prompt
    record = json.loads((workdir / "recall.json").read_text())
    assert record["step"] == 3 and all("skipped" in r for r in record["rows"])
    assert not (workdir / "recall.png").exists()
    assert "no plot" in capsys.readouterr().out

