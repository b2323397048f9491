"""Reading Hugging Face `*.safetensors` files (never pickle)."""

import glob
import json
import os

import numpy as np
from safetensors import safe_open


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


def read_safetensors(directory) -> dict:
    """All tensors of the safetensors files of `directory` (`safetensors_files`) as numpy arrays in their stored
    dtype.

    Read through the flax framework of safetensors because plain numpy cannot hold bfloat16 (ml_dtypes can, after
    `np.asarray`). A tensor name found in two files is an error.
    """
    tensors = {}
    for path in safetensors_files(directory):
        with safe_open(path, framework="flax") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} appears in more than one safetensors file of {directory!r}")
                tensors[name] = np.asarray(f.get_tensor(name))
    return tensors
