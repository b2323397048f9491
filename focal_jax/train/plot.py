"""Loss curves from the ``metrics.jsonl`` of one or more run directories.

    python -m focal_jax.train.plot WORKDIR [WORKDIR ...] --out FILE.png [--metric loss] [--labels a,b] [--logy]

One panel per metric (side by side), one colour per workdir; train records are solid lines, eval records (and any
other kind) dashed with markers. The legend gives each line's last value (and, for the loss, its perplexity
exp(loss)). A metric with a ``*`` is a pattern: its panel has a line per matching metric, e.g. ``tau/layer_*``.
Without metrics: the loss and, where every run holds them, the Focus dominance and the learned temperature per
layer (``dominance/layer_*``, ``tau/layer_*``, ``tau_clipped/layer_*``; `default_panels`). The trainer calls
``plot_losses([workdir], workdir + '/loss.png')`` at the end of a run.

Rendering uses a bare ``Figure`` on the Agg canvas, not pyplot: no global backend is switched, so importing this in
a notebook leaves its inline plots alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import math
import os
import re
import sys
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from focal_jax.train.metrics import read_metrics

_MARKERS = "osD^v<>"


def default_panels(runs: Sequence[list[dict]]) -> list[str]:
    """The panels `plot_losses` draws without `metrics`, for the records of each run (`read_metrics`): 'loss', then
    'dominance/layer_*' (Focus; 'dominance', the mean over layers, for runs stored before 0.6.23) and 'tau/layer_*',
    'tau_clipped/layer_*' (a learned temperature) where every run has them."""
    def every_run_has(name):
        return all(any(name in r for r in records) for records in runs)

    panels = ["loss"]
    if every_run_has("dominance/layer_0"):
        panels.append("dominance/layer_*")
    elif every_run_has("dominance"):
        panels.append("dominance")
    if every_run_has("tau/layer_0"):
        panels += ["tau/layer_*", "tau_clipped/layer_*"]
    return panels


def _matching(records: list[dict], metric: str) -> list[str]:
    """The metric names of `records` that `metric` names: itself, or those a pattern with `*` matches (in natural
    order: layer_2 before layer_10)."""
    if "*" not in metric:
        return [metric] if any(metric in r for r in records) else []
    names = {k for r in records for k in r if fnmatch.fnmatchcase(k, metric)}
    return sorted(names, key=lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)])


def _shown(metric: str) -> str:
    """A panel's name: 'tau/layer_*' -> 'tau per layer'."""
    return metric.replace("/layer_*", " per layer")


def plot_losses(workdirs: Sequence[str], out_png: str, *, metrics: Sequence[str] | None = None,
                labels: Sequence[str] | None = None, logy: bool = False, title: str | None = None) -> str:
    """Plot ``metrics`` against step for each workdir into ``out_png``; returns ``out_png``.

    Args:
      workdirs: run directories, each with a ``metrics.jsonl`` (see ``MetricWriter``).
      out_png: output file (its directory is created if missing).
      metrics: names of the metrics to plot, one panel each; a name with ``*`` is a pattern whose panel has a line
        per matching metric (``tau/layer_*``). None: `default_panels` (the loss, and dominance and tau per layer
        where every run holds them).
      labels: one legend label per workdir; default: the workdir's basename.
      logy: logarithmic y axis.
      title: figure title; default: the metrics and labels.

    Raises FileNotFoundError naming a workdir without ``metrics.jsonl``, ValueError naming a workdir that has no
    record of a requested metric.
    """
    workdirs = [workdirs] if isinstance(workdirs, str) else list(workdirs)
    if not workdirs:
        raise ValueError(f"need at least one workdir, got {workdirs=}")
    labels = list(labels) if labels is not None else [os.path.basename(os.path.normpath(w)) for w in workdirs]
    if len(labels) != len(workdirs):
        raise ValueError(f"{len(labels)} labels {labels} for {len(workdirs)} workdirs")
    runs = [read_metrics(w) for w in workdirs]
    metrics = default_panels(runs) if metrics is None else [metrics] if isinstance(metrics, str) else list(metrics)
    if not metrics:
        raise ValueError(f"need at least one metric, got {metrics=}")

    fig = Figure(figsize=(6 * len(metrics), 4.5))
    FigureCanvasAgg(fig)
    for ax, name in zip(fig.subplots(1, len(metrics), squeeze=False)[0], metrics):
        for i, (workdir, label, records) in enumerate(zip(workdirs, labels, runs)):
            matched = _matching(records, name)
            if not matched:
                names = sorted({k for r in records for k in r} - {"step", "kind", "time"})
                raise ValueError(f"workdir {workdir!r} has no {name!r} records (its metrics: {names or 'none'})")
            for m, metric in enumerate(matched):
                kinds = list(dict.fromkeys(r["kind"] for r in records if metric in r))
                line_label = label if metric == name else f"{label} {metric}"
                for j, kind in enumerate(sorted(kinds, key=lambda k: k != "train")):
                    steps, values = zip(*[(r["step"], r[metric]) for r in records if r["kind"] == kind and metric in r])
                    style = "-" if kind == "train" else _MARKERS[j % len(_MARKERS)] + "--"
                    last = f"{values[-1]:.4g}" + (f", ppl {math.exp(min(values[-1], 700)):.4g}" if metric == "loss"
                                                  else "")
                    ax.plot(steps, values, style, color=f"C{(i * len(matched) + m) % 10}", markersize=4,
                            label=f"{line_label} ({kind}): {last}")
        ax.set_xlabel("step")
        ax.set_ylabel(_shown(name))
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", ncol=1 + (len(ax.get_lines()) - 1) // 12)  # (a line per layer: columns of 12)
    fig.suptitle(title or f"{', '.join(map(_shown, metrics))} vs step: {', '.join(labels)}")
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
                        help="metric to plot; repeat or comma-separate for several panels; a '*' pattern plots every "
                             "matching metric in one panel, e.g. 'tau/layer_*' (default: the loss, and dominance and "
                             "tau per layer where every run has them)")
    parser.add_argument("--labels", help="comma-separated legend labels, one per WORKDIR (default: basenames)")
    parser.add_argument("--logy", action="store_true", help="logarithmic y axis")
    parser.add_argument("--title", help="figure title")
    args = parser.parse_args(argv)
    metrics = [m for arg in args.metric for m in arg.split(",") if m] if args.metric else None
    labels = args.labels.split(",") if args.labels else None
    try:
        path = plot_losses(args.workdirs, args.out, metrics=metrics, labels=labels, logy=args.logy, title=args.title)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
