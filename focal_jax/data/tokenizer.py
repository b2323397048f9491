"""Tokenizers: a SentencePiece model or a Hugging Face `tokenizer.json`; training, a cache, a run's own copy.

Two kinds of file load (`load_tokenizer`, `Tokenizer`), told apart by the file name:
- a **SentencePiece model** (any name not ending in `.json`, e.g. LLaMA's / Mistral's `tokenizer.model`): the special
  ids are those stored in the model;
- a **Hugging Face `tokenizer.json`** (GPT-2, Qwen, OLMo, LLaMA 3), read with the `tokenizers` library. The file
  holds no special ids, so they come from the files next to it: `tokenizer_config.json` (`bos_token`, `eos_token`,
  `pad_token`, `unk_token`: a token string, `{"content": ...}`, or null for none) and, for a key that file does not
  have, `config.json` (`bos_token_id`, `eos_token_id`, `pad_token_id`, `unk_token_id`; a list of eos ids gives its
  first, a negative id means none). An eos is required: every document ends with it.

Documents are framed as `[start_id] + tokens + [eos_id]` (`focal_jax.data.pipeline.encode_documents`), where
`start_id` is the bos, or the eos when the tokenizer has no bos. So a model without bos (Qwen2.5's tokenizer, or a
GPT-2 directory whose config has no bos) sees `<|endoftext|> doc <|endoftext|>`, as GPT-2 was trained (documents
separated by `<|endoftext|>`), and the first token of every document is predicted from a context token. GPT-2's own
config.json names 50256 (`<|endoftext|>`) as both bos and eos, which gives the same ids. Evaluation prompts start
with `start_id` too (`focal_jax.eval`).

A run copies its tokenizer into its workdir (`copy_tokenizer`), keeping its kind: `WORKDIR/tokenizer.model`, or
`WORKDIR/tokenizer.json` plus `WORKDIR/tokenizer_config.json` (its special tokens); `workdir_tokenizer(WORKDIR)`
loads it back, and `tokenizer_file(DIR)` names the tokenizer file of a run or Hugging Face directory.

Trained tokenizers are SentencePiece BPE with `byte_fallback` (any text encodes; nothing maps to unk), digits split
into single pieces, no normalisation and no dummy prefix, so `decode(encode(text)) == text` for every string
without U+2581 ('▁', SentencePiece's mark for a space, which decodes as a space).
Special ids: pad 0, unk 1, bos 2, eos 3 (`pack` pads with 0).
"""

import hashlib
import io
import json
import os
import pathlib
import tempfile

import sentencepiece as spm
import tokenizers

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


SPECIAL_TOKENS = ("bos", "eos", "pad", "unk")
SENTENCEPIECE_FILE, HF_FILE, HF_CONFIG_FILE = "tokenizer.model", "tokenizer.json", "tokenizer_config.json"


