"""The training and evaluation data of a run: documents -> train / eval split -> tokenizer -> packed rows ->
grain batches, sharded by process. `DataConfig(streaming=True)` reads the files lazily instead
(`focal_jax.data.streaming`); everything below describes the in-memory mode.

documents (`read_documents`) are split by a hash of their text (`eval_fraction` held out), encoded as
`start + tokens + eos` (start: the bos, or the eos for a tokenizer without bos, e.g. GPT-2 style; see
`focal_jax.data.tokenizer`) and packed into rows of `seq_len` (`pack`). Training rows go through
`MapDataset.source -> shuffle(seed) -> repeat() -> process shard -> batch(local_batch)`: an infinite, random-access
dataset whose element `s` is this process's share of global step `s`, reshuffled every epoch. Process `p` holds
rows `[p * local, (p + 1) * local)` of each global batch, so concatenating the processes' batches of a step gives
exactly the single-process batch of that step. With `eval_paths`, the evaluation documents are those files' and
no training document is held out.
"""

import dataclasses

import grain
import numpy as np

from focal_jax.data import streaming as streaming_lib
from focal_jax.data.config import DataConfig
from focal_jax.data.packing import PACKED_KEYS, frame, merge_documents, pack
from focal_jax.data.sources import check_disjoint, expand_paths, is_held_out, read_documents
from focal_jax.data.tokenizer import Tokenizer, cached_tokenizer, copy_tokenizer, load_tokenizer

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Data:
    """What `build_data` returns.

    Attributes:
      tokenizer: the Tokenizer (its `vocab_size` is the model's vocabulary size).
      train: infinite grain `MapDataset`; element `s` is this process's batch of global step `s`: a dict with the
        keys of `pack`, each `[local_batch, seq_len]` (`local_batch = global_batch // process_count`). Streaming: an
        infinite grain `IterDataset` of this process's batches (no random access; iterate with `train_iterator`).
      n_train_rows, n_train_tokens: packed training rows; their non-padding tokens (one epoch). None when streaming
        (unknown without reading the corpus).
      n_train_documents, n_eval_documents: documents in each split (None when streaming).
      eval_rows: the packed evaluation rows (all processes), `[n_eval_rows, seq_len]` per key (None when
        streaming: `eval_batches` reads them lazily).
      global_batch, process_index, process_count: the batch layout.
      streaming: whether `train` is a stream (`DataConfig.streaming`).
      config: the DataConfig.
      n_files: files of the training stream (None when not streaming).
      eval_source: the streaming evaluation rows (`focal_jax.data.streaming.EvalRows`), else None.
    """

    tokenizer: Tokenizer
    train: grain.MapDataset | grain.IterDataset
    n_train_rows: int | None
    n_train_tokens: int | None
    n_train_documents: int | None
    n_eval_documents: int | None
    eval_rows: Batch | None = dataclasses.field(repr=False)
    global_batch: int
    process_index: int
    process_count: int
    streaming: bool = False
    config: DataConfig | None = dataclasses.field(default=None, repr=False)
    n_files: int | None = None
    eval_source: streaming_lib.EvalRows | None = dataclasses.field(default=None, repr=False)

    @property
    def local_batch(self) -> int:
        """Rows of this process per step: `global_batch // process_count`."""
        return self.global_batch // self.process_count

    def describe(self) -> str:
        """One line for the run's log: the source, the rows, the tokens (or the files of a stream)."""
        config = self.config
        if not self.streaming:
            return (f"{config.source}, {self.n_train_rows} rows of {config.seq_len} tokens "
                    f"({self.n_train_tokens:,} tokens)")
        readers = self.process_count * config.interleave
        share = ("" if readers == 1 else f"; {readers} readers (processes x interleave) each read 1 of every "
                 f"{readers} {config.shard_by}s per epoch")
        return (f"{config.source}, streamed from {self.n_files} files{share}, rows of {config.seq_len} tokens "
                f"(corpus size unknown)")

    def held_out_rows(self, at_most: int) -> int:
        """How many packed held-out rows there are, counting at most `at_most` (a stream reads only that many).
        ValueError when no documents are held out."""
        if not self.streaming and self.n_eval_documents == 0:
            raise ValueError(f"there are no evaluation documents (0 of {self.n_train_documents} documents held out): "
                             f"raise eval_fraction")
        if self.streaming:
            return self.eval_source.count(at_most)
        return min(at_most, len(next(iter(self.eval_rows.values()))))

    def eval_batches(self, n: int) -> list[Batch]:
        """The first `n` held-out batches -> list of dicts, each `[local_batch, seq_len]` per key.

        Deterministic (no shuffling): global eval batch `s` is eval rows `[s * global_batch, (s + 1) * global_batch)`
        and this process gets its share, as in training. When the eval split has fewer than `n` batches of rows,
        there are fewer batches: as many as its rows fill, the last one completed with padding rows (`loss_mask`
        0), so a loss summed with `loss_mask` and divided by `loss_mask.sum()` over all batches (and processes) is
        exact. Streaming: the rows are read on the first call, only as many as needed
        (`focal_jax.data.streaming.EvalRows`).
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got n={n!r}")
        n = min(n, -(-self.held_out_rows(n * self.global_batch) // self.global_batch))
        if self.streaming:
            rows = self.eval_source.rows(n * self.global_batch)
        else:
            rows = {k: _padded_rows(v, n * self.global_batch) for k, v in self.eval_rows.items()}
        starts = [s * self.global_batch + self.process_index * self.local_batch for s in range(n)]
        return [{k: v[start:start + self.local_batch] for k, v in rows.items()} for start in starts]


def build_data(config: DataConfig, *, global_batch: int, seed: int, workdir: str | None = None,
               process_index: int | None = None, process_count: int | None = None, training: bool = True) -> Data:
    """Builds the tokenizer, the training dataset and the evaluation rows of `config` -> Data.

    Args:
      config: the DataConfig.
      global_batch: rows per training step over all processes; must be divisible by `process_count`.
      seed: shuffling seed, in [0, 2**32).
      workdir: when given, the tokenizer is also copied into the workdir (`copy_tokenizer`: WORKDIR/tokenizer.model,
        or WORKDIR/tokenizer.json with its tokenizer_config.json) and loaded from there, so a run directory holds
        the tokenizer it was trained with (`workdir_tokenizer`).
      process_index, process_count: this process and the number of processes (default: `jax.process_index()`
        and `jax.process_count()`). Every process reads all documents and keeps its share of each batch; when
        streaming, each process reads its own share of the files (or documents) instead.
      training: True (default): the training rows must fill one global batch (ValueError naming both). False (an
        evaluation, which reads the held-out rows only): they need not.
    """
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    _check_layout(global_batch, seed, process_index, process_count)
    if config.eval_paths:
        check_disjoint(config.paths, config.eval_paths)
    if config.streaming:
        return _build_stream(config, global_batch=global_batch, seed=seed, workdir=workdir,
                             process_index=process_index, process_count=process_count)

    if config.eval_paths:
        train_docs, eval_docs = read_documents(config), read_documents(config, config.eval_paths)
    else:
        train_docs, eval_docs = split_documents(read_documents(config), config.eval_fraction)
    tokenizer = _tokenizer(config, train_docs, workdir)
    train_rows = packed_rows(encode_documents(tokenizer, train_docs), config)
    n_train_rows = len(train_rows["inputs"])
    if training and n_train_rows < global_batch:
        raise ValueError(f"the training corpus packs into {n_train_rows} rows of seq_len={config.seq_len} tokens, "
                         f"fewer than one global batch (global_batch={global_batch}): add documents or lower "
                         f"global_batch / seq_len")
    eval_rows = (packed_rows(encode_documents(tokenizer, eval_docs), config) if eval_docs
                 else {k: np.zeros((0, config.seq_len), np.float32 if k == "loss_mask" else np.int32)
                       for k in PACKED_KEYS})

    train = grain.MapDataset.source(_Rows(train_rows))
    if config.shuffle:
        train = train.shuffle(seed=seed)
    local_batch = global_batch // process_count
    train = _ProcessShard(train.repeat(), global_batch, process_index, process_count)
    train = train.batch(local_batch, drop_remainder=True)
    return Data(tokenizer=tokenizer, train=train, n_train_rows=n_train_rows,
                n_train_tokens=int((train_rows["segment_ids"] > 0).sum()), n_train_documents=len(train_docs),
                n_eval_documents=len(eval_docs), eval_rows=eval_rows, global_batch=global_batch,
                process_index=process_index, process_count=process_count, config=config)


def _build_stream(config: DataConfig, *, global_batch, seed, workdir, process_index, process_count) -> Data:
    """`build_data` for `config.streaming`: nothing is read beyond the first document of each reader (and the
    tokenizer's training sample when `config.tokenizer` is None)."""
    files = expand_paths(config.paths)  # (eval_paths: checked by build_data, which fails naming a pattern)
    if config.tokenizer is not None:
        tokenizer = _tokenizer(config, [], workdir)
    else:
        sample = streaming_lib.tokenizer_sample(config, files)
        if process_index == 0:
            streaming_lib.log(f"data: the tokenizer is trained on the first {len(sample)} training documents of the "
                              f"stream ({sum(map(len, sample)) / 1e6:.1f}M characters)")
        tokenizer = _tokenizer(config, sample, workdir)
        del sample
    train = streaming_lib.train_stream(config, files, tokenizer, global_batch=global_batch, seed=seed,
                                       process_index=process_index, process_count=process_count)
    eval_source = streaming_lib.EvalRows(config, files, tokenizer, verbose=process_index == 0)
    return Data(tokenizer=tokenizer, train=train, n_train_rows=None, n_train_tokens=None, n_train_documents=None,
                n_eval_documents=None, eval_rows=None, global_batch=global_batch, process_index=process_index,
                process_count=process_count, streaming=True, config=config, n_files=len(files),
                eval_source=eval_source)


def train_iterator(data: Data) -> grain.DatasetIterator:
    """A checkpointable iterator over `data.train`, from step 0; `next(it)` is this process's next batch.

    `it.get_state()` is a JSON-serialisable dict, `{'next_index': step}` (in memory) or the stream's positions
    (`focal_jax.data.streaming.StreamIterator`: a few integers per reader; in a multi-process JAX run those of every
    process, gathered by `get_state`, which every process must then call at the same step:
    `streaming.ProcessStates`); `it.set_state(state)` resumes exactly there. In memory it reads in the calling
    thread; a stream reads ahead `config.prefetch` batches in a thread.
    """
    if data.streaming:
        iterator = iter(data.train)
        if data.process_count == 1:
            return iterator
        import jax
        return streaming_lib.ProcessStates(iterator, data.process_index, data.process_count,
                                           gather=jax.process_count() == data.process_count)
    read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return iter(data.train.to_iter_dataset(read_options))


def packed_rows(token_docs: list[np.ndarray], config: DataConfig) -> Batch:
    """`pack(token_docs, config.seq_len)`, with the documents of a row merged into one sequence (`merge_documents`)
    unless `config.doc_mask`."""
    rows = pack(token_docs, config.seq_len)
    return rows if config.doc_mask else merge_documents(rows)


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> list[np.ndarray]:
    """Documents -> one int32 array `[n_tokens + 2]` per document: `tokenizer.start_id` (the bos, or the eos when
    the tokenizer has no bos), the tokens, eos."""
    ids = tokenizer.encode_batch(documents, special_tokens=False)
    return [frame(doc, tokenizer.start_id, tokenizer.eos_id) for doc in ids]


def _check_layout(global_batch, seed, process_index, process_count):
    for name, value, minimum in (("global_batch", global_batch, 1), ("seed", seed, 0),
                                 ("process_count", process_count, 1), ("process_index", process_index, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value!r}")
    if seed >= 2**32:
        raise ValueError(f"seed must be below 2**32 (grain's shuffle), got seed={seed}")
    if process_index >= process_count:
        raise ValueError(f"process_index={process_index} must be below process_count={process_count}")
    if global_batch % process_count:
        raise ValueError(f"global_batch={global_batch} must be divisible by process_count={process_count}")


def split_documents(docs: list[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """`(train_docs, eval_docs)`: each document held out by a hash of its text (`sources.is_held_out`)."""
    held_out = [is_held_out(doc, eval_fraction) for doc in docs]
    train_docs = [doc for doc, e in zip(docs, held_out) if not e]
    if not train_docs:
        raise ValueError(f"all {len(docs)} documents were held out for evaluation: lower "
                         f"eval_fraction={eval_fraction}")
    return train_docs, [doc for doc, e in zip(docs, held_out) if e]


def _tokenizer(config: DataConfig, train_docs: list[str], workdir: str | None) -> Tokenizer:
    """The configured tokenizer (or one trained on `train_docs`, cached), copied into `workdir` if given."""
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
    else:
        tokenizer = cached_tokenizer(train_docs, config.vocab_size, config.cache_dir)
    return tokenizer if workdir is None else copy_tokenizer(tokenizer, workdir)


def _padded_rows(x: np.ndarray, n: int) -> np.ndarray:
    """The first `n` rows of `x [rows, seq_len]`, extended with zero rows when `x` has fewer."""
    x = x[:n]
    return np.concatenate([x, np.zeros((n - len(x),) + x.shape[1:], x.dtype)])


class _Rows:
    """Random-access rows of packed arrays: element `i` is `{key: array[i]}`."""

    def __init__(self, arrays: Batch):
        self._arrays = arrays

    def __len__(self):
        return len(self._arrays["inputs"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self._arrays.items()}


class _ProcessShard(grain.MapDataset):
    """This process's rows of each global batch: element `i` is global row
    `(i // local) * global_batch + process_index * local + i % local`, with `local = global_batch // process_count`.
    """

    def __init__(self, parent: grain.MapDataset, global_batch: int, process_index: int, process_count: int):
        super().__init__(parent)
        self._global_batch = global_batch
        self._local = global_batch // process_count
        self._offset = process_index * self._local

    def __len__(self):
        return len(self._parent) // self._global_batch * self._local

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        step, row = divmod(index, self._local)
        return self._parent[step * self._global_batch + self._offset + row]

    def __str__(self):
        return f"_ProcessShard(global_batch={self._global_batch}, local={self._local}, offset={self._offset})"
