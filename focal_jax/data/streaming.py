"""Streaming training data (`DataConfig(streaming=True)`): files read lazily, tokenized on the fly, packed exactly as
`pack` packs, batched; the iterator's state is a few integers, and a resumed run gets the same batches.

**Readers.** The files of `paths` (each pattern's matches sorted, as the in-memory source) are read by
`n_readers = process_count * interleave` readers. Reader `s` of epoch `e` takes the file order of that epoch (a
permutation seeded by `(seed, e)` when `shuffle`, else the sorted order) and reads

- `shard_by='file'`: the files at positions `s, s + n_readers, ...` of that order (every file once per epoch, by one
  reader);
- `shard_by='document'`: every file, keeping record `r` of the file at position `g` when
  `(r + g) % n_readers == s` (other records are skipped without being decoded).

Process `p` owns readers `p, p + process_count, ...` (`interleave` of them) and its rows alternate between them, one
row each in turn. Within a file documents come in file order, or, with `shuffle_window=W > 1` (and `shuffle`),
in windows of `W` documents each permuted by `(seed, epoch, file, window start)`. Documents held out for
evaluation (`eval_fraction`, by the hash of their text as in memory) and empty ones are skipped. Each reader repeats
epochs forever; its epochs are its own (readers with more tokens take longer), and one without a document (its only
file of that epoch an empty one, say) passes.

**Rows.** A reader encodes each document as `start + tokens + eos` and packs the documents of its stream with
`pack`: a document crossing a row boundary continues in the next row as a new segment from position 0, and the
last target of a row is the next row's first token when the document continues. At the end of an epoch the last
partial row is padded (as `pack` pads the last row), so the next epoch starts a fresh row. One reader, one process
and `shuffle=False` give exactly the rows of the in-memory pipeline with `shuffle=False`, epoch after epoch.

**State.** A reader's position is `{epoch, file, record, byte, taken, skip}`: the file (index into the reader's
files of that epoch), the record to read from (jsonl: also its byte offset, so resuming seeks there), the documents
of the current shuffle window already taken, and the tokens of the next document already emitted in earlier rows.
It points at the first document with tokens not yet emitted, so a resume re-reads and re-encodes at most that
document (and its window) and never stores tokens. The iterator state adds which reader is next and a digest of
the file list (a resume over different files, or with a different number of processes / interleave, is refused).

**Memory.** One file's read buffer (a jsonl line, a parquet row group, 256 ArrayRecord records, a text file) per
reader, the documents of a tokenizer batch (16) or shuffle window, and the rows of one packed document.

**Evaluation** (`EvalRows`): the documents of `eval_paths` in file order, or without them the held-out documents
of `paths` (`eval_fraction`) in the sorted file order, packed into rows that are read only as far as the
requested batches need (so the first batches of a large corpus cost little), then kept.
"""

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Callable, Iterator

import grain
import numpy as np

from focal_jax.data.config import DataConfig
from focal_jax.data.packing import PACKED_KEYS, frame, merge_documents, pack
from focal_jax.data.sources import expand_paths, is_held_out, iter_records
from focal_jax.data.tokenizer import Tokenizer

Batch = dict[str, np.ndarray]
STATE_VERSION = 1
POSITION_KEYS = ("epoch", "file", "record", "byte", "taken", "skip")
TOKENIZER_SAMPLE_CHARS = 20_000_000  # a tokenizer trained for a stream sees the first documents up to this size
_ENCODE_BATCH = 16  # documents tokenized at once
_START = dict.fromkeys(POSITION_KEYS, 0)
# Empty epochs in a row, per reader, after which a reader whose files change each epoch gives up: a reader with
# any document in reach meets an empty epoch with probability at most 1 - 1 / n_readers (e^-20 for all of them).
MAX_EMPTY_EPOCHS_PER_READER = 20


