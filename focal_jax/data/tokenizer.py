"""SentencePiece tokenizer: load, train from documents in memory, and a content-addressed on-disk cache.

Trained tokenizers are SentencePiece BPE with `byte_fallback` (any text encodes; nothing maps to unk), digits split
into single pieces, no normalisation and no dummy prefix, so `decode(encode(text)) == text` for every string.
Special ids: pad 0, unk 1, bos 2, eos 3 (`pack` pads with 0).
"""

import hashlib
import io
import os
import pathlib
import tempfile

import sentencepiece as spm

DEFAULT_CACHE_DIR = "~/.cache/focal_jax"

# Fixed training options; they are part of the cache key, so changing one retrains.
TRAINING_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    normalization_rule_name="identity",
    add_dummy_prefix=False,
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    user_defined_symbols=["\n"],
    character_coverage=0.9995,
    max_sentence_length=4096,
    pad_id=0, unk_id=1, bos_id=2, eos_id=3,
)
_MAX_LINE_CHARS = 1000  # training lines are cut to this length (max_sentence_length counts bytes)
_MAX_TRAINING_LINES = 2_000_000  # larger corpora are subsampled (evenly strided, deterministic)


class Tokenizer:
    """A loaded SentencePiece model.

    Attributes: `path` (the .model file), `vocab_size`, `pad_id`, `unk_id`, `bos_id`, `eos_id`.
    `encode` does not add bos / eos; the data pipeline adds them around each document.
    """

    def __init__(self, path: str):
        self.path = str(path)
        self._sp = spm.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = self._sp.get_piece_size()
        self.pad_id, self.unk_id = self._sp.pad_id(), self._sp.unk_id()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        """`text` -> token ids `[n_tokens]` (no bos / eos)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Several texts at once (multi-threaded) -> one id list per text."""
        return self._sp.encode(list(texts))

    def decode(self, ids) -> str:
        """Token ids `[n_tokens]` (list or 1-D array) -> text; pad / bos / eos are dropped."""
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self):
        return f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str) -> Tokenizer:
    """Loads the SentencePiece model at `path` (`~` expanded) -> Tokenizer."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer model not found: tokenizer={path!r} is not a file")
    return Tokenizer(path)


def _training_lines(documents: list[str]) -> list[str]:
    """The sentences SentencePiece trains on: the non-blank lines of all documents, cut to at most 1000
    characters, evenly subsampled to at most 2M lines."""
    lines = [line[i:i + _MAX_LINE_CHARS] for doc in documents for line in doc.splitlines() if line.strip()
             for i in range(0, len(line), _MAX_LINE_CHARS)]
    stride = -(-len(lines) // _MAX_TRAINING_LINES)
    return lines[::stride] if stride > 1 else lines


def train_tokenizer(documents: list[str], vocab_size: int, path: str) -> Tokenizer:
    """Trains a BPE SentencePiece model of `vocab_size` pieces on `documents` (list of str) and writes it to `path`.

    The file is written atomically (temporary file, then `os.replace`). Prints one progress line. Raises if
    `vocab_size` does not fit the corpus (more pieces than the text supports, or fewer than its characters plus the
    256 byte pieces and 5 special pieces).
    """
    lines = _training_lines(documents)
    if not lines:
        raise ValueError(f"cannot train a tokenizer: the {len(documents)} documents contain no text")
    n_chars = sum(map(len, lines))
    path = pathlib.Path(path).expanduser()
    print(f"focal_jax: training a {vocab_size}-piece sentencepiece tokenizer on {len(documents)} documents "
          f"({len(lines)} lines, {n_chars / 1e6:.2f}M characters) -> {path}", flush=True)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                       num_threads=2, minloglevel=2, **TRAINING_OPTIONS)
    except RuntimeError as e:
        problem = ("too large" if "too high" in str(e) else "too small" if "required_chars" in str(e) else None)
        if problem is None:
            raise
        raise ValueError(f"vocab_size={vocab_size} is {problem} for this corpus ({len(documents)} documents, "
                         f"{n_chars} characters). SentencePiece said: {e}") from None
    write_atomically(path, model.getvalue())
    return Tokenizer(str(path))


def _cache_key(documents: list[str], vocab_size: int) -> str:
    """sha256 (hex) of the documents, `vocab_size` and the training settings."""
    settings = (vocab_size, sorted(TRAINING_OPTIONS.items()), _MAX_LINE_CHARS, _MAX_TRAINING_LINES, len(documents))
    h = hashlib.sha256(repr(settings).encode())
    for doc in documents:
        data = doc.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def cached_tokenizer(documents: list[str], vocab_size: int, cache_dir: str | None = None) -> Tokenizer:
    """The tokenizer trained on `documents` at `vocab_size`: loaded from `cache_dir` (default ~/.cache/focal_jax)
    when an earlier call trained it, else trained and stored there as `spm_{vocab_size}_{key}.model`."""
    directory = pathlib.Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    path = directory / f"spm_{vocab_size}_{_cache_key(documents, vocab_size)[:32]}.model"
    if path.is_file():
        return Tokenizer(str(path))
    return train_tokenizer(documents, vocab_size, str(path))


def write_atomically(path: str | pathlib.Path, data: bytes):
    """Writes `data` to a temporary file next to `path`, then renames it over `path`: readers never see a partial
    file, and concurrent writers of the same bytes (several processes) are harmless."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

