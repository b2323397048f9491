"""The training config's checks (`focal_jax.train.config.check_config`, `trainer.check_run`) on settings that passed
them and then failed late, trained something else than asked, or were named without their section: a model's own
sliding window covering every key, a bad seed or section, a warmup longer than the schedule, section prefixes, the
Focus attention sink's field in every section that sets it."""

import os
import re

import ml_collections
import numpy as np
import pytest

from focal_jax.nn.attention import AttentionConfig
from focal_jax.nn.gpt2 import GPT2Config
from focal_jax.nn.retrofit import FocusConfig
from focal_jax.train import trainer
from focal_jax.train.config import check_attention_fields, check_config, config_differences, default_config, warmup_note
from focal_jax.train.optimizer import learning_rate_schedule
from helpers import load_experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_GPT2 = {"family": "gpt2", "vocab_size": 512, "n_positions": 128, "d_model": 64, "n_layers": 2, "n_heads": 4}


def _set(config: ml_collections.ConfigDict, path: str, value) -> ml_collections.ConfigDict:
    """`config` with the dotted `path` set to `value`, of any type (as a config file may give it)."""
    *head, last = path.split(".")
    section = config
    for name in head:
        section = section[name]
    if last in section:
        del section[last]  # a ConfigDict keeps the type of a field it holds
    section[last] = value
    return config


# --------------------------------------------------------------------------------- a model's own window


@pytest.mark.parametrize("family, field", [("llama", "model.attn.window"), ("gpt2", "model.window")])
def test_a_models_own_window_covering_every_key_is_refused_for_training(tmp_path, family, field):
    """`--config.model.attn.window=1000` on 64-token sequences trained full causal attention, silently, where
    `retrofit.window=1000` was refused; now the model's own window (GPT-2's `model.window`) is refused the same
    way by `check_run`, and one key shorter trains. `check_config` still takes it (a stored run loads)."""
    for window, refused in ((1000, True), (63, True), (62, False)):
        config = default_config()
        config.data.seq_len = 64
        if family == "llama":
            config.model.attn = {"window": window}
        else:
            config.model = {**TINY_GPT2, "window": window}
        check_config(config)
        if refused:
            with pytest.raises(ValueError, match=re.escape(
                    f"{field}={window} covers every key of data.seq_len=64 sequences (key j is local to query i iff "
                    f"0 <= i - j <= window): the window would change nothing; give a window < 63")):
                trainer.check_run(config, str(tmp_path / "run"))
        else:
            trainer.check_run(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


# ------------------------------------------------------------------------------------- top-level fields


@pytest.mark.parametrize("seed", [-3, 1.5, True, "3", 2**32, None])
def test_a_bad_seed_is_named_by_check_config(seed):
    """`seed=-3` or `seed=1.5` passed the check and failed later as a traceback of the data pipeline."""
    with pytest.raises(ValueError, match=re.escape(f"seed must be an integer >= 0 and < 2**32 (the data shuffle's "
                                                   f"limit), got seed={seed!r}")):
        check_config(_set(default_config(), "seed", seed))


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1, np.int64(5)])
def test_a_good_seed_is_taken(seed):
    run = check_config(_set(default_config(), "seed", seed))
    assert run.seed == seed and type(run.seed) is int


def test_counters_and_mesh_sizes_take_numpy_integers():
    """`total_steps=np.int64(20)` (a sweep's value) was refused as not an integer; it is taken as a Python int."""
    config = _set(_set(default_config(), "total_steps", np.int64(20)), "mesh", {"data": np.int32(1)})
    run = check_config(_set(config, "batch_size", np.int64(8)))
    assert (run.total_steps, run.batch_size, run.mesh["data"]) == (20, 8, 1)
    assert type(run.total_steps) is type(run.batch_size) is type(run.mesh["data"]) is int


@pytest.mark.parametrize("path, value, message", [
    ("init_from", 5, "init_from must be None or a directory (a path), got init_from=5"),
    ("mesh", 4, "mesh must be a section (a dict of its fields), got mesh=4"),
    ("model", "llama", "model must be a section (a dict of its fields), got model='llama'"),
    ("data", 5, "data must be a section (a dict of its fields), got data=5"),
    ("optim", [1], "optim must be a section (a dict of its fields), got optim=[1]"),
    ("retrofit", 1, "retrofit must be a section (a dict of its fields), got retrofit=1"),
    ("compute_dtype", ["float32"], "compute_dtype=['float32'] is not one of ('float32', 'bfloat16', 'float16')")])