class Tokenizer:
    """A loaded tokenizer: a SentencePiece model, or a Hugging Face `tokenizer.json` (a `path` ending in `.json`).

    Attributes: `path` (the file), `kind` ('sentencepiece' | 'huggingface'), `vocab_size` (1 + the largest id, so
    every id is below it), `pad_id`, `unk_id`, `bos_id`, `eos_id` (None when the tokenizer has no such token; eos
    always exists), `start_id` (the token before every document: bos, or eos without one). `encode` adds no special
    tokens (not even those of a tokenizer.json's post-processor); the data pipeline adds them around each document.
    A tokenizer.json reads the text of its special tokens (`<|endoftext|>`) as those tokens, as the `tokenizers`
    library does; `encode_batch(texts, special_tokens=False)`, which the data pipeline uses for documents, reads it
    as ordinary text, so a document's own text never yields an eos (or bos, pad) in the middle of its segment.
    Raises FileNotFoundError / ValueError naming the file when it or its special ids are missing or invalid.
    """

    def __init__(self, path: str):
        self.path = str(path)
        if self.path.endswith(".json"):
            self.kind = "huggingface"
            try:
                self._hf = tokenizers.Tokenizer.from_file(self.path)
            except Exception as e:  # the tokenizers library raises a bare Exception
                raise ValueError(f"{self.path!r} is not a Hugging Face tokenizer.json ({e})") from None
            # Truncation or padding saved in the file would cut or pad every document (encode applies them).
            self._hf.no_truncation()
            self._hf.no_padding()
            self.vocab_size = max(self._hf.get_vocab(with_added_tokens=True).values()) + 1
            ids = _hf_special_ids(self._hf, self.path, self.vocab_size)
        else:
            self.kind = "sentencepiece"
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
            self.vocab_size = self._sp.get_piece_size()
            ids = dict(bos=self._sp.bos_id(), eos=self._sp.eos_id(), pad=self._sp.pad_id(), unk=self._sp.unk_id())
        ids = {name: (None if i is None or i < 0 else int(i)) for name, i in ids.items()}  # SentencePiece: -1
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (ids[name] for name in SPECIAL_TOKENS)
        if self.eos_id is None:
            raise ValueError(f"tokenizer {self.path!r} has no eos token; documents end with it (a tokenizer.json "
                             f"needs eos_token in {HF_CONFIG_FILE} or eos_token_id in config.json next to it)")
        self.start_id = self.eos_id if self.bos_id is None else self.bos_id

    def encode(self, text: str) -> list[int]:
        """`text` -> token ids `[n_tokens]` (no bos / eos)."""
        if self.kind == "huggingface":
            return self._hf.encode(text, add_special_tokens=False).ids
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], *, special_tokens: bool = True) -> list[list[int]]:
        """Several texts at once (multi-threaded) -> one id list per text.

        special_tokens: whether the text of a special token of a tokenizer.json (`<|endoftext|>`) encodes as that
        token (True, as `encode`) or as ordinary text (False: documents, whose text must not end them early). A
        SentencePiece model never reads its control tokens (`<s>`, `</s>`) from text."""
        if self.kind == "huggingface":
            hf = self._hf if special_tokens else self._hf_plain_text()
            return [e.ids for e in hf.encode_batch(list(texts), add_special_tokens=False)]
        return self._sp.encode(list(texts))

    def _hf_plain_text(self) -> tokenizers.Tokenizer:
        """A second copy of the tokenizer.json that encodes the text of special tokens as ordinary text (a copy, so
        that `encode` keeps its behaviour while another thread encodes documents)."""
        if getattr(self, "_hf_text", None) is None:
            hf = tokenizers.Tokenizer.from_file(self.path)
            hf.no_truncation()
            hf.no_padding()
            hf.encode_special_tokens = True
            self._hf_text = hf
        return self._hf_text

    def decode(self, ids) -> str:
        """Token ids `[n_tokens]` (list or 1-D array) -> text; pad / bos / eos (and a tokenizer.json's other
        special tokens) are dropped."""
        ids = [int(i) for i in ids]
        if self.kind == "huggingface":
            control = {self.bos_id, self.eos_id, self.pad_id}
            return self._hf.decode([i for i in ids if i not in control], skip_special_tokens=True)
        return self._sp.decode(ids)

    def special_tokens(self) -> dict:
        """`{'bos_token': str | None, 'eos_token': ..., 'pad_token': ..., 'unk_token': ...}`: the special tokens
        as a Hugging Face tokenizer_config.json names them (None for one the tokenizer lacks)."""
        piece = self._hf.id_to_token if self.kind == "huggingface" else self._sp.id_to_piece
        ids = dict(bos=self.bos_id, eos=self.eos_id, pad=self.pad_id, unk=self.unk_id)
        return {f"{name}_token": None if i is None else piece(i) for name, i in ids.items()}

    def __repr__(self):
        return f"Tokenizer(path={self.path!r}, kind={self.kind!r}, vocab_size={self.vocab_size})"


def _read_json(path: str) -> dict:
    """The JSON object in `path`; {} when there is no such file."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _hf_special_ids(hf: tokenizers.Tokenizer, path: str, vocab_size: int) -> dict:
    """The bos / eos / pad / unk ids of the tokenizer.json at `path` (None for none), from the
    tokenizer_config.json next to it, else the config.json next to it (see the module docstring)."""
    directory = os.path.dirname(os.path.abspath(path))
    config_path, model_config_path = os.path.join(directory, HF_CONFIG_FILE), os.path.join(directory, "config.json")
    tokenizer_config, model_config = _read_json(config_path), _read_json(model_config_path)
    ids = {}
    for name in SPECIAL_TOKENS:
        key = f"{name}_token"
        if key in tokenizer_config:
            token = tokenizer_config[key]
            if isinstance(token, dict):
                token = token.get("content", False)  # a dict without "content" is an error, not "no token"
            if token is not None and not isinstance(token, str):
                raise ValueError(f"{config_path}: {key} must be a token string, {{'content': string}} or null, got "
                                 f"{key}={tokenizer_config[key]!r}")
            ids[name] = None if token is None else hf.token_to_id(token)
            if token is not None and ids[name] is None:
                raise ValueError(f"{config_path}: {key}={token!r} is not a token of {path}")
        else:
            value = model_config.get(f"{key}_id")
            value = (value[0] if value else None) if isinstance(value, list) else value  # several eos: the first
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value >= vocab_size):
                raise ValueError(f"{model_config_path}: {key}_id must be an integer id below the vocabulary size "
                                 f"{vocab_size} of {path}, got {key}_id={model_config[f'{key}_id']!r}")
            ids[name] = value
    return ids


def load_tokenizer(path: str) -> Tokenizer:
    """Loads the tokenizer file at `path` (`~` expanded) -> Tokenizer: a SentencePiece model, or a Hugging Face
    tokenizer.json (a name ending in `.json`; special ids from the tokenizer_config.json / config.json next to it)."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: tokenizer={path!r} is not a file (expected a "
                                f"SentencePiece .model or a Hugging Face tokenizer.json)")
    return Tokenizer(path)


