"""Test configuration: 8 fake CPU devices (for sharding tests), set before jax is imported anywhere.

Nothing else is global: float32 stays the default (no x64). `fast_compiles` and `optimized_cpu_code` are fixtures
a module opts into, e.g. `pytestmark = pytest.mark.usefixtures("fast_compiles")`.
"""

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
