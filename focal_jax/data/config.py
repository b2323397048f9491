"""`DataConfig`: what to read, how to tokenize, how to pack; validated on construction."""

import dataclasses

import numpy as np

from focal_jax.data import synthetic

SOURCES = ("builtin", "text", "jsonl", "parquet", "array_record", "synthetic")
FILE_SOURCES = ("text", "jsonl", "parquet", "array_record")
MIN_VOCAB_SIZE = 262  # 256 byte-fallback pieces + pad, unk, bos, eos and the newline piece + at least one more


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Settings of the data pipeline (`build_data`). Every field is checked in `__post_init__`.

    Attributes:
      source: 'builtin' (CPython's own documentation, no download) | 'text' (each file one document) | 'jsonl'
        (one document per line, key `field`) | 'parquet' (column `field`) | 'array_record' (one utf-8 document per
        record) | 'synthetic' (prompt + answer of the synthetic task `task`).
      paths: glob patterns of the files of a file source; a list or a comma-separated string is accepted.
      field: the jsonl key / parquet column holding the text.
      task: the synthetic task: 'associative_recall' | 'needle' | 'json_kv' | 'frequent_words'.
      task_kwargs: options of the synthetic task (e.g. n_pairs), stored as sorted (key, value) pairs; a dict is
        accepted.
      n_synthetic: number of synthetic documents.
      tokenizer: path of the tokenizer to use: a SentencePiece model, or a Hugging Face tokenizer.json (a name
        ending in `.json`; its special ids from the tokenizer_config.json / config.json next to it, see
        `focal_jax.data.tokenizer`); None trains a SentencePiece model on the training documents (cached).
      vocab_size: vocabulary size of a trained tokenizer (unused when `tokenizer` is given).
      cache_dir: where trained tokenizers are cached; None means ~/.cache/focal_jax.
      seq_len: tokens per packed row.
      eval_fraction: share of documents held out for evaluation, chosen by a hash of each document's text.
      shuffle: shuffle the training rows (differently each epoch).
    """

    source: str = "builtin"
    paths: tuple[str, ...] = ()
    field: str = "text"
    task: str = "associative_recall"
    task_kwargs: tuple = ()
    n_synthetic: int = 2000
    tokenizer: str | None = None
    vocab_size: int = 2000
    cache_dir: str | None = None
    seq_len: int = 128
    eval_fraction: float = 0.05
    shuffle: bool = True

    def __post_init__(self):
        _choice("source", self.source, SOURCES)
        object.__setattr__(self, "paths", _paths(self.paths))
        if self.source in FILE_SOURCES and not self.paths:
            raise ValueError(f"source={self.source!r} reads files: set paths (glob patterns), got paths=()")
        _string("field", self.field)
        _choice("task", self.task, tuple(synthetic.TASKS))
        object.__setattr__(self, "task_kwargs", _task_kwargs(self.task, self.task_kwargs))
        _integer("n_synthetic", self.n_synthetic, 1)
        _optional_string("tokenizer", self.tokenizer)
        _integer("vocab_size", self.vocab_size, MIN_VOCAB_SIZE)
        _optional_string("cache_dir", self.cache_dir)
        _integer("seq_len", self.seq_len, 2)
        if isinstance(self.eval_fraction, bool) or not isinstance(self.eval_fraction, (int, float)) or not (
                0 <= self.eval_fraction < 1):
            raise ValueError(f"eval_fraction must be a number in [0, 1), got eval_fraction={self.eval_fraction!r}")
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be True or False, got shuffle={self.shuffle!r}")


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"unknown {name}={value!r}; valid choices: {', '.join(choices)}")


def _string(name, value):
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")


def _optional_string(name, value):
    if value is not None:
        _string(name, value)


def _integer(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")


def _paths(paths) -> tuple[str, ...]:
    """A tuple of glob patterns from a tuple, a list or a comma-separated string."""
    if isinstance(paths, str):
        paths = paths.split(",")
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"paths must be glob patterns (a list, tuple or comma-separated string), got "
                         f"paths={paths!r}")
    return tuple(p.strip() for p in paths if p.strip())


def _task_kwargs(task, kwargs) -> tuple:
    """Sorted (key, value) pairs from a dict or pairs; the keys must be options of `task`."""
    try:
        items = dict(kwargs.items() if hasattr(kwargs, "items") else kwargs)
    except (TypeError, ValueError):
        raise ValueError(f"task_kwargs must be a dict or (key, value) pairs, got task_kwargs={kwargs!r}") from None
    options = synthetic.task_options(task)
    unknown = sorted(set(items) - set(options))
    if unknown:
        raise ValueError(f"task_kwargs has unknown option(s) {unknown} for task={task!r}; valid options: "
                         f"{sorted(options)}")
    return tuple(sorted(items.items()))
