"""Long-context recall suite: synthetic tasks at increasing prompt lengths, decoded greedily, accuracy per length.

Tasks (`TASKS`; generated offline by `focal_jax.data.synthetic`, each grown by its length knob):

- `needle`: one magic number hidden in filler sentences (`n_sentences`);
- `needle_multikey`: four magic numbers, one asked, the other three distractors (`n_sentences`);
- `json_kv`: a value looked up in a JSON object of random keys (`n_pairs`);
- `associative_recall`: multi-query associative recall, four queries of which three are answered (`n_pairs`);
- `frequent_words`: the most frequent word of a Zipf-distributed text (`n_words`).

For each task and target length, every example gets the largest knob value whose tokenized prompt (bos included)
fits the target, so its prompt has `tokens <= length < tokens of the same example with knob + 1`: it falls short
of the target by less than one knob unit (a filler sentence, a key-value pair, a word); a target below the task's
shortest prompt is skipped (a row with n = 0, reported), not an error. Prompts are decoded with
`focal_jax.eval.decode.greedy_decode` (any attention kind) up to the answer's length plus one token (stopping at
eos) and scored with `focal_jax.data.synthetic.score`.

Command line (prints progress and a table; writes `recall.json` and `recall.png` into `--out`, default the workdir):

  python -m focal_jax.eval.recall --workdir DIR [--tasks needle,json_kv] [--lengths 128,256,512] [--n 20]
      [--seed 0] [--topk K] [--mesh AXIS=N,...] [--out DIR]

`--topk K` evaluates a Focus model with hard top-K routing (its attention configs' `focus_topk` replaced).

A target below a task's shortest prompts (its knob at the smallest) gives no result for that task. With the tokenizer
of an `experiments/quickstart.py:runlocal` run (trained at 64 tokens) a task needs at least 27 tokens (frequent_words),
41 (json_kv), 79 (needle), 87 (associative_recall) or 149 (needle_multikey): there `--lengths 64` scores json_kv and
frequent_words only, `--lengths 160,256` every task.
"""

import argparse
import dataclasses
import json
import numbers
import os
import sys
import time
import zlib
from typing import Callable

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from focal_jax._validation import check_distinct, check_int, output_dir_error
from focal_jax.data.synthetic import Example, make_examples, score
from focal_jax.eval._cli import MESH_HELP, evaluation_mesh, mesh_shape, on_mesh, positive_int, rope_ntk_factor
from focal_jax.eval.decode import greedy_decode
from focal_jax.nn.attention import FOCUS_KINDS
from focal_jax.nn.models import attention_layers
from focal_jax.nn.retrofit import replace_attention


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """A suite task: the synthetic `task` with fixed `options`, grown by the option `knob` from `smallest` up."""

    task: str
    knob: str
    options: tuple = ()
    smallest: int = 1


TASKS = {
    "needle": RecallTask("needle", "n_sentences", (("n_keys", 1),)),
    "needle_multikey": RecallTask("needle", "n_sentences", (("n_keys", 4),)),
    "json_kv": RecallTask("json_kv", "n_pairs"),
    "associative_recall": RecallTask("associative_recall", "n_pairs", (("n_queries", 4),), smallest=4),
    "frequent_words": RecallTask("frequent_words", "n_words"),
}
DEFAULT_LENGTHS = (128, 256, 512)


class TooShort(ValueError):
    """A target length below the task's shortest prompt."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """An example sized to a target length: its knob value and its prompt's token ids (bos first if any)."""

    example: Example
    knob: int
    tokens: list