def tokenizer_file(directory: str) -> str:
    """The tokenizer file of a run directory or a Hugging Face model directory: its `tokenizer.model` (SentencePiece;
    Mistral ships both kinds and this one is taken) or else its `tokenizer.json`. Raises FileNotFoundError naming
    both when it has neither."""
    directory = os.path.expanduser(directory)
    for name in (SENTENCEPIECE_FILE, HF_FILE):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    raise FileNotFoundError(f"{directory!r} holds neither {SENTENCEPIECE_FILE} (SentencePiece) nor {HF_FILE} "
                            f"(Hugging Face tokenizers)")


def workdir_tokenizer(workdir: str) -> Tokenizer:
    """The tokenizer a focal_jax run was trained with: the copy `copy_tokenizer` wrote into its workdir
    (`tokenizer.model`, or `tokenizer.json` with its `tokenizer_config.json`)."""
    return Tokenizer(tokenizer_file(workdir))


def copy_tokenizer(tokenizer: Tokenizer, directory: str) -> Tokenizer:
    """Writes `tokenizer` into `directory` keeping its kind and returns the copy, loaded: `tokenizer.model`, or
    `tokenizer.json` plus a `tokenizer_config.json` naming its special tokens (so the copy needs no config.json).
    The files of the other kind are removed, so `tokenizer_file(directory)` finds this one. Files are written
    atomically: several processes may copy the same tokenizer at once."""
    directory = pathlib.Path(directory).expanduser()
    with open(tokenizer.path, "rb") as f:
        data = f.read()
    if tokenizer.kind == "huggingface":
        write_atomically(directory / HF_FILE, data)
        write_atomically(directory / HF_CONFIG_FILE, json.dumps(tokenizer.special_tokens(), indent=2).encode())
        stale = [SENTENCEPIECE_FILE]
    else:
        write_atomically(directory / SENTENCEPIECE_FILE, data)
        stale = [HF_FILE, HF_CONFIG_FILE]
    for name in stale:
        try:
            os.remove(directory / name)
        except FileNotFoundError:
            pass
    return workdir_tokenizer(str(directory))


def _training_lines(documents: list[str]) -> list[str]:
    """The sentences SentencePiece trains on: the non-blank lines of all documents, cut to at most 1000
    characters, evenly subsampled to at most 2M lines."""
    lines = [line[i:i + _MAX_LINE_CHARS] for doc in documents for line in doc.splitlines() if line.strip()
             for i in range(0, len(line), _MAX_LINE_CHARS)]
    stride = -(-len(lines) // _MAX_TRAINING_LINES)
    return lines[::stride] if stride > 1 else lines


class VocabSizeError(ValueError):
    """A `vocab_size` the corpus cannot give a tokenizer of (`train_tokenizer`): a setting to change, which the
    command lines report in one line."""


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
        raise VocabSizeError(f"vocab_size={vocab_size} is {problem} for this corpus ({len(documents)} documents, "
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


def cache_directory(cache_dir: str | None = None) -> pathlib.Path:
    """Where focal_jax caches trained tokenizers and the parsed builtin corpus: `cache_dir`, else ~/.cache/focal_jax
    (`data.cache_dir` of a run's config)."""
    return pathlib.Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()


def cached_tokenizer(documents: list[str], vocab_size: int, cache_dir: str | None = None) -> Tokenizer:
    """The tokenizer trained on `documents` at `vocab_size`: loaded from `cache_dir` (default ~/.cache/focal_jax)
    when an earlier call trained it, else trained and stored there as `spm_{vocab_size}_{key}.model`."""
    path = cache_directory(cache_dir) / f"spm_{vocab_size}_{_cache_key(documents, vocab_size)[:32]}.model"
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

