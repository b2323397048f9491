"""Test configuration: 8 fake CPU devices (for sharding tests), set before jax is imported anywhere.

Nothing else is global: float32 stays the default (no x64).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
