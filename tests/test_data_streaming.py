"""focal_jax.data.streaming: the lazily read, checkpointable training stream (`DataConfig(streaming=True)`).

References: the in-memory pipeline (rows of `pack` over all documents, tested against a naive packer in
test_data.py), the documents as written to the files, and an uninterrupted run (for resumes).
"""

import dataclasses
import itertools
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from focal_jax.data import DataConfig, build_data, cached_tokenizer, streaming, train_iterator
from focal_jax.data.sources import expand_paths, is_held_out

VOCAB = 320
SEQ = 32
WORDS = "the a of to and in data model token attention focus group sparse local window key value".split()


def words(n, seed, low=3, high=40):
    """`n` documents of random words (ids are row-crossing for high > ~20 at SEQ = 32)."""
    rng = np.random.default_rng(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS, int(rng.integers(low, high)))) + "." for i in range(n)]


DOCS = words(90, seed=11)


def check_raises(fn, *needles, error=ValueError):
    with pytest.raises(error) as info:
        fn()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in: {msg}"
    return msg


def write_corpus(directory, docs, fmt, n_files=3):
    """`docs` in `n_files` files of format `fmt` (text: one file per document), in order; returns the glob.
    jsonl files also get blank lines, an empty document and a null one, parquet files nulls and row groups of 5 rows:
    none is a document."""
    os.makedirs(directory, exist_ok=True)
    if fmt == "text":
        for i, doc in enumerate(docs):
            with open(os.path.join(directory, f"doc{i:04d}.txt"), "w") as f:
                f.write(doc)
        return os.path.join(directory, "*.txt")
    chunks = np.array_split(np.arange(len(docs)), n_files)
    for f, chunk in enumerate(chunks):
        part = [docs[i] for i in chunk]
        path = os.path.join(directory, f"part{f:03d}.{fmt}")
        if fmt == "jsonl":
            with open(path, "w") as out:
                for i, doc in enumerate(part):
                    out.write(json.dumps({"text": doc, "id": i}) + "\n")
                    if i % 7 == 3:
                        out.write("\n" + json.dumps({"text": ""}) + "\n" + json.dumps({"text": None}) + "\n")
        elif fmt == "parquet":
            pq.write_table(pa.table({"text": part[:2] + [None] + part[2:]}), path, row_group_size=5)
        else:
            from array_record.python.array_record_module import ArrayRecordWriter

            writer = ArrayRecordWriter(path, "group_size:1")
            for doc in part:
                writer.write(doc.encode("utf-8"))
            writer.close()
    return os.path.join(directory, f"*.{fmt}")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture(scope="module")
def tokenizer_path(cache_dir):
    return cached_tokenizer(words(200, seed=0), VOCAB, cache_dir).path


def config(pattern, cache_dir, **overrides):
    settings = dict(source=pattern.rsplit(".", 1)[-1].replace("txt", "text"), paths=pattern, vocab_size=VOCAB,
                    cache_dir=cache_dir, seq_len=SEQ, eval_fraction=0.1, streaming=True, prefetch=0)
    return DataConfig(**{**settings, **overrides})


def build(cfg, global_batch=4, seed=0, process_index=0, process_count=1):
    return build_data(cfg, global_batch=global_batch, seed=seed, process_index=process_index,
                      process_count=process_count)


def assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for step, (x, y) in enumerate(zip(xs, ys)):
        assert set(x) == set(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"step {step}, {key}")


def documents_in(rows, tok):
    """The documents of rows laid end to end (a document is start ... eos; rows of one stream in order)."""
    stream = rows["inputs"][rows["segment_ids"] > 0].tolist()
    docs, current = [], []
    for token in stream:
        if token == tok.start_id and not current:
            continue
        if token == tok.eos_id:
            docs.append(tok.decode(current))
            current = []
        else:
            current.append(token)
    return docs


