"""Reading the documents of a `DataConfig`: files (text, jsonl, parquet, ArrayRecord), the builtin corpus, or a
synthetic task."""

import glob
import json
import os

from focal_jax.data.config import DataConfig
from focal_jax.data.corpus import builtin_corpus
from focal_jax.data.synthetic import make_examples

SYNTHETIC_SEED = 0  # the seed of the synthetic training documents; score with other seeds to test unseen examples


def read_documents(config: DataConfig) -> list[str]:
    """All documents of `config.source` -> list of str, in a deterministic order (files in glob-sorted order).

    Empty documents are dropped; raises if none are left.
    """
    if config.source == "builtin":
        docs = list(builtin_corpus())
    elif config.source == "synthetic":
        examples = make_examples(config.task, config.n_synthetic, seed=SYNTHETIC_SEED, **dict(config.task_kwargs))
        docs = [ex.prompt + ex.answer for ex in examples]
    else:
        read = _READERS[config.source]
        docs = [doc for path in expand_paths(config.paths) for doc in read(path, config.field)]
    docs = [doc for doc in docs if doc]
    if not docs:
        raise ValueError(f"source={config.source!r} with paths={config.paths} gave no documents (or only empty ones)")
    return docs


def expand_paths(patterns: tuple[str, ...]) -> list[str]:
    """Glob patterns (`~` expanded, `**` recursive) -> the matching files, each pattern's matches sorted."""
    files = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"no file matches the pattern {pattern!r}")
        files += matches
    return files


def _read_text(path: str, field: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [f.read()]


def _read_jsonl(path: str, field: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{path}, line {number}: no field {field!r} (has {keys})")
            if not isinstance(record[field], str):
                raise ValueError(f"{path}, line {number}: field {field!r} must be a string, got "
                                 f"{type(record[field]).__name__}")
            docs.append(record[field])
    return docs


def _read_parquet(path: str, field: str) -> list[str]:
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    if field not in columns:
        raise ValueError(f"{path}: no column {field!r} (columns: {columns})")
    values = pq.read_table(path, columns=[field]).column(field).to_pylist()
    bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
    if bad is not None:
        raise ValueError(f"{path}: column {field!r} must hold strings, found {type(bad).__name__}")
    return [v for v in values if v is not None]


def _read_array_record(path: str, field: str) -> list[str]:
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(path)
    try:
        records = reader.read_all()
    finally:
        reader.close()
    docs = []
    for number, record in enumerate(records):
        try:
            docs.append(record.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}, record {number}: not utf-8 text ({e})") from None
    return docs


_READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet, "array_record": _read_array_record}