def log(message: str):
    print(f"focal_jax: {message}", flush=True)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the readers of one stream read, in which order (identical on every process).

    Attributes:
      files: all files of the stream, in sorted-glob order.
      source, field: the file format and the jsonl key / parquet column.
      split: 'train' (skip documents held out by `eval_fraction`) | 'eval' (keep only those) | 'all'.
      eval_fraction: the held-out share (see `focal_jax.data.sources.is_held_out`).
      shuffle, seed, shuffle_window: the order (see the module docstring).
      shard_by, n_readers: how the readers split the files.
      epochs: None repeats forever; n stops after n epochs.
      require_documents: an epoch read from its start without a document raises (else it is just empty).
      verbose: print progress (process 0).
    """

    files: tuple[str, ...]
    source: str
    field: str
    split: str = "all"
    eval_fraction: float = 0.0
    shuffle: bool = False
    seed: int = 0
    shuffle_window: int = 0
    shard_by: str = "file"
    n_readers: int = 1
    process_count: int = 1
    epochs: int | None = None
    require_documents: bool = True
    verbose: bool = False

    def epoch_files(self, epoch: int, reader: int) -> list[tuple[int, int]]:
        """`(g, index)` of each file reader `reader` reads in epoch `epoch`: `g` its position in the epoch's order,
        `index` its index in `files`."""
        n = len(self.files)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        positions = range(reader, n, self.n_readers) if self.shard_by == "file" else range(n)
        return [(g, int(order[g])) for g in positions]

    def keeper(self, reader: int, g: int) -> Callable[[int], bool] | None:
        """Which records of the file at epoch position `g` reader `reader` keeps (None: all)."""
        if self.shard_by == "file" or self.n_readers == 1:
            return None
        n_readers = self.n_readers
        return lambda record: (record + g) % n_readers == reader

    def in_split(self, text: str) -> bool:
        if self.split == "all":
            return True
        return is_held_out(text, self.eval_fraction) == (self.split == "eval")

    @property
    def varies_by_epoch(self) -> bool:
        """Whether a reader's documents change from epoch to epoch (shuffled among several readers)."""
        return self.shuffle and self.n_readers > 1

    @property
    def window(self) -> int:
        return self.shuffle_window if self.shuffle and self.shuffle_window > 1 else 0

    def describe_reader(self, reader: int) -> str:
        if self.n_readers == 1:
            return "the stream"
        process, stream = reader % self.process_count, reader // self.process_count
        return (f"reader {reader} of {self.n_readers} (process {process} of {self.process_count}, "
                f"interleaved stream {stream})")


@dataclasses.dataclass(frozen=True)
class _Doc:
    text: str
    before: dict  # the position from which reading yields this document first
    after: dict  # the position from which reading yields the documents after it


@dataclasses.dataclass(frozen=True)
class _EpochEnd:
    next: dict  # the position of the next epoch's start


def _position(epoch, file, record, byte, taken, skip=0) -> dict:
    return dict(epoch=epoch, file=file, record=record, byte=byte, taken=taken, skip=skip)


