"""The mesh axis types that the attention functions meet in a user's code.

- **Manual axes** (inside `jax.shard_map`, whose default `check_vma=True` types every value with the axes it varies
  over): loop carries must keep their type from one iteration to the next, and a `pallas_call`'s outputs must state
  theirs, so values built from constants (a loop's zero accumulators, a kernel's output shapes) are given the union
  of their inputs' axes (`vary_like`, `shape_like`).
- **Explicit axes** (a `jax.set_mesh` of a mesh made with `AxisType.Explicit`, `jax.make_mesh`'s default): every
  operation must say how its output is sharded, which `jnp.repeat`, `jnp.unique`, `vmap` over arrays built inside
  and `lax.map` over a sharded batch do not. The functions run with those axes made Auto (`explicit_as_auto`:
  jax's `auto_axes`), XLA's partitioner splitting them, and return arrays sharded as their inputs.

Outside `shard_map` and without an Explicit mesh these are no-ops.
"""

import contextlib
import functools
import math
import sys

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


BATCH_AXES = ("data", "fsdp")  # the mesh axes that split a batch's rows (the trainer's `focal_jax.train.sharding`)


def split_rows(x):
    """`x [B, ...]`, inside a jitted function, constrained to have its rows split over the batch axes
    (`BATCH_AXES`) of the mesh in context (`jax.set_mesh`) that have more than one device, when they divide B; as
    it is otherwise (no mesh, no such axes, or a B they do not divide)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return x
    return jax.lax.with_sharding_constraint(x, P(axes))


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


def _made_auto(mesh):
    """`mesh` (a concrete `jax.sharding.Mesh`) with its Explicit axes made Auto."""
    types = tuple(AxisType.Auto if kind == AxisType.Explicit else kind for kind in mesh.axis_types)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=types)


@contextlib.contextmanager
def auto_mesh():
    """A context with the current mesh's Explicit axes made Auto (for a host-side loop of jitted steps whose
    results come back to Python); without Explicit axes, nothing changes. Arrays already placed on the Explicit
    mesh (a model's parameters after an `nnx.jit` there) go through `onto_auto_mesh`."""
    if not explicit_axes():
        yield
        return
    with jax.set_mesh(_made_auto(jax.sharding.get_mesh())):
        yield


def onto_auto_mesh(tree):
    """`tree` with each array placed on a mesh with Explicit axes moved to that mesh with them Auto (the same
    devices and split: no copy); other leaves as they are."""
    def move(x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, NamedSharding) or AxisType.Explicit not in sharding.mesh.axis_types:
            return x
        return jax.device_put(x, NamedSharding(_made_auto(sharding.mesh), sharding.spec))

    return jax.tree.map(move, tree)


def _is_array(x) -> bool:
    """What travels through `auto_axes`: a jax array (a tracer too) or a numpy array. (`_validate.is_array` is the
    looser duck-typed test of what the attention functions accept.)"""
    return isinstance(x, (jax.Array, np.ndarray))


def leading_spec(x, n_leading: int, ndim: int) -> P:
    """A `PartitionSpec` of `ndim` dimensions: the first `n_leading` split as `x`'s sharding splits its own, the
    rest whole (an output `[B, T, ...]` sharded as an input's batch and sequence). Not an array: all whole."""
    spec = tuple(jax.typeof(x).sharding.spec) if _is_array(x) else ()
    spec = (spec + (None,) * ndim)[:n_leading]
    return P(*spec, *(None,) * (ndim - n_leading))


def _as_tree(value):
    """`value` as a pytree whose leaves can travel through `auto_axes`, and the function that rebuilds it: an
    `nnx.Module` becomes its state (parameters placed on the Explicit mesh must travel too, not be captured).
    Flax is not imported here (the attention functions, which use this module, need no Flax): a value can only be an
    `nnx.Module` once its caller has imported Flax."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(value, nnx.Module):
        graphdef, state = nnx.split(value)
        return state, lambda travelled: nnx.merge(graphdef, travelled)
    return value, lambda travelled: travelled


def explicit_as_auto(out_spec):
    """Decorator: under a mesh with Explicit axes, the function runs with them made Auto (jax's `auto_axes`) and
    its output is resharded to `out_spec(*args, **kwargs)`; otherwise it runs as it is. Every array in its arguments
    travels as an argument of `auto_axes` (resharded onto the Auto mesh): top-level arrays, the leaves of pytrees
    (a KV cache) and the state of `nnx.Module`s (a model's `self`); the rest (numbers, strings, lists to refuse)
    are passed as they are. The function must not modify a module argument's state (it runs on a copy)."""

    def wrap(fn):
        @functools.wraps(fn)
        def on_auto_axes(*args, **kwargs):
            axes = explicit_axes()
            if not axes:
                return fn(*args, **kwargs)
            positional = [_as_tree(a) for a in args]
            named = {n: _as_tree(v) for n, v in kwargs.items()}
            leaves, treedef = jax.tree.flatten(([t for t, _ in positional], {n: t for n, (t, _) in named.items()}))

            def with_arrays(arrays):
                arrays = iter(arrays)
                trees, named_trees = jax.tree.unflatten(treedef, [next(arrays) if _is_array(x) else x for x in leaves])
                return fn(*(rebuild(t) for t, (_, rebuild) in zip(trees, positional)),
                          **{n: named[n][1](t) for n, t in named_trees.items()})

            arrays = [x for x in leaves if _is_array(x)]
            return jax.sharding.auto_axes(with_arrays, axes=axes, out_sharding=out_spec(*args, **kwargs))(arrays)

        return on_auto_axes

    return wrap


def like_first(n_leading: int, ndim: int):
    """`explicit_as_auto`'s `out_spec` for an output of `ndim` dimensions whose first `n_leading` are those of the
    first argument (attention `[B, T, H, Dv]` as q's `[B, T, H, D]`: `like_first(3, 4)`)."""
    return lambda first, *args, **kwargs: leading_spec(first, n_leading, ndim)
