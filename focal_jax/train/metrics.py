"""Training metrics: a JSON-lines + TensorBoard writer, a progress bar, and MFU arithmetic.

``MetricWriter(workdir)`` appends one JSON object per ``write`` to ``WORKDIR/metrics.jsonl``
(``{"step": 100, "kind": "train", "loss": 3.2, ..., "time": 1735689600.0}``) and the same scalars to TensorBoard
under ``WORKDIR/tb`` (tag ``kind/name``). Only process 0 writes in a multi-host run. ``read_metrics`` reads the file
back; the plots in ``focal_jax.train.plot`` are built on it.

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s of the devices, with the model FLOPs of
``train_flops_per_token`` and the peaks of ``PEAK_FLOPS``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import tqdm

METRICS_FILE = "metrics.jsonl"
_RESERVED = ("step", "kind", "time")


def _parse_lines(path: str) -> list[dict]:
    """Records of a metrics.jsonl file; a malformed *last* line (a run killed mid-write) is dropped."""
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {line[:80]!r}") from None
    return records


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def read_metrics(workdir: str, kind: str | None = None) -> list[dict]:
    """All records of ``WORKDIR/metrics.jsonl`` in file order, optionally only those of one ``kind`` ('train', 'eval').

    A truncated last line (a run killed while writing it) is ignored. Raises FileNotFoundError naming the workdir if
    it has no metrics file.
    """
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"workdir {workdir!r} has no {METRICS_FILE} (was a run logged there?)")
    records = _parse_lines(path)
    return records if kind is None else [r for r in records if r.get("kind") == kind]


class MetricWriter:
    """Appends scalar metrics to ``WORKDIR/metrics.jsonl`` and to TensorBoard (``WORKDIR/tb``).

    Args:
      workdir: run directory (created if missing).
      resume_step: the step of the checkpoint a run resumes from. Records with step > resume_step (logged by the
        killed run after its last checkpoint, and about to be redone) are removed from metrics.jsonl (atomic
        rewrite), and TensorBoard is told to purge them too (``purge_step``), so each step appears once; -1 for a
        run that starts with no checkpoint to resume (every earlier record goes, step 0 too). A half-written last
        line (a killed run) is dropped in any case.
      enabled: whether this process writes; default: only process 0 (``jax.process_index() == 0``). A disabled
        writer touches no file.

    Usable as a context manager (``close`` on exit).
    """

    def __init__(self, workdir: str, *, resume_step: int | None = None, enabled: bool | None = None):
        self.workdir = workdir
        self.enabled = jax.process_index() == 0 if enabled is None else bool(enabled)
        self.path = os.path.join(workdir, METRICS_FILE)
        self._file = self._tb = None
        if not self.enabled:
            return
        if resume_step is not None and int(resume_step) < -1:
            raise ValueError(f"resume_step must be >= -1, got {resume_step}")
        os.makedirs(workdir, exist_ok=True)
        if os.path.exists(self.path) and (resume_step is not None or not _ends_with_newline(self.path)):
            # Drop the redone steps, and a half-written last line that the next append would run into.
            kept = [r for r in _parse_lines(self.path) if resume_step is None or r["step"] <= resume_step]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        # Imported here: tensorboardX imports torch wherever torch is installed (2 s on a 2-core CPU machine; on a
        # GPU machine torch's CUDA libraries then load before jax's), and only the writing process needs it.
        from tensorboardX import SummaryWriter

        purge = None if resume_step is None else int(resume_step) + 1
        self._tb = SummaryWriter(os.path.join(workdir, "tb"), purge_step=purge)

    def write(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """Log scalar ``metrics`` (Python, numpy or JAX scalars) at ``step`` under ``kind`` ('train', 'eval', ...).

        The JSON line is flushed at once. Raises ValueError for a reserved name (step, kind, time) and, on the
        writing process, for a non-scalar value. A disabled writer does not read the values at all.
        """
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty string, got {kind!r}")
        for name in set(metrics) & set(_RESERVED):
            raise ValueError(f"metric name {name!r} is reserved (reserved: {', '.join(_RESERVED)})")
        if not self.enabled:
            return  # and no device-to-host copy of the values on the other processes
        values = {}
        for name, value in metrics.items():
            arr = np.asarray(value)
            if arr.shape != ():
                raise ValueError(f"metric {name!r} must be a scalar, got shape {arr.shape}")
            values[name] = float(arr)
        record = {"step": int(step), "kind": kind, **values, "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for name, value in values.items():
            self._tb.add_scalar(f"{kind}/{name}", value, int(step), walltime=record["time"])

    def flush(self) -> None:
        """Flush TensorBoard events to disk (the JSON lines are flushed on every write)."""
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close both outputs; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._tb.close()
            self._file = self._tb = None

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Progress:
    """A tqdm progress bar on stderr: step/total, rate, ETA, and a postfix with loss, tokens/s and MFU (when known).

    ``enabled`` defaults to process 0 only. On a non-TTY stderr (a CI or cluster log) it redraws at most every 30 s,
    so the log stays short.
    """

    def __init__(self, total_steps: int, initial_step: int = 0, enabled: bool | None = None):
        if total_steps < 0 or not 0 <= initial_step <= total_steps:
            raise ValueError(f"need total_steps >= 0 and 0 <= initial_step <= total_steps, got {total_steps=}, "
                             f"{initial_step=}")
        enabled = jax.process_index() == 0 if enabled is None else enabled
        self.bar = tqdm.tqdm(total=total_steps, initial=initial_step, unit="step", file=sys.stderr,
                             dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0,
                             disable=not enabled)

    def update(self, step: int, *, loss: float, tokens_per_s: float, mfu: float | None = None) -> None:
        """Move the bar to ``step`` (the number of steps done) and show the latest loss, throughput and MFU."""
        postfix = {"loss": f"{float(loss):.4f}", "tok/s": tqdm.tqdm.format_sizeof(float(tokens_per_s))}
        if mfu is not None:
            postfix["mfu"] = f"{100 * mfu:.1f}%"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(int(step) - self.bar.n)

    def write(self, message: str) -> None:
        """Print ``message`` on stdout on a line of its own, above the bar (nothing when the bar is disabled)."""
        if not self.bar.disable:
            self.bar.write(message, file=sys.stdout)
            sys.stdout.flush()

    def close(self) -> None:
        """Close the bar (prints its final state)."""
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Dense bf16 peak FLOP/s per device (no sparsity), keyed by a substring of jax's ``device.device_kind``. The longest
# matching key wins ('TPU v5 lite' before 'TPU v5', 'H100 PCIe' before 'H100').
PEAK_FLOPS = {
    "H100": 989e12,  # SXM, e.g. 'NVIDIA H100 80GB HBM3'
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,  # NVIDIA's datasheet: 1,671 TFLOP/s bf16 with sparsity, per card
    "H200 NVL": 835e12,  # likewise
    "H200": 989e12,  # 'NVIDIA H200' (also matches 'NVIDIA GH200 ...', the same H100-class chip)
    "A100": 312e12,  # 'NVIDIA A100-SXM4-80GB', 'NVIDIA A100-SXM4-40GB', 'NVIDIA A100-PCIE-40GB'
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p reports 'TPU v5'
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
}


def peak_flops(device: Any = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device (default ``jax.devices()[0]``), or None on CPU or for an unknown kind.

    ``device`` may be a jax Device or a device-kind string such as 'NVIDIA H100 80GB HBM3'. Matching is by
    case-insensitive substring against the keys of ``PEAK_FLOPS``, longest key first.
    """
    device = jax.devices()[0] if device is None else device
    if isinstance(device, str):
        kind = device
    else:
        if getattr(device, "platform", None) == "cpu":
            return None
        kind = device.device_kind
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in kind.lower():
            return PEAK_FLOPS[key]
    return None


