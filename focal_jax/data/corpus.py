"""The builtin corpus: English text that ships with CPython itself (no network, no download).

Documents, in a deterministic order:

1. every topic of `pydoc_data.topics` (the language reference sections behind `help()`, ~465 KB), one document each;
2. for every standard-library `.py` file (sorted by path), the docstrings of the module and of its classes and
   functions, read with `ast` (the modules are never imported; files that fail to parse are skipped), one document
   per file. Skipped: `test/`, `tests/`, `idlelib/`, `site-packages/`, `encodings/` (codec tables, boilerplate
   docstrings) and `pydoc_data/` (already part 1).

About 2 MB in all; the exact text depends on the CPython version (a tokenizer cache keyed on the documents notices).
"""

import ast
import functools
import pathlib
import sysconfig
import warnings

_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__", "encodings", "pydoc_data"})


@functools.cache
def builtin_corpus() -> list[str]:
    """The builtin corpus -> list of documents (str), pydoc topics first, then one document per stdlib module.

    Cached in-process; treat the list as read-only.

    >>> docs = builtin_corpus()
    >>> sum(map(len, docs)) > 1_000_000
    True
    """
    return _pydoc_topics() + [doc for path in _stdlib_files() if (doc := _module_docstrings(path))]


def _pydoc_topics() -> list[str]:
    from pydoc_data.topics import topics  # a data module: a dict of topic name -> text
    return [topics[name].strip() for name in sorted(topics) if topics[name].strip()]


def _stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_path("stdlib"))
    files = (p for p in root.rglob("*.py") if not _SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1]))
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
