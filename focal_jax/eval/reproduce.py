"""Small-scale reproductions of the two papers' claims: one command trains (cached), evaluates, plots, and writes
REPRODUCTION.md.

  python -m focal_jax.eval.reproduce [--only focal,focus_retrofit] [--out experiments/reproduction] [--steps N]
      [--workdirs DIR] [--render-only]

Every study is one function (`STUDIES`) that builds its configs from `experiments/quickstart.py` (the small LLaMA on
the builtin corpus: d_model 128, 4 layers, 4 heads of 32, vocab 2000, 128-token rows, batch 16) and the retrofit
experiment files (loaded by path, as the trainer's `--config` does), trains each run with `focal_jax.train.train` into
`--workdirs/<run>` (a finished run is reused, an interrupted one resumes), evaluates it with `focal_jax.eval`, and
writes `<study>.json` and its PNGs into `--out`. REPRODUCTION.md (`--markdown`, default next to BENCHMARKS.md) is then
rendered from every `<study>.json` present: one row per claim (the paper's number and where it is, ours, whether the
direction holds, the command); studies not run yet are listed with their command.

Scale: from-scratch runs train `--steps` steps (default 400, ~2 M tokens), retrofits and adapters half of that, one
dense base shared by every retrofit. The noise level is the held-out-loss spread between two seeds of the dense base;
"A beats B" holds only when the difference exceeds it (`judge`), "A matches B" when it does not; the other claims'
rules (pair counts, recall, group shares) are written next to them.
"""

import argparse
import dataclasses
import glob
import importlib.util
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from focal_jax.configs import common
from focal_jax.data import build_data
from focal_jax.data.config import DataConfig
from focal_jax.data.tokenizer import tokenizer_file, workdir_tokenizer
from focal_jax.eval.diagnostics import load_run
from focal_jax.eval.perplexity import evaluate_model, topk_table
from focal_jax.eval.recall import recall_suite
from focal_jax.train import checkpoint, train
from focal_jax.train.config import check_config
from focal_jax.train.metrics import read_metrics
from focal_jax.train.plot import plot_losses
from focal_jax.train.trainer import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(ROOT, "experiments", "reproduction")
DEFAULT_MARKDOWN = os.path.join(ROOT, "REPRODUCTION.md")
DEFAULT_WORKDIRS = "/tmp/focal_jax_reproduction"
DEFAULT_STEPS = 400
COMMAND = "python -m focal_jax.eval.reproduce"


