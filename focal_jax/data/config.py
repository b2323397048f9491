"""`DataConfig`: what to read, how to tokenize, how to pack; validated on construction."""

import dataclasses

import numpy as np

from focal_jax._validation import check_int
from focal_jax.data import synthetic

SOURCES = ("builtin", "text", "jsonl", "parquet", "array_record", "synthetic")
FILE_SOURCES = ("text", "jsonl", "parquet", "array_record")
SHARD_BY = ("file", "document")
# Settings of the streaming mode only, with their defaults (a different value without streaming=True is an error).
STREAMING_DEFAULTS = dict(shard_by="file", shuffle_window=0, interleave=1, prefetch=2)
MIN_VOCAB_SIZE = 262  # 256 byte-fallback pieces + pad, unk, bos, eos and the newline piece + at least one more


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Settings of the data pipeline (`build_data`). Every field is checked in `__post_init__`.

    Attributes:
      source: 'builtin' (CPython's own documentation, no download) | 'text' (each file one document) | 'jsonl'
        (one document per line, key `field`) | 'parquet' (column `field`) | 'array_record' (one utf-8 document per
        record) | 'synthetic' (prompt + answer of the synthetic task `task`).
      paths: glob patterns of the files of a file source; a list or a comma-separated string is accepted. Relative
        ones are read against the working directory (a training run's checkpoints record them, `eval_paths` and
        `tokenizer` absolute).
      field: the jsonl key / parquet column holding the text.
      task: the synthetic task: 'associative_recall' | 'needle' | 'json_kv' | 'frequent_words'.
      task_kwargs: options of the synthetic task (e.g. n_pairs), stored as sorted (key, value) pairs; a dict is
        accepted.
      n_synthetic: number of synthetic documents.
      tokenizer: path of the tokenizer to use: a SentencePiece model, or a Hugging Face tokenizer.json (a name
        ending in `.json`; its special ids from the tokenizer_config.json / config.json next to it, see
        `focal_jax.data.tokenizer`); None trains a SentencePiece model on the training documents (cached).
      vocab_size: vocabulary size of a trained tokenizer (unused when `tokenizer` is given).
      cache_dir: where trained tokenizers (and the parsed builtin corpus) are cached; None means ~/.cache/focal_jax.
      seq_len: tokens per packed row.
      doc_mask: True: the documents packed into a row never attend to each other (segment ids, positions restart at
        each document; DESIGN.md). False: each row is one causal sequence over its documents, separated by their
        bos / eos tokens (`packing.merge_documents`; FOCAL_SPEC.md OQ-F9, Open-LLaMA-style training). The loss
        covers the same tokens either way.
      eval_fraction: share of documents held out for evaluation, chosen by a hash of each document's text
        (unused when `eval_paths` is set).
      shuffle: shuffle the training rows (differently each epoch); when streaming, the order of the files
        (differently each epoch) and, with `shuffle_window`, the documents within windows of a file.
      eval_paths: glob patterns of held-out evaluation files, in the format of `source` (a file source only). When
        set, their documents are the evaluation documents and every document of `paths` is trained on.
      streaming: read the files of a file source lazily during training instead of loading the corpus
        (`focal_jax.data.streaming`): memory stays at one file's read buffer plus a few rows, whatever the corpus
        size; the training stream repeats epochs forever. The keys below are for this mode only.
      shard_by: how the processes of a multi-host run split a stream: 'file' (process i of n reads every n-th file
        of each epoch's file order; needs at least n * interleave files) | 'document' (every process reads every
        file and keeps every n-th document; for corpora of few files).
      shuffle_window: when > 1 (and `shuffle`), documents are shuffled within consecutive windows of this many
        documents of a file (seeded; memory: that many documents). 0 or 1: file order.
      interleave: readers per process, each with its own files, whose rows alternate in the batches (so a long
        document does not fill a whole batch); 1 = one reader.
      prefetch: batches read ahead in a background thread; 0 reads in the calling thread.
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
    doc_mask: bool = True
    eval_fraction: float = 0.05
    shuffle: bool = True
    eval_paths: tuple[str, ...] = ()
    streaming: bool = False
    shard_by: str = "file"
    shuffle_window: int = 0
    interleave: int = 1
    prefetch: int = 2

    def __post_init__(self):
        _choice("source", self.source, SOURCES)
        object.__setattr__(self, "paths", _paths(self.paths))
        if self.source in FILE_SOURCES and not self.paths:
            raise ValueError(f"source={self.source!r} reads files: set paths (glob patterns), got paths=()")
        _string("field", self.field)
        _choice("task", self.task, tuple(synthetic.TASKS))
        object.__setattr__(self, "task_kwargs", _task_kwargs(self.task, self.task_kwargs))
        check_int("n_synthetic", self.n_synthetic, 1)
        _optional_string("tokenizer", self.tokenizer)
        check_int("vocab_size", self.vocab_size, MIN_VOCAB_SIZE)
        _optional_string("cache_dir", self.cache_dir)
        check_int("seq_len", self.seq_len, 2)
        if isinstance(self.eval_fraction, bool) or not isinstance(self.eval_fraction, (int, float)) or not (
                0 <= self.eval_fraction < 1):
            raise ValueError(f"eval_fraction must be a number in [0, 1), got eval_fraction={self.eval_fraction!r}")
        for name in ("doc_mask", "shuffle", "streaming"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {name}={getattr(self, name)!r}")
        object.__setattr__(self, "eval_paths", _paths(self.eval_paths, "eval_paths"))
        if self.eval_paths and self.source not in FILE_SOURCES:
            raise ValueError(f"eval_paths={self.eval_paths} are files in the format of source, but "
                             f"source={self.source!r} is not a file source ({', '.join(FILE_SOURCES)})")
        if self.streaming and self.source not in FILE_SOURCES:
            raise ValueError(f"streaming=True reads files: source must be one of {', '.join(FILE_SOURCES)}, got "
                             f"source={self.source!r}")
        _choice("shard_by", self.shard_by, SHARD_BY)
        check_int("shuffle_window", self.shuffle_window, 0)
        check_int("interleave", self.interleave, 1)
        check_int("prefetch", self.prefetch, 0)
        if not self.streaming:
            changed = [f"{k}={getattr(self, k)!r}" for k, v in STREAMING_DEFAULTS.items() if getattr(self, k) != v]
            if changed:
                raise ValueError(f"{', '.join(changed)} only applies to streaming=True (streaming=False)")


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"unknown {name}={value!r}; valid choices: {', '.join(choices)}")


def _string(name, value):
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {name}={value!r}")


def _optional_string(name, value):
    if value is not None:
        _string(name, value)


def _paths(paths, name: str = "paths") -> tuple[str, ...]:
    """A tuple of glob patterns from a tuple, a list or a comma-separated string."""
    if isinstance(paths, str):
        paths = paths.split(",")
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{name} must be glob patterns (a list, tuple or comma-separated string), got "
                         f"{name}={paths!r}")
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
