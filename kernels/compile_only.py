"""Compiling for a GPU or a TPU without one: whether the kernels compile, and what they use there.

XLA compiles for a device it is only told about, with none attached:

* a GPU from a description of it (a `GpuTargetConfigProto`; `H200` below), when jaxlib's CUDA plugin is installed
  (`jax-cuda12-plugin` of jax's version, and `nvidia-cuda-nvcc-cu12` for ptxas). Triton's whole pipeline runs down
  to sm_90 machine code, so what lowering alone cannot see (a kernel needing more shared memory than the GPU has)
  fails here as on the device; `ptxas -v` on the emitted PTX reports each kernel's registers and spills. With
  cuDNN installed (`nvidia-cudnn-cu12`), cuDNN attention (the models' `impl='cudnn'`) lowers and compiles too, as
  XLA custom calls; cuDNN itself builds their graphs only on a device.
* a TPU from a topology name (`'v5e:2x2'`, `'v5p:2x2x1'`, `'v6e:2x2'`, `'v4:2x2x1'`), when libtpu is installed
  (`jax[tpu]`). Mosaic compiles the kernels for that generation, so a kernel needing more VMEM than it has fails.

`make compile-check` builds such an environment (`.venv-compile`) and runs `tests/test_compile_only.py` in it, with
`JAX_PLATFORMS=cpu` so that neither plugin looks for a device (and `ALLOW_MULTIPLE_LIBTPU_LOAD=1`, so that two such
processes may load libtpu at once); `python -m focal_jax.bench compile` reports.

    >>> device = gpu_device()                                               # doctest: +SKIP
    >>> for r in kernel_resources(fn, q, k, v, device=device): print(r)     # doctest: +SKIP
    >>> compile_for(fn, q, k, v, device=tpu_device('v5e:2x2')).memory_analysis()  # doctest: +SKIP
"""

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from typing import NamedTuple

import jax
import numpy as np

from focal_jax.kernels.focus_sparse import target_platform

# The H200 (SXM) as XLA's GpuTargetConfigProto (text format): Hopper, compute capability 9.0, 132 SMs, 228 KiB of
# shared memory per SM (227 KiB per block with opt-in), 64K 32-bit registers per SM, 141 GB of HBM3e at 4.8 TB/s.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""
H200_SHARED_MEMORY_PER_BLOCK = 232448  # bytes, `shared_memory_per_block_optin` above


class KernelResources(NamedTuple):
    """One kernel launch of a compiled program, as XLA plans it and ptxas assembles it."""
    name: str
    grid: tuple[int, int, int]
    threads: int          # per block (32 x Triton's num_warps)
    shared_memory: int    # bytes per block
    registers: int        # per thread
    spill_stores: int     # bytes per thread
    spill_loads: int      # bytes per thread
    matmul: str           # the tensor-core instructions in its PTX: 'wgmma' (Hopper's warpgroup MMA, which
                          # Triton emits for blocks of >= 64 rows on 4 warps or more), 'mma.sync' (the warp-level
                          # MMA of Ampere), 'both' or 'none'


