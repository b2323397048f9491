"""The training and evaluation data of a run: documents -> train / eval split -> tokenizer -> packed rows ->
grain batches, sharded by process.

documents (`read_documents`) are split by a hash of their text (`eval_fraction` held out), encoded as
`start + tokens + eos` (start: the bos, or the eos for a tokenizer without bos, e.g. GPT-2 style; see
`focal_jax.data.tokenizer`) and packed into rows of `seq_len` (`pack`). Training rows go through
`MapDataset.source -> shuffle(seed) -> repeat() -> process shard -> batch(local_batch)`: an infinite, random-access
dataset whose element `s` is this process's share of global step `s`, reshuffled every epoch. Process `p` holds
rows `[p * local, (p + 1) * local)` of each global batch, so concatenating the processes' batches of a step gives
exactly the single-process batch of that step.
"""

import dataclasses
import hashlib

import grain
import numpy as np

from focal_jax.data.config import DataConfig
from focal_jax.data.packing import PACKED_KEYS, pack
from focal_jax.data.sources import read_documents
from focal_jax.data.tokenizer import Tokenizer, cached_tokenizer, copy_tokenizer, load_tokenizer

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Data:
    """What `build_data` returns.

    Attributes:
      tokenizer: the Tokenizer (its `vocab_size` is the model's vocabulary size).
      train: infinite grain `MapDataset`; element `s` is this process's batch of global step `s`: a dict with the
        keys of `pack`, each `[local_batch, seq_len]` (`local_batch = global_batch // process_count`).
      n_train_rows, n_train_tokens: packed training rows; their non-padding tokens (one epoch).
      n_train_documents, n_eval_documents: documents in each split.
      eval_rows: the packed evaluation rows (all processes), `[n_eval_rows, seq_len]` per key.
      global_batch, process_index, process_count: the batch layout.
    """

    tokenizer: Tokenizer
    train: grain.MapDataset
    n_train_rows: int
    n_train_tokens: int
    n_train_documents: int
    n_eval_documents: int
    eval_rows: Batch = dataclasses.field(repr=False)
    global_batch: int
    process_index: int
    process_count: int

    @property
    def local_batch(self) -> int:
        """Rows of this process per step: `global_batch // process_count`."""
        return self.global_batch // self.process_count

    def eval_batches(self, n: int) -> list[Batch]:
        """The first `n` held-out batches -> list of dicts, each `[local_batch, seq_len]` per key.

        Deterministic (no shuffling): global eval batch `s` is eval rows `[s * global_batch, (s + 1) * global_batch)`
        and this process gets its share, as in training. When the eval split has fewer rows, the remaining rows are
        padding (`loss_mask` 0), so a loss summed with `loss_mask` and divided by `loss_mask.sum()` over all
        batches (and processes) is exact.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got n={n!r}")
        if self.n_eval_documents == 0:
            raise ValueError(f"there are no evaluation documents (0 of {self.n_train_documents} documents held out): "
                             f"raise eval_fraction")
        rows = {k: _padded_rows(v, n * self.global_batch) for k, v in self.eval_rows.items()}
        starts = [s * self.global_batch + self.process_index * self.local_batch for s in range(n)]
        return [{k: v[start:start + self.local_batch] for k, v in rows.items()} for start in starts]


def build_data(config: DataConfig, *, global_batch: int, seed: int, workdir: str | None = None,
               process_index: int | None = None, process_count: int | None = None) -> Data:
    """Builds the tokenizer, the training dataset and the evaluation rows of `config` -> Data.

    Args:
      config: the DataConfig.
      global_batch: rows per training step over all processes; must be divisible by `process_count`.
      seed: shuffling seed, in [0, 2**32).
      workdir: when given, the tokenizer is also copied into the workdir (`copy_tokenizer`: WORKDIR/tokenizer.model,
        or WORKDIR/tokenizer.json with its tokenizer_config.json) and loaded from there, so a run directory holds
        the tokenizer it was trained with (`workdir_tokenizer`).
      process_index, process_count: this process and the number of processes (default: `jax.process_index()`
        and `jax.process_count()`). Every process reads all documents and keeps its share of each batch.
    """
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    _check_layout(global_batch, seed, process_index, process_count)

    train_docs, eval_docs = split_documents(read_documents(config), config.eval_fraction)
    tokenizer = _tokenizer(config, train_docs, workdir)
    train_rows = pack(encode_documents(tokenizer, train_docs), config.seq_len)
    n_train_rows = len(train_rows["inputs"])
    if n_train_rows < global_batch:
        raise ValueError(f"the training corpus packs into {n_train_rows} rows of seq_len={config.seq_len} tokens, "
                         f"fewer than one global batch (global_batch={global_batch}): add documents or lower "
                         f"global_batch / seq_len")
    eval_rows = (pack(encode_documents(tokenizer, eval_docs), config.seq_len) if eval_docs
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
                process_index=process_index, process_count=process_count)


def train_iterator(data: Data) -> grain.DatasetIterator:
    """A checkpointable iterator over `data.train`, from step 0.

    `it.get_state()` is a JSON-serialisable dict, `{'next_index': step}`; `it.set_state(state)` resumes exactly
    there. Reads in the calling thread (the rows are in memory).
    """
    read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return iter(data.train.to_iter_dataset(read_options))


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> list[np.ndarray]:
    """Documents -> one int32 array `[n_tokens + 2]` per document: `tokenizer.start_id` (the bos, or the eos when
    the tokenizer has no bos), the tokens, eos."""
    ids = tokenizer.encode_batch(documents)
    return [np.array([tokenizer.start_id, *doc, tokenizer.eos_id], np.int32) for doc in ids]


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
    """`(train_docs, eval_docs)`: each document held out by a hash of its text (see `_is_eval`)."""
    held_out = [_is_eval(doc, eval_fraction) for doc in docs]
    train_docs = [doc for doc, e in zip(docs, held_out) if not e]
    if not train_docs:
        raise ValueError(f"all {len(docs)} documents were held out for evaluation: lower "
                         f"eval_fraction={eval_fraction}")
    return train_docs, [doc for doc, e in zip(docs, held_out) if e]


def _is_eval(doc: str, eval_fraction: float) -> bool:
    """Whether `doc` is held out: a uniform number in [0, 1) from the sha256 of its text is below the fraction.
    Equal documents land in the same split, and the split of a document does not depend on the others."""
    digest = hashlib.sha256(doc.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_fraction


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
