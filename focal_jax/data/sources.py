"""Reading the documents of a `DataConfig`: files (text, jsonl, parquet, ArrayRecord), the builtin corpus, or a
synthetic task.

Every file format has one lazy reader, `iter_records(path, source, field, start=...)`, which reads a file
incrementally (a jsonl line, a parquet row group, a chunk of ArrayRecord records at a time) and can start in the
middle of a file (at a record index, and for jsonl at a byte offset). The in-memory pipeline (`read_documents`)
and the streaming one (`focal_jax.data.streaming`) both read through it, so they see the same documents with the
same errors.
"""

import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterator

from focal_jax.data.config import DataConfig
from focal_jax.data.corpus import builtin_corpus
from focal_jax.data.synthetic import make_examples

SYNTHETIC_SEED = 0  # the seed of the synthetic training documents; score with other seeds to test unseen examples
_ARRAY_RECORD_CHUNK = 256  # ArrayRecord records read at a time


def read_documents(config: DataConfig, paths: tuple[str, ...] | None = None) -> list[str]:
    """All documents of `config.source` -> list of str, in a deterministic order (files in glob-sorted order).

    `paths` (glob patterns) replaces `config.paths` for a file source (e.g. `config.eval_paths`). Empty documents
    are dropped; raises if none are left.
    """
    paths = config.paths if paths is None else paths
    if config.source == "builtin":
        docs = list(builtin_corpus(config.cache_dir))
    elif config.source == "synthetic":
        examples = make_examples(config.task, config.n_synthetic, seed=SYNTHETIC_SEED, **dict(config.task_kwargs))
        docs = [ex.prompt + ex.answer for ex in examples]
    else:
        docs = [text for path in expand_paths(paths)
                for _, _, _, text in iter_records(path, config.source, config.field) if text]
    docs = [doc for doc in docs if doc]
    if not docs:
        raise ValueError(f"source={config.source!r} with paths={paths} gave no documents (or only empty ones)")
    return docs


def expand_paths(patterns: tuple[str, ...]) -> list[str]:
    """Glob patterns (`~` expanded, `**` recursive) -> the matching files, each pattern's matches sorted; a file
    that several patterns match is read once (where it first appears)."""
    files, seen = [], set()
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"no file matches the pattern {pattern!r}")
        for path in matches:
            real = os.path.realpath(path)
            if real not in seen:
                seen.add(real)
                files.append(path)
    return files


def check_disjoint(paths: tuple[str, ...], eval_paths: tuple[str, ...]):
    """ValueError naming the files that both the training patterns `paths` and `eval_paths` match (a run would
    evaluate on documents it trains on)."""
    train = {os.path.realpath(path) for path in expand_paths(paths)}
    both = [path for path in expand_paths(eval_paths) if os.path.realpath(path) in train]
    if both:
        raise ValueError(f"eval_paths={eval_paths} and paths={paths} both match {len(both)} file(s) {both[:3]}"
                         f"{' ...' if len(both) > 3 else ''}: the run would evaluate on documents it trains on; "
                         f"make the training patterns leave the evaluation files out")


