"""Running a Pallas kernel per shard of a device mesh, with `shard_map` over batch and heads.

A `pallas_call` is opaque to XLA's SPMD partitioner: inside a partitioned (`jax.jit` over a mesh) computation XLA
gathers its operands and runs the whole kernel on every device. `per_shard` instead runs the kernel once per shard,
on that device's rows of the batch and its heads, through `shard_map`. Attention is independent per (batch row,
head), so nothing is communicated inside; XLA only reshards the operands to the layout asked for (a no-op when they
already are: batch split over `('data', 'fsdp')`, heads over `'tensor'`, as `focal_jax.train.sharding` places them).

The mesh is the one set with `jax.set_mesh(mesh)` (read with `jax.sharding.get_abstract_mesh()`), or an explicit
one. Without a mesh, or when no axis can split anything, the kernel is called directly: single-device code is
unchanged.
"""

import math
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")  # mesh axes the batch is split over (those the mesh has; in this order)
HEAD_AXES = ("tensor",)        # mesh axes the heads are split over


def context_mesh():
    """The mesh of the current `jax.set_mesh` context (an `AbstractMesh` under `jax.jit`), or None."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    return None if mesh is None or mesh.empty else mesh


def _free_axes(mesh, names):
    """The axes of `names` that `mesh` has with size > 1 and that are not already manual (inside an outer
    `shard_map` the kernel sees its shard, and those axes are left alone)."""
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    return [a for a in names if a in mesh.shape and mesh.shape[a] > 1 and a not in manual]


class Layout(NamedTuple):
    """How `per_shard` splits one call: the mesh axes over the batch dimension and over the head dimension (None:
    not split), and how many times each kv head is repeated so that the kv heads split like the query heads."""
    batch: tuple | None
    heads: tuple | None
    kv_repeat: int


def layout(mesh, batch, heads, kv_heads, *, batch_axes=BATCH_AXES, head_axes=HEAD_AXES) -> Layout:
    """The split of a call with `batch` rows, `heads` query heads and `kv_heads` kv heads over `mesh`.

    Batch: over the axes of `batch_axes` (size > 1), each kept while the product of the kept sizes divides `batch`
    (an axis that does not divide it is left out: the rows are replicated over it).
    Heads: over the axes of `head_axes` when their size n divides `heads`; otherwise the heads are replicated over
    those axes (every device of a tensor group computes all heads of its rows). GQA: each shard's query heads must
    read the kv heads of the same shard. When n divides `kv_heads` the kv heads split as they are; otherwise
    (e.g. MQA, or 2 kv heads on 4 devices) each kv head is repeated `n / gcd(kv_heads, n)` times first, so that
    every shard holds exactly the kv heads its query heads read (its gradient sums over the copies).
    """
    if mesh is None:
        return Layout(None, None, 1)
    kept, size = [], 1
    for axis in _free_axes(mesh, batch_axes):
        if batch % (size * mesh.shape[axis]) == 0:
            kept.append(axis)
            size *= mesh.shape[axis]
    head_split = _free_axes(mesh, head_axes)
    n = math.prod(mesh.shape[a] for a in head_split)
    if not head_split or heads % n:
        return Layout(tuple(kept) or None, None, 1)
    return Layout(tuple(kept) or None, tuple(head_split), n // math.gcd(kv_heads, n))


def _shard_map(fn, mesh, context, in_specs, out_specs):
    """`shard_map` over `mesh` (`context`: the mesh of the `jax.set_mesh` context) without the replication check
    (a `pallas_call` has no replication rule), through `jax.shard_map` (jax >= 0.7), else
    `jax.experimental.shard_map`."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=None if context else mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map  # older jax
    return shard_map(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def per_shard(kernel, q, k, v, token_arrays, *, head_arrays=(), mesh=None, batch_axes=BATCH_AXES,
              head_axes=HEAD_AXES):
    """`kernel(q, k, v, *head_arrays, *token_arrays)` run once per shard of `mesh`, batch over `batch_axes` and
    heads over `head_axes` (see `layout`).

    q `[B, T, H, D]`, k `[B, T, Hk, D]`, v `[B, T, Hk, Dv]`, `head_arrays`: arrays `[B, T, H, ...]` split as q (a
    multiplier per query and head `[B, T, H]`), `token_arrays`: arrays whose first dimension is the batch
    (per-token ids `[B, T]`, membership `[B, T, K]`, ...), split with the batch; the kernel returns the attention
    `[B, T, H, Dv]` and its log-sum-exp `[B, T, H]`. The kernel must treat every (batch row, query head)
    independently and map query head h to kv head `h // (H // Hk)` (the GQA convention). `mesh`: a `Mesh` /
    `AbstractMesh`, or None for the mesh of the `jax.set_mesh` context (no context: the kernel is called as it is).
    Differentiable whenever `kernel` is.
    """
    context = mesh is None
    mesh = context_mesh() if context else mesh
    b, h, hk = q.shape[0], q.shape[2], k.shape[2]
    split = layout(mesh, b, h, hk, batch_axes=batch_axes, head_axes=head_axes)
    explicit = bool(getattr(mesh, "explicit_axes", ()))
    if not (split.batch or split.heads or explicit):
        return kernel(q, k, v, *head_arrays, *token_arrays)
    # (Explicit axes with nothing to split: still through shard_map, every operand replicated, so that the kernel
    # sees manual axes; called directly under the mesh it met operands typed as sharded and failed.)
    if split.kv_repeat > 1:
        k, v = (x.repeat(split.kv_repeat, axis=2) for x in (k, v))
    heads = P(split.batch, None, split.heads, None)
    per_head = [P(split.batch, None, split.heads, *(None,) * (x.ndim - 3)) for x in head_arrays]
    tokens = [P(split.batch, *(None,) * (x.ndim - 1)) for x in token_arrays]
    specs = (heads, heads, heads, *per_head, *tokens)
    args = (q, k, v, *head_arrays, *token_arrays)
    if getattr(mesh, "explicit_axes", ()):  # sharding in types: shard_map wants the operands laid out as asked
        args = tuple(jax.sharding.reshard(x, s) for x, s in zip(args, specs))
    return _shard_map(kernel, mesh, context, specs, (heads, P(split.batch, None, split.heads)))(*args)
