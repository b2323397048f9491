"""Command lines of focal_jax.eval: a bad argument or a run that cannot give what is asked ends in a usage error
(SystemExit 2, the message naming the value), never a traceback; a recall command whose every cell is skipped still
writes its JSON. Runs are stubbed (no training, no forward pass)."""

import json

import pytest
from flax import nnx

from focal_jax.eval import diagnostics, harness, helmet, perplexity, recall
from focal_jax.eval.diagnostics import Run
from focal_jax.nn.llama import Llama, LlamaConfig
from helpers import usage_error

FOCUS = dict(kind="focus", focus_groups=4, focus_dim=8, focus_window=2, focus_iters=2)


def _llama(attn):
    config = LlamaConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=32, attn=attn)
    return Llama(config, rngs=nnx.Rngs(0))


def _stub_run(monkeypatch, module, attn):
    run = Run(model=_llama(attn), tokenizer=None, batches=[], seq_len=16, trained_seq_len=16, step=1)
    monkeypatch.setattr(module, "load_run", lambda workdir, **kwargs: run)


def test_diagnostics_bad_topk_and_top_are_usage_errors(monkeypatch, capsys):
    _stub_run(monkeypatch, diagnostics, FOCUS)
    usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--topk", "5"], "focus_topk=5")
    usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--topk", "0"],
                 "argument --topk: expected an integer >= 1, got '0'")
    usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--top", "0"],
                 "--top: expected an integer >= 1, got '0'")
    _stub_run(monkeypatch, diagnostics, {"kind": "dense"})
    usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--no-entropy", "--png", "x.png"], "nothing to plot")


def test_perplexity_topk_and_window_errors_name_the_flag(monkeypatch, capsys):
    """They named topk and window, the function's arguments ('leave topk unset (None)'); a malformed --topk was
    found only after the run loaded."""
    _no_loading(monkeypatch)
    for value in ("0", "1,-1", "x", ","):
        usage_error(capsys, perplexity.main, ["--workdir", "RUN", "--topk", value],
                     f"argument --topk: expected 'all' or comma-separated integers >= 1, got '{value}'")
    _stub_run(monkeypatch, perplexity, {"kind": "dense"})
    usage_error(capsys, perplexity.main, ["--workdir", "RUN", "--topk", "all"],
                 "--topk=all needs a Focus model (kind 'focus' or 'focal+focus'); this model's attention kind is "
                 "['dense']: leave --topk out")
    _stub_run(monkeypatch, perplexity, FOCUS)
    usage_error(capsys, perplexity.main, ["--workdir", "RUN", "--topk", "2,5"],
                 "--topk=2,5: top-k must be an integer with 1 <= k <= K=4 (the model's focus_groups), got k=5")
    usage_error(capsys, perplexity.main, ["--workdir", "RUN", "--window", "8"], "--window=8: window=8 is for")


def test_perplexity_bad_rope_ntk_factor_is_ausage_error(monkeypatch, capsys):
    _stub_run(monkeypatch, perplexity, {"kind": "dense"})
    for value in "0", "-1":
        usage_error(capsys, perplexity.main, ["--workdir", "RUN", "--rope-ntk-factor", value],
                     f"must be a finite number >= 1, got '{value}'")


@pytest.mark.parametrize("module, flag", [(perplexity, "--batches"), (perplexity, "--batch-size"),
                                          (perplexity, "--seq-len"), (diagnostics, "--batches"),
                                          (diagnostics, "--batch-size"), (diagnostics, "--seq-len"),
                                          (recall, "--n"), (recall, "--batch-size"), (helmet, "--n"),
                                          (helmet, "--batch-size"), (harness, "--batch_size"),
                                          (harness, "--max_length"), (harness, "--max_gen_toks")])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_counts_below_one_are_usage_errors_naming_the_flag(monkeypatch, capsys, module, flag, value):
    """`perplexity --batches 0` said 'n_batches must be an integer >= 1, got n_batches=0', the name of a function
    argument, after the run had loaded."""
    _no_loading(monkeypatch)
    usage_error(capsys, module.main, ["--workdir", "RUN", flag, value],
                 f"argument {flag}: expected an integer >= 1, got '{value}'")


