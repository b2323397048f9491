"""Device mesh `('data', 'fsdp', 'tensor')`, parameter sharding by logical axis rules, and batch sharding.

Parameters get logical axis names from their path (`LOGICAL_AXES`, first match wins), and logical names map to mesh
axes through `RULES`. A dimension is split only when the mesh axis divides it; otherwise it stays replicated. Batches
are split over `('data', 'fsdp')` along the batch dimension; each process feeds its own rows
(`jax.make_array_from_process_local_data`).
"""

import functools
import math
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from focal_jax._axes import BATCH_AXES
from focal_jax.train.optimizer import path_str

MESH_AXES = ("data", "fsdp", "tensor")

# (regex on the parameter path, logical name of each dimension). LLaMA family and GPT-2 names.
LOGICAL_AXES = (
    (r"(embed_tokens|wte)/embedding$", ("vocab", "embed")),
    (r"wpe/embedding$", (None, "embed")),
    (r"(q_proj|k_proj|v_proj)/kernel$", ("embed", "heads")),
    (r"(q_proj|k_proj|v_proj)/bias$", ("heads",)),
    (r"o_proj/kernel$", ("heads", "embed")),
    (r"(gate_proj|up_proj|c_fc)/kernel$", ("embed", "mlp")),
    (r"c_fc/bias$", ("mlp",)),
    (r"(down_proj|c_proj)/kernel$", ("mlp", "embed")),
    (r"lm_head/kernel$", ("embed", "vocab")),
    (r"(q_proj|k_proj|v_proj)/lora_b$", (None, "heads")),
    (r"o_proj/lora_a$", ("heads", None)),
)
RULES = {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


def make_mesh(shape: dict) -> Mesh:
    """A mesh over all devices (of every process) with axes `('data', 'fsdp', 'tensor')`. `shape` maps each axis
    to its size; at most one size may be -1 (the rest of the devices), e.g. `{'data': -1, 'fsdp': 1, 'tensor': 1}`."""
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh has unknown axes {sorted(unknown)}; the axes are {MESH_AXES}")
    sizes = [int(shape.get(axis, 1)) for axis in MESH_AXES]
    n = jax.device_count()
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh sizes must be >= 1, with at most one -1; got {dict(zip(MESH_AXES, sizes))}")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if n % known:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} does not fit {n} devices")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices, but there are {n}")
    # Auto axes: XLA's sharding propagation places the activations (the parameters and batches are placed here).
    return jax.make_mesh(tuple(sizes), MESH_AXES, devices=jax.devices(),
                         axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_axes(path: str, ndim: int) -> tuple:
    """Logical axis names of the parameter at `path` (all None for anything not in `LOGICAL_AXES`)."""
    for pattern, names in LOGICAL_AXES:
        if re.search(pattern, path) and len(names) == ndim:
            return names
    return (None,) * ndim


def partition_spec(path: str, shape: tuple, mesh: Mesh) -> P:
    """The PartitionSpec of a parameter: its logical axes through `RULES`, a dimension split only when the mesh
    axis divides it."""
    spec = []
    for name, size in zip(logical_axes(path, len(shape)), shape):
        axis = RULES.get(name)
        spec.append(axis if axis is not None and mesh.shape[axis] > 1 and size % mesh.shape[axis] == 0 else None)
    return P(*spec)


def param_sharding(mesh: Mesh):
    """The function `(parameter path, shape) -> NamedSharding` of the layout `tree_shardings` gives, for
    `focal_jax.convert.hf.from_hf(..., sharding=)` to read a checkpoint straight onto `mesh`."""
    return lambda path, shape: NamedSharding(mesh, partition_spec(path, tuple(shape), mesh))


def tree_shardings(tree, mesh: Mesh):
    """NamedShardings for every leaf of a parameter pytree, or of an optimizer state whose leaves sit under the
    parameter paths (Adam's `mu` / `nu`: the path regexes match their suffixes). Scalars are replicated."""
    shard = param_sharding(mesh)
    return jax.tree_util.tree_map_with_path(lambda path, x: shard(path_str(path), np.shape(x)), tree)


def put(x, sharding):
    """`x` placed with `sharding`. An array already on the sharding's devices (read onto the mesh by `from_hf`) is
    resharded there, without a host copy (it may span other processes); anything else goes through a host copy, so
    it may come from another backend (the host's CPU), or from this process's devices in a multi-process run."""
    if isinstance(x, jax.Array) and x.sharding.device_set == sharding.device_set:
        return jax.device_put(x, sharding)
    return jax.device_put(np.asarray(x), sharding)


def place_tree(tree, shardings):
    """Every leaf of `tree` placed with its sharding (`put`)."""
    return jax.tree.map(put, tree, shardings)


def abstract_on_mesh(model, mesh: Mesh):
    """`model`, abstract (`nnx.eval_shape`), with each variable a `jax.ShapeDtypeStruct` that carries its sharding
    on `mesh` (the layout of `tree_shardings`), in place; returns `model`: a target that a checkpoint restores
    straight onto the mesh, each process reading only its own shards."""
    state = nnx.to_pure_dict(nnx.state(model))
    nnx.update(model, jax.tree.map(lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                                   state, tree_shardings(state, mesh)))
    return model


def drawn_on_mesh(cls, config, seed: int, mesh: Mesh | None = None):
    """`cls(config, rngs=nnx.Rngs(seed))` (a `Llama` or `GPT2` from scratch), its variables drawn by one jitted call
    straight into their shardings on `mesh` (the layout of `tree_shardings`): no process holds the whole model in
    host memory, and each draws only its own shards. Without a mesh, onto the default device. The draws are the same
    with and without a mesh, bit for bit (JAX's partitionable threefry); they may differ in the last bit from
    calling the constructor outside `jax.jit`, as XLA compiles the initialisers' arithmetic whole. A process
    compiles each (cls, config, seed, mesh) once."""
    model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(seed)))
    nnx.update(model, _jitted_draw(cls, config, seed, mesh)())
    return model