def has_cuda_plugin() -> bool:
    """Whether jaxlib's CUDA plugin (`jax-cuda12-plugin`) is installed."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no `jax_plugins` package at all
        return False


def has_cudnn() -> bool:
    """Whether cuDNN (`nvidia-cudnn-cu12`) is installed, which `jax.nn.dot_product_attention(implementation='cudnn')`
    needs in order to lower."""
    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ModuleNotFoundError:  # no `nvidia` package at all
        return False


def has_libtpu() -> bool:
    """Whether libtpu (`jax[tpu]`) is installed."""
    return importlib.util.find_spec("libtpu") is not None


def gpu_device(target_config: str = H200):
    """A compile-only GPU device described by `target_config` (default `H200`); needs the CUDA plugin, not a GPU."""
    if not has_cuda_plugin():
        raise RuntimeError(f"compiling for a GPU without one needs jaxlib's CUDA plugin: pip install "
                           f"'jax-cuda12-plugin=={jax.__version__}' nvidia-cuda-nvcc-cu12 (or make compile-check)")
    from jax.experimental import topologies

    return topologies.get_topology_desc("target", platform="cuda", topology="1x1x1",
                                        target_config=target_config).devices[0]


def tpu_device(topology: str = "v5e:2x2"):
    """The first chip of a compile-only TPU `topology` ('generation:shape', e.g. 'v5p:2x2x1'); needs libtpu, not a
    TPU."""
    if not has_libtpu():
        raise RuntimeError(f"compiling for a TPU without one needs libtpu: pip install 'jax[tpu]=={jax.__version__}' "
                           f"(or make compile-check)")
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology, "tpu").devices[0]


def compile_for(fn, *args, device, dump_to=None):
    """`jax.jit(fn)` compiled for `device` (from `gpu_device` or `tpu_device`); `args`: pytrees of arrays or
    `jax.ShapeDtypeStruct`s (only their shapes and dtypes matter). `dump_to`: a directory for XLA's dump (on a GPU:
    the PTX and the launch plan that `kernel_resources` reads)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    options = {} if dump_to is None else {"xla_dump_to": dump_to}
    with target_platform(device.platform):  # the kernels' backend and the cuDNN guard see the device's platform
        return jax.jit(fn).trace(*specs).lower().compile(options)


def ptxas() -> str:
    """The path of `ptxas`: on PATH, or from the `nvidia-cuda-nvcc-cu12` wheel."""
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:
        spec = None
    for root in (spec.submodule_search_locations if spec else []):
        candidate = os.path.join(root, "bin", "ptxas")
        if os.path.exists(candidate):
            return candidate
    raise RuntimeError("ptxas not found: pip install nvidia-cuda-nvcc-cu12 (or put CUDA's bin directory on PATH)")


_LAUNCH = re.compile(r"\]\s+(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), 1, 1\]\s+shared_memory: (\d+) bytes")


def _launches(dump: str) -> dict[str, tuple]:
    """Kernel name -> (grid, threads, shared memory) from XLA's thunk sequence in `dump`."""
    launches = {}
    for file in os.listdir(dump):
        if file.endswith(".thunk_sequence.txt"):
            with open(os.path.join(dump, file)) as f:
                for match in _LAUNCH.finditer(f.read()):
                    name, *numbers = match.groups()
                    numbers = [int(n) for n in numbers]
                    launches[name] = (tuple(numbers[:3]), numbers[3], numbers[4])
    return launches


def _assembled(ptx_file: str) -> dict[str, tuple[int, int, int]]:
    """Entry name -> (registers, spill store bytes, spill load bytes) from `ptxas -v` on one PTX file."""
    with open(ptx_file) as f:
        target = re.search(r"^\.target\s+(\w+)", f.read(), re.M).group(1)
    report = subprocess.run([ptxas(), "-v", f"--gpu-name={target}", ptx_file, "-o", os.devnull],
                            capture_output=True, text=True, check=True).stderr
    found, name = {}, None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name = m.group(1)
        elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            found[name] = (0, int(m.group(1)), int(m.group(2)))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            found[name] = (int(m.group(1)),) + found.get(name, (0, 0, 0))[1:]
    return found


def _matmul_instructions(ptx: str) -> dict[str, str]:
    """Entry name -> the kind of tensor-core instructions in its PTX ('wgmma', 'mma.sync', 'both', 'none')."""
    kinds = {}
    for entry in re.split(r"(?=\.visible\s+\.entry\s)", ptx)[1:]:
        name = re.search(r"\.entry\s+(\w+)", entry).group(1)
        found = [kind for kind in ("wgmma", "mma.sync") if re.search(rf"\b{re.escape(kind)}\.", entry)]
        kinds[name] = "both" if len(found) == 2 else found[0] if found else "none"
    return kinds


def kernel_resources(fn, *args, device, prefix: str = "focus_") -> list[KernelResources]:
    """Compiles `fn(*args)` for a GPU `device` (from `gpu_device`) and returns the launches of its kernels whose
    names start with `prefix` (the Pallas kernels of `focal_jax.kernels.focus_sparse`), in launch order."""
    with tempfile.TemporaryDirectory() as dump:
        compile_for(fn, *args, device=device, dump_to=dump)
        launches = {name: v for name, v in _launches(dump).items() if name.startswith(prefix)}
        assembled, matmuls = {}, {}
        for file in sorted(os.listdir(dump)):
            if file.endswith(".ptx"):
                with open(os.path.join(dump, file)) as f:
                    ptx = f.read()
                if set(re.findall(r"\.entry\s+(\w+)", ptx)) & set(launches):
                    assembled.update(_assembled(os.path.join(dump, file)))
                    matmuls.update(_matmul_instructions(ptx))
    return [KernelResources(name, grid, threads, shared, *assembled[name], matmuls[name])
            for name, (grid, threads, shared) in launches.items()]