def test_a_top_level_value_of_another_type_is_named(path, value, message):
    """These were a TypeError traceback from inside check_config (`dict(5)`, `os.path.expanduser(5)`, an unhashable
    dtype), which the CLI does not turn into one line."""
    with pytest.raises(ValueError, match=re.escape(message)):
        check_config(_set(default_config(), path, value))


# -------------------------------------------------------------------- a warmup longer than the schedule


def test_a_warmup_longer_than_the_run_is_noted_as_the_schedule_runs_it():
    """warmup_steps=500 over 20 steps: the schedule cuts the warmup to 20 steps, so the lr rises the whole run (its
    last update at 19/20 of lr) and never decays; the note says so. The configs shipped do this on purpose in their
    short runs (`default_config()`: 2000 warmup steps of 100), so it is a note, not an error."""
    config = default_config()
    config.total_steps = 20
    config.optim.update(lr=1e-3, warmup_steps=500)
    run = check_config(config)
    note = warmup_note(run)
    assert note is not None and "\n" not in note
    assert "optim.warmup_steps=500 is longer than the run, total_steps=20" in note
    assert "cut to 20 steps" in note and "19/20 of optim.lr=0.001" in note and "never decays" in note
    lrs = np.asarray(learning_rate_schedule(run.optim, run.total_steps)(np.arange(run.total_steps)))
    assert np.all(np.diff(lrs) > 0) and np.isclose(lrs[-1], 0.95e-3)  # what the note says: rises, 19/20 at the end


def test_a_warmup_longer_than_decay_steps_is_noted():
    config = default_config()
    config.total_steps = 10
    config.optim.update(lr=1e-3, warmup_steps=5, decay_steps=2, final_lr_fraction=0.1)
    run = check_config(config)
    note = warmup_note(run)
    assert note is not None and "optim.warmup_steps=5 is longer than optim.decay_steps=2" in note
    assert "cut to 2 steps" in note and "no cosine decay" in note
    lrs = np.asarray(learning_rate_schedule(run.optim, run.total_steps)(np.arange(5)))
    np.testing.assert_allclose(lrs, [0.0, 0.5e-3, 1e-3, 1e-4, 1e-4], rtol=1e-5)  # peak after 2, final one later


@pytest.mark.parametrize("total_steps, warmup_steps, decay_steps", [(20, 20, None), (20, 5, None), (0, 2000, None),
                                                                    (20, 8, 8), (20, 0, 3)])
def test_a_warmup_that_fits_has_no_note(total_steps, warmup_steps, decay_steps):
    config = default_config()
    config.total_steps = total_steps
    config.optim.warmup_steps = warmup_steps
    config.optim.decay_steps = decay_steps
    assert warmup_note(check_config(config)) is None


def test_train_warns_of_a_warmup_longer_than_the_run_once(tmp_path, monkeypatch, capsys):
    """`train` (the Python API and `python -m focal_jax.train`) prints the note once, as a warning line, after the
    config's checks (the training itself is replaced by a no-op here)."""
    config = load_experiment("quickstart", "runlocal")
    config.batch_size = 8  # the 8 fake devices of conftest
    config.optim.warmup_steps = 500
    monkeypatch.setattr(trainer, "_train", lambda *args, **kwargs: [])
    assert trainer.train(config, str(tmp_path / "run")) == []
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "optim.warmup_steps=500 is longer than the run, total_steps=20" in warnings[0], \
        warnings


# ------------------------------------------------------------------------------------- section prefixes