def _no_loading(monkeypatch):
    """Every command's loading of its run (and the diagnostics' evaluation) fails the test: what is refused must be
    refused before it."""
    def loaded(*args, **kwargs):
        pytest.fail("loaded (or evaluated) the run before refusing the arguments")

    for module, name in ((perplexity, "load_run"), (diagnostics, "load_run"), (recall, "load_for_decoding"),
                         (helmet, "load_for_decoding")):
        monkeypatch.setattr(module, name, loaded)


def test_outputs_that_cannot_be_written_are_refused_before_the_run_loads(tmp_path, monkeypatch, capsys):
    """An --out (--png) that is a directory, or below a file, used to fail only after the whole evaluation, its
    results lost; recall's --out names a directory, so there an existing file is refused."""
    _no_loading(monkeypatch)
    a_file = tmp_path / "file.json"
    a_file.write_text("{}")
    for main in perplexity.main, diagnostics.main:
        usage_error(capsys, main, ["--workdir", "RUN", "--out", str(tmp_path)],
                     f"--out={tmp_path} is a directory; expected the path of a file")
        usage_error(capsys, main, ["--workdir", "RUN", "--out", str(a_file / "x.json")], f"{a_file} is a file")
    usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--png", str(tmp_path)],
                 f"--png={tmp_path} is a directory")
    usage_error(capsys, recall.main, ["--workdir", "RUN", "--out", str(a_file)],
                 f"--out={a_file} is a file; expected a directory")
    usage_error(capsys, recall.main, ["--workdir", "RUN", "--out", str(a_file / "sub")], f"{a_file} is a file")
    for flag in "--out", "--png":
        usage_error(capsys, helmet.main, ["--workdir", "RUN", "--data", "DATA", flag, str(tmp_path)],
                     f"{flag}={tmp_path} is a directory")
    usage_error(capsys, helmet.main, ["--workdir", str(a_file), "--data", "DATA"],  # the default: WORKDIR/helmet.json
                 f"{a_file} is a file")


def test_outputs_that_can_be_written_are_accepted(tmp_path):
    """An existing file is overwritten and a missing folder made where the command makes it (perplexity,
    diagnostics, recall); harness's --output needs its folder to exist."""
    from focal_jax._validation import output_dir_error, output_file_error

    a_file = tmp_path / "file.json"
    a_file.write_text("{}")
    assert output_file_error("--out", str(a_file), make_folder=False) == ""
    assert output_file_error("--out", str(tmp_path / "new" / "x.json"), make_folder=True) == ""
    assert output_file_error("--out", "x.json", make_folder=False) == ""  # the working directory
    assert output_file_error("--output", str(tmp_path / "new" / "x.json"), make_folder=False) == (
        f"--output={tmp_path / 'new' / 'x.json'}: its directory {tmp_path / 'new'} does not exist; expected an "
        f"existing directory (create it)")
    assert output_dir_error("--out", str(tmp_path)) == output_dir_error("--out", str(tmp_path / "a" / "b")) == ""


def test_diagnostics_without_entropy_of_a_model_without_focus_is_ausage_error(monkeypatch, capsys):
    """It used to print nothing and exit 0 (the routing tables are all it prints without the entropy)."""
    _stub_run(monkeypatch, diagnostics, {"kind": "focal", "focal_t": 0.5})
    monkeypatch.setattr(diagnostics, "diagnose", lambda *args, **kwargs: pytest.fail("evaluated"))
    usage_error(capsys, diagnostics.main, ["--workdir", "RUN", "--no-entropy"],
                 "--no-entropy leaves nothing to report for a model without Focus layers (attention kind ['focal'])")