_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\](\{[^}]*\})?")
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")  # a TPU layout's memory space other than HBM (VMEM, SMEM, ...)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(.*)$")
_NO_TRAFFIC = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")


def _array_bytes(shape_text: str) -> int:
    """Bytes in HBM of the arrays in an HLO shape (`bf16[8,128]{1,0}`, or a tuple of them), as stored: a TPU
    layout's tile pads the most minor dimensions (`s32[4096,4]{1,0:T(8,128)}` takes 4096 x 128 words); an array
    that a TPU keeps on chip (layout `{...S(1)}`) counts 0."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(shape_text):
        if _ON_CHIP.search(layout):
            continue
        bits = 1 if dtype == "pred" else 16 if dtype == "bf16" else int(dtype[1:])
        shape = _tile_padded([int(d) for d in dims.split(",") if d], layout)
        total += int(np.prod(shape, dtype=np.int64)) * max(bits // 8, 1)
    return total


def _tile_padded(shape: list[int], layout: str) -> list[int]:
    """`shape` padded to the first tile of its `layout` (`{1,0:T(8,128)}`: dimension 1, the most minor, to a
    multiple of 128 and dimension 0 to one of 8); unchanged without a tile (GPUs)."""
    match = re.match(r"\{([\d,]*):T\(([\d,]+)\)", layout)
    if not match:
        return shape
    minor_to_major = [int(x) for x in match.group(1).split(",") if x]
    tile = [int(x) for x in match.group(2).split(",")]
    padded = list(shape)
    for dim, size in zip(minor_to_major, reversed(tile)):
        padded[dim] = -(-padded[dim] // size) * size
    return padded


def xla_traffic(compiled, kernel_prefix: str = "focus_") -> tuple[int, int]:
    """`(kernels, other)`: bytes of the device's memory (HBM) read and written by the top-level instructions of a
    compiled program's entry computation, the custom calls of the Pallas kernels named `kernel_prefix*` apart from
    XLA's own ops (fusions, copies, sorts, gathers). See `hlo_traffic`."""
    return hlo_traffic(compiled.as_text(), kernel_prefix)


def hlo_traffic(text: str, kernel_prefix: str = "focus_") -> tuple[int, int]:
    """`xla_traffic` of a compiled program's HLO text. Operand plus result sizes, each instruction's inputs counted
    as read once: a bandwidth floor for a memory-bound op, not a measurement; loops count once. On TPUs, arrays
    count as stored, padded to their layout's tiles; arrays that XLA keeps on chip (memory space `S(1)`, VMEM)
    move nothing; and an asynchronous copy counts once, at its start (whose result holds the source and the
    destination)."""
    entry = text[text.index("\nENTRY"):].split("\n}\n")[0]
    shapes, kernels, other = {}, 0, 0
    for line in entry.splitlines()[1:]:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, opcode, operands, rest = match.groups()
        shapes[name] = shape
        if opcode in _NO_TRAFFIC or opcode.endswith("-done"):
            continue
        operands = re.sub(r"/\*.*?\*/", "", operands).split(",")  # drops XLA's /*index=5*/ marks
        reads = sum(_array_bytes(shapes.get(x.split()[-1], "")) for x in operands if x.strip())
        moved = _array_bytes(shape) + (0 if opcode.endswith("-start") else reads)
        # A Triton kernel's name is in its config; a Mosaic kernel's in the instruction's (`%jvp_focus_group_.1`).
        named = kernel_prefix in name or re.search(rf'name="{kernel_prefix}|{kernel_prefix}\w*"', rest)
        if opcode == "custom-call" and named:
            kernels += moved
        else:
            other += moved
    return kernels, other
