"""Inside a user's `jax.shard_map` (with its default `check_vma=True`) every value has a type that says over which
manual mesh axes it varies. Loop carries must keep their type from one iteration to the next, and a `pallas_call`'s
outputs must state theirs, so values built from constants (a loop's zero accumulators, a kernel's output shapes)
are given the union of their inputs' axes here. Outside `shard_map` no value varies and these are no-ops."""

import jax


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
