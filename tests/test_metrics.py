"""Metrics side of the trainer: metrics.jsonl, TensorBoard events, resume truncation, progress bar, MFU, plots."""

import json
import pathlib
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tensorboardX.proto import event_pb2

from focal_jax.train import metrics as M
from focal_jax.train import plot


def _lines(workdir):
    return [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _tb_events(workdir):
    """All events of the TFRecord files under WORKDIR/tb, parsed independently of tensorboardX's writer."""
    events = []
    for path in sorted((pathlib.Path(workdir) / "tb").glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])  # length, then crc(length), payload, crc(payload)
            events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
            i += 12 + n + 4
    return events


def _scalars(workdir):
    return {(v.tag, e.step): v.simple_value for e in _tb_events(workdir) for v in e.summary.value}


# ---------------------------------------------------------------- metrics.jsonl


def test_jsonl_records_are_plain_floats(tmp_path):
    before = time.time()
    with M.MetricWriter(str(tmp_path), enabled=True) as w:
        w.write(1, {"loss": np.float32(2.5), "lr": jnp.asarray(3e-4), "tokens": 4096, "acc": 0.25})
        w.write(2, {"loss": 1.5}, kind="eval")
        # flushed at once: visible before close
        assert [r["step"] for r in _lines(tmp_path)] == [1, 2]
    train, evaluation = _lines(tmp_path)
    assert set(train) == {"step", "kind", "loss", "lr", "tokens", "acc", "time"}
    assert train["kind"] == "train" and evaluation["kind"] == "eval"
    assert train["loss"] == 2.5 and train["lr"] == pytest.approx(3e-4) and train["tokens"] == 4096.0
    assert all(type(train[k]) is float for k in ("loss", "lr", "tokens", "acc", "time"))
    assert type(train["step"]) is int
    assert before <= train["time"] <= evaluation["time"] <= time.time()
    assert M.read_metrics(str(tmp_path), kind="eval") == [evaluation]
    assert M.read_metrics(str(tmp_path)) == [train, evaluation]


def test_write_rejects_bad_input(tmp_path):
    with M.MetricWriter(str(tmp_path), enabled=True) as w:
        with pytest.raises(ValueError, match="'step' is reserved"):
            w.write(1, {"step": 1.0})
        with pytest.raises(ValueError, match="'loss' must be a scalar"):
            w.write(1, {"loss": np.ones(3)})
        with pytest.raises(ValueError, match="kind"):
            w.write(1, {"loss": 1.0}, kind="")


def test_disabled_writer_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    with M.MetricWriter(str(workdir), enabled=False) as w:
        w.write(1, {"loss": 1.0})
    assert not workdir.exists()
    # the default follows jax.process_index(): this single process is process 0
    with M.MetricWriter(str(workdir)) as w:
        assert w.enabled


def test_resume_keeps_each_step_once(tmp_path):
    with M.MetricWriter(str(tmp_path), enabled=True) as w:
        for step in range(1, 11):
            w.write(step, {"loss": 10.0 - step})
    with M.MetricWriter(str(tmp_path), resume_step=6, enabled=True) as w:
        w.write(7, {"loss": 0.5})
    records = _lines(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert records[5]["loss"] == 4.0 and records[6]["loss"] == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "tb"]  # no temp file left
    # TensorBoard is told to drop the redone steps: the new event file starts with a START at step 7
    starts = [e.step for e in _tb_events(tmp_path) if e.HasField("session_log")]
    assert starts == [7]


def test_a_run_with_no_checkpoint_drops_every_earlier_record(tmp_path):
    """resume_step=-1 (a run that starts with no checkpoint to resume): whatever an earlier attempt logged goes,
    step 0 too (a zero-shot evaluation), in metrics.jsonl and TensorBoard."""
    with M.MetricWriter(str(tmp_path), enabled=True) as w:
        w.write(0, {"loss": 1.0}, kind="eval")
        w.write(1, {"loss": 2.0})
    with M.MetricWriter(str(tmp_path), resume_step=-1, enabled=True) as w:
        w.write(0, {"loss": 3.0}, kind="eval")
    assert [(r["step"], r["loss"]) for r in _lines(tmp_path)] == [(0, 3.0)]
    assert [e.step for e in _tb_events(tmp_path) if e.HasField("session_log")] == [0]
    with pytest.raises(ValueError, match="resume_step must be >= -1, got -2"):
        M.MetricWriter(str(tmp_path), resume_step=-2, enabled=True)


def test_truncated_last_line(tmp_path):
    with M.MetricWriter(str(tmp_path), enabled=True) as w:
        for step in (1, 2, 3):
            w.write(step, {"loss": 1.0})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 4, "kind": "tr')  # killed mid-write
    assert [r["step"] for r in M.read_metrics(str(tmp_path))] == [1, 2, 3]
    # a later writer (even without resume_step) does not append onto the broken line
    with M.MetricWriter(str(tmp_path), enabled=True) as w:
        w.write(4, {"loss": 1.0})
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]
    # a broken line in the middle is corruption, not a kill: it is reported with its line number
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        M.read_metrics(str(tmp_path))


