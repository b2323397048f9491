"""Reading Hugging Face checkpoints straight onto a mesh: `StoredTensors` (memory-mapped safetensors, whole or one
slice at a time) against the `safetensors` package, and `from_hf(..., sharding=)`, which reads each parameter into
its sharding, each shard once, with the values of `from_hf` on one device. 8 fake CPU devices (conftest); the
two-process run, where each process reads only its own shards, is in test_train.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch_file

from focal_jax.convert.hf import from_hf
from focal_jax.convert.safetensors_io import StoredTensors, read_safetensors, tensors_equal
from focal_jax.train.sharding import make_mesh, param_sharding, tree_shardings
from test_llama_hf import make_hf

MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def test_stored_tensors_read_every_dtype_whole_and_sliced_as_safetensors_does(tmp_path):
    """Tensors written by the safetensors package (numpy, and torch for bfloat16 and float8) in two files read back
    equal, whole and sliced, a scalar and an empty tensor included; `bytes_read` counts a slice's bytes only."""
    rng = np.random.default_rng(0)
    arrays = {"f32": rng.normal(size=(5, 7)).astype(np.float32), "f16": rng.normal(size=(3, 4)).astype(np.float16),
              "f64": rng.normal(size=(2,)), "i64": np.arange(6).reshape(2, 3), "u8": np.arange(9, dtype=np.uint8),
              "bool": np.array([True, False, True]), "scalar": np.array(2.5, np.float32),
              "empty": np.zeros((0, 3), np.float32)}
    save_file(arrays, str(tmp_path / "a.safetensors"))
    low = {"bf16": torch.randn(6, 10, dtype=torch.bfloat16), "f8": torch.randn(4, 4).to(torch.float8_e4m3fn)}
    save_torch_file(low, str(tmp_path / "b.safetensors"))
    stored = StoredTensors(tmp_path)
    assert sorted(stored) == sorted([*arrays, *low])
    for name, want in arrays.items():
        got = stored.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)
    for name, dtype in (("bf16", jnp.bfloat16), ("f8", jnp.float8_e4m3fn)):
        got = stored.read(name)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.astype(np.float32), low[name].float().numpy())
    np.testing.assert_array_equal(stored.read("f32", (slice(1, 4), slice(2, 7))), arrays["f32"][1:4, 2:7])
    np.testing.assert_array_equal(stored.read("bf16", (slice(None), slice(5, 10))).astype(np.float32),
                                  low["bf16"][:, 5:10].float().numpy())
    assert stored.shape("bf16") == (6, 10)
    whole = sum(a.nbytes for a in arrays.values()) + 6 * 10 * 2 + 16
    assert stored.nbytes == whole
    before = stored.bytes_read
    stored.read("f32", (slice(0, 2),))
    assert stored.bytes_read - before == 2 * 7 * 4
    assert set(read_safetensors(tmp_path)) == set(stored)


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    save_file({"x": np.ones((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    for broken, message in ((data[:4], r"is not a safetensors file \(4 bytes, header length missing\)"),
                            (data[:-8], r"tensor 'x' in .*model\.safetensors.*bytes 0\.\.64 do not hold a F32 tensor "
                                        r"of shape \[4, 4\]"),
                            (b"\xff" * 16, r"is not a safetensors file \(16 bytes, header length"),
                            (len(b"[1]").to_bytes(8, "little") + b"[1]", r"its header is not a JSON object"),
                            (len(b'{"x": 1}').to_bytes(8, "little") + b'{"x": 1}',
                             r"the header entry of 'x' is 1, not a dtype, shape and data_offsets")):
        (tmp_path / "model.safetensors").write_bytes(broken)
        with pytest.raises(ValueError, match=message):
            StoredTensors(tmp_path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("llama"))
    make_hf("llama", directory)  # GQA: 4 query heads, 2 key-value heads
    return directory


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    directory = str(tmp_path_factory.mktemp("gpt2"))
    transformers.GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
    return directory


def record_reads(monkeypatch) -> list:
    """`(tensor name, shape of the slice read)` of every `StoredTensors.read` from now on."""
    reads, read = [], StoredTensors.read

    def spied(self, name, index=()):
        array = read(self, name, index)
        reads.append((name, array.shape))
        return array

    monkeypatch.setattr(StoredTensors, "read", spied)
    return reads


def check_on_mesh(model, mesh):
    """Every parameter of `model` is on `mesh` with the trainer's sharding (`tree_shardings`)."""
    state = nnx.to_pure_dict(nnx.state(model))
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    for (path, x), want in zip(leaves, jax.tree.leaves(tree_shardings(state, mesh)), strict=True):
        assert x.sharding == want, (jax.tree_util.keystr(path), x.sharding, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_from_hf_reads_each_shard_once_straight_onto_the_mesh(llama_dir, monkeypatch, dtype):
    """On mesh data 2 x fsdp 2 x tensor 2, each parameter is placed with the trainer's sharding and equals
    `from_hf` on one device exactly; a transposed projection `[d_model, heads * head_dim]` split over fsdp x
    tensor is read as its 4 distinct shards (each held by 2 devices, read once), and in all exactly the bytes of
    the checkpoint are read."""
    mesh = make_mesh(MESH)
    reads = record_reads(monkeypatch)
    lines = []
    model = from_hf(llama_dir, dtype=dtype, sharding=param_sharding(mesh), progress=lines.append)
    first_load = list(reads)
    check_on_mesh(model, mesh)
    want = from_hf(llama_dir, dtype=dtype)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)),
                 nnx.to_pure_dict(nnx.state(want)))
    q_reads = [shape for name, shape in first_load if name == "model.layers.0.self_attn.q_proj.weight"]
    assert q_reads == [(32, 32)] * 4  # HF stores it [heads * head_dim, d_model] = [64, 64]
    stored = StoredTensors(llama_dir)
    assert sum(int(np.prod(shape)) * 4 for _, shape in first_load) == stored.nbytes  # float32 on disk
    size = stored.nbytes / 2**20
    assert len(lines) == 1 and lines[0].startswith(f"read {size:,.1f} MiB (100%) of the {size:,.1f} MiB")
    assert "(the shards this process's devices hold)" in lines[0]
    if dtype == jnp.float32:  # (bfloat16 matmuls split over the mesh round differently from unsplit ones)
        tokens = np.arange(32, dtype=np.int32).reshape(2, 16)
        with jax.set_mesh(mesh):
            logits = jax.jit(lambda m, x: m(x))(model, tokens)
        np.testing.assert_allclose(logits, want(tokens), atol=1e-5)


def test_from_hf_reads_a_gpt2_checkpoint_onto_the_mesh_shard_by_shard(gpt2_dir, monkeypatch):
    """GPT-2's fused c_attn `[d, 3d]` is read as the shards of its q, k and v parts (each `[d, d]` split over fsdp x
    tensor: 4 distinct shards of `[d/2, d/2]` each, at their column offsets); the values equal `from_hf` on one
    device, and in all exactly the checkpoint's bytes are read."""
    mesh = make_mesh(MESH)
    reads = record_reads(monkeypatch)
    model = from_hf(gpt2_dir, sharding=param_sharding(mesh))
    first_load = list(reads)
    check_on_mesh(model, mesh)
    assert [shape for name, shape in first_load if name.endswith("h.0.attn.c_attn.weight")] == [(32, 32)] * 12
    assert [shape for name, shape in first_load if name.endswith("h.0.attn.c_attn.bias")] == [(32,)] * 6
    stored = StoredTensors(gpt2_dir)
    assert "lm_head.weight" not in stored  # (else its comparison with wte would read more)
    assert sum(int(np.prod(shape)) * 4 for _, shape in first_load) == stored.nbytes
    assert model.h[0].attn.k_proj.kernel[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model)),
                 nnx.to_pure_dict(nnx.state(from_hf(gpt2_dir))))


def test_a_tied_head_is_compared_in_blocks_of_rows(tmp_path, monkeypatch):
    """A tied checkpoint that still stores lm_head.weight is checked against the embedding a block of rows at a
    time, never two whole vocabulary-sized copies at once; a difference in the last block is found."""
    embedding = np.random.default_rng(0).normal(size=(100, 8)).astype(np.float32)
    head = embedding.copy()
    head[99, 7] += 1.0
    save_file({"embed": embedding, "same": embedding, "head": head}, str(tmp_path / "model.safetensors"))
    reads = record_reads(monkeypatch)
    stored = StoredTensors(tmp_path)
    assert tensors_equal(stored, "same", "embed", rows=32)
    assert [shape for _, shape in reads] == [(32, 8)] * 6 + [(4, 8)] * 2
    assert not tensors_equal(stored, "head", "embed", rows=32)