def _check_task(task):
    if task not in TASKS:
        raise ValueError(f"unknown recall task {task!r}; valid tasks: {list(TASKS)}")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids `[n]` of a prompt as the model saw documents in training: the document-start token (bos, or eos
    when the tokenizer has no bos: `focal_jax.data.tokenizer`), then the text."""
    bos = getattr(tokenizer, "bos_id", None)
    start = bos if bos is not None and bos >= 0 else tokenizer.eos_id
    return [start] + list(tokenizer.encode(text))


def _example_seed(seed: int, task: str, length: int, index: int) -> int:
    """A seed for example `index` of (`task`, `length`), independent across the three."""
    entropy = [seed, zlib.crc32(task.encode()), length, index]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def _largest_fitting(fits: Callable[[int], bool], start: int, smallest: int) -> int | None:
    """The k >= smallest with fits(k) and not fits(k + 1), galloping from `start` then bisecting; None when not
    even fits(smallest)."""
    if fits(start):
        lo, step = start, 1
        while fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = lo + step
    else:
        hi, step = start, 1
        while True:
            candidate = max(hi - step, smallest)
            if fits(candidate):
                lo = candidate
                break
            if candidate == smallest:
                return None
            hi, step = candidate, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def length_matched(task: str, tokenizer, length: int, n: int, seed: int) -> list[Sample]:
    """`n` examples of suite task `task` whose prompts fit `length` tokens as closely as the knob allows.

    Example i (its own seed from `seed`, `task`, `length`, i) takes a knob value k whose prompt has at most `length`
    tokens (`encode_prompt`) while the example of the same seed with k + 1 has more (the largest such k, as prompts
    grow with the knob): `length - (tokens of one knob unit) < tokens <= length`. Raises `TooShort` (a ValueError)
    naming `length` when even the smallest knob does not fit.
    """
    _check_task(task)
    check_int("length", length, 1)
    check_int("n", n, 1)
    spec = TASKS[task]
    samples, start = [], spec.smallest
    for i in range(n):
        example_seed = _example_seed(seed, task, length, i)
        built = {}

        def build(k):
            if k not in built:
                example = make_examples(spec.task, 1, example_seed, **dict(spec.options), **{spec.knob: k})[0]
                built[k] = Sample(example, k, encode_prompt(tokenizer, example.prompt))
            return built[k]

        knob = _largest_fitting(lambda k: len(build(k).tokens) <= length, start, spec.smallest)
        if knob is None:
            shortest = build(spec.smallest)
            raise TooShort(f"length={length} is too short for task {task!r}: its shortest prompt "
                           f"({spec.knob}={spec.smallest}) has {len(shortest.tokens)} tokens")
        samples.append(build(knob))
        start = knob  # the next example's knob is close
    return samples


def recall_suite(model, tokenizer, *, tasks=tuple(TASKS), lengths=DEFAULT_LENGTHS, n_examples: int = 20,
                 seed: int = 0, batch_size: int = 8, log: Callable[[str], None] | None = None) -> list[dict]:
    """Greedy-decoding accuracy of `model` on each recall task at each target prompt length.

    Args:
      model: a focal_jax `Llama` or `GPT2` (any attention kind).
      tokenizer: its tokenizer (`focal_jax.data.Tokenizer`: `encode`, `decode`, `bos_id`, `eos_id`).
      tasks: names from `TASKS`.
      lengths: target prompt lengths in tokens, integers >= 1 (see `length_matched` for how close prompts get).
      n_examples: examples per task and length.
      seed: the examples depend on it (and on task, length, index) only.
      batch_size: prompts decoded together.
      log: called with one progress line per (task, length), e.g. `print`, and one per decoded batch when a
        cell has several (`decode_in_batches`); None is silent.

    Returns:
      one row per (task, length), in that order: `{'task', 'length' (the target), 'prompt_tokens' (mean actual
      prompt length), 'accuracy' (`score` of the decoded texts), 'n'}`. A length below the task's shortest prompt
      gives a row with `n` 0, `prompt_tokens` and `accuracy` None and the reason under 'skipped'.
    """
    if isinstance(tasks, str) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names from {list(TASKS)}, got tasks={tasks!r}")
    for task in tasks:
        _check_task(task)
    if isinstance(lengths, (str, numbers.Number)) or not lengths:
        raise ValueError(f"lengths must be a non-empty list of integers >= 1, got lengths={lengths!r}")
    for length in lengths:
        check_int("length", length, 1)
    check_distinct("tasks", tasks)
    check_distinct("lengths", lengths)
    check_int("n_examples", n_examples, 1)
    n_positions = getattr(model.config, "n_positions", None)
    if n_positions is not None and max(lengths) >= n_positions:
        raise ValueError(f"length={max(lengths)} leaves no room to generate within the model's "
                         f"n_positions={n_positions}")
    eos = getattr(tokenizer, "eos_id", None)
    eos = eos if eos is not None and eos >= 0 else None
    # Every prompt is built (or fails) before any decoding.
    cells, skipped = {}, {}
    for task in tasks:
        for length in lengths:
            try:
                cells[task, length] = length_matched(task, tokenizer, length, n_examples, seed)
            except TooShort as e:
                skipped[task, length] = str(e)
    answer_tokens = {cell: max(len(tokenizer.encode(s.example.answer)) for s in samples) + 1
                     for cell, samples in cells.items()}
    for (task, length), samples in cells.items():
        longest = max(len(s.tokens) for s in samples)
        if n_positions is not None and longest + answer_tokens[task, length] > n_positions:
            raise ValueError(f"length={length}: {task} prompts of up to {longest} tokens and "
                             f"{answer_tokens[task, length]} answer tokens exceed the model's "
                             f"n_positions={n_positions}; use a shorter length")
    rows = []
    for task, length in [(task, length) for task in tasks for length in lengths]:
        cell = f"recall: {task} at {length} tokens"
        if (task, length) in skipped:
            rows.append({"task": task, "length": int(length), "prompt_tokens": None, "accuracy": None, "n": 0,
                         "skipped": skipped[task, length]})
            if log is not None:
                log(f"{cell}: skipped ({skipped[task, length]})")
            continue
        samples = cells[task, length]
        start = time.perf_counter()
        examples = [s.example for s in samples]
        max_new = answer_tokens[task, length]
        new_tokens = decode_in_batches(greedy_decode, model, [s.tokens for s in samples], batch_size=batch_size,
                                       log=log, label=cell, max_new_tokens=max_new, eos_id=eos)
        predictions = [tokenizer.decode(tokens) for tokens in new_tokens]
        row = {"task": task, "length": int(length),
               "prompt_tokens": float(np.mean([len(s.tokens) for s in samples])),
               "accuracy": score(predictions, examples), "n": len(examples)}
        rows.append(row)
        if log is not None:
            log(f"{cell} (mean prompt {row['prompt_tokens']:.0f}): accuracy "
                f"{row['accuracy']:.3f} of {row['n']} ({time.perf_counter() - start:.1f}s)")
    return rows


def decode_in_batches(decode: Callable, model, prompts: list[list[int]], *, batch_size: int,
                      log: Callable[[str], None] | None = None, label: str = "decoding", **kwargs) -> list[list[int]]:
    """`decode(model, prompts, batch_size=batch_size, **kwargs)` (`greedy_decode`'s signature) called once per batch,
    so that progress can be shown: `log(f"{label}: batch i/n (seconds so far)")` after each batch when there are
    several. The batches are those `greedy_decode` makes of the whole list: prompts sorted by length, a short last
    batch filled with copies of its first prompt (every batch keeps one compiled shape; the copies' outputs are
    dropped). Returns the new tokens of each prompt, in the order of `prompts`."""
    if not prompts:
        return []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows = min(batch_size, len(prompts))
    n_batches = -(-len(prompts) // rows)
    outputs = [None] * len(prompts)
    start = time.perf_counter()
    for b in range(n_batches):
        batch = order[b * rows:(b + 1) * rows]
        batch_prompts = [prompts[i] for i in batch]
        new = decode(model, batch_prompts + [batch_prompts[0]] * (rows - len(batch)), batch_size=batch_size, **kwargs)
        for i, tokens in zip(batch, new):
            outputs[i] = tokens
        if log is not None and n_batches > 1:
            log(f"{label}: batch {b + 1}/{n_batches} ({time.perf_counter() - start:.1f}s)")
    return outputs


def format_table(rows: list[dict]) -> str:
    """A markdown table of `recall_suite` rows: one line per task, one accuracy column per target length ('-' for a
    skipped or missing cell)."""
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    accuracy = {(r["task"], r["length"]): r["accuracy"] for r in rows}
    lines = ["| task | " + " | ".join(str(n) for n in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for task in tasks:
        cells = [f"{accuracy[task, n]:.3f}" if accuracy.get((task, n)) is not None else "-" for n in lengths]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_recall(rows: list[dict], png: str, *, title: str | None = None) -> str:
    """Accuracy against target prompt length (log2 x axis), one line per task (skipped cells left out), into `png`;
    returns `png`."""
    rows = [r for r in rows if r["accuracy"] is not None]
    if not rows:
        raise ValueError("plot_recall needs at least one row with an accuracy, got none")
    series = {task: [(r["length"], r["accuracy"]) for r in rows if r["task"] == task]
              for task in dict.fromkeys(r["task"] for r in rows)}
    return plot_by_length(series, png, title=title or "long-context recall", xlabel="prompt length (tokens)",
                          ylabel="accuracy")


def plot_by_length(series: dict[str, list[tuple[int, float]]], png: str, *, title: str, xlabel: str,
                   ylabel: str) -> str:
    """Scores in [0, 1] against length (log2 x axis): one line per `series` label (its `(length, score)` points),
    into `png`; returns `png`."""
    fig = Figure(figsize=(6.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, (label, points) in enumerate(series.items()):
        ax.plot(*zip(*sorted(points)), "o-", color=f"C{i % 10}", label=label)
    lengths = sorted({n for points in series.values() for n, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small" if len(series) > 5 else "small")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=100)
    return png


def remove_stale_plot(png: str) -> str:
    """Deletes `png`, a plot an earlier run left where this run writes results but no plot (it would show results the
    new JSON does not hold); returns a note saying so for the printed line, '' when there was none."""
    if not os.path.isfile(png):
        return ""
    os.remove(png)
    return f"; removed {png}, an earlier run's plot"


def topk_error(model, topk: int) -> str:
    """The command line's message for a `--topk` that `model` (a `Llama` / `GPT2`) cannot take: no Focus layers, or
    more groups than a layer has; '' when it fits (`with_topk` then applies it)."""
    configs = [attn.config for attn in attention_layers(model)]
    kinds = sorted({c.kind for c in configs})
    if any(kind not in FOCUS_KINDS for kind in kinds):
        return f"--topk={topk} needs a Focus model (attention kind in {FOCUS_KINDS}); this model's attention is {kinds}"
    groups = min(c.focus_groups for c in configs)
    if topk > groups:
        return f"--topk={topk} is more than the model's {groups} Focus groups (focus_groups)"
    return ""


def with_topk(model, topk: int):
    """`model` (a Focus `Llama` / `GPT2`) switched in place to hard top-`topk` routing, every other setting and
    parameter kept (`focal_jax.nn.retrofit.replace_attention(model, focus_topk=topk)`). Raises ValueError naming
    `topk` for a model without Focus or a `topk` outside [1, focus_groups]."""
    configs = [attn.config for attn in attention_layers(model)]
    kinds = sorted({c.kind for c in configs})
    if any(kind not in FOCUS_KINDS for kind in kinds):
        raise ValueError(f"topk={topk!r} needs a Focus model (kind in {FOCUS_KINDS}), this one has kind {kinds}")
    return replace_attention(model, focus_topk=topk)


def with_rope_ntk(model, factor: float, *, trained_len: int):
    """`model` (a `Llama`) switched in place to dynamic NTK RoPE scaling past `trained_len` tokens
    (`focal_jax.nn.layers.dynamic_ntk_theta`). Raises ValueError for a factor below 1 (Hugging Face's 'dynamic'
    rope type requires >= 1 too) and for a model without rotary embeddings (GPT-2)."""
    if any(attn.config.rope_theta is None for attn in attention_layers(model)):
        raise ValueError(f"rope_ntk_factor={factor!r} needs rotary embeddings; this {type(model).__name__} model "
                         f"has none")
    return replace_attention(model, rope_ntk_factor=factor, rope_trained_len=trained_len)


def load_for_decoding(workdir: str, *, step: int | None = None, tokenizer: str | None = None,
                      topk: int | None = None, rope_ntk_factor: float | None = None, name: str = "recall",
                      lengths=(), mesh=None):
    """`(model, tokenizer, step)` of a focal_jax run directory for the decoding evaluations (recall, HELMET): the
    model of checkpoint `step` (default the latest), the tokenizer file `tokenizer` (default the run's own copy),
    switched to hard top-`topk` routing (`with_topk`; a `topk` the model cannot take is refused naming
    `--topk`, `topk_error`) and to dynamic NTK RoPE past the trained length
    (`with_rope_ntk`) when asked. A note is printed when `lengths` (the input lengths to evaluate) go past the
    trained length of a model with RoPE and no `rope_ntk_factor`. `mesh`: place the parameters on it
    (`focal_jax.train.trainer.load_model`; decode under `jax.set_mesh(mesh)`). Raises FileNotFoundError /
    ValueError naming what is missing or wrong."""
    from focal_jax.data.tokenizer import load_tokenizer, workdir_tokenizer  # the training stack: command lines only
    from focal_jax.eval.diagnostics import untrained_positions_note
    from focal_jax.train.checkpoint import read_meta
    from focal_jax.train.trainer import load_model

    tokenizer = load_tokenizer(tokenizer) if tokenizer else workdir_tokenizer(workdir)
    model = load_model(workdir, step=step, mesh=mesh)
    step, meta = read_meta(workdir, step)
    print(f"{name}: loaded {workdir} (step {step})", flush=True)
    if topk is not None:
        if problem := topk_error(model, topk):
            raise ValueError(problem)
        model = with_topk(model, topk)
    trained_len = meta["config"]["data"]["seq_len"]
    if rope_ntk_factor is not None:
        model = with_rope_ntk(model, rope_ntk_factor, trained_len=trained_len)
    if note := untrained_positions_note(model, lengths, trained_len, rope_ntk_factor):
        print(f"{name}: {note}", flush=True)
    return model, tokenizer, step


def length_list(text: str) -> list[int]:
    """argparse type of `--lengths` (recall, HELMET): comma-separated distinct integers >= 1, at least one; anything
    else is a usage error naming the value, before the model loads."""
    expected = f"expected comma-separated distinct integers >= 1, got {text!r}"
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(expected) from None
    if not lengths or min(lengths) < 1 or len(set(lengths)) < len(lengths):
        raise argparse.ArgumentTypeError(expected)
    return lengths


def main(argv=None) -> list[dict]:
    """Command line (see the module docstring): evaluate a run directory's model, print and save the results."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.eval.recall", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="focal_jax run directory (checkpoint, tokenizer)")
    parser.add_argument("--step", type=int, default=None, help="a saved checkpoint step (default: the latest)")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {','.join(TASKS)}")
    parser.add_argument("--lengths", type=length_list, default=list(DEFAULT_LENGTHS),
                        help="comma-separated target prompt lengths in tokens")
    parser.add_argument("--n", type=positive_int, default=20, help="examples per task and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--topk", type=positive_int, default=None,
                        help="hard top-k routing for a Focus model (1 to its number of groups)")
    parser.add_argument("--rope-ntk-factor", type=rope_ntk_factor, default=None,
                        help="dynamic NTK scaling (>= 1) of RoPE past the trained length (models with RoPE only)")
    parser.add_argument("--tokenizer", default=None,
                        help="SentencePiece model or tokenizer.json (default: the workdir's own copy)")
    parser.add_argument("--mesh", type=mesh_shape, default=None, help=MESH_HELP)
    parser.add_argument("--out", default=None, help="output directory (default: the workdir)")
    args = parser.parse_args(argv)
    if args.out and (problem := output_dir_error("--out", os.path.expanduser(args.out))):
        parser.error(problem)  # now, not after the evaluation
    mesh = evaluation_mesh(parser, args.mesh, rows=("--batch-size", args.batch_size))

    workdir = os.path.abspath(os.path.expanduser(args.workdir))
    tasks = [t for t in args.tasks.split(",") if t]
    try:
        for task in tasks:
            _check_task(task)
        model, tokenizer, step = load_for_decoding(workdir, step=args.step, tokenizer=args.tokenizer, topk=args.topk,
                                                   rope_ntk_factor=args.rope_ntk_factor, name="recall",
                                                   lengths=args.lengths, mesh=mesh)
        with on_mesh(mesh):
            rows = recall_suite(model, tokenizer, tasks=tasks, lengths=args.lengths, n_examples=args.n,
                                seed=args.seed, batch_size=args.batch_size, log=lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(format_table(rows))
    out = os.path.abspath(os.path.expanduser(args.out or workdir))
    os.makedirs(out, exist_ok=True)
    record = {"workdir": workdir, "step": step, "topk": args.topk, "rope_ntk_factor": args.rope_ntk_factor,
              "seed": args.seed, "mesh": args.mesh, "rows": rows}
    with open(os.path.join(out, "recall.json"), "w") as f:
        json.dump(record, f, indent=2)
    label = f"{os.path.basename(workdir)} (step {step}{f', top-{args.topk}' if args.topk else ''})"
    written, png = [os.path.join(out, "recall.json")], os.path.join(out, "recall.png")
    if any(r["accuracy"] is not None for r in rows):
        written.append(plot_recall(rows, png, title=f"recall: {label}"))
    else:
        print(f"recall: every cell was skipped (see the reasons above): no plot{remove_stale_plot(png)}")
    print(f"recall: wrote {' and '.join(written)}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