def is_held_out(doc: str, eval_fraction: float) -> bool:
    """Whether `doc` is held out for evaluation: a uniform number in [0, 1) from the sha256 of its text is below
    `eval_fraction`. Equal documents land in the same split, and the split of a document does not depend on the
    others (so a stream can decide it document by document)."""
    if eval_fraction <= 0:
        return False
    digest = hashlib.sha256(doc.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < eval_fraction


Record = tuple[int, int, int, "str | None"]


def iter_records(path: str, source: str, field: str, *, start_record: int = 0, start_byte: int = 0,
                 wanted: Callable[[int], bool] | None = None) -> Iterator[Record]:
    """Reads the file `path` of format `source` lazily -> `(record, start_byte, end_byte, text)` per record.

    A record is one document slot of the file: the whole file ('text'), a line ('jsonl', blank lines included),
    a row ('parquet'), a record ('array_record'); `record` counts them from 0. `text` is the document, or None for
    a record without one (a blank jsonl line, a null jsonl or parquet value, or a record `wanted(record)` rejects:
    it is then not decoded). `start_byte` / `end_byte` are the record's byte offsets in a jsonl file (0 for the other
    formats). Reading starts at record `start_record` (jsonl: at byte `start_byte`, which must be the start of that
    record's line, as an earlier `end_byte` is).

    Memory: one jsonl line, one parquet row group (of the one column), 256 ArrayRecord records, or one text file.
    Raises OSError naming the file when it cannot be read, ValueError naming the file and record when a record is
    not a document (invalid JSON or utf-8, a missing field, a value that is not a string).
    """
    reader = _READERS[source]
    try:
        yield from reader(path, field, start_record, start_byte, wanted or _everything)
    except OSError as e:
        raise OSError(f"{path}: cannot read the file ({e.strerror or e})") from e


def _everything(record: int) -> bool:
    return True


def _read_text(path, field, start_record, start_byte, wanted):
    if start_record > 0:
        return
    if not wanted(0):
        yield 0, 0, 0, None
        return
    try:
        with open(path, encoding="utf-8-sig") as f:  # text mode: universal newlines; a leading BOM is dropped
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not utf-8 text ({e})") from None
    yield 0, 0, 0, text


def _read_jsonl(path, field, start_record, start_byte, wanted):
    with open(path, "rb") as f:
        f.seek(start_byte)
        record, offset = start_record, start_byte
        for line in f:
            end = offset + len(line)
            text = _jsonl_text(path, record + 1, line, field) if wanted(record) else None
            yield record, offset, end, text
            record, offset = record + 1, end


def _jsonl_text(path: str, number: int, line: bytes, field: str) -> str | None:
    """The document of jsonl line `number` (1-based), None for a blank line or a null `field`."""
    try:
        line = line.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM may start the file
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}, line {number}: not utf-8 text ({e})") from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from None
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}, line {number}: no field {field!r} (has {keys})")
    if record[field] is None:  # as a null parquet value
        return None
    if not isinstance(record[field], str):
        raise ValueError(f"{path}, line {number}: field {field!r} must be a string, got "
                         f"{type(record[field]).__name__}")
    try:
        record[field].encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate escape ("\ud83d"), valid JSON but no text
        raise ValueError(f"{path}, line {number}: field {field!r} holds an unpaired surrogate escape, which is not "
                         f"text ({e}); remove or replace it") from None
    return record[field]


def _read_parquet(path, field, start_record, start_byte, wanted):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, ValueError) as e:
        if isinstance(e, OSError):
            raise
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    with file:
        columns = file.schema_arrow.names
        if field not in columns:
            raise ValueError(f"{path}: no column {field!r} (columns: {columns})")
        first = 0
        for group in range(file.num_row_groups):
            n = file.metadata.row_group(group).num_rows
            if first + n <= start_record:
                first += n
                continue
            values = file.read_row_group(group, columns=[field]).column(field).to_pylist()
            for row in range(max(start_record - first, 0), n):
                value = values[row]
                if value is not None and not isinstance(value, str):
                    raise ValueError(f"{path}: column {field!r} must hold strings, found {type(value).__name__} "
                                     f"(row {first + row})")
                yield first + row, 0, 0, value if wanted(first + row) else None
            first += n


def _read_array_record(path, field, start_record, start_byte, wanted):
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(path)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable ArrayRecord file ({e})") from None
    read_all = False
    try:
        n = reader.num_records()  # 0 for a file it cannot make sense of: close() then raises
        for begin in range(start_record, n, _ARRAY_RECORD_CHUNK):
            try:
                chunk = reader.read(begin, min(begin + _ARRAY_RECORD_CHUNK, n))
            except RuntimeError as e:
                raise ValueError(f"{path}, records {begin}..: not a readable ArrayRecord file ({e})") from None
            for number, data in enumerate(chunk, start=begin):
                if not wanted(number):
                    yield number, 0, 0, None
                    continue
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}, record {number}: not utf-8 text ({e})") from None
                yield number, 0, 0, text
        read_all = True
    finally:
        try:
            reader.close()
        except RuntimeError as e:  # (after another error, or a generator left early, that error stands)
            if read_all:
                raise ValueError(f"{path}: not a readable ArrayRecord file ({str(e) or 'truncated?'})") from None


_READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet, "array_record": _read_array_record}
