"""Reading Hugging Face `*.safetensors` files (never pickle), whole or one slice at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
range) and the raw little-endian data. `StoredTensors` parses the headers and memory-maps the files, so a tensor, or
the slice of it one device's shard holds, is copied out of the page cache on demand: no framework is involved (the
`safetensors` package's numpy reader cannot hold bfloat16, and its flax reader puts each tensor on the default
device), and a process that loads only its own shards reads only those bytes.
"""

import glob
import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# safetensors dtype names -> numpy dtypes (the low-precision floats are ml_dtypes', as jax.numpy names them).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
          "F8_E4M3": jnp.float8_e4m3fn, "F8_E5M2": jnp.float8_e5m2, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_}


def safetensors_files(directory) -> list[str]:
    """The safetensors files of a Hugging Face directory, chosen as transformers chooses them: `model.safetensors`
    alone when it exists, else the files that `model.safetensors.index.json` maps tensors to, else every
    `*.safetensors` (so that other files beside them, such as Mistral's `consolidated.safetensors`, are not read)."""
    directory = os.fspath(directory)
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [name for name in names if not os.path.isfile(os.path.join(directory, name))]
        if missing:
            raise ValueError(f"{index!r} maps tensors to files that are not in {directory!r}: {missing[:4]}")
        return [os.path.join(directory, name) for name in names]
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not paths:
        raise ValueError(f"no *.safetensors file in {directory!r} (pickled checkpoints are not read)")
    return paths


def _read_header(path: str) -> tuple[dict, int, int]:
    """The JSON header of a safetensors file, the offset its data starts at and the file's size. ValueError if it
    is not one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if length is None or length > size - 8:
            raise ValueError(f"{path!r} is not a safetensors file ({size} bytes, header length "
                             f"{'missing' if length is None else length})")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path!r} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path!r} is not a safetensors file: its header is not a JSON object")
    return header, 8 + length, size


class StoredTensors:
    """The tensors of a Hugging Face directory's safetensors files (`safetensors_files`), read on demand: only the
    headers are read when it is made. `read(name)` copies a whole tensor out, `read(name, index)` one slice of it
    (a tuple of slices, e.g. the index of a device's shard); `bytes_read` counts the bytes copied out so far.

    Raises ValueError naming the file for a file that is not safetensors, a tensor of an unknown dtype or whose
    byte range does not match its shape, and a tensor name found in two files.
    """

    def __init__(self, directory):
        self.directory = os.fspath(directory)
        self.bytes_read = 0
        self._tensors = {}  # name -> (memory map of its file, data offset, byte range, numpy dtype, shape)
        for path in safetensors_files(self.directory):
            header, data_start, size = _read_header(path)
            data = np.memmap(path, dtype=np.uint8, mode="r") if size > data_start else None
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self._tensors:
                    raise ValueError(f"tensor {name!r} appears in more than one safetensors file of "
                                     f"{self.directory!r}")
                if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
                    raise ValueError(f"{path!r} is not a safetensors file: the header entry of {name!r} is {info!r}, "
                                     f"not a dtype, shape and data_offsets")
                if info["dtype"] not in DTYPES:
                    raise ValueError(f"tensor {name!r} in {path!r} has dtype {info['dtype']!r}; readable: "
                                     f"{sorted(DTYPES)}")
                dtype, shape = np.dtype(DTYPES[info["dtype"]]), tuple(info["shape"])
                begin, end = info["data_offsets"]
                if end - begin != int(np.prod(shape)) * dtype.itemsize or data_start + end > size:
                    raise ValueError(f"tensor {name!r} in {path!r}: bytes {begin}..{end} do not hold a "
                                     f"{info['dtype']} tensor of shape {list(shape)} (or lie past the file's end)")
                self._tensors[name] = (data, data_start, (begin, end), dtype, shape)

    def __contains__(self, name) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def shape(self, name) -> tuple:
        return self._tensors[name][4]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in all the files."""
        return sum(end - begin for _, _, (begin, end), _, _ in self._tensors.values())

    def read(self, name, index=()) -> np.ndarray:
        """Tensor `name`, or its slice `index` (a tuple of slices, as numpy indexes), as a numpy array in its
        stored dtype (bfloat16 as `jnp.bfloat16`)."""
        data, data_start, (begin, end), dtype, shape = self._tensors[name]
        if data is None or begin == end:
            whole = np.zeros(shape, dtype)
        else:
            whole = data[data_start + begin:data_start + end].view(dtype).reshape(shape)
        array = np.array(whole[tuple(index)])
        self.bytes_read += array.nbytes
        return array


class TensorsInMemory:
    """`StoredTensors`' interface over tensors already read (`{name: numpy array}`, e.g. from `read_safetensors`)."""

    def __init__(self, tensors: dict, directory: str = "the checkpoint"):
        self.tensors, self.directory = tensors, directory

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def shape(self, name) -> tuple:
        return tuple(np.shape(self.tensors[name]))

    def read(self, name, index=()) -> np.ndarray:
        return np.asarray(self.tensors[name])[tuple(index)]


def tensors_equal(stored, a: str, b: str, rows: int = 4096) -> bool:
    """Whether tensors `a` and `b` of `stored` (`StoredTensors` or `TensorsInMemory`) are equal, compared a block of
    `rows` rows at a time (never two whole vocabulary-sized copies at once)."""
    shape = stored.shape(a)
    if shape != stored.shape(b):
        return False
    blocks = [(slice(i, i + rows),) for i in range(0, shape[0], rows)] if shape else [()]
    return all(np.array_equal(stored.read(a, block), stored.read(b, block)) for block in blocks)


def read_safetensors(directory) -> dict:
    """All tensors of the safetensors files of `directory` (`safetensors_files`) as numpy arrays in their stored
    dtype (bfloat16 as `jnp.bfloat16`). A tensor name found in two files is an error."""
    stored = StoredTensors(directory)
    return {name: stored.read(name) for name in stored}


def variable_paths(model) -> dict:
    """`{id(variable): 'layers/0/self_attn/q_proj/kernel'}` for every variable of an NNX module: the parameter
    paths `from_hf(..., sharding=)` passes to its sharding function (as `focal_jax.train.optimizer.path_str`
    writes a state's paths)."""
    return {id(variable): "/".join(map(str, path)) for path, variable in nnx.iter_graph(model)
            if isinstance(variable, nnx.Variable)}


def to_array(read, shape: tuple, dtype, sharding=None) -> jax.Array:
    """A parameter of `shape` as a `dtype` jax array. `read(index)` returns its values at `index` (a tuple of
    slices; `()` is the whole) as numpy. Without a `sharding`, the whole is read onto the default device; with one,
    each shard this process's devices hold is read once (devices holding the same shard share the read), so a
    process never holds more of the parameter than its own shards."""
    if sharding is None:
        return jnp.asarray(read(()), dtype=dtype)
    shards = {}

    def shard(index):
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in shards:
            shards[key] = np.asarray(read(index), dtype=dtype)
        return shards[key]

    return jax.make_array_from_callback(tuple(shape), sharding, shard)