def test_read_metrics_missing_file_names_workdir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        M.read_metrics(str(tmp_path / "nowhere"))


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars(tmp_path):
    with M.MetricWriter(str(tmp_path), enabled=True) as w:
        w.write(3, {"loss": 2.5, "lr": 0.125})
        w.write(4, {"loss": 2.25}, kind="eval")
    assert _scalars(tmp_path) == {("train/loss", 3): 2.5, ("train/lr", 3): 0.125, ("eval/loss", 4): 2.25}


# ---------------------------------------------------------------- progress bar


def test_progress_bar(capsys):
    with M.Progress(10, initial_step=2, enabled=True) as bar:
        bar.update(5, loss=np.float32(2.3456), tokens_per_s=12345.0, mfu=0.4321)
        bar.update(10, loss=1.0, tokens_per_s=2000.0)
    err = capsys.readouterr().err
    assert "10/10" in err and "loss=1.0000" in err and "tok/s=2.00k" in err
    with M.Progress(10, enabled=False) as bar:
        bar.update(3, loss=1.0, tokens_per_s=1.0)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="initial_step=11"):
        M.Progress(10, initial_step=11)


# ---------------------------------------------------------------- peak FLOP/s and MFU


class _FakeDevice:
    def __init__(self, device_kind, platform="gpu"):
        self.device_kind, self.platform = device_kind, platform


def test_peak_flops():
    assert jax.devices()[0].platform == "cpu"
    assert M.peak_flops() is None
    assert M.peak_flops(_FakeDevice("NVIDIA H100 80GB HBM3", platform="cpu")) is None
    expected = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H200": 989e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200 NVL": 835e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA A100-SXM4-40GB": 312e12,
        "TPU v4": 275e12,
        "TPU v5 lite": 197e12,
        "TPU v5": 459e12,
        "TPU v5p": 459e12,
        "TPU v6 lite": 918e12,
        "tpu V5 LITE": 197e12,  # case-insensitive
        "Quantum Abacus 9000": None,
    }
    for kind, peak in expected.items():
        assert M.peak_flops(_FakeDevice(kind)) == peak, kind
        assert M.peak_flops(kind) == peak, kind


def test_flops_and_mfu_arithmetic():
    # 6 * 100 + 12 * 2 * 10 * 4 = 600 + 960
    assert M.train_flops_per_token(100, 2, 10, 4) == 1560.0
    # 1000 tok/s * 1560 FLOP/tok on 2 devices of 1e6 FLOP/s each
    assert M.mfu(1000.0, 1560.0, 2, 1e6) == pytest.approx(0.78)
    # GPT-2 small-like: 6 * 85e6 + 12 * 12 * 1024 * 768 = 510e6 + 113_246_208 = 623_246_208 FLOP/token;
    # 200k tok/s on 8 H100: 1.246492416e14 / 7.912e15
    flops = M.train_flops_per_token(85_000_000, 12, 1024, 768)
    assert flops == 623_246_208.0
    assert M.mfu(200_000.0, flops, 8, M.peak_flops("NVIDIA H100 80GB HBM3")) == pytest.approx(0.01575445, rel=1e-6)
    assert M.mfu(1000.0, 1560.0, 2, None) is None
    with pytest.raises(ValueError, match="seq_len"):
        M.train_flops_per_token(100, 2, 0, 4)
    assert M.train_flops_per_token(100, 2, 10, 4, n_frozen=40) == 1560.0 - 80  # 4 FLOPs per frozen parameter
    with pytest.raises(ValueError, match="n_frozen"):
        M.train_flops_per_token(100, 2, 10, 4, n_frozen=101)
    with pytest.raises(ValueError, match="n_devices=0"):
        M.mfu(1.0, 1.0, 0, 1e12)


# ---------------------------------------------------------------- plots


def _fake_run(workdir, scale):
    with M.MetricWriter(str(workdir), enabled=True) as w:
        for step in range(1, 21):
            w.write(step, {"loss": scale * 5.0 / step + 1.0, "lr": 1e-3})
            if step % 5 == 0:
                w.write(step, {"loss": scale * 5.0 / step + 1.2}, kind="eval")


def _assert_png(path):
    data = pathlib.Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_losses_two_workdirs(tmp_path):
    _fake_run(tmp_path / "a", 1.0)
    _fake_run(tmp_path / "b", 2.0)
    out = str(tmp_path / "figs" / "loss.png")
    assert plot.plot_losses([str(tmp_path / "a"), str(tmp_path / "b")], out, logy=True) == out
    _assert_png(out)
    for name in ("compare", "curve.v2"):  # a PNG at the path returned, whatever the name ends with
        _assert_png(plot.plot_losses([str(tmp_path / "a")], str(tmp_path / name)))
    with pytest.raises(ValueError, match="1 labels"):
        plot.plot_losses([str(tmp_path / "a"), str(tmp_path / "b")], out, labels=["x"])


