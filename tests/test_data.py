"""focal_jax.data: sources, builtin corpus, tokenizer, packing, synthetic tasks and the grain pipeline.

Most tests use a small synthetic corpus and a 320-piece tokenizer cached once per session; one test trains on the
builtin corpus at the default vocabulary size.
"""

import collections
import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from focal_jax.data import (DataConfig, Tokenizer, build_data, builtin_corpus, cached_tokenizer, load_tokenizer,
                            make_examples, merge_documents, pack, read_documents, score, train_iterator,
                            train_tokenizer)
from focal_jax.data import corpus, tokenizer as tokenizer_module
from focal_jax.data.synthetic import Example

VOCAB = 320
SEQ = 32


def check_raises(fn, *needles, error=ValueError):
    """fn() raises `error` whose message contains every needle (a str, or a compiled regex)."""
    with pytest.raises(error) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        found = needle.search(msg) if isinstance(needle, re.Pattern) else needle in msg
        assert found, f"{needle!r} not in: {msg}"
    return msg


def words(n, seed):
    """`n` short documents of random English-ish words (a small, fast corpus for tokenizer tests)."""
    rng = np.random.default_rng(seed)
    vocab = "the a of to and in data model token attention focus group sparse local window key value".split()
    return [" ".join(rng.choice(vocab, int(rng.integers(5, 40)))) + "." for _ in range(n)]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizers"))


def synthetic_config(cache_dir, **overrides):
    settings_ = dict(source="synthetic", task="associative_recall", task_kwargs={"n_pairs": 6, "n_queries": 2},
                     n_synthetic=200, vocab_size=VOCAB, cache_dir=cache_dir, seq_len=SEQ, eval_fraction=0.1)
    return DataConfig(**{**settings_, **overrides})


# ----------------------------------------------------------------------------------------------------------------
# DataConfig


def test_config_normalises_paths_and_task_kwargs():
    assert DataConfig(source="text", paths="a/*.txt, b.txt").paths == ("a/*.txt", "b.txt")
    assert DataConfig(source="text", paths=["a.txt"]).paths == ("a.txt",)
    config = DataConfig(source="synthetic", task="needle", task_kwargs={"n_sentences": 9, "n_keys": 2})
    assert config.task_kwargs == (("n_keys", 2), ("n_sentences", 9))
    assert DataConfig(source="synthetic", task="needle", task_kwargs=[("n_sentences", 9), ("n_keys", 2)]) == config
    assert hash(config) == hash(DataConfig(source="synthetic", task="needle", task_kwargs=config.task_kwargs))


@pytest.mark.parametrize("field, value, needle", [
    ("source", "csv", "jsonl"),  # unknown choices list the valid ones
    ("task", "sorting", "json_kv"),
    ("paths", 3, None),
    ("field", "", None),
    ("n_synthetic", 0, None),
    ("vocab_size", 100, None),
    ("vocab_size", 2000.0, None),
    ("seq_len", 1, None),
    ("eval_fraction", 1.0, None),
    ("eval_fraction", -0.1, None),
    ("shuffle", "yes", None),
    ("doc_mask", 0, None),
    ("tokenizer", 5, None),
    ("cache_dir", "", None),
])
def test_config_errors_name_the_field_and_value(field, value, needle):
    msg = check_raises(lambda: DataConfig(**{field: value}), re.compile(rf"\b{field}\b"), repr(value))
    if needle:
        assert needle in msg


def test_config_errors_for_file_source_without_paths_and_unknown_task_option():
    check_raises(lambda: DataConfig(source="jsonl"), "paths", "jsonl")
    check_raises(lambda: DataConfig(task="needle", task_kwargs={"n_pairs": 3}), "n_pairs", "n_sentences")


# ----------------------------------------------------------------------------------------------------------------
# Sources


def test_text_source_reads_each_file_as_one_document_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second\nfile")
    (tmp_path / "a.txt").write_text("first file é")
    (tmp_path / "empty.txt").write_text("")
    docs = read_documents(DataConfig(source="text", paths=str(tmp_path / "*.txt")))
    assert docs == ["first file é", "second\nfile"]


def test_jsonl_source_and_missing_field_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one", "id": 1}\n\n{"text": "two"}\n')
    assert read_documents(DataConfig(source="jsonl", paths=[str(path)])) == ["one", "two"]
    assert read_documents(DataConfig(source="jsonl", paths=[str(path)], field="text")) == ["one", "two"]
    path.write_text('{"text": "one"}\n{"body": "two"}\n')
    check_raises(lambda: read_documents(DataConfig(source="jsonl", paths=[str(path)])),
                 str(path), "line 2", "'text'", "body")


def test_a_byte_order_mark_starting_a_file_is_not_text(tmp_path):
    """Editors on Windows start utf-8 files with a BOM (U+FEFF): the text source kept it as the document's first
    character, and the jsonl source refused the file's first line as invalid JSON."""
    (tmp_path / "a.txt").write_text("first\ufefffile", encoding="utf-8-sig")
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\n{"text": "\ufefftwo"}\n', encoding="utf-8-sig")
    assert (tmp_path / "a.txt").read_bytes().startswith(b"\xef\xbb\xbf")
    assert read_documents(DataConfig(source="text", paths=str(tmp_path / "a.txt"))) == ["first\ufefffile"]
    assert read_documents(DataConfig(source="jsonl", paths=str(tmp_path / "d.jsonl"))) == ["one", "\ufefftwo"]


