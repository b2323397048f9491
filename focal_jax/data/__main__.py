"""`python -m focal_jax.data --source builtin --vocab_size 2000 --out tokenizer.model`: build a run's tokenizer."""

import argparse
import contextlib
import sys

from focal_jax.data.config import DataConfig
from focal_jax.data.pipeline import split_documents
from focal_jax.data.sources import expand_paths, read_documents
from focal_jax.data.streaming import tokenizer_sample
from focal_jax.data.tokenizer import VocabSizeError, cached_tokenizer, write_atomically


def main(argv=None) -> str:
    """`python -m focal_jax.data --source builtin --vocab_size 2000 [--paths GLOB ...] [--field text]
    [--eval_paths GLOB ...] [--streaming] [--task TASK --task_kwargs KEY=VALUE ... --n_synthetic N]
    [--cache_dir DIR] [--out FILE]`: train (or find in the cache) the tokenizer a run with these data settings would
    use, print its path (the only line on stdout; progress goes to stderr), and copy it to `--out` if given. Runs
    train the same one themselves; this command lets a cluster job build it once up front, or a user inspect it.
    `--streaming` trains on the sample a streaming run uses (its first training documents, up to 20M characters).
    `--task`, `--task_kwargs` and `--n_synthetic` are `data.task`, `data.task_kwargs` and `data.n_synthetic` of a
    synthetic source."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.data", description=main.__doc__)
    parser.add_argument("--source", default="builtin")
    parser.add_argument("--paths", nargs="*", default=())
    parser.add_argument("--field", default="text")
    parser.add_argument("--vocab_size", type=int, default=2000)
    parser.add_argument("--eval_fraction", type=float, default=0.05)
    parser.add_argument("--eval_paths", nargs="*", default=())
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--task", default=DataConfig.task)
    parser.add_argument("--task_kwargs", nargs="*", default=(), metavar="KEY=VALUE",
                        help="options of the synthetic task, e.g. n_pairs=8 (integers)")
    parser.add_argument("--n_synthetic", type=int, default=DataConfig.n_synthetic)
    parser.add_argument("--cache_dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    task_kwargs = _task_kwargs(parser, args.task_kwargs)
    try:  # a bad setting (an unknown source, a pattern matching no file) as a one-line usage error, naming it
        config = DataConfig(source=args.source, paths=tuple(args.paths), field=args.field,
                            vocab_size=args.vocab_size, eval_fraction=args.eval_fraction,
                            eval_paths=tuple(args.eval_paths), streaming=args.streaming, cache_dir=args.cache_dir,
                            task=args.task, task_kwargs=task_kwargs, n_synthetic=args.n_synthetic)
        paths = expand_paths(config.paths)
        expand_paths(config.eval_paths)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    with contextlib.redirect_stdout(sys.stderr):  # progress lines: stdout holds the path alone
        if config.streaming:
            train_docs = tokenizer_sample(config, paths)
        elif config.eval_paths:
            train_docs = read_documents(config)
        else:
            train_docs, _ = split_documents(read_documents(config), config.eval_fraction)
        try:
            tokenizer = cached_tokenizer(train_docs, config.vocab_size, config.cache_dir)
        except VocabSizeError as e:
            parser.error(f"--{e}")
    path = tokenizer.path
    if args.out:
        with open(tokenizer.path, "rb") as f:
            write_atomically(args.out, f.read())
        path = args.out
    print(path)
    return path


def _task_kwargs(parser, items) -> dict:
    """`['n_pairs=8', ...]` -> `{'n_pairs': 8, ...}` (the synthetic tasks' options are integers)."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        if not key or not value.removeprefix("-").isdigit():
            parser.error(f"--task_kwargs takes KEY=INTEGER items, got {item!r}")
        out[key] = int(value)
    return out


if __name__ == "__main__":
    main()
