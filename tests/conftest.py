"""Test configuration: 8 fake CPU devices (for sharding tests), set before jax is imported anywhere.

Nothing else is global: float32 stays the default (no x64), and each module's compiled programs are freed after it
(`_free_compiled_programs`). `fast_compiles` and `optimized_cpu_code` are fixtures a module opts into, e.g.
`pytestmark = pytest.mark.usefixtures("fast_compiles")`.
"""

import gc
import os

import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


def _most_optimizations_disabled(disabled: bool):
    """A module fixture's body: `jax_disable_most_optimizations` set to `disabled` on CPU, restored afterwards."""
    import jax  # after XLA_FLAGS is set above

    if jax.default_backend() != "cpu":
        yield
        return
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", disabled)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


def pytest_configure(config):
    # a library path (an evaluation view, an export, a retrofit) that builds a model whose attention ignores one of
    # its settings fails its test; the tests that build one on purpose expect the warning (`pytest.warns`)
    config.addinivalue_line("filterwarnings", "error:attention kind=.* does not read:UserWarning")


@pytest.fixture(scope="module")
def fast_compiles():
    """Tiny models, many shapes: XLA's optimisation passes cost more than they save here (compile time halves).
    For direct pytest runs: `make test` turns them off for every test (JAX_DISABLE_MOST_OPTIMIZATIONS). CPU only: on
    a GPU (`make gpu-check`) the device tests run as compiled for real."""
    yield from _most_optimizations_disabled(True)


@pytest.fixture(scope="module")
def optimized_cpu_code():
    """XLA's optimized CPU code, even where `make test` asks for less (JAX_DISABLE_MOST_OPTIMIZATIONS): for tests
    whose outcome depends on how near-ties round (test_generate.py)."""
    yield from _most_optimizations_disabled(False)


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """jax keeps every program a process compiles or reads back from the persistent cache, and on CPU each one
    holds three memory mappings. A pytest-xdist worker running half the suite reached 57,864 of Linux's default
    limit of 65,530 (`vm.max_map_count`) and 8.7 GB, and workers segfaulted now and then late in the run while
    loading a program, as they would when the limit is passed. Freed after each module (peak: 18,147 and 4.9 GB),
    the programs are read back from the persistent cache by the next module that needs them."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