def documents(plan: Plan, reader: int, start: dict | None = None) -> Iterator[_Doc | _EpochEnd]:
    """The documents of reader `reader` from position `start` (default: the beginning), each with its position;
    an `_EpochEnd` after each epoch's last document. When `plan.require_documents`, raises ValueError once the
    reader cannot find a document: an epoch read from its start is empty and every epoch reads the same documents,
    or (`plan.varies_by_epoch`: shuffled among several readers, so an empty file or a small one may fall to one
    reader alone in some epoch) `MAX_EMPTY_EPOCHS_PER_READER * n_readers` epochs in a row are empty."""
    start = start or _START
    epoch, first = start["epoch"], start["file"]
    within = (start["record"], start["byte"], start["taken"])
    whole = first == 0 and within == (0, 0, 0)
    empty_epochs = 0
    while True:
        files = plan.epoch_files(epoch, reader)
        count, every = 0, max(1, len(files) // 10)
        if plan.verbose and whole:
            log(f"data: {plan.describe_reader(reader)} starts epoch {epoch} ({len(files)} files)")
        for j in range(first, len(files)):
            g, index = files[j]
            for text, before, after in _file_documents(plan, reader, epoch, g, index, within):
                count += 1
                yield _Doc(text, _position(epoch, j, *before), _position(epoch, j, *after))
            within = (0, 0, 0)
            if plan.verbose and len(files) >= 10 and (j + 1) % every == 0:
                log(f"data: {plan.describe_reader(reader)}, epoch {epoch}: {j + 1}/{len(files)} files read")
        empty_epochs = empty_epochs + 1 if whole and count == 0 else 0
        limit = MAX_EMPTY_EPOCHS_PER_READER * plan.n_readers if plan.varies_by_epoch else 1
        if empty_epochs >= limit and plan.require_documents:
            names = [plan.files[index] for _, index in files]
            held = f" or all held out for evaluation (eval_fraction={plan.eval_fraction})" \
                if plan.split == "train" and plan.eval_fraction > 0 else ""
            epochs = f"epoch {epoch}" if limit == 1 else f"{limit} epochs in a row (the last, {epoch},"
            raise ValueError(f"empty document stream: {plan.describe_reader(reader)} found no documents in {epochs} "
                             f"in its {len(names)} file(s) {names[:3]}{' ...' if len(names) > 3 else ''}"
                             f"{'' if limit == 1 else ')'}: they hold no non-empty documents{held}"
                             + (" (fewer documents than readers? shard_by='document' gives each reader every "
                                f"{plan.n_readers}-th document)" if plan.shard_by == "document" else ""))
        yield _EpochEnd(_position(epoch + 1, 0, 0, 0, 0))
        if plan.epochs is not None and epoch + 1 >= plan.epochs:
            return
        epoch, first, within, whole = epoch + 1, 0, (0, 0, 0), True


def _file_documents(plan: Plan, reader: int, epoch: int, g: int, index: int, within: tuple[int, int, int]):
    """`(text, before, after)` of the documents reader `reader` takes from file `index` (epoch position `g`),
    from `within = (record, byte, taken)`; `before` / `after` are `(record, byte, taken)` positions."""
    record, byte, taken = within
    records = iter_records(plan.files[index], plan.source, plan.field, start_record=record, start_byte=byte,
                           wanted=plan.keeper(reader, g))
    docs = ((r, start, end, text) for r, start, end, text in records if text and plan.in_split(text))
    window = plan.window
    if not window:
        for r, start, end, text in docs:
            yield text, (r, start, 0), (r + 1, end, 0)
        return
    window_start = (record, byte)
    while True:
        chunk = list(itertools.islice(docs, window))
        if not chunk:
            return
        order = np.random.default_rng([plan.seed, epoch, index, window_start[0]]).permutation(len(chunk))
        for k in range(taken, len(chunk)):
            yield chunk[order[k]][3], (*window_start, k), (*window_start, k + 1)
        taken = 0
        window_start = (chunk[-1][0] + 1, chunk[-1][2])


def _encoded(items: Iterator, tokenizer: Tokenizer) -> Iterator:
    """`(tokens, doc)` per `_Doc` (`tokens`: int32 `[n + 2]`, framed as `encode_documents` frames), `_EpochEnd`s
    passed through; documents are tokenized in batches of 16."""
    batch = []

    def flush():
        if not batch:
            return []
        ids = tokenizer.encode_batch([doc.text for doc in batch], special_tokens=False)
        out = [(frame(i, tokenizer.start_id, tokenizer.eos_id), doc) for i, doc in zip(ids, batch)]
        batch.clear()
        return out

    for item in items:
        if isinstance(item, _Doc):
            batch.append(item)
            if len(batch) < _ENCODE_BATCH:
                continue
        yield from flush()
        if not isinstance(item, _Doc):
            yield item
    yield from flush()


def rows(plan: Plan, reader: int, tokenizer: Tokenizer, seq_len: int,
         start: dict | None = None) -> Iterator[tuple[Batch, dict]]:
    """The packed rows of reader `reader` from position `start` -> `(row, position after it)`; a row is a dict of
    `[seq_len]` arrays with the keys of `pack`. Rows equal `pack(all documents of an epoch, seq_len)`, epoch after
    epoch."""
    start = start or _START
    skip = start["skip"]
    pieces = []  # (tokens, position of their document, offset of tokens[0] in the document)
    total = 0
    for item in _encoded(documents(plan, reader, start), tokenizer):
        if isinstance(item, _EpochEnd):
            if total:  # the epoch's last, partial row, padded
                yield _row(pack([p[0] for p in pieces], seq_len), 0), item.next
                pieces, total = [], 0
            continue
        tokens, doc = item
        offset = 0
        if skip:
            if skip >= len(tokens):
                raise ValueError(f"cannot resume the data stream: the state skips {skip} tokens of a document of "
                                 f"{len(tokens)} tokens at {doc.before} (did the files or the tokenizer change?)")
            tokens, offset, skip = tokens[skip:], skip, 0
        pieces.append((tokens, doc.before, offset))
        total += len(tokens)
        n_full = total // seq_len
        if not n_full:
            continue
        packed = pack([p[0] for p in pieces], seq_len)
        starts = np.cumsum([0] + [len(p[0]) for p in pieces])
        for r in range(n_full):
            end = (r + 1) * seq_len
            if end == total:
                after = doc.after
            else:
                i = int(np.searchsorted(starts, end, side="right")) - 1
                after = {**pieces[i][1], "skip": pieces[i][2] + end - int(starts[i])}
            yield _row(packed, r), after
        cut = n_full * seq_len
        if cut == total:
            pieces = []
        else:
            i = int(np.searchsorted(starts, cut, side="right")) - 1
            inner = cut - int(starts[i])
            pieces = [(pieces[i][0][inner:], pieces[i][1], pieces[i][2] + inner)] + pieces[i + 1:]
        total -= cut


def _row(packed: Batch, r: int) -> Batch:
    return {k: packed[k][r] for k in PACKED_KEYS}


class _Reader:
    """One reader's rows, resumable at any row boundary (`position`)."""

    def __init__(self, plan: Plan, reader: int, tokenizer: Tokenizer, seq_len: int):
        self.plan, self.reader, self.tokenizer, self.seq_len = plan, reader, tokenizer, seq_len
        self.position = dict(_START)
        self._rows = None

    def __next__(self) -> Batch:
        if self._rows is None:
            self._rows = rows(self.plan, self.reader, self.tokenizer, self.seq_len, self.position)
        try:
            row, position = next(self._rows)
        except BaseException:
            self._rows = None  # a retry starts again from the last good position (and fails the same way)
            raise
        self.position = position
        return row

    def reset(self, position: dict):
        self.close()
        self.position = dict(position)

    def close(self):
        if self._rows is not None:
            self._rows.close()
            self._rows = None


def _digest(files) -> str:
    return hashlib.sha256("\n".join(files).encode("utf-8", "surrogatepass")).hexdigest()[:16]


class StreamIterator(grain.DatasetIterator):
    """Rows of a process's readers, alternating (one row each in turn); checkpointable.

    `get_state()` -> `{'version': 1, 'files': n_files, 'files_digest': str, 'readers': [reader ids],
    'n_readers': int, 'next': i, 'positions': [one position dict per reader]}` (JSON, a few integers);
    `set_state(state)` resumes exactly there.
    """

    def __init__(self, stream: "TrainStream"):
        super().__init__()
        self._stream = stream
        self._readers = [_Reader(stream.plan, r, stream.tokenizer, stream.seq_len) for r in stream.readers]
        self._next = 0

    def __next__(self) -> Batch:
        row = next(self._readers[self._next])
        self._next = (self._next + 1) % len(self._readers)
        return row

    def get_state(self) -> dict:
        plan = self._stream.plan
        return {"version": STATE_VERSION, "files": len(plan.files), "files_digest": _digest(plan.files),
                "readers": list(self._stream.readers), "n_readers": plan.n_readers, "next": self._next,
                "positions": [dict(r.position) for r in self._readers]}

    def set_state(self, state: dict):
        _check_state(state, self._stream, self.get_state())
        for r, position in zip(self._readers, state["positions"]):
            r.reset({k: int(position[k]) for k in POSITION_KEYS})
        self._next = int(state["next"])

    def close(self):
        for r in self._readers:
            r.close()

    def __str__(self):
        return f"StreamIterator(readers={list(self._stream.readers)} of {self._stream.plan.n_readers})"


def _check_state(state, stream: "TrainStream", current: dict):
    """Raises ValueError naming the mismatch when `state` cannot resume `stream`."""
    if not isinstance(state, dict):
        raise ValueError(f"a streaming data state is a dict, got {type(state).__name__}")
    if "next_index" in state and "positions" not in state:
        raise ValueError(f"the data state {state} was saved by the in-memory pipeline (streaming=False); it cannot "
                         f"resume a stream")
    missing = sorted(set(current) - set(state))
    if missing or state.get("version") != STATE_VERSION:
        raise ValueError(f"not a streaming data state of version {STATE_VERSION}: missing keys {missing}, "
                         f"version={state.get('version')!r}")
    if (state["files"], state["files_digest"]) != (current["files"], current["files_digest"]):
        raise ValueError(f"the files of paths={stream.paths} changed since the data state was saved "
                         f"({state['files']} files then, {current['files']} now, or other names): a stream resumes "
                         f"over the same files only")
    if list(state["readers"]) != current["readers"] or state["n_readers"] != current["n_readers"]:
        raise ValueError(f"the data state belongs to readers {state['readers']} of {state['n_readers']}, this "
                         f"process has readers {current['readers']} of {current['n_readers']} (process_count x "
                         f"interleave changed, or the state of another process): resume with the same layout")
    positions = state["positions"]
    bad = [p for p in positions if not isinstance(p, dict) or any(
        isinstance(p.get(k), bool) or not isinstance(p.get(k), (int, np.integer)) or p[k] < 0 for k in POSITION_KEYS)]
    following = state["next"]
    if len(positions) != len(current["positions"]) or bad or isinstance(following, bool) or not isinstance(
            following, (int, np.integer)) or not 0 <= following < len(positions):
        raise ValueError(f"invalid positions in the data state: {positions} (next={state['next']!r}); each needs "
                         f"the integer keys {POSITION_KEYS}")


class ProcessStates:
    """A process's training iterator whose state, in a multi-process JAX run, holds the positions of every process.

    A checkpoint keeps one JSON data state, written by process 0, but each process of a stream is elsewhere. So
    `get_state()` gathers the states of all processes (`{'processes': [state of process 0, ...]}`, a small
    collective: every process calls it at the same step, as the checkpoint save that follows already requires),
    and `set_state` takes this process's entry (a single process's state is accepted too). Iterating is `iterator`'s.
    """

    def __init__(self, iterator, process_index: int, process_count: int, *, gather: bool):
        self.iterator, self.process_index, self.process_count, self.gather = (iterator, process_index,
                                                                             process_count, gather)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        return next(self.iterator)

    def get_state(self) -> dict:
        state = self.iterator.get_state()
        return {"processes": allgather_json(state)} if self.gather else state

    def set_state(self, state: dict):
        if isinstance(state, dict) and "processes" in state:
            states = state["processes"]
            if not isinstance(states, list) or len(states) != self.process_count:
                raise ValueError(f"the data state holds the positions of {len(states)} processes, this run has "
                                 f"process_count={self.process_count}: a stream resumes with the same processes")
            state = states[self.process_index]
        self.iterator.set_state(state)

    def close(self):
        self.iterator.close()


def allgather_json(value) -> list:
    """`value` (JSON-serialisable) of every JAX process -> list indexed by process (a collective)."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n])) for row, n in zip(gathered, lengths)]


class TrainStream(grain.IterDataset):
    """The rows of this process's readers as a grain `IterDataset` (infinite; element: dict of `[seq_len]` arrays
    with the keys of `pack`). `iter()` gives a `StreamIterator`."""

    def __init__(self, plan: Plan, readers: tuple[int, ...], tokenizer: Tokenizer, seq_len: int, paths=()):
        super().__init__()
        self.plan, self.readers, self.tokenizer, self.seq_len, self.paths = plan, readers, tokenizer, seq_len, paths

    def __iter__(self) -> StreamIterator:
        return StreamIterator(self)

    def __str__(self):
        return f"TrainStream({len(self.plan.files)} files, readers={list(self.readers)} of {self.plan.n_readers})"


def train_plan(config: DataConfig, files: list[str], *, seed: int, process_index: int, process_count: int) -> Plan:
    """The plan of the training stream of `config` over `files` (the expanded `paths`)."""
    n_readers = process_count * config.interleave
    if config.shard_by == "file" and len(files) < n_readers:
        raise ValueError(f"shard_by='file' gives each of the {n_readers} readers (process_count={process_count} x "
                         f"interleave={config.interleave}) its own files, but paths={config.paths} match "
                         f"{len(files)} file(s): split the corpus into more files, lower interleave, or set "
                         f"shard_by='document'")
    return Plan(files=tuple(files), source=config.source, field=config.field,
                split="all" if config.eval_paths else "train", eval_fraction=config.eval_fraction,
                shuffle=config.shuffle, seed=seed, shuffle_window=config.shuffle_window, shard_by=config.shard_by,
                n_readers=n_readers, process_count=process_count, verbose=process_index == 0)


def train_stream(config: DataConfig, files: list[str], tokenizer: Tokenizer, *, global_batch: int, seed: int,
                 process_index: int, process_count: int) -> grain.IterDataset:
    """This process's training batches: `TrainStream -> batch(local_batch) -> thread prefetch(config.prefetch)`;
    each element a dict of `[global_batch // process_count, seq_len]` arrays. Checks that each of the process's
    readers finds a first document (raises the empty-stream error at once)."""
    plan = train_plan(config, files, seed=seed, process_index=process_index, process_count=process_count)
    readers = tuple(process_index + process_count * i for i in range(config.interleave))
    for reader in readers:
        items = documents(dataclasses.replace(plan, verbose=False), reader)
        next(item for item in items if isinstance(item, _Doc))  # a first document exists (or raises)
    dataset = TrainStream(plan, readers, tokenizer, config.seq_len, paths=config.paths)
    if not config.doc_mask:
        dataset = dataset.map(merge_documents)
    dataset = dataset.batch(global_batch // process_count, drop_remainder=True)
    if config.prefetch:
        dataset = grain.experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=config.prefetch)
    return dataset


def tokenizer_sample(config: DataConfig, files: list[str], max_chars: int = TOKENIZER_SAMPLE_CHARS) -> list[str]:
    """The documents a tokenizer for this stream is trained on: the first training documents of `files` in sorted
    order (not shuffled, not sharded: the same on every process) up to `max_chars` characters; all of them for a
    corpus below that, which then gives the tokenizer of the in-memory pipeline."""
    plan = Plan(files=tuple(files), source=config.source, field=config.field,
                split="all" if config.eval_paths else "train", eval_fraction=config.eval_fraction, epochs=1,
                require_documents=False)
    sample, chars = [], 0
    for item in documents(plan, 0):
        if isinstance(item, _EpochEnd) or chars >= max_chars:
            break
        sample.append(item.text)
        chars += len(item.text)
    if not sample:
        raise ValueError(f"empty document stream: paths={config.paths} ({len(files)} files) hold no training "
                         f"documents to train a tokenizer on")
    return sample


class EvalRows:
    """The held-out rows of a stream, read lazily and kept: `rows(n)` -> dict of `[n, seq_len]` arrays.

    The documents of `eval_paths` (in sorted-glob order), or else the documents of `paths` held out by
    `eval_fraction` (in sorted order), packed with `pack` (one pass, no shuffling, the same on every process); past
    the last document the rows are padding (`loss_mask` 0). With neither source, `rows` raises.
    """

    def __init__(self, config: DataConfig, files: list[str], tokenizer: Tokenizer, *, verbose: bool = False):
        self.config, self.tokenizer, self.verbose = config, tokenizer, verbose
        self.plan = None
        if config.eval_paths:
            self.plan = Plan(files=tuple(expand_paths(config.eval_paths)), source=config.source, field=config.field,
                             epochs=1, require_documents=False)
        elif config.eval_fraction > 0:
            self.plan = Plan(files=tuple(files), source=config.source, field=config.field, split="eval",
                             eval_fraction=config.eval_fraction, epochs=1, require_documents=False)
        self._rows: list[Batch] = []
        self._iterator = None
        self._done = False

    def count(self, n: int) -> int:
        """How many of the first `n` held-out rows hold documents (fewer than `n` past the end of the split)."""
        self._read(n)
        return min(n, len(self._rows))

    def rows(self, n: int) -> Batch:
        """The first `n` held-out rows -> dict of `[n, seq_len]` arrays (zero rows past the end)."""
        self._read(n)
        seq_len = self.config.seq_len
        out = {}
        for k in PACKED_KEYS:
            have = np.stack([r[k] for r in self._rows[:n]])
            out[k] = np.concatenate([have, np.zeros((n - len(have), seq_len), have.dtype)])
        return out if self.config.doc_mask else merge_documents(out)

    def _read(self, n: int):
        """Reads held-out rows until `n` are kept or the split ends; ValueError when it has none."""
        if self.plan is None:
            raise ValueError("there are no evaluation documents: streaming with eval_fraction=0 and no eval_paths; "
                             "set eval_paths (held-out files) or eval_fraction > 0")
        if len(self._rows) < n and not self._done:
            if self._iterator is None:
                self._iterator = rows(self.plan, 0, self.tokenizer, self.config.seq_len)
            before = len(self._rows)
            for row, _ in self._iterator:
                self._rows.append(row)
                if len(self._rows) >= n:
                    break
            else:
                self._done = True
            if self.verbose:
                log(f"data: {len(self._rows) - before} evaluation rows read ({len(self._rows)} in all"
                    f"{', the whole evaluation split' if self._done else ''})")
        if not self._rows:
            where = (f"eval_paths={self.config.eval_paths}" if self.config.eval_paths else
                     f"paths={self.config.paths} with eval_fraction={self.config.eval_fraction}")
            raise ValueError(f"there are no evaluation documents: {where} gave none (raise eval_fraction or set "
                             f"eval_paths)")
