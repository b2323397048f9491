"""Loss curves from the ``metrics.jsonl`` of one or more run directories.

    python -m focal_jax.train.plot WORKDIR [WORKDIR ...] --out FILE.png [--metric loss] [--labels a,b] [--logy]

One panel per metric (side by side), one colour per workdir; train records are solid lines, eval records (and any
other kind) dashed with markers. The legend gives each line's last value (and, for the loss, its perplexity
exp(loss)). The trainer calls ``plot_losses([workdir], workdir + '/loss.png')`` at the end of a run.

Rendering uses a bare ``Figure`` on the Agg canvas, not pyplot: no global backend is switched, so importing this in
a notebook leaves its inline plots alone.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from focal_jax.train.metrics import read_metrics

_MARKERS = "osD^v<>"


def plot_losses(workdirs: Sequence[str], out_png: str, *, metrics: Sequence[str] = ("loss",),
                labels: Sequence[str] | None = None, logy: bool = False, title: str | None = None) -> str:
    """Plot ``metrics`` against step for each workdir into ``out_png``; returns ``out_png``.

    Args:
      workdirs: run directories, each with a ``metrics.jsonl`` (see ``MetricWriter``).
      out_png: output file (its directory is created if missing).
      metrics: names of the metrics to plot, one panel each.
      labels: one legend label per workdir; default: the workdir's basename.
      logy: logarithmic y axis.
      title: figure title; default: the metrics and labels.

    Raises FileNotFoundError naming a workdir without ``metrics.jsonl``, ValueError naming a workdir that has no
    record of a requested metric.
    """
    workdirs = [workdirs] if isinstance(workdirs, str) else list(workdirs)
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    if not workdirs or not metrics:
        raise ValueError(f"need at least one workdir and one metric, got {workdirs=}, {metrics=}")
    labels = list(labels) if labels is not None else [os.path.basename(os.path.normpath(w)) for w in workdirs]
    if len(labels) != len(workdirs):
        raise ValueError(f"{len(labels)} labels {labels} for {len(workdirs)} workdirs")
    runs = [read_metrics(w) for w in workdirs]

    fig = Figure(figsize=(6 * len(metrics), 4.5))
    FigureCanvasAgg(fig)
    for ax, name in zip(fig.subplots(1, len(metrics), squeeze=False)[0], metrics):
        for i, (workdir, label, records) in enumerate(zip(workdirs, labels, runs)):
            kinds = list(dict.fromkeys(r["kind"] for r in records if name in r))
            if not kinds:
                names = sorted({k for r in records for k in r} - {"step", "kind", "time"})
                raise ValueError(f"workdir {workdir!r} has no {name!r} records (its metrics: {names or 'none'})")
            for j, kind in enumerate(sorted(kinds, key=lambda k: k != "train")):
                steps, values = zip(*[(r["step"], r[name]) for r in records if r["kind"] == kind and name in r])
                style = "-" if kind == "train" else _MARKERS[j % len(_MARKERS)] + "--"
                last = f"{values[-1]:.4g}" + (f", ppl {math.exp(min(values[-1], 700)):.4g}" if name == "loss" else "")
                ax.plot(steps, values, style, color=f"C{i % 10}", markersize=4, label=f"{label} ({kind}): {last}")
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title or f"{', '.join(metrics)} vs step: {', '.join(labels)}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
    fig.savefig(out_png, dpi=100, format="png")  # whatever the name ends with
    return out_png


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: plot several workdirs' metrics into one PNG and print its path."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.train.plot", description=__doc__.split("\n")[0])
    parser.add_argument("workdirs", nargs="+", metavar="WORKDIR", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", required=True, help="output PNG file")
    parser.add_argument("--metric", action="append",
                        help="metric to plot; repeat or comma-separate for several panels (default: loss)")
    parser.add_argument("--labels", help="comma-separated legend labels, one per WORKDIR (default: basenames)")
    parser.add_argument("--logy", action="store_true", help="logarithmic y axis")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    metrics = [m for arg in (args.metric or ["loss"]) for m in arg.split(",") if m]
    labels = args.labels.split(",") if args.labels else None
    try:
        path = plot_losses(args.workdirs, args.out, metrics=metrics, labels=labels, logy=args.logy, title=args.title)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
