"""The builtin corpus: English text that ships with CPython itself (no network, no download).

Documents, in a deterministic order:

1. every topic of `pydoc_data.topics` (the language reference sections behind `help()`, ~465 KB), one document each;
2. for every standard-library `.py` file (sorted by path), the docstrings of the module and of its classes and
   functions, read with `ast` (the modules are never imported; files that fail to parse are skipped), one document
   per file. Skipped: `test/`, `tests/`, `idlelib/`, `site-packages/`, `encodings/` (codec tables, boilerplate
   docstrings) and `pydoc_data/` (already part 1).

About 2 MB in all; the exact text depends on the CPython version (a tokenizer cache keyed on the documents notices).
Parsing the stdlib takes about 10 s, so the first build is stored in the cache directory (`data.cache_dir`, default
~/.cache/focal_jax, next to the tokenizers) and read back (under 0.2 s) by every later process with the same Python
and the same stdlib files.
"""

import ast
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
import warnings

from focal_jax.data.tokenizer import cache_directory, write_atomically

_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__", "encodings", "pydoc_data"})
_FORMAT = 1  # part of the stored copy's key: bump it when the documents' extraction below changes


_BUILT: dict[str, list[str]] = {}  # the corpora this process has read or parsed, by their `_files_key`


def builtin_corpus(cache_dir: str | None = None) -> list[str]:
    """The builtin corpus -> list of documents (str), pydoc topics first, then one document per stdlib module.

    Read from its stored copy in `cache_dir` (default ~/.cache/focal_jax) when one matches this Python and its
    stdlib files (names, sizes, modification times), else built and stored there (where the directory is writable).
    Kept in-process whichever `cache_dir` asks (treat the list as read-only): a directory without a stored copy
    gets one.

    >>> docs = builtin_corpus()
    >>> sum(map(len, docs)) > 1_000_000
    True
    """
    files = _stdlib_files()
    key = _files_key(files)
    stored = cache_directory(cache_dir) / f"builtin_corpus_{key}.json"
    docs = _BUILT.get(key)
    if docs is None:
        try:
            docs = _BUILT[key] = json.loads(stored.read_bytes())
            return docs
        except (OSError, ValueError):  # none yet, or damaged: rebuilt
            docs = _BUILT[key] = _pydoc_topics() + [doc for path in files if (doc := _module_docstrings(path))]
    elif stored.is_file():
        return docs
    try:
        write_atomically(stored, json.dumps(docs).encode())
    except OSError:
        pass  # a read-only cache directory: every process builds its own
    return docs


def _files_key(files: list[pathlib.Path]) -> str:
    """24 hex digits of sha256 over the format, the Python version and every source file's path, size and mtime."""
    from pydoc_data import topics
    h = hashlib.sha256(repr((_FORMAT, sys.version)).encode())
    for path in [pathlib.Path(topics.__file__), *files]:
        stat = path.stat()
        h.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def _pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics  # a data module: a dict of topic name -> text
    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_path("stdlib"))
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _SKIPPED_DIRS]  # not walked into
        files += [pathlib.Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _module_docstrings(path: pathlib.Path) -> str:
    """The docstrings of the module at `path` and of its classes and functions, blank-line separated ('' if none)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes in old files
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return ""
    nodes = (n for n in ast.walk(tree)
             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return "\n\n".join(doc for n in nodes if (doc := ast.get_docstring(n)))