def test_default_panels_add_dominance_and_tau_per_layer_and_patterns_match_in_layer_order(tmp_path):
    """Without metrics, a Focus run's plot has its dominance and a learned temperature's its tau per layer
    (FOCAL_SPEC OQ-F4: 'always log per-layer tau and the fraction of clipped values'); a pattern panel has one line
    per matching metric, in layer order."""
    _fake_run(tmp_path / "plain", 1.0)
    with M.MetricWriter(str(tmp_path / "learned"), enabled=True) as w:
        for step in (10, 20):
            w.write(step, {"loss": 3.0 / step}, kind="train")
            w.write(step, {"loss": 4.0 / step, "dominance": 0.3, "dominance/layer_0": 0.3, "tau": 7.0,
                           "tau_clipped": 0.1, **{f"tau/layer_{i}": 7.0 + i / 10 for i in range(12)},
                           **{f"tau_clipped/layer_{i}": 0.01 * i for i in range(12)}}, kind="eval")
    learned, plain = (M.read_metrics(str(tmp_path / name)) for name in ("learned", "plain"))
    assert plot.default_panels([learned]) == ["loss", "dominance/layer_*", "tau/layer_*", "tau_clipped/layer_*"]
    assert plot.default_panels([[{"loss": 1.0, "dominance": 0.5}]]) == ["loss", "dominance"]  # (before 0.6.23)
    assert plot.default_panels([learned, plain]) == ["loss"]  # panels every run can fill
    assert plot._matching(learned, "tau/layer_*") == [f"tau/layer_{i}" for i in range(12)]  # 2 before 10, no 'tau'
    assert plot._matching(learned, "tau") == ["tau"] and plot._matching(plain, "tau/layer_*") == []
    _assert_png(plot.plot_losses([str(tmp_path / "learned")], str(tmp_path / "learned.png")))
    with pytest.raises(ValueError, match=r"plain' has no 'tau/layer_\*' records"):
        plot.plot_losses([str(tmp_path / "plain")], str(tmp_path / "x.png"), metrics=["loss", "tau/layer_*"])


def test_plot_cli(tmp_path, capsys):
    _fake_run(tmp_path / "a", 1.0)
    _fake_run(tmp_path / "b", 2.0)
    out = str(tmp_path / "cmp.png")
    argv = [str(tmp_path / "a"), str(tmp_path / "b"), "--out", out, "--metric", "loss,lr", "--labels", "base,focus"]
    assert plot.main(argv) == 0
    assert capsys.readouterr().out.strip() == out
    _assert_png(out)


def test_plot_command_line_runs_without_warnings(tmp_path):
    """`python -m focal_jax.train.plot`, as the README gives it: runpy warned that the package had imported the
    module already (the trainer imported it), on every call."""
    _fake_run(tmp_path / "a", 1.0)
    out = str(tmp_path / "cmp.png")
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "focal_jax.train.plot",
                           str(tmp_path / "a"), "--out", out], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr, proc.stderr
    _assert_png(out)


def test_plot_errors_name_the_workdir(tmp_path, capsys):
    _fake_run(tmp_path / "a", 1.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        plot.plot_losses([str(tmp_path / "a"), str(tmp_path / "empty")], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match=r"a' has no 'grad_norm' records.*loss"):
        plot.plot_losses([str(tmp_path / "a")], str(tmp_path / "x.png"), metrics=("grad_norm",))
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")])
    assert "empty" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("trainable", ["all", "centroids"])
def test_train_flops_estimate_matches_the_compiled_step(trainable):
    """The trainer's FLOPs per token against XLA's count of the compiled train step, training everything and a
    Focus retrofit's centroids only (frozen matrices get no weight gradient: it was 6 N for them, 1.5x too many)."""
    from focal_jax.nn.llama import Llama, focal_config
    from focal_jax.nn.retrofit import FocusConfig, retrofit
    from focal_jax.train.optimizer import OptimConfig, make_optimizer, split_trainable
    from focal_jax.train.trainer import make_steps, model_flops_per_token

    b, t = 2, 64
    config = focal_config("tiny", d_model=128, intermediate=344, n_heads=2, head_dim=64, n_kv_heads=2, n_layers=2,
                          vocab_size=256)
    model = retrofit(Llama(config, rngs=nnx.Rngs(0)), FocusConfig(groups=4, dim=16, window=16), rngs=0)
    optim = OptimConfig(trainable=trainable)
    graphdef, params, frozen = split_trainable(model, optim)
    tx = make_optimizer(optim, 10)
    train_step, _ = make_steps(graphdef, tx, jnp.float32)
    batch = {"inputs": jnp.zeros((b, t), jnp.int32), "targets": jnp.zeros((b, t), jnp.int32),
             "positions": jnp.tile(jnp.arange(t), (b, 1)), "segment_ids": jnp.ones((b, t), jnp.int32),
             "loss_mask": jnp.ones((b, t), jnp.float32)}
    cost = jax.jit(train_step).lower(params, tx.init(params), frozen, batch).compile().cost_analysis()
    compiled = (cost[0] if isinstance(cost, list) else cost)["flops"] / (b * t)
    estimate = model_flops_per_token(model, frozen, t)
    assert 0.85 < compiled / estimate < 1.15, compiled / estimate
