"""Test configuration: 8 fake CPU devices (for sharding tests), set before jax is imported anywhere.

Nothing else is global: float32 stays the default (no x64). `fast_compiles` is a fixture a module opts into with
`pytestmark = pytest.mark.usefixtures("fast_compiles")`.
"""

import os

import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()


@pytest.fixture(scope="module")
def fast_compiles():
    """Tiny models, many shapes: XLA's optimisation passes cost more than they save here (compile time halves).
    CPU only: on a GPU (`make gpu-check`) the device tests run as compiled for real."""
    import jax  # after XLA_FLAGS is set above

    if jax.default_backend() != "cpu":
        yield
        return
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