@functools.lru_cache(maxsize=16)
def _jitted_draw(cls, config, seed: int, mesh: Mesh | None):
    """The jitted draw of `drawn_on_mesh`: `() -> the model's state as a pure dict`, placed on `mesh`."""
    def draw():
        return nnx.to_pure_dict(nnx.state(cls(config, rngs=nnx.Rngs(seed))))

    return jax.jit(draw, out_shardings=None if mesh is None else tree_shardings(jax.eval_shape(draw), mesh))


def place_model(model, mesh: Mesh):
    """`model` (an NNX module, e.g. built in host memory by `focal_jax.train.trainer.load_model`) with each of its
    arrays put on `mesh` as the trainer lays out parameters (`tree_shardings`: the embedding dimension over
    'fsdp', heads, MLP and vocabulary over 'tensor'), in place; returns `model`. Arrays go through host copies
    unless they are on the mesh already (`put`)."""
    state = nnx.to_pure_dict(nnx.state(model))
    nnx.update(model, place_tree(state, tree_shardings(state, mesh)))
    return model


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays `[batch, seq]`: batch split over `('data', 'fsdp')`."""
    return NamedSharding(mesh, P(BATCH_AXES))


def shard_batch(local_batch: dict, mesh: Mesh) -> dict:
    """Global arrays from this process's rows: `{name: [local_batch, seq]}` numpy -> `{name: [global_batch, seq]}`
    jax arrays sharded by `batch_sharding`."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split (data x fsdp): the global batch must be a multiple of it."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch_layout(mesh: Mesh, batch_size: int, process_count: int):
    """ValueError unless a global batch of `batch_size` rows splits over the mesh's batch axes (data x fsdp) and
    each of `process_count` processes, which load their own `batch_size / process_count` rows (`shard_batch`), holds
    shards of its own: batch axes spanning fewer devices than processes would take one process's rows for the
    whole batch, silently training on a fraction of it."""
    parallel = data_parallel_size(mesh)
    if batch_size % parallel:
        raise ValueError(f"batch_size={batch_size} must be a multiple of the data-parallel size {parallel} "
                         f"(mesh {dict(mesh.shape)})")
    if parallel % process_count:
        raise ValueError(f"the mesh splits the batch {parallel} ways (data x fsdp, mesh {dict(mesh.shape)}), which "
                         f"{process_count} processes cannot share: each process loads its own rows, so data x fsdp "
                         f"must be a multiple of the process count; split the other way within a host (tensor)")
