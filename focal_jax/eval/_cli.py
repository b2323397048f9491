"""Checks shared by the `focal_jax.eval` command lines, made before a model loads: a setting out of range, or an
output path that cannot be written (`focal_jax._validation.output_file_error`), would otherwise fail only after the
whole evaluation, its results lost."""

import argparse
import contextlib
import math

MESH_AXES = ("data", "fsdp", "tensor")  # as focal_jax.train.sharding, which the command lines import only when asked
MESH_HELP = ("place the model on a mesh of this process's devices: e.g. tensor=8 (heads, MLP and vocabulary split "
             "over 8 devices), fsdp=2,tensor=4 (the embedding dimension too), data=8 (the parameters whole on every "
             "device); data and fsdp split each batch's rows. Axes data, fsdp, tensor; one size may be -1 (the rest "
             "of the devices). Default: one device")


def rope_ntk_factor(text: str) -> float:
    """argparse type of `--rope-ntk-factor`: a finite float >= 1 (as `AttentionConfig.rope_ntk_factor`);
    anything else is a usage error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}") from None
    if not 1 <= value < math.inf:  # (NaN too)
        raise argparse.ArgumentTypeError(f"the dynamic NTK scaling factor must be a finite number >= 1, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count (`--batches`, `--batch-size`, `--seq-len`, ...): an integer >= 1; anything else is a
    usage error naming the value (rather than a message naming the function argument it reaches)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def mesh_shape(text: str) -> dict:
    """argparse type of `--mesh`: `AXIS=SIZE[,AXIS=SIZE...]` over the axes `MESH_AXES`, each size an integer >= 1
    or -1 (the rest of the devices), each axis once -> {axis: size}; anything else is a usage error naming it.
    Whether the sizes fit the devices is `evaluation_mesh`'s check."""
    shape = {}
    for item in text.split(","):
        axis, equals, size = item.strip().partition("=")
        if not equals or axis.strip() not in MESH_AXES or axis.strip() in shape:
            raise argparse.ArgumentTypeError(
                f"expected AXIS=SIZE pairs separated by commas, each of the axes {', '.join(MESH_AXES)} at most once "
                f"(e.g. tensor=8), got {text!r}")
        try:
            shape[axis.strip()] = int(size)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{axis.strip()}={size!r} in {text!r}: the size must be an integer "
                                             f"(>= 1, or -1 for the rest of the devices)") from None
    return shape


def evaluation_mesh(parser: argparse.ArgumentParser, shape: dict | None, rows: tuple[str, int] | None = None):
    """The `jax.sharding.Mesh` of a command's `--mesh` shape (None without one). Usage errors: a shape that does not
    fit the devices (naming it and the device count), and, given `rows` = (its flag, the command's batch size), a
    batch size that the mesh's data x fsdp axes, which split each batch's rows, do not divide."""
    if shape is None:
        return None
    from focal_jax.train.sharding import data_parallel_size, make_mesh  # the training stack: only when asked for

    try:
        mesh = make_mesh(shape)
    except ValueError as e:
        parser.error(f"--mesh: {e}")
    if rows is not None and rows[1] % data_parallel_size(mesh):
        parser.error(f"{rows[0]}={rows[1]} must be a multiple of {data_parallel_size(mesh)}, the data x fsdp size of "
                     f"--mesh {dict(mesh.shape)}, which split each batch's rows")
    return mesh


def on_mesh(mesh):
    """The context an evaluation runs in: `jax.set_mesh(mesh)` (the Pallas kernels then run per shard), or none
    without a mesh."""
    import jax

    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
