"""Reading Hugging Face `*.safetensors` files (never pickle)."""

import glob
import os

import numpy as np
from safetensors import safe_open


def read_safetensors(directory) -> dict:
    """All tensors of `directory/*.safetensors` as numpy arrays in their stored dtype.

    Read through the flax framework of safetensors because plain numpy cannot hold bfloat16 (ml_dtypes can, after
    `np.asarray`). A tensor name found in two files is an error.
    """
    directory = os.fspath(directory)
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not paths:
        raise ValueError(f"no *.safetensors file in {directory!r} (pickled checkpoints are not read)")
    tensors = {}
    for path in paths:
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} appears in more than one safetensors file of {directory!r}")
                tensors[name] = np.asarray(f.get_tensor(name))
    return tensors