@pytest.mark.parametrize("path, value, message", [
    ("data.seq_len", 0, r"^data\.seq_len must be an integer >= 2, got seq_len=0"),
    ("data.shuffle", "maybe", r"^data\.shuffle must be True or False"),
    ("data.eval_fraction", 1.5, r"^data\.eval_fraction must be a number in \[0, 1\)"),
    ("model.d_model", 0, r"^model\.d_model must be an integer >= 1, got d_model=0"),
    ("model.attn", {"kind": "focal", "focal_t": -0.4}, r"^model\.attn\.focal_t must be a finite number > 0"),
    ("model.attn", {"kind": "flash"}, r"^model\.attn\.kind='flash' is not one of"),
    # messages that name their section or class, or do not start with a field, stay as they were
    ("optim.lr", -1.0, r"^optim\.lr must be a finite number > 0"),
    ("data.source", "txt", r"^unknown source='txt'"),
    ("retrofit.focal", {"t": -1.0}, r"^FocalConfig: t must be"),
])
def test_a_bad_field_of_a_section_is_named_with_its_section(path, value, message):
    """`data.seq_len=0` was named 'seq_len must be ...', `model.attn.focal_t=-0.4` 'focal_t must be ...'."""
    with pytest.raises(ValueError, match=message):
        check_config(_set(default_config(), path, value))


# ------------------------------------------------------------------------------ the Focus attention sink


@pytest.mark.parametrize("sink", [-1, 1.5, True, "2"])
def test_a_bad_focus_sink_is_named_wherever_it_is_set(sink):
    """`focus_sink` (FOCUS_SPEC OQ-12) is an integer >= 0 on the layer, GPT-2's config, a training config's model
    section and a Focus retrofit (`sink`); anything else is refused naming the field and the value."""
    shown = re.escape(repr(sink))
    with pytest.raises(ValueError, match=rf"^focus_sink must be an integer >= 0, got focus_sink={shown}$"):
        AttentionConfig(d_model=8, n_heads=2, n_kv_heads=2, head_dim=4, kind="focus", focus_sink=sink)
    with pytest.raises(ValueError, match=rf"^GPT2Config: focus_sink must be an integer >= 0, got focus_sink={shown}"):
        GPT2Config(n_layers=1, kind="focus", focus_sink=sink)
    with pytest.raises(ValueError, match=rf"^model\.attn\.focus_sink must be an integer >= 0, got focus_sink={shown}"):
        check_config(_set(default_config(), "model.attn", {"kind": "focus", "focus_sink": sink}))
    with pytest.raises(ValueError, match=rf"^FocusConfig: sink must be an integer >= 0, got sink={shown}$"):
        FocusConfig(groups=4, dim=8, window=4, sink=sink)


def test_focus_sink_is_set_by_each_config_section_and_refused_on_kinds_that_do_not_read_it():
    """`model.attn.focus_sink` (LLaMA), `model.focus_sink` (GPT-2) and `retrofit.focus.sink` reach the attention
    config; on a non-Focus kind the setting would change nothing and training refuses it; a stored run without the
    field resumes under the default (0) and is told apart from one with a sink."""
    llama = check_config(_set(default_config(), "model.attn", {"kind": "focus", "focus_sink": 2}))
    assert llama.model.attention.focus_sink == 2
    gpt2 = check_config(_set(default_config(), "model", {**TINY_GPT2, "kind": "focal+focus", "focus_sink": 3}))
    assert gpt2.model.attention.focus_sink == 3
    retrofit = check_config(_set(default_config(), "retrofit.focus", {"groups": 4, "dim": 8, "window": 4, "sink": 1}))
    assert retrofit.retrofit[0].attention_fields()["focus_sink"] == 1
    for model in ({"size": "tiny", "attn": {"kind": "focal", "focus_sink": 2}}, {**TINY_GPT2, "focus_sink": 2}):
        run = check_config(_set(default_config(), "model", model))
        with pytest.raises(ValueError, match=r"does not read focus_sink=2 \(read by kinds \('focus', 'focal\+focus'"):
            check_attention_fields(run.model)
    stored = {"model": {"size": "tiny", "attn": {"kind": "focus"}},
              "retrofit": {"focus": {"groups": 4, "dim": 8, "window": 4}}}
    now = {"model": {"size": "tiny", "attn": {"kind": "focus", "focus_sink": 0}},
           "retrofit": {"focus": {"groups": 4, "dim": 8, "window": 4, "sink": 0}}}
    assert config_differences(stored, now) == []
    now["model"]["attn"]["focus_sink"], now["retrofit"]["focus"]["sink"] = 2, 1
    assert config_differences(stored, now) == ["model.attn.focus_sink: 0 (stored) vs 2 (now)",
                                               "retrofit.focus.sink: 0 (stored) vs 1 (now)"]