def log(message: str):
    print(f"[reproduce {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Settings, configs, cached runs
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Context:
    """Where and how big: `steps` of the from-scratch runs (retrofits train `steps // 2`), `tiny` (the runlocal
    model and 64-token rows: tests), the run directories, the output folder, the held-out batches per evaluation."""

    workdirs: str
    out: str
    steps: int = DEFAULT_STEPS
    tiny: bool = False
    eval_batches: int = 8

    @property
    def retrofit_steps(self) -> int:
        return max(2, self.steps // 2)

    @property
    def window(self) -> int:
        """The Focus local window: a quarter of the row (32 of 128 tokens; 16 of 64 when tiny)."""
        return 16 if self.tiny else 32

    def workdir(self, name: str, steps: int) -> str:
        return os.path.join(self.workdirs, f"{name}-{'tiny-' if self.tiny else ''}s{steps}")


def load_experiment(name: str, arg: str = "") -> ml_collections.ConfigDict:
    """`get_config(arg)` of `experiments/<name>.py`, loaded by path (experiments is not a package). The shared
    `focal_jax.configs.common` is reloaded first, so that a long session reads the experiment files and the module
    they import at the same version."""
    path = os.path.join(ROOT, "experiments", f"{name}.py")
    if not os.path.isfile(path):
        raise ValueError(f"experiment {name!r} not found at {path}")
    importlib.reload(common)
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def _schedule(config, ctx: Context, steps: int, *, eval_points: int = 4):
    config.total_steps = steps
    config.log_every = max(1, steps // 40)
    config.eval_every = max(1, steps // eval_points)
    config.eval_batches = 1 if ctx.tiny else 4
    config.ckpt_every = steps
    config.keep_checkpoints = 1
    return config


def scratch_config(ctx: Context, attn: dict, *, seed: int = 0) -> ml_collections.ConfigDict:
    """The quickstart model (or its runlocal form when tiny) with attention settings `attn`, trained from scratch."""
    config = load_experiment("quickstart", "runlocal" if ctx.tiny else "")
    model = config.model.to_dict()
    model["attn"] = dict(attn)
    config.model = ml_collections.ConfigDict(model)
    config.seed = seed
    if ctx.tiny:
        config.batch_size = 8  # a multiple of the 8 fake devices of the tests
    return _schedule(config, ctx, ctx.steps)


def head_dim(config) -> int:
    run = check_config(config)
    return run.model.attention.head_dim


def retrofit_config(ctx: Context, base: str, *, steps: int | None = None, eval_points: int = 4,
                    **focus) -> ml_collections.ConfigDict:
    """`experiments/focus_retrofit.py` on the dense `base` workdir (centroids only), at the base's row length and
    batch, with Focus settings `focus` (groups, window, gate, causal, assign, ...)."""
    arg = ",".join([f"init_from={base}"] + (["runlocal"] if ctx.tiny else [])
                   + [f"{k}={v}" for k, v in focus.items() if k != "assign"])
    config = load_experiment("focus_retrofit", arg)
    if "assign" in focus:
        config.retrofit.focus.assign = focus["assign"]
    base_config = checkpoint.read_meta(base)[1]["config"]
    config.data.seq_len = base_config["data"]["seq_len"]
    config.batch_size = base_config["batch_size"]
    return _schedule(config, ctx, steps or ctx.retrofit_steps, eval_points=eval_points)


def finished(workdir: str, steps: int) -> bool:
    """Whether `workdir` holds a checkpoint at step >= `steps`."""
    if not os.path.isdir(os.path.join(workdir, "checkpoints")) and not os.path.isdir(workdir):
        return False
    try:
        return checkpoint.read_meta(workdir)[0] >= steps
    except (ValueError, FileNotFoundError):
        return False


def run(ctx: Context, name: str, config) -> str:
    """Train `config` into the cached workdir `name` (skipped when finished; resumed when interrupted). A run from
    another (`init_from`) is named after it too, so that a base trained for other steps gets its own."""
    if config.get("init_from"):
        name = f"{name}-from-{os.path.basename(os.path.normpath(config.init_from))}"
    workdir = ctx.workdir(name, config.total_steps)
    if finished(workdir, config.total_steps):
        log(f"{name}: finished run reused ({workdir})")
        return workdir
    log(f"{name}: training {config.total_steps} steps into {workdir}")
    start = time.perf_counter()
    train(config, workdir)
    log(f"{name}: trained in {time.perf_counter() - start:.0f}s")
    return workdir


def dense_base(ctx: Context, seed: int = 0) -> str:
    """The dense (t = 1) quickstart model: Focal's baseline, the base of every retrofit; seed 1 gives the noise."""
    return run(ctx, "dense" if seed == 0 else f"dense-seed{seed}", scratch_config(ctx, {"kind": "dense"}, seed=seed))


# ----------------------------------------------------------------------------------------------------------------
# Evaluation helpers
# ----------------------------------------------------------------------------------------------------------------


_BATCHES: dict = {}


def held_out_batches(ctx: Context, workdir: str) -> list:
    """The held-out batches of a run's data (`load_run`'s), built once per workdir and reused."""
    key = (workdir, ctx.eval_batches)
    if key not in _BATCHES:
        _BATCHES[key] = load_run(workdir, n_batches=ctx.eval_batches).batches
    return _BATCHES[key]


def tokenizer_of(workdir: str):
    """The tokenizer a run trained with (the copy in its workdir)."""
    return workdir_tokenizer(workdir)


def noise_level(ctx: Context) -> dict:
    """Held-out loss of the dense base at seeds 0 and 1 and their spread (the noise level of every comparison)."""
    batches = held_out_batches(ctx, dense_base(ctx, 0))
    losses = [evaluate_model(load_model(dense_base(ctx, seed)), batches)["loss"] for seed in (0, 1)]
    return {"loss_seed0": losses[0], "loss_seed1": losses[1], "spread": abs(losses[0] - losses[1])}


def judge(better: float, worse: float, noise: float, *, lower_is_better: bool = True) -> str:
    """'yes' when `better` beats `worse` by more than `noise`, 'no' when it loses by more, else 'unclear'."""
    gain = (worse - better) if lower_is_better else (better - worse)
    if gain > noise:
        return "yes"
    if gain < -noise:
        return "no"
    return "unclear"


def claim(claim: str, paper: str, ours: str, holds: str) -> dict:
    return {"claim": claim, "paper": paper, "ours": ours, "holds": holds}


def eval_batches_of(ctx: Context, workdir: str, data: DataConfig, n: int | None = None) -> list:
    """Held-out batches of another data source `data`, tokenized with the run's tokenizer."""
    _, meta = checkpoint.read_meta(workdir)
    run_config = check_config(ml_collections.ConfigDict(checkpoint.stored_config(meta)))
    data = dataclasses.replace(data, tokenizer=tokenizer_file(workdir), seq_len=run_config.data.seq_len)
    built = build_data(data, global_batch=run_config.batch_size, seed=0, process_index=0, process_count=1)
    return built.eval_batches(n or ctx.eval_batches)


def short_input_change(base_model, model, batches, length: int) -> float:
    """Max |logit difference| between two models on the first `length` tokens of the held-out rows (inputs no
    longer than the window + 1: every pair is local)."""
    worst = 0.0
    for batch in batches[:2]:
        inputs = jnp.asarray(batch["inputs"][:, :length])
        positions = jnp.broadcast_to(jnp.arange(length), inputs.shape)
        a, b = base_model(inputs, positions=positions), model(inputs, positions=positions)
        worst = max(worst, float(jnp.max(jnp.abs(a - b))))
    return worst


def causality_leak(model, batch, i: int) -> float:
    """Max |change| of the logits at positions <= i when every token after i is replaced (0 for a causal model)."""
    inputs = jnp.asarray(batch["inputs"])
    vocab = model.config.vocab_size
    perturbed = inputs.at[:, i + 1:].set((inputs[:, i + 1:] + 7) % vocab)
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    a, b = model(inputs, positions=positions), model(perturbed, positions=positions)
    return float(jnp.max(jnp.abs(a[:, :i + 1] - b[:, :i + 1])))


def _figure(width=6.5, height=4.5):
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig, path: str) -> str:
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def write_study(ctx: Context, name: str, result: dict) -> str:
    """Write `<out>/<name>.json` (the study's claims, numbers, settings, PNG names); returns its path."""
    command = study_command(name) + ("" if ctx.steps == DEFAULT_STEPS else f" --steps {ctx.steps}") + (
        " --tiny" if ctx.tiny else "")
    result = {"study": name, "command": command, "steps": ctx.steps, "tiny": ctx.tiny,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **result}
    path = os.path.join(ctx.out, f"{name}.json")
    os.makedirs(ctx.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=float)
    log(f"{name}: wrote {path}")
    return path


def study_command(name: str) -> str:
    return f"{COMMAND} --only {name}"


def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


# ----------------------------------------------------------------------------------------------------------------
# Studies
# ----------------------------------------------------------------------------------------------------------------


PAPER_TS = (0.6, 0.5, 0.4, 0.3)  # the constant temperatures of the Focal paper's Fig. 8, against t = 1
EXTRA_T = 0.7  # a milder one, run beside them (not judged): where a tiny model's best t may lie


def study_focal(ctx: Context) -> dict:
    """Focal Attention: constant t in {1, 0.7, 0.6, 0.5, 0.4, 0.3} (the paper's Fig. 8 grid {0.3, 0.4, 0.5, 0.6}
    against 1, which the claims are judged on, and a milder 0.7 beside it), learned tau ('prefix' and the paper's
    'sequence' mean): held-out loss, recall accuracy at increasing lengths, the sequence mean's leak."""
    base = scratch_config(ctx, {"kind": "dense"})
    scale = math.sqrt(head_dim(base) / 128)  # FOCAL_SPEC OQ-F6: tau_min / tau_max are for head_dim 128
    tau = {"tau_min": 5.0 * scale, "tau_max": 10.0 * scale}
    runs = {"t=1 (dense)": dense_base(ctx)}
    for t in (EXTRA_T, *PAPER_TS):
        runs[f"t={t}"] = run(ctx, f"focal-t{t}", scratch_config(ctx, {"kind": "focal", "focal_t": t}))
    for mode in ("prefix", "sequence"):
        runs[f"learned ({mode})"] = run(ctx, f"focal-learned-{mode}",
                                        scratch_config(ctx, {"kind": "focal_learned", "tau_mode": mode, **tau}))
    noise = noise_level(ctx)
    lengths = (32, 64, 128) if ctx.tiny else (64, 128, 256)
    n_examples = 2 if ctx.tiny else 10
    evals, recall = {}, {}
    batches = held_out_batches(ctx, runs["t=1 (dense)"])
    tokenizer = tokenizer_of(runs["t=1 (dense)"])
    for label, workdir in runs.items():
        model = load_model(workdir)
        evals[label] = evaluate_model(model, batches)["loss"]
        rows = recall_suite(model, tokenizer, tasks=("needle", "json_kv"), lengths=lengths,
                            n_examples=n_examples, batch_size=n_examples)
        recall[label] = rows
        log(f"focal: {label}: held-out loss {evals[label]:.4f}, recall "
            f"{[(r['task'], r['length'], r['accuracy']) for r in rows]}")
    leak = {mode: causality_leak(load_model(runs[f"learned ({mode})"]), batches[0],
                                 i=batches[0]["inputs"].shape[1] // 2) for mode in ("prefix", "sequence")}

    def mean_recall(label):
        values = [r["accuracy"] for r in recall[label] if r["accuracy"] is not None]
        return float(np.mean(values)) if values else None

    # Figures: held-out loss against t, loss curves, recall against length.
    pngs = {}
    fig, ax = _figure()
    ts = [1.0, EXTRA_T, *PAPER_TS]
    ax.plot(ts, [evals["t=1 (dense)"], *(evals[f"t={t}"] for t in ts[1:])], "o-", label="constant t")
    for i, mode in enumerate(("prefix", "sequence")):
        ax.axhline(evals[f"learned ({mode})"], color=f"C{i + 1}", ls="--", label=f"learned tau ({mode})")
    ax.axhspan(evals["t=1 (dense)"] - noise["spread"], evals["t=1 (dense)"] + noise["spread"], color="gray",
               alpha=0.2, label="dense +- seed spread")
    ax.set_xlabel("temperature t")
    ax.set_ylabel("held-out loss")
    ax.invert_xaxis()
    ax.legend(fontsize="small")
    ax.set_title("Focal: held-out loss vs temperature")
    pngs["loss_vs_t"] = os.path.basename(_save(fig, os.path.join(ctx.out, "focal_loss_vs_t.png")))
    pngs["curves"] = os.path.basename(plot_losses(list(runs.values()), os.path.join(ctx.out, "focal_curves.png"),
                                                  labels=list(runs), title="Focal: training loss"))
    fig, ax = _figure()
    for i, (label, rows) in enumerate(recall.items()):
        points = {}
        for r in rows:
            if r["accuracy"] is not None:
                points.setdefault(r["length"], []).append(r["accuracy"])
        if points:
            xs = sorted(points)
            ax.plot(xs, [np.mean(points[x]) for x in xs], "o-", color=f"C{i}", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("recall accuracy (needle, json_kv mean)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize="small")
    ax.set_title("Focal: recall vs length")
    pngs["recall"] = os.path.basename(_save(fig, os.path.join(ctx.out, "focal_recall.png")))

    dense, spread = evals["t=1 (dense)"], noise["spread"]
    sharper = {t: evals[f"t={t}"] for t in PAPER_TS}  # the claims are the paper's, on its grid
    best_t = min(sharper, key=sharper.get)
    all_better = [judge(sharper[t], dense, spread) for t in sharper]
    extra = f"; outside the paper's grid, t={EXTRA_T} {_fmt(evals[f't={EXTRA_T}'])}"
    claims = [
        claim("Every t < 1 beats t = 1 (held-out loss)", "Fig. 8: t in {0.3, 0.4, 0.5, 0.6} vs 1 (plot only; 2.7B, "
              "26B tokens)",
              "loss t=1 " + _fmt(dense) + "; " + ", ".join(f"t={t} {_fmt(v)}" for t, v in sharper.items()) + extra,
              "yes" if all(j == "yes" for j in all_better) else ("no" if "no" in all_better else "unclear")),
        claim("t = 0.4 is the best constant temperature", "Fig. 8: best of {0.3, 0.4, 0.5, 0.6}",
              f"best of those t = {best_t} ({_fmt(sharper[best_t])}; t=0.4 {_fmt(sharper[0.4])}){extra}",
              "yes" if best_t == 0.4 and all(sharper[t] - sharper[0.4] > spread for t in sharper if t != 0.4)
              else ("unclear" if abs(sharper[0.4] - sharper[best_t]) <= spread else "no")),
        claim("Focal (t = 0.4) beats the baseline on synthetic recall", "App. D Fig. 9: large gains on 3 of 4 tasks",
              f"mean accuracy over {lengths} tokens: t=1 {_fmt(mean_recall('t=1 (dense)'), 2)}, t=0.4 "
              f"{_fmt(mean_recall('t=0.4'), 2)}" + ("" if mean_recall("t=0.4") or mean_recall("t=1 (dense)") else
                                                  " (neither recalls anything: the test cannot tell them apart)"),
              "unclear" if not (mean_recall("t=0.4") or mean_recall("t=1 (dense)")) else
              judge(mean_recall("t=0.4"), mean_recall("t=1 (dense)"), 1.0 / max(1, 2 * n_examples),
                    lower_is_better=False)),
        claim("Learned tau beats the baseline", "Table 1: avg 56.71 vs 55.83 (2.7B)",
              f"loss learned (prefix) {_fmt(evals['learned (prefix)'])} vs t=1 {_fmt(dense)}",
              judge(evals["learned (prefix)"], dense, spread)),
        claim("Constant t = 0.4 beats learned tau", "Table 1: avg 58.02 vs 56.71 (2.7B)",
              f"loss t=0.4 {_fmt(sharper[0.4])} vs learned (prefix) {_fmt(evals['learned (prefix)'])}",
              judge(sharper[0.4], evals["learned (prefix)"], spread)),
        claim("The paper's whole-sequence mean leaks future tokens; the prefix mean is causal",
              "FOCAL_SPEC OQ-F2 (inferred; no number)",
              f"max logit change at positions <= i from tokens > i: prefix {leak['prefix']:.1e}, sequence "
              f"{leak['sequence']:.1e}; held-out loss prefix {_fmt(evals['learned (prefix)'])}, sequence "
              f"{_fmt(evals['learned (sequence)'])}",
              "yes" if leak["prefix"] < 1e-4 < leak["sequence"] else "no"),
    ]
    return {"title": "Focal Attention: temperature, learned tau, prefix vs sequence mean", "claims": claims,
            "noise": noise, "held_out_loss": evals, "recall": recall, "leak": leak, "tau_range": tau,
            "pngs": pngs, "runs": runs}


def study_focus_retrofit(ctx: Context) -> dict:
    """Focus retrofit on the frozen dense base (centroids only, K = 4): perplexity before and after, inputs shorter
    than the window unchanged, the top-k table, gate 'paper' vs 'log', causal vs non-causal routing."""
    base = dense_base(ctx)
    variants = {"paper gate": {}, "log gate": {"gate": "log"}, "causal routing": {"causal": "true"}}
    runs = {label: run(ctx, "retrofit-K4" + "".join(f"-{k}{v}" for k, v in changes.items()),
                       retrofit_config(ctx, base, groups=4, window=ctx.window, **changes))
            for label, changes in variants.items()}
    noise = noise_level(ctx)
    base_model = load_model(base)
    batches = held_out_batches(ctx, base)
    base_row = topk_table(base_model, batches, topk=None)[0]
    tables, short = {}, {}
    for label, workdir in runs.items():
        model = load_model(workdir)
        tables[label] = topk_table(model, batches, topk="all")
        short[label] = short_input_change(base_model, model, batches, ctx.window + 1)
        log(f"focus_retrofit: {label}: " + ", ".join(f"{r['form']}{r['k'] or ''} {r['perplexity']:.2f}"
                                                     for r in tables[label]))

    # Figures: the top-k trade-off and the loss curves.
    fig, ax = _figure()
    for i, (label, rows) in enumerate(tables.items()):
        hard = [r for r in rows if r["form"] == "hard"]
        ax.plot([100 * r["pairs_retained"] for r in hard], [r["perplexity"] for r in hard], "o-", color=f"C{i}",
                label=f"{label} (hard top-k)")
        for r in hard:
            ax.annotate(f"k={r['k']}", (100 * r["pairs_retained"], r["perplexity"]), fontsize=7)
        soft = next(r for r in rows if r["form"] == "soft")
        ax.axhline(soft["perplexity"], color=f"C{i}", ls=":", label=f"{label} (soft gate)")
    ax.axhline(base_row["perplexity"], color="k", ls="--", label="dense base")
    ax.set_xlabel("causal pairs retained (%)")
    ax.set_ylabel("held-out perplexity")
    ax.legend(fontsize="small")
    ax.set_title("Focus retrofit (K=4): top-k trade-off")
    pngs = {"topk": os.path.basename(_save(fig, os.path.join(ctx.out, "focus_retrofit_topk.png"))),
            "curves": os.path.basename(plot_losses(list(runs.values()),
                                                   os.path.join(ctx.out, "focus_retrofit_curves.png"),
                                                   labels=list(runs), title="Focus retrofit: training loss"))}

    spread = noise["spread"]
    base_loss, base_ppl = base_row["loss"], base_row["perplexity"]
    paper = {r["k"] if r["form"] == "hard" else "soft": r for r in tables["paper gate"]}
    claims = [
        claim("A centroid-only retrofit lowers perplexity (hard top-2)", "Table 2: GPT-2 124M 42.8 -> 34.2; "
              "Table 7: 42.8 -> 41.3 at top-2",
              f"ppl {base_ppl:.2f} -> top-2 {paper[2]['perplexity']:.2f} (soft gate {paper['soft']['perplexity']:.2f})",
              judge(paper[2]["loss"], base_loss, spread)),
        claim("Top-1 (argmax) degrades perplexity sharply", "Table 7: 82.9 vs 42.8 (26% pairs)",
              f"top-1 ppl {paper[1]['perplexity']:.2f} ({100 * paper[1]['pairs_retained']:.0f}% pairs) vs "
              f"{base_ppl:.2f}", judge(base_loss, paper[1]["loss"], spread)),
        claim("Top-2 keeps a fraction of the pairs", "Table 7: 60% of pairs (GPT-2), 73% (Mistral)",
              f"{100 * paper[2]['pairs_retained']:.0f}% of causal pairs, {100 * paper[2]['distant_retained']:.0f}% "
              f"of distant ones", "yes" if paper[2]["pairs_retained"] < 1 else "no"),
        claim("Top-3 of K = 4 retains every pair and recovers the pretrained perplexity",
              "Table 7: 100%; Mistral 10.8 = 10.8 (GPT-2 47.2 vs 42.8)",
              f"{100 * paper[3]['pairs_retained']:.1f}% pairs, ppl {paper[3]['perplexity']:.2f} vs {base_ppl:.2f}",
              "yes" if paper[3]["pairs_retained"] > 0.9999 and abs(paper[3]["loss"] - base_loss) < 1e-4 else "no"),
        claim("Outputs on inputs shorter than the window are unchanged", "Design (§2: local pairs never gated)",
              "max |logit change| at " + str(ctx.window + 1) + " tokens: "
              + ", ".join(f"{label} {v:.1e}" for label, v in short.items()),
              "yes" if max(short.values()) < 1e-4 else "no"),
        claim("Gate 'log' (tends to the hard mask) vs the paper's Eq. 2 gate", "OQ-1 (no paper number)",
              "; ".join(f"{label}: soft {next(r for r in tables[label] if r['form'] == 'soft')['perplexity']:.2f}, "
                        f"top-2 {[r for r in tables[label] if r['k'] == 2][0]['perplexity']:.2f}"
                        for label in ("paper gate", "log gate")), "n/a"),
        claim("Causal (prefix) routing costs little against the paper's non-causal Sinkhorn",
              "§2.6 (the paper is non-causal; no number)",
              "; ".join(f"{label}: soft {next(r for r in tables[label] if r['form'] == 'soft')['perplexity']:.2f}, "
                        f"top-2 {[r for r in tables[label] if r['k'] == 2][0]['perplexity']:.2f}"
                        for label in ("paper gate", "causal routing")),
              "n/a"),
    ]
    return {"title": "Focus retrofit (centroids only, K = 4) on the dense base", "claims": claims, "noise": noise,
            "base": base_row, "tables": tables, "short_input_change": short, "pngs": pngs, "runs": runs}


def study_focus_collapse(ctx: Context) -> dict:
    """Dominance over training, K = 8: Sinkhorn vs a softmax assignment (with and without the balance loss),
    centroid-only (phase 1) then full fine-tuning (phase 2), FOCUS_SPEC §4 / §7 / Table 8."""
    base = dense_base(ctx)
    weight = 0.1
    variants = {"sinkhorn": ({}, 0.0), "softmax": ({"assign": "softmax"}, 0.0),
                "softmax + balance loss": ({"assign": "softmax"}, weight)}
    phase1, phase2 = {}, {}
    for label, (changes, balance) in variants.items():
        config = retrofit_config(ctx, base, groups=8, window=ctx.window, eval_points=10, **changes)
        config.balance_weight = balance
        name = "collapse-K8-" + label.replace(" + balance loss", "-balance").replace(" ", "")
        phase1[label] = run(ctx, name, config)
        if label != "softmax":
            # Phase 2: every weight trained, starting from phase 1 (experiments/focus_finetune.py's protocol).
            config2 = load_experiment("focus_finetune", f"init_from={phase1[label]}" + (",runlocal" if ctx.tiny
                                                                                       else ""))
            attn = config2.model.attn.to_dict()
            attn.update({f"focus_{k}": v for k, v in changes.items()})
            config2.model.attn = attn
            config2.data.seq_len = config.data.seq_len
            config2.batch_size = config.batch_size
            config2.optim.lr = 3e-4
            config2.balance_weight = balance
            phase2[label] = run(ctx, name + "-ft", _schedule(config2, ctx, ctx.retrofit_steps, eval_points=10))

    def dominance(workdir):
        return [(r["step"], r["dominance"]) for r in read_metrics(workdir, "eval") if "dominance" in r]

    curves = {label: dominance(w) for label, w in phase1.items()}
    curves.update({f"{label}, full FT": [(s + ctx.retrofit_steps, d) for s, d in dominance(w)]
                   for label, w in phase2.items()})
    fig, ax = _figure(7.5, 4.5)
    for i, (label, points) in enumerate(curves.items()):
        if points:
            ax.plot(*zip(*points), "o-" if "full FT" not in label else "s--", color=f"C{i}", label=label, ms=3)
    ax.axhline(1 / 8, color="gray", ls=":", label="perfect balance 1/K")
    ax.axvline(ctx.retrofit_steps, color="k", lw=0.5)
    ax.set_xlabel("step (phase 1: centroids only; then full fine-tuning)")
    ax.set_ylabel("dominance (share of tokens in the largest group)")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small")
    ax.set_title("Group dominance over training, K = 8")
    pngs = {"dominance": os.path.basename(_save(fig, os.path.join(ctx.out, "focus_collapse_dominance.png")))}

    def last(label):
        return curves[label][-1][1] if curves.get(label) else None

    claims = [
        claim("A softmax assignment collapses: one group absorbs the tokens", "§7: within 600 steps",
              f"softmax, centroid-only, final dominance {_fmt(last('softmax'), 2)} (1/K = 0.125)",
              "yes" if (last("softmax") or 0) > 0.9 else ("no" if (last("softmax") or 1) < 0.5 else "unclear")),
        claim("Softmax + balance loss stays balanced while only the centroids train",
              "§4 two-phase table: 15.0% (K = 8)", f"dominance {_fmt(last('softmax + balance loss'), 2)}",
              "yes" if (last("softmax + balance loss") or 1) < 0.3 else "no"),
        claim("... and collapses once every weight trains", "§4: 99.4% after full FT; Table 8: collapses by step 600",
              f"dominance after full FT {_fmt(last('softmax + balance loss, full FT'), 2)}",
              "yes" if (last("softmax + balance loss, full FT") or 0) > 0.9 else
              ("no" if (last("softmax + balance loss, full FT") or 1) < 0.5 else "unclear")),
        claim("Sinkhorn stays balanced in both phases", "§4: 14.6% then 15.9%",
              f"dominance {_fmt(last('sinkhorn'), 2)} then {_fmt(last('sinkhorn, full FT'), 2)}",
              "yes" if max(last("sinkhorn") or 1, last("sinkhorn, full FT") or 1) < 0.3 else "no"),
    ]
    return {"title": "Group collapse: Sinkhorn vs softmax assignment (+ balance loss), K = 8", "claims": claims,
            "balance_weight": weight, "balance_loss": "K * sum_k f_k P_k (Switch Transformer form)",
            "dominance": curves, "pngs": pngs, "runs": {**phase1, **{f"{k} (full FT)": v for k, v in phase2.items()}}}


def study_lora_vs_centroids(ctx: Context) -> dict:
    """Adapting the frozen dense base to a new domain (the synthetic json_kv documents) with LoRA r = 4 or with Focus
    centroids: domain loss gained, general (builtin corpus) loss lost: the forgetting claim of Table 3."""
    base = dense_base(ctx)
    domain = {"source": "synthetic", "task": "json_kv", "n_synthetic": 400 if ctx.tiny else 4000}
    focus = retrofit_config(ctx, base, groups=4, window=ctx.window)
    focus.data.update(domain)
    lora = load_experiment("lora_baseline", f"init_from={base},rank=4,lr=1e-3" + (",runlocal" if ctx.tiny else ""))
    lora.data.update(domain)
    lora.data.tokenizer = focus.data.tokenizer
    lora.data.seq_len, lora.batch_size = focus.data.seq_len, focus.batch_size
    runs = {"LoRA r=4 (q, v)": run(ctx, "adapt-json-lora-r4", _schedule(lora, ctx, ctx.retrofit_steps)),
            "Focus centroids": run(ctx, "adapt-json-centroids", focus)}
    noise = noise_level(ctx)
    general = held_out_batches(ctx, base)
    domain_batches = eval_batches_of(ctx, base, DataConfig(**domain))
    models = {"base": load_model(base), **{label: load_model(w) for label, w in runs.items()}}
    results = {}
    for label, model in models.items():
        results[label] = {"domain": evaluate_model(model, domain_batches)["loss"],
                          "general": evaluate_model(model, general)["loss"]}
        log(f"lora_vs_centroids: {label}: {results[label]}")
    pngs = {"curves": os.path.basename(plot_losses(list(runs.values()),
                                                   os.path.join(ctx.out, "lora_vs_centroids_curves.png"),
                                                   labels=list(runs), title="Adapting to json_kv: training loss"))}
    fig, ax = _figure()
    labels = list(results)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, [results[k]["domain"] for k in labels], 0.4, label="domain (json_kv) loss")
    ax.bar(x + 0.2, [results[k]["general"] for k in labels], 0.4, label="general (builtin corpus) loss")
    ax.set_xticks(x, labels, fontsize="small")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize="small")
    ax.set_title("LoRA vs centroids: domain gain, general loss")
    pngs["bars"] = os.path.basename(_save(fig, os.path.join(ctx.out, "lora_vs_centroids.png")))
    spread = noise["spread"]
    b, l, c = results["base"], results["LoRA r=4 (q, v)"], results["Focus centroids"]
    claims = [
        claim("LoRA lowers the domain perplexity more than centroids do", "Table 3: 31.6 (r=4) vs 34.2",
              f"domain loss base {_fmt(b['domain'])} -> LoRA {_fmt(l['domain'])}, centroids {_fmt(c['domain'])}",
              judge(l["domain"], c["domain"], spread)),
        claim("LoRA degrades general ability (forgetting)",
              "Table 3: -0.3 to -2.1 points on 4 benchmarks (r = 4 and 16)",
              f"general loss {_fmt(b['general'])} -> {_fmt(l['general'])}", judge(b["general"], l["general"], spread)),
        claim("Centroids leave general ability unchanged", "Table 3: +-0.0 on every benchmark",
              f"general loss {_fmt(b['general'])} -> {_fmt(c['general'])} (soft gate)",
              "yes" if abs(c["general"] - b["general"]) <= spread else "no"),
    ]
    return {"title": "LoRA vs Focus centroids: domain adaptation and forgetting", "claims": claims, "noise": noise,
            "losses": results, "domain": domain, "pngs": pngs, "runs": runs}


def study_focus_scratch(ctx: Context) -> dict:
    """Focus (K = 4) and Focal + Focus (t = 0.4) trained from scratch, against the dense model."""
    focus_attn = {"kind": "focus", "focus_groups": 4, "focus_dim": 16, "focus_window": ctx.window}
    runs = {"dense": dense_base(ctx),
            "focus": run(ctx, "scratch-focus-K4", scratch_config(ctx, focus_attn)),
            "focal+focus": run(ctx, "scratch-focal-focus-K4",
                               scratch_config(ctx, {**focus_attn, "kind": "focal+focus", "focal_t": 0.4}))}
    noise = noise_level(ctx)
    batches = held_out_batches(ctx, runs["dense"])
    tables = {label: topk_table(load_model(w), batches, topk=None if label == "dense" else "2")
              for label, w in runs.items()}
    for label, rows in tables.items():
        log(f"focus_scratch: {label}: " + ", ".join(f"{r['form']}{r['k'] or ''} {r['perplexity']:.2f}" for r in rows))
    curves = plot_losses(list(runs.values()), os.path.join(ctx.out, "focus_scratch_curves.png"), labels=list(runs),
                         title="From scratch: training loss")
    pngs = {"curves": os.path.basename(curves)}
    dense = tables["dense"][0]
    soft = {label: next(r for r in tables[label] if r["form"] == "soft") for label in ("focus", "focal+focus")}
    hard = {label: next(r for r in tables[label] if r["form"] == "hard") for label in ("focus", "focal+focus")}
    spread = noise["spread"]
    # The paper does not say whether its 13.82 is the soft gate's or hard top-k's (FOCUS_SPEC §6.3): judge both.
    claims = [
        claim(f"Focus trained from scratch matches or beats dense attention ({form})",
              "§6.3: 13.82 vs 13.89 PPL (7B, 2B tokens; soft or hard not stated)",
              f"ppl dense {dense['perplexity']:.2f}, Focus {form} {row['perplexity']:.2f} (ln ratio "
              f"{row['loss'] - dense['loss']:+.4f}, noise {spread:.4f})",
              "yes" if row["loss"] <= dense["loss"] + spread else "no")
        for form, row in (("soft gate", soft["focus"]), ("hard top-2", hard["focus"]))
    ] + [
        claim("Focal and Focus combine (temperature first, then the gate)", "FOCAL_SPEC OQ-F13 (no paper number)",
              f"ppl focal+focus soft {soft['focal+focus']['perplexity']:.2f}, top-2 "
              f"{hard['focal+focus']['perplexity']:.2f} vs Focus {soft['focus']['perplexity']:.2f}",
              judge(soft["focal+focus"]["loss"], soft["focus"]["loss"], spread)),
    ]
    return {"title": "Focus and Focal + Focus from scratch vs dense", "claims": claims, "noise": noise,
            "tables": tables, "pngs": pngs, "runs": runs}


# What each study tests, for REPRODUCTION.md's rows of studies not run yet.
TITLES = {
    "focus_retrofit": "Focus retrofit (centroids only): perplexity before / after, short inputs unchanged, top-k "
                      "table, gate 'paper' vs 'log', causal vs non-causal routing",
    "focal": "Focal: t in {1, 0.7, 0.6, 0.5, 0.4, 0.3}, learned tau (prefix / sequence mean): held-out loss, "
             "recall vs length",
    "focus_collapse": "Dominance over training: Sinkhorn vs softmax assignment (+ balance loss), centroid-only then "
                      "full fine-tuning",
    "lora_vs_centroids": "LoRA vs centroids on a new domain: domain gain, general loss (forgetting)",
    "focus_scratch": "Focus and Focal + Focus from scratch vs dense",
}

STUDIES = {  # in the order they run: the cheaper retrofits first, the from-scratch runs last
    "focus_retrofit": study_focus_retrofit,
    "lora_vs_centroids": study_lora_vs_centroids,
    "focus_collapse": study_focus_collapse,
    "focal": study_focal,
    "focus_scratch": study_focus_scratch,
}


# ----------------------------------------------------------------------------------------------------------------
# REPRODUCTION.md
# ----------------------------------------------------------------------------------------------------------------


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(out: str, markdown: str) -> str:
    """Write `markdown` (REPRODUCTION.md) from every `<study>.json` in `out`; studies without one are listed as not
    run yet, with their command. Returns the path."""
    results = {}
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("study") in STUDIES:
            results[data["study"]] = data
    rel = os.path.relpath(out, os.path.dirname(os.path.abspath(markdown)))
    lines = [
        "# Reproductions at small scale",
        "",
        "Each paper claim we can test on one CPU machine, with the paper's number, ours, and whether the direction "
        "holds here. Written by `python -m focal_jax.eval.reproduce` (`focal_jax/eval/reproduce.py`) from the "
        f"results in `{rel}/`; rerun a study with its command.",
        "",
        "**Read with care.** The models are tiny (the quickstart LLaMA: d_model 128, 4 layers, 4 heads of 32, vocab "
        "2000, 128-token rows from the builtin corpus, a few hundred steps; the papers use 124M to 70B parameters and "
        "billions of tokens), and each setting is one seed. The noise level is the held-out-loss spread between two "
        "seeds of the dense model: a claim that one setting beats another is 'yes' or 'no' only when the difference "
        "exceeds it, else 'unclear', and a claim that settings match ('matches or beats', 'unchanged') holds within "
        "it. Pair counts are checked exactly, recall against half of one example's share of the accuracy, and group "
        "collapse against fixed shares of the largest group (collapsed above 0.9, not below 0.5, balanced below "
        "0.3); each rule is next to its claim in `reproduce.py`. "
        "'n/a': the paper states no direction. A 'no' here says the effect does not show at this scale, not that "
        "the paper is wrong.",
        "",
        "| study | claim | paper | ours | holds | command |",
        "|---|---|---|---|---|---|",
    ]
    for name in STUDIES:
        if name not in results:
            lines.append(f"| {name} | {_cell(TITLES[name])} | - | not run yet | - | "
                         f"`{study_command(name)}` |")
            continue
        for c in results[name]["claims"]:
            lines.append(f"| {name} | {_cell(c['claim'])} | {_cell(c['paper'])} | {_cell(c['ours'])} | "
                         f"**{c['holds']}** | `{results[name]['command']}` |")
    verdicts = [(name, c) for name, data in results.items() for c in data["claims"]]
    if verdicts:
        lines += ["", "**Where the direction does not hold at our scale** ('no'): " + (
            "; ".join(f"{name}: {c['claim']}" for name, c in verdicts if c["holds"] == "no") or "none") + ".",
                  "", "**Within the noise** ('unclear'): " + (
            "; ".join(f"{name}: {c['claim']}" for name, c in verdicts if c["holds"] == "unclear") or "none") + "."]
    lines += ["", "Scale notes: the Focus window is 32 of 128 tokens (the paper: 128 of 1024), so local pairs are a "
              "far larger share of all pairs here and hard top-1 keeps more of them than the paper's 26%; the "
              "learned temperature's range [tau_min, tau_max] = [5, 10] is rescaled by sqrt(head_dim / 128) to "
              "[2.5, 5] for our head_dim 32 (FOCAL_SPEC OQ-F6); the balance loss is K * sum_k f_k P_k (Switch "
              "Transformer form, `focal_jax.train.trainer.balance_loss`) at weight 0.1; the recall suite decodes "
              "prompts up to twice the trained length."]
    for name, data in results.items():
        lines += ["", f"## {name}: {data['title']}", ""]
        noise = data.get("noise")
        scale = (f"{data['steps']} steps from scratch, {max(2, data['steps'] // 2)} for retrofits"
                 + (" (tiny test scale)" if data.get("tiny") else ""))
        lines.append(f"Run {data['date']}, {scale}." + (
            f" Noise: dense held-out loss {noise['loss_seed0']:.4f} (seed 0) vs {noise['loss_seed1']:.4f} "
            f"(seed 1), spread {noise['spread']:.4f}." if noise else ""))
        lines.append("")
        for key, png in data.get("pngs", {}).items():
            lines.append(f"![{name} {key}]({rel}/{png})")
        lines.append("")
        lines.append(f"Results: `{rel}/{name}.json`. Command: `{data['command']}`.")
    lines.append("")
    with open(markdown, "w") as f:
        f.write("\n".join(lines))
    return markdown


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    """Run the selected studies (all by default), each writing its JSON and PNGs, then render REPRODUCTION.md.
    A study that fails is reported and the others still run. Returns {study: JSON path or the error}."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--only", default="", help=f"comma-separated studies (default all): {', '.join(STUDIES)}")
    parser.add_argument("--out", default=DEFAULT_OUT, help="results JSON and PNGs (default experiments/reproduction)")
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN, help="the REPRODUCTION.md to write")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                        help=f"steps of the from-scratch runs (default {DEFAULT_STEPS}; retrofits half)")
    parser.add_argument("--workdirs", default=DEFAULT_WORKDIRS, help=f"cached run directories ({DEFAULT_WORKDIRS})")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation (default 8)")
    parser.add_argument("--tiny", action="store_true", help="the runlocal model and 64-token rows (smoke tests)")
    parser.add_argument("--render-only", action="store_true", help="only rewrite REPRODUCTION.md from the JSONs")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(STUDIES)
    unknown = [n for n in names if n not in STUDIES]
    if unknown:
        parser.error(f"unknown studies {unknown}; known: {list(STUDIES)}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    ctx = Context(workdirs=os.path.abspath(args.workdirs), out=os.path.abspath(args.out), steps=args.steps,
                  tiny=args.tiny, eval_batches=args.eval_batches)
    done = {}
    if not args.render_only:
        log(f"studies {names}, {ctx.steps} steps, workdirs {ctx.workdirs}, out {ctx.out}, "
            f"{jax.device_count()} {jax.devices()[0].platform} device(s)")
        for name in names:
            start = time.perf_counter()
            try:
                done[name] = write_study(ctx, name, STUDIES[name](ctx))
            except Exception as e:  # one failing study must not stop the others; the log says why
                import traceback
                traceback.print_exc()
                done[name] = f"failed: {type(e).__name__}: {e}"
            log(f"{name}: {done[name]} ({time.perf_counter() - start:.0f}s)")
            render(ctx.out, args.markdown)
    log(f"wrote {render(ctx.out, args.markdown)}")
    return done


if __name__ == "__main__":
    main(sys.argv[1:])
