"""What `pip install focal_jax` (no extras) must bring: every module-level import of the library comes from the
standard library, the project itself, or a requirement that `setup.py` declares for it. An undeclared one passes
every other test here (the test extra installs it) and breaks a user's install. `make compile-check` runs this file
again in `.venv-compile`, which has the project without extras, where every module is also imported."""

import ast
import importlib
import importlib.metadata
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "focal_jax").rglob("*.py"), *(ROOT / "kernels").glob("*.py"),
                  *(ROOT / "configs").glob("*.py")])
# Modules that are an extra's adapter: their module-level imports may come from that extra.
EXTRA_MODULES = {"focal_jax.eval.harness": "eval"}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str | None) -> set[str]:
    """Normalized distribution names that `pip install focal_jax` (extra None) or `focal_jax[extra]` brings."""
    names = set()
    for requirement in importlib.metadata.requires("focal_jax") or []:
        marker = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
        if marker is None or marker.group(1) == extra:
            names.add(_normalized(re.match(r"[A-Za-z0-9._-]+", requirement).group(0)))
    return names


def module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level package names imported when the module is imported (not inside functions)."""
    names, pending = set(), list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return names


def undeclared(source: str, relative_path: str, distributions: dict[str, list[str]]) -> list[str]:
    """The module-level imports of `source` (the file at `relative_path`) that no declared requirement provides."""
    extra = EXTRA_MODULES.get(relative_path.removesuffix(".py").replace("/", "."))
    allowed = declared(None) | (declared(extra) if extra else set())
    missing = []
    for name in sorted(module_level_imports(ast.parse(source))):
        if name in sys.stdlib_module_names or name == "focal_jax":
            continue
        if not {_normalized(d) for d in distributions.get(name, [name])} & allowed:
            missing.append(f"{name} (from {distributions.get(name, ['an unknown distribution'])})")
    return missing


@pytest.fixture(scope="module")
def distributions():
    return importlib.metadata.packages_distributions()


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_level_imports_are_declared(path, distributions):
    relative_path = path.relative_to(ROOT).as_posix()
    missing = undeclared(path.read_text(), relative_path, distributions)
    assert not missing, f"{relative_path} imports {missing} at module level, which setup.py does not declare for it"


def test_the_check_sees_an_undeclared_import(distributions):
    """Negative control: a test-only requirement imported at module level is caught, also inside a `try`; the same
    import inside a function is not; an extra's adapter module may import that extra's requirements."""
    source = "import json\ntry:\n    import transformers\nexcept ImportError:\n    pass\n\ndef f():\n    import torch\n"
    assert module_level_imports(ast.parse(source)) == {"json", "transformers"}
    assert [m.split()[0] for m in undeclared(source, "focal_jax/probe.py", distributions)] == ["transformers"]
    assert undeclared("import lm_eval\n", "focal_jax/probe.py", distributions)
    assert undeclared("import lm_eval\n", "focal_jax/eval/harness.py", distributions) == []


def test_every_module_imports():
    """Each module of the installed package imports; an extra's adapter, where that extra is not installed, fails
    with an error that names the extra."""
    import focal_jax
    import focal_jax.configs
    import focal_jax.kernels  # package_dirs of their own: not under focal_jax.__path__ in an editable install

    names = sorted({m.name for package in (focal_jax, focal_jax.kernels, focal_jax.configs)
                    for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")})
    assert {"focal_jax.kernels.focus_sparse", "focal_jax.train.trainer", "focal_jax.configs.common"} <= set(names)
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            assert name in EXTRA_MODULES, f"{name}: {error}"
            assert f"focal_jax[{EXTRA_MODULES[name]}]" in str(error), error


def last_line_printed(code: str) -> str:
    """The last line `code` prints when run in a fresh interpreter, which must succeed."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_no_module_imports_torch():
    """tensorboardX imports torch wherever torch is installed (2 s on this machine; on a GPU machine, torch's CUDA
    libraries before jax's), so only the process that writes metrics imports it: importing every module of the
    library (in a fresh interpreter) loads neither."""
    code = ("import importlib, pkgutil, sys, focal_jax, focal_jax.configs, focal_jax.kernels\n"
            "for package in (focal_jax, focal_jax.kernels, focal_jax.configs):\n"
            "    for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "        try:\n"
            "            importlib.import_module(m.name)\n"
            "        except ModuleNotFoundError:\n"
            "            pass  # an extra's adapter, where the extra is not installed\n"
            "print(sorted(name for name in ('torch', 'tensorboardX') if name in sys.modules))\n")
    assert last_line_printed(code) == "[]"


def test_the_attention_functions_import_no_flax():
    """DESIGN.md: the pure attention functions need no Flax, nor the trainer's stack: importing
    `focal_jax.attention` (in a fresh interpreter) loads none of flax, optax, orbax, grain or ml_collections, and
    neither does calling one (which goes through `focal_jax._axes`)."""
    code = ("import sys\nimport jax.numpy as jnp\nimport focal_jax.attention as fa\n"
            "q = jnp.ones((1, 4, 2, 8))\nfa.focal_attention(q, q, q, temperature=0.5).block_until_ready()\n"
            "print(sorted({name.split('.')[0] for name in sys.modules} & "
            "{'flax', 'optax', 'orbax', 'grain', 'ml_collections'}))\n")
    assert last_line_printed(code) == "[]"


def test_kernels_in_the_repository_root_is_the_installed_package(tmp_path):
    """Where Python runs in the repository root (`python -m`, pytest), its kernels/ (`focal_jax.kernels`) would also
    be a top-level `kernels` and shadow Hugging Face's package of that name, which transformers >= 5.25 imports: its
    models failed to load with "cannot import name 'CUDAProperties' from 'kernels'". There `import kernels` gives the
    installed package, and without one fails as outside the repository. (`python -S`: no site-packages, so only the
    stand-in below is installed.)"""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("NAME = 'installed'\n")

    def import_kernels(pythonpath: str):
        code = "import kernels; print(kernels.NAME)"
        return subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": pythonpath})

    found = import_kernels(str(site))
    assert found.returncode == 0 and found.stdout.strip() == "installed", found.stderr[-2000:]
    missing = import_kernels("")
    assert "ModuleNotFoundError: No module named 'kernels' (the repository's kernels/ is focal_jax.kernels)" in (
        missing.stderr), missing.stderr[-2000:]