def train_flops_per_token(n_params: int, n_layers: int, seq_len: int, d_model: int, *, n_frozen: int = 0) -> float:
    """Model FLOPs of one training step per token: ``6 * n_params - 2 * n_frozen + 12 * n_layers * seq_len *
    d_model``.

    The estimate of the PaLM paper (Chowdhery et al. 2022, appendix B): each parameter that takes part in a matmul
    costs 2 FLOPs per token forward and 4 backward (6 N); attention scores and the weighted sum of values add
    ``2 * 2 * seq_len * d_model`` per layer forward, times 3 with the backward pass. Causal attention is counted fully
    (as if every query saw every key), the convention of PaLM and MaxText, so MFU stays comparable across papers;
    Focus sparsity is not credited either: MFU measures the dense model's work.

    Choice of N (``n_params``): all parameters that take part in matmuls, i.e. the weight matrices of the blocks and
    the output (unembedding) projection; leave out the input-embedding table (a gather, no matmul) unless it is tied to
    the output projection (then count it once), and norms/biases, which are negligible. ``d_model`` is the attention
    width, n_heads * head_dim. ``n_frozen`` of the ``n_params`` are not trained (a retrofit training its centroids,
    LoRA): the backward pass computes no gradient for them, 4 FLOPs per token instead of 6.
    """
    for name, value in (("n_params", n_params), ("n_layers", n_layers), ("seq_len", seq_len), ("d_model", d_model)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 <= n_frozen <= n_params:
        raise ValueError(f"n_frozen must be in [0, n_params={n_params}], got {n_frozen}")
    return 6.0 * n_params - 2.0 * n_frozen + 12.0 * n_layers * seq_len * d_model


def mfu(tokens_per_s: float, flops_per_token: float, n_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``tokens_per_s * flops_per_token / (n_devices * peak)``, or None if ``peak`` is None.

    ``tokens_per_s`` is the global throughput (all devices together); ``peak`` is the per-device peak of
    ``peak_flops``. Returns a fraction (0.4 means 40 %).
    """
    if peak is None:
        return None
    if n_devices < 1 or peak <= 0:
        raise ValueError(f"need n_devices >= 1 and peak > 0, got {n_devices=}, {peak=}")
    return tokens_per_s * flops_per_token / (n_devices * peak)