def test_rope_ntk_factor_below_one_is_ausage_error(monkeypatch, capsys):
    """Dynamic NTK scaling needs a factor >= 1 (as Hugging Face's 'dynamic' rope type); 0.5 used to be accepted."""
    _no_loading(monkeypatch)
    for main, required in (perplexity.main, []), (recall.main, []), (helmet.main, ["--data", "DATA"]):
        for value in "0.5", "nan", "inf":
            usage_error(capsys, main, ["--workdir", "RUN", *required, "--rope-ntk-factor", value],
                         f"argument --rope-ntk-factor: the dynamic NTK scaling factor must be a finite number >= 1, "
                         f"got '{value}'")
    for value in 0.5, float("nan"), float("inf"):  # the library's own check (the Python API, a training config)
        with pytest.raises(ValueError, match=f"rope_ntk_factor={value}: the dynamic NTK scaling factor must be"):
            recall.with_rope_ntk(_llama({"kind": "dense"}), value, trained_len=16)


def test_recall_with_every_cell_skipped_writes_json_and_no_plot(tmp_path, monkeypatch, capsys):
    from focal_jax.data.synthetic import make_examples
    from focal_jax.data.tokenizer import train_tokenizer
    from focal_jax.train import checkpoint, trainer

    workdir = tmp_path / "run"
    workdir.mkdir()
    documents = [ex.prompt + ex.answer for ex in make_examples("needle", 20, seed=0, n_sentences=4)]
    train_tokenizer(documents, 400, str(workdir / "tokenizer.model"))
    monkeypatch.setattr(trainer, "load_model", lambda path, step=None, mesh=None: _llama({"kind": "dense"}))
    monkeypatch.setattr(checkpoint, "read_meta", lambda path, step=None: (3, {"config": {"data": {"seq_len": 16}}}))
    rows = recall.main(["--workdir", str(workdir), "--tasks", "needle", "--lengths", "8,16", "--n", "1"])
    assert [r["n"] for r in rows] == [0, 0]  # both lengths are below needle's shortest prompt
    record = json.loads((workdir / "recall.json").read_text())
    assert record["step"] == 3 and all("skipped" in r for r in record["rows"])
    assert not (workdir / "recall.png").exists()
    assert "no plot" in capsys.readouterr().out



def test_a_mesh_that_cannot_be_made_is_refused_before_the_run_loads(monkeypatch, capsys):
    """`--mesh`: a malformed value, an axis outside data / fsdp / tensor, sizes that do not fit the 8 devices, or a
    batch size that its data x fsdp axes do not divide name the value, in every command, before anything loads."""
    from focal_jax.eval import _cli, harness
    from focal_jax.train import sharding

    assert _cli.MESH_AXES == sharding.MESH_AXES  # (the command lines parse --mesh without the training stack)
    _no_loading(monkeypatch)
    monkeypatch.setattr(harness, "hf_model", lambda *args, **kwargs: pytest.fail("loaded the model"))
    commands = [(perplexity.main, []), (diagnostics.main, []), (recall.main, []), (helmet.main, ["--data", "DATA"]),
                (harness.main, ["--tasks", "x"])]
    for main, required in commands:
        for value, needle in (
                ("tensor", "argument --mesh: expected AXIS=SIZE pairs separated by commas, each of the axes data, "
                           "fsdp, tensor at most once (e.g. tensor=8), got 'tensor'"),
                ("model=8", "got 'model=8'"), ("tensor=2,tensor=4", "got 'tensor=2,tensor=4'"),
                ("tensor=two", "tensor='two' in 'tensor=two': the size must be an integer"),
                ("tensor=3", "--mesh: mesh {'data': 1, 'fsdp': 1, 'tensor': 3} has 3 devices, but there are 8"),
                ("fsdp=-1,tensor=-1", "--mesh: mesh sizes must be >= 1, with at most one -1"),
                ("tensor=0", "--mesh: mesh sizes must be >= 1")):
            usage_error(capsys, main, ["--workdir", "RUN", *required, "--mesh", value], needle)
    for main, required in commands[2:]:  # the decoding commands: their batch size is known before anything loads
        flag = "--batch_size" if main is harness.main else "--batch-size"
        usage_error(capsys, main, ["--workdir", "RUN", *required, "--mesh", "data=2,fsdp=2,tensor=2", flag, "6"],
                     f"{flag}=6 must be a multiple of 4, the data x fsdp size of --mesh {{'data': 2, 'fsdp': 2, "
                     f"'tensor': 2}}, which split each batch's rows")
