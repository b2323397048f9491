"""The mesh axis types that the attention functions meet in a user's code.

- **Manual axes** (inside `jax.shard_map`, whose default `check_vma=True` types every value with the axes it varies
  over): loop carries must keep their type from one iteration to the next, and a `pallas_call`'s outputs must state
  theirs, so values built from constants (a loop's zero accumulators, a kernel's output shapes) are given the union
  of their inputs' axes (`vary_like`, `shape_like`).
- **Explicit axes** (a `jax.set_mesh` of a mesh made with `AxisType.Explicit`, `jax.make_mesh`'s default): every
  operation must say how its output is sharded, which `jnp.repeat`, `jnp.unique`, `vmap` over arrays built inside
  and `lax.map` over a sharded batch do not. The functions run with those axes made Auto (`on_auto_axes`: jax's
  `auto_axes`), XLA's partitioner splitting them, and return arrays sharded as their inputs.

Outside `shard_map` and without an Explicit mesh these are no-ops.
"""

import jax
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P


def varying_axes(*arrays) -> frozenset:
    """The manual mesh axes over which any of `arrays` varies (empty outside `shard_map`)."""
    return frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in arrays))


def vary_like(tree, *like):
    """`tree` (a pytree of arrays) with each leaf cast to vary over every manual mesh axis any of `like` varies
    over: the type a loop's output gets from mixing them."""
    target = varying_axes(*like)

    def cast(x):
        missing = tuple(sorted(target - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree) if target else tree


def shape_like(struct: jax.ShapeDtypeStruct, like) -> jax.ShapeDtypeStruct:
    """`struct` with the manual-axis type of the array `like` (a kernel output that varies as its inputs do)."""
    if not varying_axes(like):
        return struct
    return jax.ShapeDtypeStruct(struct.shape, struct.dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def explicit_axes() -> tuple[str, ...]:
    """The Explicit axes of the current mesh (`jax.set_mesh`), in mesh order; () without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit)


def leading_spec(x, n_leading: int, ndim: int) -> P:
    """A `PartitionSpec` of `ndim` dimensions: the first `n_leading` as `x`'s sharding splits its own, the rest
    whole (an output `[B, T, ...]` sharded as an input's batch and sequence)."""
    spec = tuple(jax.typeof(x).sharding.spec) + (None,) * np.ndim(x)
    return P(*spec[:n_leading], *(None,) * (ndim - n_leading))


def on_auto_axes(fn, out_spec: P, *args, **kwargs):
    """`fn(*args, **kwargs)`, run with the current mesh's Explicit axes made Auto when it has any; its output
    resharded to `out_spec`. Array keyword arguments travel as arguments (resharded to the Auto mesh), the others
    as they are."""
    axes = explicit_axes()
    if not axes:
        return fn(*args, **kwargs)
    arrays = {name: value for name, value in kwargs.items() if isinstance(value, (jax.Array, np.ndarray))}
    static = {name: value for name, value in kwargs.items() if name not in arrays}
    return jax.sharding.auto_axes(lambda args, arrays: fn(*args, **static, **arrays), axes=axes,
                                  out_sharding=out_spec)(args, arrays)