def rows_of(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def epoch_documents(cfg, epoch, readers, *, seed=0, process_count=1):
    """The documents the given readers take in `epoch`, read with `streaming.documents` (no tokenizer)."""
    files = expand_paths(cfg.paths)
    plan = streaming.train_plan(cfg, files, seed=seed, process_index=0, process_count=process_count)
    out = []
    for reader in readers:
        start = dict(streaming._START, epoch=epoch)
        for item in streaming.documents(plan, reader, start):
            if isinstance(item, streaming._EpochEnd):
                break
            out.append(item.text)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The stream's rows are the in-memory pipeline's rows


@pytest.mark.parametrize("fmt, doc_mask", [("jsonl", True), ("text", True), ("parquet", True),
                                           ("array_record", True), ("jsonl", False)])
def test_stream_equals_in_memory_rows_and_eval_batches(tmp_path, cache_dir, fmt, doc_mask):
    pattern = write_corpus(str(tmp_path / fmt), DOCS, fmt)
    in_memory = build(config(pattern, cache_dir, streaming=False, prefetch=2, shuffle=False, doc_mask=doc_mask))
    stream = build(config(pattern, cache_dir, shuffle=False, doc_mask=doc_mask))
    assert stream.tokenizer.path == in_memory.tokenizer.path  # trained on the same (whole) training split
    assert stream.n_train_rows is None and stream.n_train_tokens is None and stream.streaming
    assert "streamed from" in stream.describe() and "rows of 32 tokens" in in_memory.describe()
    steps = -(-5 * in_memory.n_train_rows // 2 // 4)  # two and a half epochs: the padded last rows repeat too
    it = train_iterator(stream)
    batches = [next(it) for _ in range(steps)]
    assert_batches_equal(batches, [in_memory.train[s] for s in range(steps)])
    n_eval = -(-len(in_memory.eval_rows["inputs"]) // 4)  # every eval row, the last batch completed by padding
    assert len(stream.eval_batches(n_eval + 1)) == len(in_memory.eval_batches(n_eval + 1)) == n_eval
    assert_batches_equal(stream.eval_batches(n_eval), in_memory.eval_batches(n_eval))
    segments = max(b["segment_ids"].max() for b in batches + stream.eval_batches(n_eval))
    assert segments == 1 if not doc_mask else segments > 1  # (doc_mask=False: one sequence per row)
    assert_batches_equal(stream.eval_batches(1), in_memory.eval_batches(1))


def test_eval_batches_grow_lazily_without_repeating_rows(tmp_path, cache_dir):
    """The stream's evaluation rows are read only as far as asked, then kept: asking for more batches later
    continues where the first call stopped, so the batches equal the in-memory pipeline's at every count."""
    pattern = write_corpus(str(tmp_path / "c"), DOCS, "jsonl")
    in_memory = build(config(pattern, cache_dir, streaming=False, prefetch=2, shuffle=False, eval_fraction=0.3))
    stream = build(config(pattern, cache_dir, shuffle=False, eval_fraction=0.3))
    n_eval = -(-len(in_memory.eval_rows["inputs"]) // 4)
    assert n_eval >= 3
    for n in (1, 2, n_eval + 1):
        assert_batches_equal(stream.eval_batches(n), in_memory.eval_batches(n))


# ----------------------------------------------------------------------------------------------------------------
# Resume


def resume_setup(tmp_path, tokenizer_path, **overrides):
    pattern = write_corpus(str(tmp_path / "resume"), words(60, seed=3, high=60), "jsonl", n_files=4)
    settings = dict(tokenizer=tokenizer_path, shuffle=True, shuffle_window=4, interleave=2, eval_fraction=0.1)
    return config(pattern, None, **{**settings, **overrides})


@pytest.mark.parametrize("doc_mask", [True, False])
def test_resume_is_exact_at_every_step(tmp_path, tokenizer_path, doc_mask):
    """Stop after step k (JSON state), rebuild everything, resume: the next batches equal the uninterrupted run's,
    for every k over three epochs: in the middle of a document, of a shuffle window, of a file, at an epoch end
    (`doc_mask=False` too: its rows are mapped by `merge_documents`, which must keep the stream's state)."""
    cfg = dataclasses.replace(resume_setup(tmp_path, tokenizer_path), doc_mask=doc_mask)
    it = train_iterator(build(cfg, seed=5))
    batches, states = [], [json.loads(json.dumps(it.get_state()))]
    while max(p["epoch"] for p in states[-1]["positions"]) < 3:
        batches.append(next(it))
        states.append(json.loads(json.dumps(it.get_state())))
    ahead = 6
    for k in range(0, len(batches) - ahead):
        resumed = train_iterator(build(cfg, seed=5))
        resumed.set_state(states[k])
        for j in range(k, k + ahead):
            assert_batches_equal([next(resumed)], [batches[j]])
            assert resumed.get_state() == states[j + 1]  # a resumed run saves the states an uninterrupted one does
        resumed.close()
    # the resumes above covered each kind of position (else this test would prove less than it claims)
    positions = [p for s in states for p in s["positions"]]
    assert any(p["skip"] > 0 for p in positions)  # inside a document
    assert any(p["taken"] > 0 for p in positions)  # inside a shuffle window
    assert any(p["byte"] > 0 and p["record"] > 0 for p in positions)  # inside a file (seek by byte offset)
    crossing = [k for k in range(len(batches) - ahead)
                if {p["epoch"] for p in states[k]["positions"]} != {p["epoch"] for p in states[k + ahead]["positions"]}]
    assert crossing  # a resume whose batches cross an epoch boundary
    assert len(json.dumps(states[-1])) < 600  # small: a few integers per reader


def test_prefetch_thread_keeps_the_state_of_the_consumed_batches(tmp_path, tokenizer_path):
    cfg = resume_setup(tmp_path, tokenizer_path)
    plain = train_iterator(build(cfg))
    expected = [next(plain) for _ in range(12)]
    fetching = train_iterator(build(dataclasses.replace(cfg, prefetch=3)))
    assert_batches_equal([next(fetching) for _ in range(5)], expected[:5])
    plain_state = train_iterator(build(cfg))
    for _ in range(5):
        next(plain_state)
    assert fetching.get_state() == plain_state.get_state()  # not the read-ahead batches' state
    state = fetching.get_state()
    resumed = train_iterator(build(dataclasses.replace(cfg, prefetch=3)))
    resumed.set_state(state)
    assert_batches_equal([next(resumed) for _ in range(7)], expected[5:])
    for it in (fetching, resumed):
        it.close()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_an_iterator_rewound_to_its_start_reads_its_batches_again(tmp_path, tokenizer_path, prefetch):
    """The trainer's k-means init reads the first batch, then sets the iterator back to its starting state, so that
    training starts at that batch: the same iterator then yields what a fresh one does (read-ahead batches of a
    prefetching one dropped)."""
    cfg = dataclasses.replace(resume_setup(tmp_path, tokenizer_path), prefetch=prefetch)
    fresh = train_iterator(build(cfg))
    expected = [next(fresh) for _ in range(6)]
    fresh.close()
    rewound = train_iterator(build(cfg))
    start = rewound.get_state()
    assert_batches_equal([next(rewound) for _ in range(2)], expected[:2])
    rewound.set_state(start)
    assert_batches_equal([next(rewound) for _ in range(6)], expected)
    rewound.close()


def test_a_state_holding_every_process_resumes_each(tmp_path, tokenizer_path):
    """Multi-process runs save one state with every process's positions (gathered by `get_state` under
    jax.distributed; here two processes are simulated): each process resumes from its own entry."""
    cfg = resume_setup(tmp_path, tokenizer_path, interleave=1)
    its = [train_iterator(build(cfg, seed=2, process_index=p, process_count=2)) for p in (0, 1)]
    for it in its:
        for _ in range(3):
            next(it)
    combined = json.loads(json.dumps({"processes": [it.get_state() for it in its]}))
    expected = [[next(it) for _ in range(4)] for it in its]
    for p in (0, 1):
        resumed = train_iterator(build(cfg, seed=2, process_index=p, process_count=2))
        resumed.set_state(combined)
        assert_batches_equal([next(resumed) for _ in range(4)], expected[p])
    assert not set(map(bytes, expected[0][0]["inputs"])) & set(map(bytes, expected[1][0]["inputs"]))
    check_raises(lambda: resumed.set_state({"processes": combined["processes"][:1]}), "1 processes",
                 "process_count=2")


def test_resume_errors(tmp_path, tokenizer_path, cache_dir):
    cfg = resume_setup(tmp_path, tokenizer_path)
    it = train_iterator(build(cfg))
    next(it)
    state = it.get_state()
    fresh = train_iterator(build(cfg))
    check_raises(lambda: fresh.set_state({"next_index": 3}), "in-memory pipeline")
    other = train_iterator(build(cfg, process_index=1, process_count=2))
    check_raises(lambda: other.set_state(state), "readers [0, 1] of 2", "readers [1, 3] of 4")
    bad = json.loads(json.dumps(state))
    bad["positions"][0]["skip"] = -1
    check_raises(lambda: fresh.set_state(bad), "invalid positions")
    with open(os.path.join(os.path.dirname(cfg.paths[0]), "part999.jsonl"), "w") as f:
        f.write(json.dumps({"text": "a new file"}) + "\n")
    check_raises(lambda: train_iterator(build(cfg)).set_state(state), "changed", "4 files then, 5 now")


def test_resume_refuses_a_state_of_as_many_files_with_other_names(tmp_path, tokenizer_path):
    """The files digest guards a resume: a file renamed (same number of files, other names, so file `i` of the
    state may now be another file) is refused, not resumed at positions meant for other files."""
    cfg = resume_setup(tmp_path, tokenizer_path)
    it = train_iterator(build(cfg))
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    directory = os.path.dirname(cfg.paths[0])
    os.rename(os.path.join(directory, "part000.jsonl"), os.path.join(directory, "part999.jsonl"))
    check_raises(lambda: train_iterator(build(cfg)).set_state(state), "changed", "4 files then, 4 now")


def test_resume_refuses_a_state_that_skips_past_its_document(tmp_path, tokenizer_path):
    """A state whose `skip` (tokens of the next document already emitted) is not inside that document cannot come
    from these files and this tokenizer: the resume names the problem instead of packing garbage."""
    cfg = resume_setup(tmp_path, tokenizer_path)
    it = train_iterator(build(cfg))
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    state["positions"][state["next"]]["skip"] = 10**6
    resumed = train_iterator(build(cfg))
    resumed.set_state(state)
    check_raises(lambda: next(resumed), "cannot resume the data stream", "skips 1000000 tokens")


# ----------------------------------------------------------------------------------------------------------------
# Order, sharding, evaluation split


@pytest.mark.parametrize("shard_by", ["file", "document"])
def test_processes_read_disjoint_documents_covering_the_training_split(tmp_path, tokenizer_path, shard_by):
    pattern = write_corpus(str(tmp_path / "c"), DOCS, "jsonl", n_files=4)
    cfg = config(pattern, None, tokenizer=tokenizer_path, shuffle=True, shuffle_window=3, shard_by=shard_by)
    train_docs = sorted(d for d in DOCS if not is_held_out(d, 0.1))
    assert 0 < len(train_docs) < len(DOCS)
    orders = []
    for epoch in (0, 1):
        shares = [epoch_documents(cfg, epoch, [p], seed=7, process_count=2) for p in (0, 1)]
        assert shares[0] and shares[1] and not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == train_docs
        orders.append(shares)
    assert orders[0] != orders[1]  # reshuffled each epoch
    single = epoch_documents(dataclasses.replace(cfg, shuffle=False), 0, [0])
    assert single == [d for d in DOCS if not is_held_out(d, 0.1)]  # unshuffled: file order

    # the same through the batches of two processes (each reads its own rows: documents are disjoint)
    decoded = []
    for p in (0, 1):
        data = build(cfg, seed=7, process_index=p, process_count=2)
        it = train_iterator(data)
        rows = rows_of([next(it) for _ in range(4)])
        assert rows["inputs"].shape == (8, SEQ)
        decoded.append(documents_in(rows, data.tokenizer))
    assert decoded[0] and decoded[1] and not set(decoded[0]) & set(decoded[1])
    assert set(decoded[0] + decoded[1]) <= set(train_docs)


def test_interleaved_readers_alternate_rows(tmp_path, tokenizer_path):
    """interleave=2: rows alternate between two readers; (shuffle off) reader 0 reads files 0 and 2, reader 1
    files 1 and 3, each in file order."""
    pattern = write_corpus(str(tmp_path / "c"), DOCS, "jsonl", n_files=4)
    data = build(config(pattern, None, tokenizer=tokenizer_path, shuffle=False, interleave=2))
    it = train_iterator(data)
    rows = rows_of([next(it) for _ in range(30)])
    files = [list(chunk) for chunk in np.array_split(np.arange(len(DOCS)), 4)]
    for reader, (a, b) in enumerate([(0, 2), (1, 3)]):
        mine = {k: v[reader::2] for k, v in rows.items()}  # 60 rows: more documents than one file has
        first, second = ([DOCS[i] for i in files[f] if not is_held_out(DOCS[i], 0.1)] for f in (a, b))
        decoded = documents_in(mine, data.tokenizer)
        assert len(decoded) > len(first) and decoded == (first + second)[:len(decoded)]


def test_eval_split_is_held_out(tmp_path, tokenizer_path):
    pattern = write_corpus(str(tmp_path / "c"), DOCS, "jsonl")
    data = build(config(pattern, None, tokenizer=tokenizer_path, shuffle=False, eval_fraction=0.2))
    tok = data.tokenizer
    held_out = [d for d in DOCS if is_held_out(d, 0.2)]
    eval_docs = documents_in(rows_of(data.eval_batches(40)), tok)
    assert eval_docs == held_out and len(held_out) > 5
    train_docs = epoch_documents(data.config, 0, [0])
    assert not set(train_docs) & set(eval_docs) and sorted(train_docs + eval_docs) == sorted(DOCS)

    # eval_paths: those files' documents are the evaluation set; every document of paths is trained on
    eval_pattern = write_corpus(str(tmp_path / "eval"), words(12, seed=99), "jsonl", n_files=2)
    cfg = config(pattern, None, tokenizer=tokenizer_path, shuffle=False, eval_paths=eval_pattern)
    data = build(cfg)
    assert documents_in(rows_of(data.eval_batches(30)), tok) == words(12, seed=99)
    assert epoch_documents(cfg, 0, [0]) == DOCS
    in_memory = build(dataclasses.replace(cfg, streaming=False, prefetch=2))  # eval_paths work in memory too
    assert (in_memory.n_train_documents, in_memory.n_eval_documents) == (len(DOCS), 12)
    assert_batches_equal(in_memory.eval_batches(30), data.eval_batches(30))
    first = next(train_iterator(data))
    assert_batches_equal([first], [in_memory.train[0]])



def count_records(monkeypatch):
    """Every record the stream reads from a file is appended to the returned list."""
    pulled = []
    original = streaming.iter_records

    def counting(*args, **kwargs):
        for record in original(*args, **kwargs):
            pulled.append(record[0])
            yield record

    monkeypatch.setattr(streaming, "iter_records", counting)
    return pulled


def test_stream_reads_incrementally(tmp_path, tokenizer_path, monkeypatch):
    """A 20,000-document file: three batches read a few dozen documents, never the corpus."""
    path = tmp_path / "big.jsonl"
    docs = words(20_000, seed=5, high=12)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    import focal_jax.data.pipeline as pipeline

    monkeypatch.setattr(pipeline, "read_documents", lambda *a, **k: pytest.fail("read the whole corpus"))
    pulled = count_records(monkeypatch)
    data = build(config(str(path), None, tokenizer=tokenizer_path, shuffle=True, shuffle_window=8,
                        eval_fraction=0.05))
    it = train_iterator(data)
    batches = [next(it) for _ in range(3)]  # 12 rows of 32 tokens: ~40 documents of ~10 tokens
    assert all(b["inputs"].shape == (4, SEQ) for b in batches)
    assert 20 < len(pulled) < 150, len(pulled)
    assert it.get_state()["positions"][0]["byte"] < path.stat().st_size // 100
    pulled.clear()
    data.eval_batches(1)  # 4 held-out rows: ~15 held-out documents, ~300 read
    assert len(pulled) < 1500, len(pulled)


# ----------------------------------------------------------------------------------------------------------------
# Errors and config


def test_stream_errors(tmp_path, tokenizer_path, cache_dir):
    missing = str(tmp_path / "none" / "*.jsonl")
    check_raises(lambda: build(config(missing, None, tokenizer=tokenizer_path)), missing, error=FileNotFoundError)
    pattern = write_corpus(str(tmp_path / "c"), DOCS, "jsonl")
    missing_eval = str(tmp_path / "no_eval*.jsonl")
    check_raises(lambda: build(config(pattern, None, tokenizer=tokenizer_path, eval_paths=missing_eval)),
                 missing_eval, error=FileNotFoundError)
    part = pattern.replace("*", "part001")  # a training file given as evaluation file too
    overlapping = config(pattern, None, tokenizer=tokenizer_path, eval_paths=part)
    for cfg in (overlapping, dataclasses.replace(overlapping, streaming=False, prefetch=2)):
        check_raises(lambda: build(cfg), "both match 1 file(s)", part)
    assert expand_paths((pattern, part, pattern)) == expand_paths((pattern,))  # a file matched twice is read once

    # no documents at all: named at build time, with or without a tokenizer to train
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text('\n{"text": ""}\n')
    (empty / "b.jsonl").write_text("")
    check_raises(lambda: build(config(str(empty / "*.jsonl"), None, tokenizer=tokenizer_path)),
                 "empty document stream", "a.jsonl")
    check_raises(lambda: build(config(str(empty / "*.jsonl"), cache_dir)), "empty document stream", "2 files")

    # a corrupt file and a bad line name the file (and the line)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.parquet").write_bytes(b"not a parquet file at all")
    check_raises(lambda: build(config(str(bad / "*.parquet"), None, tokenizer=tokenizer_path)),
                 str(bad / "x.parquet"), "parquet")
    (bad / "y.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "\xff\xfe"}\n')
    it = train_iterator(build(config(str(bad / "y.jsonl"), None, tokenizer=tokenizer_path, eval_fraction=0.0)))
    check_raises(lambda: next(it), str(bad / "y.jsonl"), "line 3", "utf-8")
    (bad / "s.jsonl").write_text('{"text": "fine"}\n{"text": "half an emoji \\ud83d"}\n')  # valid JSON, not text
    it = train_iterator(build(config(str(bad / "s.jsonl"), None, tokenizer=tokenizer_path, eval_fraction=0.0)))
    check_raises(lambda: next(it), str(bad / "s.jsonl"), "line 2", "unpaired surrogate")
    (bad / "n.jsonl").write_text('{"text": "fine"}\n{"text": null}\n{"text": 7}\n')  # null: no document; 7: refused
    it = train_iterator(build(config(str(bad / "n.jsonl"), None, tokenizer=tokenizer_path, eval_fraction=0.0)))
    check_raises(lambda: next(it), str(bad / "n.jsonl"), "line 3", "field 'text' must be a string, got int")
    (bad / "z.array_record").write_bytes(b"not an array record file" * 40)
    check_raises(lambda: build(config(str(bad / "z.array_record"), None, tokenizer=tokenizer_path)),
                 str(bad / "z.array_record"), "not a readable ArrayRecord file")
    if os.geteuid() != 0:  # root reads anything
        locked = bad / "locked.jsonl"
        locked.write_text('{"text": "secret"}\n')
        locked.chmod(0)
        check_raises(lambda: build(config(str(locked), None, tokenizer=tokenizer_path)), str(locked),
                     "cannot read", error=OSError)

    # sharding needs enough files / documents
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "a single document"}) + "\n")
    check_raises(lambda: build(config(str(one), None, tokenizer=tokenizer_path, eval_fraction=0.0),
                               process_index=0, process_count=2), "shard_by='file'", "1 file(s)", "2 readers")
    check_raises(lambda: build(config(str(one), None, tokenizer=tokenizer_path, eval_fraction=0.0,
                                      shard_by="document"), process_index=1, process_count=2),
                 "empty document stream", "fewer documents than readers")

    # no held-out documents
    no_eval = build(config(pattern, None, tokenizer=tokenizer_path, eval_fraction=0.0))
    check_raises(lambda: no_eval.eval_batches(1), "no evaluation documents", "eval_paths")
    # shuffled among several readers, a reader that can never find a document gives up after 20 epochs per reader
    check_raises(lambda: build(config(str(one), None, tokenizer=tokenizer_path, eval_fraction=0.0, shuffle=True,
                                      shard_by="document"), process_index=1, process_count=2),
                 "empty document stream", "40 epochs in a row", "fewer documents than readers")


def test_a_reader_with_an_empty_epoch_goes_on(tmp_path, tokenizer_path):
    """Shuffled among two readers, an empty file is some epochs' only file of a reader: that epoch is empty, and the
    reader goes on to the next (it used to stop training with 'empty document stream')."""
    directory = tmp_path / "shards"
    directory.mkdir()
    for name, docs in (("a", words(6, 1)), ("b", words(6, 2)), ("c", [])):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    cfg = config(str(directory / "*.jsonl"), None, tokenizer=tokenizer_path, eval_fraction=0.0, shuffle=True,
                 interleave=2)
    it = train_iterator(build(cfg, global_batch=2))
    batches = [next(it) for _ in range(200)]
    positions = it.get_state()["positions"]
    plan = streaming.train_plan(cfg, sorted(expand_paths(cfg.paths)), seed=0, process_index=0, process_count=1)
    empty = [(epoch, reader) for reader in (0, 1) for epoch in range(positions[reader]["epoch"])
             if [plan.files[i] for _, i in plan.epoch_files(epoch, reader)] == [str(directory / "c.jsonl")]]
    assert empty, "no reader met an empty epoch: the test needs more steps"
    assert all(np.any(batch["segment_ids"] > 0, axis=1).all() for batch in batches)  # no empty rows


@pytest.mark.parametrize("settings, needles", [
    (dict(source="builtin", streaming=True), ["streaming=True", "'builtin'"]),
    (dict(source="jsonl", paths="x", interleave=2), ["interleave=2", "streaming=True"]),
    (dict(source="jsonl", paths="x", shuffle_window=8), ["shuffle_window=8"]),
    (dict(source="synthetic", eval_paths="x.jsonl"), ["eval_paths", "'synthetic'"]),
    (dict(source="jsonl", paths="x", streaming=True, shard_by="row"), ["shard_by='row'", "document"]),
    (dict(source="jsonl", paths="x", streaming=True, interleave=0), ["interleave=0"]),
    (dict(source="jsonl", paths="x", streaming=True, prefetch=-1), ["prefetch=-1"]),
    (dict(source="jsonl", paths="x", streaming="yes"), ["streaming='yes'"]),
    (dict(source="jsonl", paths="x", eval_paths=3), ["eval_paths=3"]),
])
def test_streaming_config_errors(settings, needles):
    check_raises(lambda: DataConfig(**settings), *needles)


def test_streaming_config_defaults_and_tokenizer_command(tmp_path, cache_dir):
    cfg = DataConfig(source="jsonl", paths="a.jsonl, b.jsonl", eval_paths="e.jsonl", streaming=True)
    assert (cfg.eval_paths, cfg.shard_by, cfg.shuffle_window, cfg.interleave, cfg.prefetch) == (
        ("e.jsonl",), "file", 0, 1, 2)
    from focal_jax.data.__main__ import main

    pattern = write_corpus(str(tmp_path / "c"), DOCS, "jsonl")
    path = main(["--source", "jsonl", "--paths", pattern, "--vocab_size", str(VOCAB), "--eval_fraction", "0.1",
                 "--cache_dir", cache_dir, "--streaming"])
    assert build(config(pattern, cache_dir)).tokenizer.path == path
    assert re.search(r"spm_320_\w+\.model$", path)


# ----------------------------------------------------------------------------------------------------------------
# Edge cases: boundaries, seeds, sharding, resume positions, validation


@pytest.mark.parametrize("fmt", ["text", "parquet", "array_record"])
def test_reading_a_file_from_a_record_index_starts_at_that_record(tmp_path, fmt):
    """A resumed stream reads a file from the record of its position: jsonl seeks a byte offset (resumed in the
    tests above), the other formats start at a record index, which must give the file's records from there."""
    [path, *_] = expand_paths((write_corpus(str(tmp_path / fmt), DOCS[:12], fmt, n_files=1),))
    whole = list(streaming.iter_records(path, fmt, "text"))
    assert len(whole) == {"text": 1, "parquet": 13, "array_record": 12}[fmt]  # parquet: a null row too
    for start in range(len(whole) + 1):
        assert list(streaming.iter_records(path, fmt, "text", start_record=start)) == whole[start:], start


@pytest.mark.parametrize("fmt", ["parquet", "array_record"])
def test_resume_is_exact_inside_files_read_by_record_index(tmp_path, tokenizer_path, fmt):
    """As test_resume_is_exact_at_every_step (jsonl), for the formats resumed at a record index: stop after step
    k, resume from the JSON state, the next batches are the uninterrupted run's."""
    pattern = write_corpus(str(tmp_path / fmt), DOCS[:40], fmt, n_files=2)
    cfg = config(pattern, None, tokenizer=tokenizer_path, shuffle=False, eval_fraction=0.0)
    it = train_iterator(build(cfg))
    states, batches = [], []
    for _ in range(8):
        states.append(json.loads(json.dumps(it.get_state())))
        batches.append(next(it))
    assert any(s["positions"][0]["record"] > 0 for s in states)  # some resumes start inside a file
    for k in range(1, 6):
        resumed = train_iterator(build(cfg))
        resumed.set_state(states[k])
        assert_batches_equal([next(resumed) for _ in range(8 - k)], batches[k:])


def test_sharding_by_document_alternates_one_record_files_between_readers(tmp_path, tokenizer_path):
    """shard_by='document' gives reader s record r of the file at epoch position g when (r + g) % n_readers == s:
    text files (one record each) alternate between the readers instead of all going to reader 0."""
    pattern = write_corpus(str(tmp_path / "t"), DOCS[:10], "text")
    cfg = config(pattern, None, tokenizer=tokenizer_path, shuffle=False, eval_fraction=0.0, shard_by="document")
    shares = [epoch_documents(cfg, 0, [p], process_count=2) for p in (0, 1)]
    assert shares == [DOCS[0:10:2], DOCS[1:10:2]]


def test_shuffle_windows_are_reshuffled_every_epoch(tmp_path, tokenizer_path):
    """One file and one reader, so the file order cannot change: the documents of each window of 8 are still permuted
    anew every epoch, and stay within their window."""
    pattern = write_corpus(str(tmp_path / "c"), DOCS, "jsonl", n_files=1)
    cfg = config(pattern, None, tokenizer=tokenizer_path, shuffle=True, shuffle_window=8, eval_fraction=0.0)
    epochs = [epoch_documents(cfg, epoch, [0]) for epoch in (0, 1)]
    assert epochs[0] != epochs[1]
    for docs in epochs:
        assert docs != DOCS and all(sorted(docs[w:w + 8]) == sorted(DOCS[w:w + 8]) for w in range(0, len(DOCS), 8))


def test_a_stream_resumed_after_the_last_document_of_an_epoch_goes_on(tmp_path, tokenizer_path):
    """A row that ends exactly at the end of an epoch's last document saves the position after that document; from
    there the epoch holds no more documents, which is not an empty stream: the next epoch follows."""
    pattern = write_corpus(str(tmp_path / "c"), DOCS[:5], "jsonl", n_files=1)
    cfg = config(pattern, None, tokenizer=tokenizer_path, shuffle=False, eval_fraction=0.0)
    plan = streaming.train_plan(cfg, expand_paths(cfg.paths), seed=0, process_index=0, process_count=1)
    first_epoch = list(itertools.islice(streaming.documents(plan, 0), 6))
    assert [d.text for d in first_epoch[:5]] == DOCS[:5] and isinstance(first_epoch[5], streaming._EpochEnd)
    resumed = list(itertools.islice(streaming.documents(plan, 0, first_epoch[4].after), 3))
    assert isinstance(resumed[0], streaming._EpochEnd) and [d.text for d in resumed[1:]] == DOCS[:2]


def test_resume_refuses_a_state_of_another_reader_count_or_next_reader(tmp_path, tokenizer_path):
    """A state of readers [0] of 1 (one process) cannot resume readers [0] of 2 (process 0 of 2: it reads half the
    files), and a state whose next reader is not one of its readers is invalid."""
    cfg = resume_setup(tmp_path, tokenizer_path, interleave=1)
    it = train_iterator(build(cfg))
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    half = train_iterator(build(cfg, process_index=0, process_count=2))
    check_raises(lambda: half.set_state(state), "readers [0] of 1", "readers [0] of 2")
    check_raises(lambda: train_iterator(build(cfg)).set_state({**state, "next": 1}), "invalid positions", "next=1")


def test_a_seed_beyond_32_bits_is_refused_for_a_stream_too(tmp_path, tokenizer_path):
    """Seeds are in [0, 2**32) (grain's shuffle of the in-memory pipeline); a stream, which shuffles with numpy,
    refuses the same seeds, so a run's seed is valid in both modes."""
    pattern = write_corpus(str(tmp_path / "c"), DOCS[:10], "jsonl", n_files=1)
    cfg = config(pattern, None, tokenizer=tokenizer_path, shuffle=True, eval_fraction=0.0)
    check_raises(lambda: build(cfg, seed=2**32), "seed=4294967296", "2**32")
    assert next(train_iterator(build(cfg, seed=2**32 - 1)))["inputs"].shape == (4, SEQ)


def test_resume_continues_with_the_reader_whose_row_is_next(tmp_path, tokenizer_path):
    """Two interleaved readers and a batch of 3 rows: a batch can end after either reader's row, so the state's
    `next` names the reader of the next row, and a resume continues with it."""
    cfg = resume_setup(tmp_path, tokenizer_path)  # interleave=2
    it = train_iterator(build(cfg, global_batch=3))
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state["next"] == 1
    expected = [next(it) for _ in range(4)]
    resumed = train_iterator(build(cfg, global_batch=3))
    resumed.set_state(state)
    assert_batches_equal([next(resumed) for _ in range(4)], expected)


def test_a_negative_shuffle_window_is_refused():
    """shuffle_window is a count of documents: 0 or 1 reads in file order, a negative one is an error."""
    check_raises(lambda: DataConfig(source="jsonl", paths="x", streaming=True, shuffle_window=-1), "shuffle_window=-1")
    assert DataConfig(source="jsonl", paths="x", streaming=True, shuffle_window=0).shuffle_window == 0