def test_parquet_source_and_missing_column_names_the_columns(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"content": ["alpha", "beta", None], "n": [1, 2, 3]}), path)
    assert read_documents(DataConfig(source="parquet", paths=[path], field="content")) == ["alpha", "beta"]
    check_raises(lambda: read_documents(DataConfig(source="parquet", paths=[path])), path, "'text'", "content", "'n'")


def test_array_record_source(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "d.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for text in ["record one", "record two ü"]:
        writer.write(text.encode("utf-8"))
    writer.close()
    assert read_documents(DataConfig(source="array_record", paths=[path])) == ["record one", "record two ü"]


def test_missing_glob_and_no_documents(tmp_path):
    pattern = str(tmp_path / "nothing*.jsonl")
    check_raises(lambda: read_documents(DataConfig(source="jsonl", paths=pattern)), pattern, error=FileNotFoundError)
    (tmp_path / "empty.txt").write_text("")
    check_raises(lambda: read_documents(DataConfig(source="text", paths=str(tmp_path / "*.txt"))), "no documents")


def test_synthetic_source_is_prompt_plus_answer():
    config = DataConfig(source="synthetic", task="json_kv", task_kwargs={"n_pairs": 3}, n_synthetic=5)
    examples = make_examples("json_kv", 5, seed=0, n_pairs=3)
    assert read_documents(config) == [ex.prompt + ex.answer for ex in examples]


# ----------------------------------------------------------------------------------------------------------------
# Synthetic tasks


@pytest.mark.parametrize("task, knob", [("associative_recall", "n_pairs"), ("needle", "n_sentences"),
                                        ("json_kv", "n_pairs")])
def test_synthetic_tasks_are_deterministic_and_grow_with_the_length_knob(task, knob):
    a, b, c = (make_examples(task, 20, seed=s) for s in (3, 3, 4))
    assert a == b and a != c
    assert all(isinstance(ex, Example) and ex.answer.isdigit() and not ex.prompt.endswith(" ") for ex in a)
    short, long = (make_examples(task, 10, seed=0, **{knob: n}) for n in (4, 40))
    assert min(len(ex.prompt) for ex in long) > 3 * max(len(ex.prompt) for ex in short)


def test_synthetic_answers_are_found_in_the_context():
    for ex in make_examples("associative_recall", 30, seed=1, n_pairs=10, n_queries=3):
        context, queries = ex.prompt.split("\nQueries: ")
        pairs = dict(re.findall(r"\b([a-z]{3})=(\d{4})\b", context))
        answered = re.findall(r"\b([a-z]{3})=(\d{4})\b", queries)
        assert len(pairs) == 10 and len(answered) == 2 and all(pairs[k] == v for k, v in answered)
        asked = queries.split(", ")[-1].removesuffix("=")
        assert pairs[asked] == ex.answer
        assert len({k for k, _ in answered} | {asked}) == 3  # distinct queries: the asked one is not answered before
    for ex in make_examples("needle", 30, seed=1, n_sentences=30, n_keys=3):
        key = re.search(r"What is the magic number for (\w+)\?", ex.prompt).group(1)
        assert f"The magic number for {key} is {ex.answer}." in ex.prompt
        assert ex.prompt.count("The magic number for") == 3
    for ex in make_examples("json_kv", 30, seed=1, n_pairs=7):
        obj_text, key_line, _ = ex.prompt.split("\n")
        obj = json.loads(obj_text)
        assert len(obj) == 7 and obj[json.loads(key_line.removeprefix("Key: "))] == ex.answer


def test_score():
    examples = make_examples("needle", 10, seed=0, n_sentences=5)
    assert score([ex.answer for ex in examples], examples) == 1.0
    assert score([f"  {ex.answer} and more\n" for ex in examples], examples) == 1.0
    assert score(["x" + ex.answer for ex in examples], examples) == 0.0
    assert score([ex.answer.strip() + "7" for ex in examples], examples) == 0.0  # an extra digit is a wrong number
    assert score([ex.answer if i < 4 else "" for i, ex in enumerate(examples)], examples) == 0.4
    check_raises(lambda: score(["1"], examples), "1 predictions", "10 examples")


def test_synthetic_errors():
    check_raises(lambda: make_examples("sorting", 1, seed=0), "sorting", "needle")
    check_raises(lambda: make_examples("needle", 1, seed=0, n_pairs=3), "n_pairs", "n_sentences")
    check_raises(lambda: make_examples("associative_recall", 1, seed=0, n_pairs=2, n_queries=3), "n_queries=3")


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.fixture(scope="session")
def small_tokenizer(cache_dir):
    return cached_tokenizer(words(200, seed=0), VOCAB, cache_dir)


def test_tokenizer_special_ids_and_exact_round_trip(small_tokenizer):
    tok = small_tokenizer
    assert (tok.vocab_size, tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (VOCAB, 0, 1, 2, 3)
    text = "the data model\n\n  attends   locally:\tx=1234 é 中 😀"
    ids = tok.encode(text)
    assert tok.unk_id not in ids and tok.decode(ids) == text and tok.decode(np.array(ids)) == text
    assert tok.encode_batch([text, "key"]) == [ids, tok.encode("key")]
    assert len(tok.encode("the attention")) < len("the attention")  # merges were learned


@settings(max_examples=50, deadline=None)
# (U+2581 decodes as a space: see the tokenizer's docstring)
@given(st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\u2581"), max_size=60))
def test_tokenizer_round_trips_any_text(small_tokenizer, text):
    assert small_tokenizer.decode(small_tokenizer.encode(text)) == text


def test_tokenizer_errors(tmp_path):
    check_raises(lambda: load_tokenizer(str(tmp_path / "no.model")), "no.model", error=FileNotFoundError)
    docs = words(20, seed=1)
    check_raises(lambda: train_tokenizer(docs, 5000, str(tmp_path / "t.model")), "vocab_size=5000", "too large",
                 "20 documents")
    check_raises(lambda: train_tokenizer(docs, 262, str(tmp_path / "t.model")), "vocab_size=262", "too small")
    assert not list(tmp_path.iterdir())  # nothing (not even a temporary file) left behind


def test_cached_tokenizer_reuses_and_keys_on_documents(tmp_path, monkeypatch, capsys):
    docs = words(100, seed=2)
    first = cached_tokenizer(docs, VOCAB, str(tmp_path))
    assert capsys.readouterr().out.count("\n") == 1  # one progress line
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(first.path)]

    def no_training(*args):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    again = cached_tokenizer(docs, VOCAB, str(tmp_path))
    assert again.path == first.path and again.encode("the key") == first.encode("the key")
    for changed in ([*docs, "one more document"], docs[:-1]):
        with pytest.raises(AssertionError, match="retrained"):
            cached_tokenizer(changed, VOCAB, str(tmp_path))
    with pytest.raises(AssertionError, match="retrained"):
        cached_tokenizer(docs, VOCAB + 10, str(tmp_path))


def test_builtin_corpus_and_its_tokenizer(tmp_path, monkeypatch):
    docs = builtin_corpus()
    assert docs is builtin_corpus()  # cached in-process
    assert sum(len(d.encode()) for d in docs) > 1_500_000 and len(docs) > 300
    assert any("assert_stmt ::=" in d for d in docs)  # a pydoc topic
    import inspect
    import textwrap  # an independent reference: the docstrings, as Python itself reports them

    module_doc = next(d for d in docs if d.startswith(inspect.getdoc(textwrap)))
    assert inspect.getdoc(textwrap.dedent) in module_doc and inspect.getdoc(textwrap.TextWrapper) in module_doc
    assert all(isinstance(d, str) and d for d in docs)

    tok = cached_tokenizer(docs, 2000, str(tmp_path))
    assert tok.vocab_size == 2000
    sample = docs[0][:2000]
    assert tok.decode(tok.encode(sample)) == sample
    assert len(tok.encode(sample)) < len(sample) / 2.5  # a real vocabulary: well under a token per 2.5 characters
    mtime = os.stat(tok.path).st_mtime_ns
    monkeypatch.setattr(tokenizer_module, "train_tokenizer", lambda *a: pytest.fail("retrained although cached"))
    assert cached_tokenizer(docs, 2000, str(tmp_path)).path == tok.path
    assert os.stat(tok.path).st_mtime_ns == mtime


def test_builtin_corpus_is_stored_and_read_back(tmp_path, monkeypatch):
    """The first build is stored in the cache directory; a later process reads it back without parsing the stdlib;
    the same process gives another cache directory its copy without parsing; a damaged copy is rebuilt; an
    unwritable cache directory still gives the corpus; a changed file changes the key. On 40 of the stdlib's files:
    the corpus is built three times."""
    files = corpus._stdlib_files()[:40]
    monkeypatch.setattr(corpus, "_stdlib_files", lambda: files)
    cache, other_cache = str(tmp_path / "cache"), str(tmp_path / "other")

    def build(cache_dir, as_new_process=True):
        if as_new_process:
            monkeypatch.setattr(corpus, "_BUILT", {})
        return corpus.builtin_corpus(cache_dir)

    built = build(cache)
    [stored] = (tmp_path / "cache").glob("builtin_corpus_*.json")
    with monkeypatch.context() as patched:
        patched.setattr(corpus, "_module_docstrings", lambda path: pytest.fail(f"parsed {path} again"))
        assert build(cache) == built
        assert build(other_cache, as_new_process=False) == built
        assert json.loads((tmp_path / "other" / stored.name).read_text()) == built
    stored.write_text('["cut sh')
    assert build(cache) == built and json.loads(stored.read_text()) == built

    def unwritable(path, data):
        raise PermissionError(13, "Permission denied", str(path))

    stored.unlink()
    monkeypatch.setattr(corpus, "write_atomically", unwritable)
    assert build(cache) == built and not stored.exists()

    source = tmp_path / "module.py"
    source.write_text('"""One."""\n')
    key = corpus._files_key([source])
    source.write_text('"""Two!"""\n')
    assert corpus._files_key([source]) != key


# ----------------------------------------------------------------------------------------------------------------
# Packing


def naive_pack(docs, seq_len):
    """Token-by-token reference for `pack`: rows of seq_len, segments renumbered per row, positions restart at
    each segment start and at each row start, target = next token of the same document."""
    stream = [(int(tok), d) for d, doc in enumerate(docs) for tok in doc]
    n_rows = -(-len(stream) // seq_len)
    out = {k: np.zeros((n_rows, seq_len), np.int64) for k in ("inputs", "targets", "segment_ids", "positions")}
    out["loss_mask"] = np.zeros((n_rows, seq_len))
    for r in range(n_rows):
        segment, position, previous = 0, 0, None
        for t in range(seq_len):
            i = r * seq_len + t
            if i >= len(stream):
                break
            token, d = stream[i]
            if d != previous:
                segment, position, previous = segment + 1, 0, d
            out["inputs"][r, t], out["segment_ids"][r, t], out["positions"][r, t] = token, segment, position
            position += 1
            if i + 1 < len(stream) and stream[i + 1][1] == d:
                out["targets"][r, t], out["loss_mask"][r, t] = stream[i + 1][0], 1
    return out


def test_pack_hand_checked_example():
    docs = [np.array([2, 5, 6, 3]), np.array([2, 7, 3]), np.array([2, 8, 9, 10, 3]), np.array([2, 3])]
    out = pack(docs, 4)
    assert out["inputs"].tolist() == [[2, 5, 6, 3], [2, 7, 3, 2], [8, 9, 10, 3], [2, 3, 0, 0]]
    # the third document starts at the end of row 1: its first target is the first input of row 2
    assert out["targets"].tolist() == [[5, 6, 3, 0], [7, 3, 0, 8], [9, 10, 3, 0], [3, 0, 0, 0]]
    assert out["loss_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 0], [1, 0, 0, 0]]
    assert out["segment_ids"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 2], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert out["positions"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 0, 0]]
    for key, dtype in [("inputs", np.int32), ("targets", np.int32), ("segment_ids", np.int32),
                       ("positions", np.int32), ("loss_mask", np.float32)]:
        assert out[key].dtype == dtype and out[key].shape == (4, 4)


documents = st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=30).map(np.array), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(documents, st.integers(1, 17))
def test_pack_matches_reference_and_recovers_every_bigram(docs, seq_len):
    out = pack(docs, seq_len)
    expected = naive_pack(docs, seq_len)
    for key in expected:
        np.testing.assert_array_equal(out[key], expected[key], err_msg=key)
    m = out["loss_mask"] > 0
    pairs = collections.Counter(zip(out["inputs"][m].tolist(), out["targets"][m].tolist()))
    bigrams = collections.Counter((int(a), int(b)) for doc in docs for a, b in zip(doc[:-1], doc[1:]))
    assert pairs == bigrams
    # inside a row, a trained target is the next input of the same segment
    inner = m[:, :-1]
    np.testing.assert_array_equal(out["targets"][:, :-1][inner], out["inputs"][:, 1:][inner])
    assert (out["segment_ids"][:, :-1][inner] == out["segment_ids"][:, 1:][inner]).all()
    # padding is masked and every row starts a segment at position 0
    assert not m[out["segment_ids"] == 0].any() and (out["positions"][:, 0] == 0).all()


@settings(max_examples=40, deadline=None)
@given(documents, st.integers(1, 17))
def test_merged_documents_make_each_row_one_sequence(docs, seq_len):
    """`doc_mask=False` (FOCAL_SPEC OQ-F9): one segment per row over its real tokens, positions the column; the
    tokens, targets and loss mask are `pack`'s."""
    out, packed = merge_documents(pack(docs, seq_len)), pack(docs, seq_len)
    assert sorted(out) == sorted(packed)
    for key in ("inputs", "targets", "loss_mask"):
        np.testing.assert_array_equal(out[key], packed[key], err_msg=key)
    real = packed["segment_ids"] > 0
    np.testing.assert_array_equal(out["segment_ids"], real.astype(np.int32))
    np.testing.assert_array_equal(out["positions"], np.where(real, np.arange(seq_len), 0))
    assert out["segment_ids"].dtype == out["positions"].dtype == np.int32


def test_merged_documents_hand_checked_and_errors():
    docs = [np.array([2, 5, 6, 3]), np.array([2, 7, 3]), np.array([2, 8, 9, 10, 3]), np.array([2, 3])]
    out = merge_documents(pack(docs, 4))
    assert out["segment_ids"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert out["positions"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 0, 0]]
    check_raises(lambda: merge_documents({"inputs": np.zeros((1, 4))}), "keys of pack", "'positions'")


def test_pack_errors():
    check_raises(lambda: pack([np.array([1, 2])], 0), "seq_len=0")
    check_raises(lambda: pack([], 4), "at least one document")
    check_raises(lambda: pack([np.array([1]), np.array([])], 4), "token_docs[1]")
    check_raises(lambda: pack([np.array([1]), np.array([2, 2**31])], 4), "token_docs[1] holds token id 2147483648",
                 "[0, 2147483647]")  # was: wrapped to -2147483648
    check_raises(lambda: pack([np.array([5, -1])], 4), "token_docs[0] holds token id -1")
    assert pack([np.array([2**31 - 1], np.int64)], 2)["inputs"].tolist() == [[2**31 - 1, 0]]


# ----------------------------------------------------------------------------------------------------------------
# Pipeline


def rows_of(batches):
    """Batches (dicts of [b, seq]) -> one dict of all their rows [sum b, seq]."""
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_train_batches_shapes_and_epochs(cache_dir):
    data = build_data(synthetic_config(cache_dir), global_batch=4, seed=0, process_index=0, process_count=1)
    assert data.tokenizer.vocab_size == VOCAB and data.n_train_documents + data.n_eval_documents == 200
    batch = next(train_iterator(data))
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
    for key, value in batch.items():
        assert value.shape == (4, SEQ) and value.dtype == (np.float32 if key == "loss_mask" else np.int32)
    # each epoch is a permutation of the packed rows, and the next epoch is shuffled differently
    n = data.n_train_rows
    steps = -(-2 * n // 4)
    rows = rows_of([data.train[s] for s in range(steps)])["inputs"]
    epoch1, epoch2 = rows[:n], rows[n:2 * n]
    assert sorted(map(tuple, epoch1.tolist())) == sorted(map(tuple, epoch2.tolist()))
    assert not np.array_equal(epoch1, epoch2)
    unshuffled = build_data(synthetic_config(cache_dir, shuffle=False), global_batch=4, seed=0, process_index=0,
                            process_count=1)
    plain = {k: v[:n] for k, v in rows_of([unshuffled.train[s] for s in range(-(-n // 4))]).items()}
    assert sorted(map(tuple, plain["inputs"].tolist())) == sorted(map(tuple, epoch1.tolist()))
    assert not np.array_equal(plain["inputs"], epoch1)
    assert data.n_train_tokens == (plain["segment_ids"] > 0).sum() == (plain["inputs"] > 0).sum()


def test_doc_mask_false_merges_the_documents_of_training_and_eval_rows(cache_dir):
    masked = build_data(synthetic_config(cache_dir, shuffle=False), global_batch=4, seed=0, process_index=0,
                        process_count=1)
    merged = build_data(synthetic_config(cache_dir, shuffle=False, doc_mask=False), global_batch=4, seed=0,
                        process_index=0, process_count=1)
    assert (masked.n_train_rows, masked.n_train_tokens) == (merged.n_train_rows, merged.n_train_tokens)
    assert masked.train[0]["segment_ids"].max() > 1  # rows hold several documents
    for a, b in ((masked.train[3], merged.train[3]), (masked.eval_batches(2)[1], merged.eval_batches(2)[1])):
        expected = merge_documents(a)
        for key in a:
            np.testing.assert_array_equal(b[key], expected[key], err_msg=key)


def test_process_shards_concatenate_to_the_global_batch(cache_dir):
    config = synthetic_config(cache_dir)
    one = build_data(config, global_batch=6, seed=3, process_index=0, process_count=1)
    parts = [build_data(config, global_batch=6, seed=3, process_index=p, process_count=2) for p in range(2)]
    steps = 2 * one.n_train_rows // 6 + 1  # crosses an epoch boundary
    for s in range(steps):
        shards = [part.train[s] for part in parts]
        assert shards[0]["inputs"].shape == (3, SEQ)
        for key, value in one.train[s].items():
            np.testing.assert_array_equal(np.concatenate([sh[key] for sh in shards]), value)
    for a, b in zip(one.eval_batches(3), zip(*(part.eval_batches(3) for part in parts))):
        for key in a:
            np.testing.assert_array_equal(np.concatenate([b[0][key], b[1][key]]), a[key])


def test_iterator_state_restores_exactly(cache_dir):
    data = build_data(synthetic_config(cache_dir), global_batch=4, seed=1, process_index=0, process_count=1)
    it = train_iterator(data)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(7)]
    restored = train_iterator(build_data(synthetic_config(cache_dir), global_batch=4, seed=1, process_index=0,
                                         process_count=1))
    restored.set_state(state)
    for a, b, step in zip(expected, [next(restored) for _ in range(7)], range(5, 12)):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
            np.testing.assert_array_equal(a[key], data.train[step][key])  # iterator step s == random access s


def test_eval_batches_are_deterministic_and_held_out(cache_dir):
    config = synthetic_config(cache_dir, shuffle=False, eval_fraction=0.2)
    data = build_data(config, global_batch=4, seed=0, process_index=0, process_count=1)
    tok = data.tokenizer

    def documents_in(rows):
        """Decode the documents of rows laid end to end (a document is bos ... eos)."""
        stream = rows["inputs"][rows["segment_ids"] > 0].tolist()
        text = tok.decode(stream)  # bos / eos are dropped by decode: split on them first
        docs, current = [], []
        for token in stream:
            if token == tok.bos_id:
                current = []
            elif token == tok.eos_id:
                docs.append(tok.decode(current))
            else:
                current.append(token)
        assert text == "".join(docs)
        return docs

    n_eval_rows = len(data.eval_rows["inputs"])
    n_eval_steps = -(-n_eval_rows // 4)
    assert n_eval_rows % 4, "the last batch should be part padding"
    # more batches than the rows fill: as many as they fill (batches of padding only cost a forward pass each:
    # eval_batches=100000 padded 99,700 of them, minutes at every evaluation)
    batches = data.eval_batches(n_eval_steps + 2)
    assert len(batches) == n_eval_steps and all(b["inputs"].shape == (4, SEQ) for b in batches)
    padding = batches[-1]["segment_ids"][n_eval_rows % 4:]
    assert padding.size and not padding.any() and not batches[-1]["loss_mask"][n_eval_rows % 4:].any()
    assert all(b["loss_mask"][:n_eval_rows - 4 * i].any(axis=1).all() for i, b in enumerate(batches))
    assert len(data.eval_batches(n_eval_steps - 1)) == n_eval_steps - 1
    again = data.eval_batches(n_eval_steps + 2)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(batches, again) for k in a)
    eval_docs = documents_in(rows_of(batches))
    train_rows = rows_of([data.train[s] for s in range(-(-data.n_train_rows // 4))])
    train_docs = documents_in({k: v[:data.n_train_rows] for k, v in train_rows.items()})
    assert len(eval_docs) == data.n_eval_documents > 0 and len(train_docs) == data.n_train_documents
    assert not set(eval_docs) & set(train_docs)
    assert sorted(eval_docs + train_docs) == sorted(read_documents(config))


def test_workdir_gets_the_tokenizer(cache_dir, tmp_path):
    data = build_data(synthetic_config(cache_dir), global_batch=4, seed=0, workdir=str(tmp_path / "run"),
                      process_index=0, process_count=1)
    assert data.tokenizer.path == str(tmp_path / "run" / "tokenizer.model")
    assert isinstance(load_tokenizer(data.tokenizer.path), Tokenizer)


def test_tokenizer_command_builds_the_runs_tokenizer(tmp_path):
    from focal_jax.data.__main__ import main

    (tmp_path / "corpus.txt").write_text("\n".join(words(300, seed=5)))
    cache = str(tmp_path / "cache")
    out = main(["--source", "text", "--paths", str(tmp_path / "*.txt"), "--vocab_size", "300", "--eval_fraction",
                "0", "--cache_dir", cache, "--out", str(tmp_path / "tok.model")])
    config = DataConfig(source="text", paths=(str(tmp_path / "*.txt"),), vocab_size=300, eval_fraction=0.0,
                        cache_dir=cache, seq_len=16)
    data = build_data(config, global_batch=2, seed=0, process_index=0, process_count=1)
    assert os.listdir(cache) == [os.path.basename(data.tokenizer.path)]  # the run found the command's tokenizer
    assert open(out, "rb").read() == open(data.tokenizer.path, "rb").read()


def test_pipeline_errors(cache_dir, tmp_path):
    def build(config=None, **kw):
        kw = {"global_batch": 4, "seed": 0, "process_index": 0, "process_count": 1, **kw}
        return build_data(config or synthetic_config(cache_dir), **kw)

    tiny = synthetic_config(cache_dir, n_synthetic=3, eval_fraction=0.0)
    check_raises(lambda: build(tiny, global_batch=64), re.compile(r"\b\d+ rows\b"), "global_batch=64",
                 f"seq_len={SEQ}")
    check_raises(lambda: build(global_batch=6, process_count=4), "global_batch=6", "process_count=4")
    check_raises(lambda: build(process_index=2, process_count=2), "process_index=2")
    check_raises(lambda: build(seed=-1), "seed=-1")
    no_eval = build(synthetic_config(cache_dir, eval_fraction=0.0))
    check_raises(lambda: no_eval.eval_batches(1), "no evaluation documents", "eval_fraction")
    check_raises(lambda: no_eval.eval_batches(0), "n=0")
    check_raises(lambda: build(synthetic_config(cache_dir, tokenizer=str(tmp_path / "x.model"))), "x.model",
                 error=FileNotFoundError)


# ----------------------------------------------------------------------------------------------------------------
# frequent_words (and the other tasks' outputs, which training data depends on)


def test_existing_synthetic_tasks_are_unchanged():
    import hashlib

    golden = {"associative_recall": "cb38d898748c6a30444d8504e9cee93e83b72ab47fc1dad2162a1dcf23e5ee95",
              "needle": "d2f472e4c348f87853e0afd4ec30c87b48f77a3f417dc3df17de9c2925b8fb42",
              "json_kv": "ce199665d3e74ecc4dd5fcb2c0306ad35820da3fac92d810b9cc2609ac013fec"}
    for task, digest in golden.items():
        examples = [(ex.prompt, ex.answer) for ex in make_examples(task, 5, seed=0)]
        assert hashlib.sha256(repr(examples).encode()).hexdigest() == digest, task


@pytest.mark.parametrize("top", [1, 3])
def test_frequent_words_answer_is_the_naive_count(top):
    examples = make_examples("frequent_words", 30, seed=2, n_words=40, n_vocab=6, top=top)
    assert examples == make_examples("frequent_words", 30, seed=2, n_words=40, n_vocab=6, top=top)
    assert examples != make_examples("frequent_words", 30, seed=3, n_words=40, n_vocab=6, top=top)
    for ex in examples:
        text, question = ex.prompt.split("\n")
        words = text.removeprefix("Words: ").removesuffix(".").split(" ")
        ranked = collections.Counter(words).most_common() + [("", 0)]  # a word never drawn counts 0
        assert len(words) == 40 and len(ranked) <= 7 and all(w.isalpha() for w in words)
        assert all(ranked[i][1] > ranked[i + 1][1] for i in range(top))  # the answer is unique
        assert ex.answer == " " + ", ".join(word for word, _ in ranked[:top])
        assert question.endswith(":") and (str(top) in question) == (top > 1)
    short, long = (make_examples("frequent_words", 10, seed=0, n_words=n) for n in (4, 40))
    assert min(len(ex.prompt) for ex in long) > 3 * max(len(ex.prompt) for ex in short)


def test_frequent_words_scoring_and_errors():
    from focal_jax.data.synthetic import _WORDS

    assert not [(a, b) for a in _WORDS for b in _WORDS if a != b and b.startswith(a)]  # prefix match is exact
    examples = make_examples("frequent_words", 4, seed=0, n_words=20)
    assert score([ex.answer.strip() + ", and more" for ex in examples], examples) == 1.0
    others = [next(w for w in _WORDS if w != ex.answer.strip()) for ex in examples]
    assert score(others, examples) == 0.0
    check_raises(lambda: make_examples("frequent_words", 1, seed=0, n_vocab=3, top=3), "top=3", "n_vocab=3")
    check_raises(lambda: make_examples("frequent_words", 1, seed=0, n_vocab=33), "n_vocab=33")
    check_raises(lambda: make_examples("frequent_words", 1, seed=0, n_words=2, top=2), "n_words=2")


# ----------------------------------------------------------------------------------------------------------------
# The run's tokenizer copy (SentencePiece kind; the Hugging Face kind: tests/test_tokenizer_hf.py)


def test_workdir_copy_keeps_the_sentencepiece_kind(small_tokenizer, tmp_path):
    import sentencepiece as spm

    from focal_jax.data import copy_tokenizer, tokenizer_file, workdir_tokenizer

    workdir = tmp_path / "run"
    workdir.mkdir()
    for stale in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer of the other kind, replaced
        (workdir / stale).write_text("{}")
    copy = copy_tokenizer(small_tokenizer, str(workdir))
    assert sorted(os.listdir(workdir)) == ["tokenizer.model"] and copy.path == str(workdir / "tokenizer.model")
    reference = spm.SentencePieceProcessor(model_file=small_tokenizer.path)  # the original file, read directly
    loaded = workdir_tokenizer(str(workdir))
    assert (loaded.kind, loaded.vocab_size, loaded.bos_id, loaded.eos_id, loaded.start_id) == (
        "sentencepiece", VOCAB, 2, 3, 2)
    texts = words(5, seed=3) + ["x=1234 é 中 😀"]
    assert loaded.encode_batch(texts) == reference.encode(texts)

    # tokenizer.model is taken before tokenizer.json (Mistral ships both); neither: both names in the error.
    (workdir / "tokenizer.json").write_text("{}")
    assert tokenizer_file(str(workdir)) == str(workdir / "tokenizer.model")
    os.remove(workdir / "tokenizer.model")
    assert tokenizer_file(str(workdir)) == str(workdir / "tokenizer.json")
    check_raises(lambda: tokenizer_file(str(tmp_path)), str(tmp_path), "neither tokenizer.model",
                 "nor tokenizer.json", error=FileNotFoundError)


def test_sentencepiece_model_without_bos_starts_documents_with_eos(tmp_path):
    import io

    import sentencepiece as spm

    from focal_jax.data import encode_documents

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(words(100, seed=4)), model_writer=model, vocab_size=40,
                                   bos_id=-1, eos_id=1, unk_id=0, pad_id=-1, minloglevel=2)
    path = tmp_path / "no_bos.model"
    path.write_bytes(model.getvalue())
    reference = spm.SentencePieceProcessor(model_file=str(path))
    assert reference.bos_id() == -1 and reference.eos_id() == 1
    tok = load_tokenizer(str(path))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.start_id) == (None, 1, None, 1)
    doc = words(1, seed=9)[0]
    assert encode_documents(tok, [doc])[0].tolist() == [1] + reference.encode(doc) + [1]


def test_tokenizer_command_builds_a_synthetic_runs_tokenizer_and_prints_only_its_path(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    config = DataConfig(source="synthetic", task="needle", task_kwargs={"n_sentences": 6, "n_keys": 2},
                        n_synthetic=150, vocab_size=400, cache_dir=cache, seq_len=SEQ, eval_fraction=0.1)
    command = [sys.executable, "-m", "focal_jax.data", "--source", "synthetic", "--task", "needle", "--task_kwargs",
               "n_sentences=6", "n_keys=2", "--n_synthetic", "150", "--vocab_size", "400", "--eval_fraction", "0.1",
               "--cache_dir", cache]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    assert "training a 400-piece" in done.stderr  # progress on stderr: stdout is the path alone
    printed = done.stdout.splitlines()
    data = build_data(config, global_batch=2, seed=0, process_index=0, process_count=1)
    assert printed == [data.tokenizer.path] and os.listdir(cache) == [os.path.basename(printed[0])]
    from focal_jax.data.__main__ import main

    for bad in ("n_keys", "n_keys=two"):  # n_keys is an option of the needle task: only the form is wrong
        with pytest.raises(SystemExit):
            main(["--source", "synthetic", "--task", "needle", "--task_kwargs", bad])
        assert f"--task_kwargs takes KEY=INTEGER items, got {bad!r}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--source", "bultin"], "unknown source='bultin'"),
    (["--vocab_size", "0"], "vocab_size must be an integer >= 262"),
    (["--vocab_size", "262"], "--vocab_size=262 is too small for this corpus ("),
    (["--source", "text", "--paths", "no_such_dir/*.txt"], "no file matches the pattern 'no_such_dir/*.txt'"),
    (["--source", "text", "--paths", __file__, "--eval_paths", "no_such_dir/*.txt"], "no file matches")])
def test_tokenizer_command_names_a_bad_setting_as_a_usage_error(argv, message, capsys):
    """A bad data setting is argparse's one-line error (status 2) naming it; it was DataConfig's traceback."""
    from focal_jax.data.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# Edge cases: boundaries, seeds, sharding, resume positions, validation


def test_config_drops_blank_path_patterns():
    """A trailing or doubled comma in `paths` / `eval_paths` leaves no empty pattern (which would match no file)."""
    assert DataConfig(source="text", paths="a.txt,").paths == ("a.txt",)
    assert DataConfig(source="text", paths=["a.txt", " ", ""]).paths == ("a.txt",)
    assert DataConfig(source="text", paths="a.txt", eval_paths=" b.txt,, ").eval_paths == ("b.txt",)


def test_score_refuses_an_answer_followed_by_a_letter():
    """A prediction counts only when the answer is not followed by a letter or digit: 'moons' is not 'moon'."""
    examples = [Example("Words: moon rain moon.\nThe most frequent word is:", " moon"), Example("a=", "1234")]
    assert score(["moons", "1234a"], examples) == 0.0
    assert score(["moon, rain", "1234."], examples) == 1.0


def test_the_seed_sets_the_order_of_the_training_rows(cache_dir):
    """Another seed shuffles the same rows into another order (the seed of a run is not ignored)."""
    config = synthetic_config(cache_dir)
    runs = [build_data(config, global_batch=4, seed=seed, process_index=0, process_count=1) for seed in (0, 1)]
    n = runs[0].n_train_rows
    epochs = [rows_of([data.train[s] for s in range(-(-n // 4))])["inputs"][:n] for data in runs]
    assert sorted(map(tuple, epochs[0].tolist())) == sorted(map(tuple, epochs[1].tolist()))
    assert not np.array_equal(epochs[0], epochs[1])


def test_a_corpus_of_exactly_one_global_batch_of_rows_trains(cache_dir):
    """The corpus must pack into at least `global_batch` rows: exactly that many is enough, one fewer is refused
    (unless the data is built for an evaluation)."""
    tiny = synthetic_config(cache_dir, n_synthetic=3, eval_fraction=0.0)
    n_rows = build_data(tiny, global_batch=1, seed=0, process_index=0, process_count=1).n_train_rows
    assert n_rows > 1
    data = build_data(tiny, global_batch=n_rows, seed=0, process_index=0, process_count=1)
    assert next(train_iterator(data))["inputs"].shape == (n_rows, SEQ)
    check_raises(lambda: build_data(tiny, global_batch=n_rows + 1, seed=0, process_index=0, process_count=1),
                 f"{n_rows} rows", f"global_batch={n_rows + 1}")
    # an evaluation reads the held-out rows only (`training=False`)
    assert build_data(tiny, global_batch=n_rows + 1, seed=0, process_index=0, process_count=1,
                      training=False).n_train_rows == n_rows


def test_an_eval_file_that_is_a_training_file_through_a_symlink_is_refused(tmp_path):
    """eval_paths naming a training file by another path (a symlink to it) would evaluate on trained documents."""
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.jsonl").write_text('{"text": "one"}\n')
    link = tmp_path / "eval.jsonl"
    link.symlink_to(tmp_path / "train" / "a.jsonl")
    config = DataConfig(source="jsonl", paths=str(tmp_path / "train" / "*.jsonl"), eval_paths=str(link),
                        cache_dir=str(tmp_path / "cache"))
    check_raises(lambda: build_data(config, global_batch=1, seed=0, process_index=0, process_count=1),
                 "both match 1 file(s)", str(link))


def test_the_tokenizer_cache_key_tells_apart_documents_split_differently():
    """The same characters cut into documents at another place are another corpus (other training lines): the cache
    key hashes each document's length with its text, so they do not share a cached tokenizer."""
    key = tokenizer_module._cache_key
    assert key(["the data", "model"], VOCAB) != key(["the", " datamodel"], VOCAB)
    assert key(["the data", "model"], VOCAB) == key(["the data", "model"], VOCAB)
