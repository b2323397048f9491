"""The kernels compiled for devices this machine does not have (`focal_jax.kernels.compile_only`): the Triton form
for an H200 (every kernel reaches sm_90 machine code within its shared memory; the default launch assembles without
register spills) and the Mosaic form for four TPU generations (within their VMEM).

Needs jaxlib's CUDA plugin, ptxas and libtpu: `make compile-check` installs them in `.venv-compile` and runs this
file (CI runs it after `make test`); in the main environment its tests are skipped."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from focal_jax import bench
from focal_jax.kernels import compile_only
from focal_jax.kernels import focus_sparse as ks
from focal_jax.nn.llama import Llama, LlamaConfig
from focal_jax.train.optimizer import OptimConfig

needs_cuda = pytest.mark.skipif(not compile_only.has_cuda_plugin(),
                                reason="needs jaxlib's CUDA plugin: make compile-check runs these in .venv-compile")
needs_cudnn = pytest.mark.skipif(not (compile_only.has_cuda_plugin() and compile_only.has_cudnn()),
                                 reason="needs jaxlib's CUDA plugin and cuDNN: make compile-check runs these in "
                                        ".venv-compile")
needs_libtpu = pytest.mark.skipif(not compile_only.has_libtpu(),
                                  reason="needs libtpu: make compile-check runs these in .venv-compile")

T, HEADS, KV_HEADS, GROUPS = 512, 4, 2, 8
FUSED = {"focus_group", "focus_group_dq", "focus_group_dkv", "focus_band", "focus_band_dq", "focus_band_dkv"}


@pytest.fixture(scope="module")
def h200():
    return compile_only.gpu_device()


def shapes(dtype, head_dim):
    """q, k, v, membership, segment ids and per-query multipliers as shapes (GQA: 4 query heads on 2)."""
    q = jax.ShapeDtypeStruct((2, T, HEADS, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, T, KV_HEADS, head_dim), dtype)
    return (q, kv, kv, jax.ShapeDtypeStruct((2, T, GROUPS), jnp.bool_), jax.ShapeDtypeStruct((2, T), jnp.int32),
            jax.ShapeDtypeStruct((2, T, HEADS), jnp.float32))


def fused_forward(backend, max_groups=2, **options):
    """Hard Focus (top-2, or top-1 with `max_groups=1`) through the kernels, with a per-query multiplier."""
    def forward(q, k, v, membership, segment_ids, multiplier):
        return ks.focus_sparse_pallas(q, k, v, membership, multiplier=multiplier, window=48,
                                      segment_ids=segment_ids, backend=backend, max_groups=max_groups, **options)

    return forward


def fused_step(backend, max_groups=2, **options):
    """Forward + backward of `fused_forward`, in q, k, v and the per-query multiplier."""
    forward = fused_forward(backend, max_groups, **options)
    loss = lambda *args: jnp.sum(forward(*args).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 5))


def dense_step(backend, window):
    """Forward + backward of dense (window None) or local attention through the kernels, with a softcap."""
    def loss(q, k, v, membership, segment_ids, multiplier):
        out = ks.dot_product_pallas(q, k, v, multiplier=multiplier, window=window, segment_ids=segment_ids,
                                    softcap=30.0, backend=backend)
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2, 5))


# ------------------------------------------------------------------------------------------------ H200 (Triton)


@needs_cuda
@pytest.mark.parametrize("dtype,head_dim,max_groups", [(jnp.bfloat16, 128, 2), (jnp.bfloat16, 64, 2),
                                                       (jnp.float32, 64, 2), (jnp.float32, 128, 2),
                                                       (jnp.bfloat16, 128, 1), (jnp.float32, 128, 1)])
def test_focus_kernels_compile_for_the_h200(h200, dtype, head_dim, max_groups):
    """Every kernel of the forward and backward pass reaches machine code at the default launch, within the
    H200's shared memory; 16-bit inputs without a register spill. Set A's kernels (blocks of 64 entries) multiply
    with Hopper's warpgroup MMA (`wgmma`); the band's (tiles of 32 tokens, below wgmma's 64 rows) with the
    warp-level `mma.sync`. With one entry per token the backward kernels store set A's gradients at their tokens
    and add set B's in place."""
    kernels = compile_only.kernel_resources(fused_step("triton", max_groups), *shapes(dtype, head_dim), device=h200)
    assert {r.name for r in kernels} == FUSED
    warps = ks.triton_launch(dtype)[0]
    for r in kernels:
        assert r.threads == 32 * warps and 0 < r.registers <= 255, r
        assert r.shared_memory <= compile_only.H200_SHARED_MEMORY_PER_BLOCK, r
        assert r.matmul == ("wgmma" if r.name.startswith("focus_group") else "mma.sync"), r
        if dtype == jnp.bfloat16:
            assert r.spill_stores == 0, r


@needs_cuda
@pytest.mark.parametrize("window", [None, 64])
def test_dense_and_local_through_the_kernels_compile_for_the_h200(h200, window):
    kernels = compile_only.kernel_resources(dense_step("triton", window), *shapes(jnp.bfloat16, 128), device=h200)
    expected = {"focus_group", "focus_group_dq", "focus_group_dkv"} if window is None else {
        "focus_band", "focus_band_dq", "focus_band_dkv"}
    assert {r.name for r in kernels} == expected
    assert all(r.spill_stores == 0 for r in kernels), kernels
    assert all(r.matmul == ("wgmma" if window is None else "mma.sync") for r in kernels), kernels


@needs_cuda
def test_the_h200_check_sees_spills_and_shared_memory_overflows(h200):
    """The launch the kernels had before this check (128-entry blocks, 4 warps, 2 stages) spills registers in bf16,
    already in the forward (its group kernel 2.5 KB per thread; the backward's kernels, which spill more, take
    ptxas half a minute and are left out), and asks float32 for more shared memory than the H200 has: compiling
    catches both."""
    old = dict(block_size=128, num_warps=4, num_stages=2)
    kernels = compile_only.kernel_resources(fused_forward("triton", **old), *shapes(jnp.bfloat16, 128), device=h200)
    assert {r.name for r in kernels} == {"focus_group", "focus_band"}
    assert max(r.spill_stores for r in kernels) > 0
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        compile_only.compile_for(fused_step("triton", **old), *shapes(jnp.float32, 128), device=h200)


# ------------------------------------------------------------------------------------------------ TPUs (Mosaic)


@needs_libtpu
@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_focus_kernels_compile_for_tpus(topology):
    """The Mosaic form (forward and backward; bf16 at head_dim 128, float32 at 64), and dense and local attention
    through it, compiled for each generation at the default blocks."""
    device = compile_only.tpu_device(topology)
    for dtype, head_dim in ((jnp.bfloat16, 128), (jnp.float32, 64)):
        compiled = compile_only.compile_for(fused_step("mosaic"), *shapes(dtype, head_dim), device=device)
        assert "tpu_custom_call" in compiled.as_text()
    for window in (None, 64):
        compile_only.compile_for(dense_step("mosaic", window), *shapes(jnp.bfloat16, 128), device=device)


# Tests reading `compiled_at_4k`, kept in one pytest-xdist worker (`--dist loadgroup`) so that it compiles each once.
SHARES_4K = pytest.mark.xdist_group("compiled_at_4k")
ACTIVATION_4K = 4096 * bench.COMPILE_HEADS * bench.COMPILE_DIM * 2  # bytes of one bf16 `[1, 4K, H, D]` array


@functools.cache
def compiled_at_4k(backend, fused=True):
    """bench's fused kernels' (or the decomposed path's) forward + backward at 4K tokens, compiled for an H200
    ('triton') or a v5e ('mosaic'): once per process for the tests that read the same program."""
    device = compile_only.gpu_device() if backend == "triton" else compile_only.tpu_device("v5e:2x2")
    q, membership = bench._compile_inputs(4096)
    fn = bench._fused_grad(backend) if fused else bench._decomposed_grad()
    return compile_only.compile_for(fn, q, q, q, membership, device=device)


def _temp_bytes(backend, fused=True):
    return compiled_at_4k(backend, fused).memory_analysis().temp_size_in_bytes


@SHARES_4K
@needs_libtpu
def test_the_tpu_form_keeps_its_per_row_statistics_small():
    """Forward + backward at 4K tokens: the Mosaic kernels' temporary memory on a v5e stays within four activations
    `[B, T, H, D]` (it is 33 MiB, about two: the copies gathered into entry order that the TPU form keeps). With
    the per-row statistics laid out as the GPU form's own blocks, columns `[B, H, rows, 1]`, which a TPU's (8, 128)
    tiles pad 128 times, it was 261 MiB."""
    temp = _temp_bytes("mosaic")
    assert temp <= 4 * ACTIVATION_4K, (temp / 2 ** 20, ACTIVATION_4K / 2 ** 20)


@SHARES_4K
@needs_cuda
@needs_libtpu
@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_the_fused_kernel_needs_no_more_memory_than_the_decomposed_path(backend):
    """Forward + backward at 4K tokens, bf16: the kernels' temporary memory stays within the decomposed path's (H200:
    97 vs 196 MiB; v5e: 33 vs 65). With float32 gradients scattered back to token order (`segment_sum` into `[B,
    T + 1, H, D]` float32) the kernels needed 113 MiB on the v5e."""
    fused, decomposed = _temp_bytes(backend), _temp_bytes(backend, fused=False)
    assert fused <= decomposed, (fused, decomposed)


@needs_cuda
def test_a_layer_keeps_no_gathered_copies_until_its_backward(h200):
    """Stacked layers of the fused kernels (q = k = v = the previous layer's output, bf16 `[1, 4K, 8, 128]`,
    compiled for an H200): what each layer holds from its forward to its backward grows the temporary memory by
    about 4 such arrays per layer (its residuals: the scaled q, the output, ...; 4.09 now). It grew by 6 when the
    kernels read copies of q, k, v gathered into (group, position) order and XLA merged the backward's gathers with
    the forward's, keeping the forward's copies alive until the backward (96 MiB per layer of a 400M model at T =
    16K); since 0.6.5 the GPU kernels gather those rows themselves and no such copy exists."""
    x = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    membership = jax.ShapeDtypeStruct((1, 4096, GROUPS), jnp.bool_)

    def gradient(layers):
        def loss(x, membership):
            for _ in range(layers):
                x = ks.focus_sparse_pallas(x, x, x, membership, multiplier=0.1, window=128, backend="triton",
                                           max_groups=1)
            return jnp.sum(x.astype(jnp.float32))
        return jax.grad(loss)

    one, three = (compile_only.compile_for(gradient(n), x, membership, device=h200).memory_analysis()
                  .temp_size_in_bytes for n in (1, 3))
    per_layer = (three - one) / 2 / (x.size * 2)
    assert per_layer < 5, per_layer


TPU_HLO = """HloModule m

ENTRY %main (p: bf16[1024,512]) -> bf16[1024,512] {
%p = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
%copy-start = (bf16[1024,512]{1,0:T(8,128)(2,1)S(1)}, bf16[1024,512]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%p)
%copy-done = bf16[1024,512]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
%jvp_focus_band_.1 = bf16[1024,512]{1,0:T(8,128)(2,1)S(1)} custom-call(%copy-done), custom_call_target="tpu_custom_call"
ROOT %fusion = bf16[1024,512]{1,0:T(8,128)(2,1)} fusion(%jvp_focus_band_.1, %p), kind=kLoop, calls=%f
}
"""


def test_matmul_instructions_are_read_per_kernel():
    ptx = """.version 8.4
.target sm_90a
.visible .entry focus_group(
{
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 0, 1;
}
.visible .entry focus_band(
{
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
}
.visible .entry focus_plan(
{
	ld.global.b32 %r1, [%rd1];
}
"""
    assert compile_only._matmul_instructions(ptx) == {"focus_group": "wgmma", "focus_band": "mma.sync",
                                                      "focus_plan": "none"}


def test_hlo_traffic_of_a_tpu_program():
    """A TPU program: XLA prefetches a 1 MiB input into VMEM (`S(1)`) with an asynchronous copy (1 MiB read), a
    Mosaic kernel (named in its instruction) reads and writes VMEM (nothing), a fusion reads the VMEM result and the
    input and writes its output (2 MiB). Before this was mended the copy counted 6 MiB and the kernel 2 MiB as
    XLA's."""
    mib = 2 ** 20
    assert compile_only.hlo_traffic(TPU_HLO) == (0, 3 * mib)
    assert compile_only.hlo_traffic(TPU_HLO.replace("S(1)", "")) == (2 * mib, 5 * mib)  # all in HBM


PADDED_HLO = """HloModule m

ENTRY %main (p: s32[1024,4]) -> s32[1024,4] {
%p = s32[1024,4]{1,0:T(8,128)} parameter(0)
ROOT %fusion = s32[1024,4]{1,0:T(8,128)} fusion(%p), kind=kLoop, calls=%f
}
"""


def test_hlo_traffic_counts_tpu_arrays_as_stored():
    """A TPU layout's tile pads the most minor dimensions: an int32 `[1024, 4]` with dimension 1 minor takes 1024 x
    128 words (32 times its data), with dimension 0 minor 8 x 1024; without a tile (GPUs) its data."""
    words = lambda rows, columns: 2 * rows * columns * 4  # read once and written once
    assert compile_only.hlo_traffic(PADDED_HLO) == (0, words(1024, 128))
    assert compile_only.hlo_traffic(PADDED_HLO.replace("{1,0:", "{0,1:")) == (0, words(8, 1024))
    assert compile_only.hlo_traffic(PADDED_HLO.replace(":T(8,128)", "")) == (0, words(1024, 4))


@SHARES_4K
@needs_cuda
def test_xla_traffic_counts_operands_and_results_kernels_apart(h200):
    """One fusion reading and writing a float32 [1024, 1024] moves 8 MiB, no kernel; the fused Focus gradient at 4K
    splits into its Pallas kernels' traffic and XLA's own (both positive)."""
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    assert compile_only.xla_traffic(compile_only.compile_for(lambda x: (2 * x).T, x, device=h200)) == (0, 8 * 2 ** 20)
    kernels, other = compile_only.xla_traffic(compiled_at_4k("triton"))
    assert kernels > 6 * ACTIVATION_4K and other > 0, (kernels, other)  # 6 kernels, each reading at least q's size


@SHARES_4K
@needs_libtpu
def test_xla_traffic_finds_the_mosaic_kernels():
    """A Mosaic kernel's name is its instruction's (`%jvp_focus_group_.1`), not in its config as a Triton kernel's:
    before this was mended the TPU kernels' traffic was counted as XLA's own (kernels 0)."""
    kernels, other = compile_only.xla_traffic(compiled_at_4k("mosaic"))
    assert kernels > 6 * ACTIVATION_4K and other > 0, (kernels, other)


@needs_libtpu
def test_the_tpu_check_sees_a_vmem_overflow():
    """Kernels asking for more VMEM than a v5e has fail to compile, as on a TPU: rows of 16,384 values, 4 MiB per
    block of 128 rows of q, k, v or the output. (Blocks of 2048 rows at head dim 128 fail alike, but Mosaic takes
    50 s to compile their score tiles first.)"""
    q = jax.ShapeDtypeStruct((1, 512, 1, 16384), jnp.bfloat16)
    membership = jax.ShapeDtypeStruct((1, 512, GROUPS), jnp.bool_)
    forward = lambda q, k, v, m: ks.focus_sparse_pallas(q, k, v, m, multiplier=0.1, window=128, backend="mosaic",
                                                         max_groups=1, block_size=128)
    with pytest.raises(Exception, match="(?i)vmem"):
        compile_only.compile_for(forward, q, q, q, membership, device=compile_only.tpu_device("v5e:2x2"))


# ------------------------------------------------------------------------------------------------ a model's step


def trainer_step(attn, *, d_model=128, n_heads=2, n_kv_heads=1, seq_len=T):
    """The trainer's step (`make_steps`: bf16 compute, AdamW) of a small 2-layer LLaMA with attention `attn`, and
    its arguments (`bench._train_step_and_args`: the parameters as shapes, a packed batch of 2 rows of `seq_len`
    tokens with segment ids)."""
    config = LlamaConfig(vocab_size=256, d_model=d_model, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         intermediate=2 * d_model, attn=attn)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return bench._train_step_and_args(model, OptimConfig(), 2, seq_len, jnp.bfloat16)


HARD_FOCUS = {"kind": "focal+focus", "impl": "pallas", "focus_topk": 1, "focus_groups": 4, "focus_window": 32,
              "focal_t": 0.4}


@needs_cuda
def test_a_model_train_step_with_impl_pallas_compiles_for_the_h200(h200):
    """Focal + hard Focus through the kernels, in the trainer's bf16 step."""
    step, args = trainer_step(HARD_FOCUS)
    assert "triton" in compile_only.compile_for(step, *args, device=h200).as_text().lower()


@needs_cudnn
@pytest.mark.parametrize("kind,window,seq_len", [("dense", None, T), ("focal", None, T - 1), ("focal", 32, T)])
def test_a_model_train_step_with_impl_cudnn_compiles_for_the_h200(h200, kind, window, seq_len):
    """cuDNN attention (GQA, segments; an odd length, which jax's cuDNN call refuses to train on, is padded) in the
    trainer's bf16 step: jax's cuDNN checks pass and XLA compiles the forward and backward custom calls for sm_90.
    (cuDNN builds its graphs only on a device, so `tests/test_gpu.py` still has to run on one.)"""
    step, args = trainer_step({"kind": kind, "impl": "cudnn", "window": window, "focal_t": 0.4}, d_model=256,
                              n_heads=4, n_kv_heads=2, seq_len=seq_len)
    compiled = compile_only.compile_for(step, *args, device=h200).as_text()
    targets = re.findall(r'custom_call_target="(__cudnn\$fmha[A-Za-z]*)"', compiled)
    assert len([t for t in targets if not t.endswith("Backward")]) == 2, targets  # one per layer
    assert len([t for t in targets if t.endswith("Backward")]) == 2, targets


@needs_libtpu
def test_a_model_train_step_with_impl_pallas_compiles_for_a_tpu():
    step, args = trainer_step(HARD_FOCUS)
    compiled = compile_only.compile_for(step, *args, device=compile_only.tpu_device("v5e:2x2"))
    assert "tpu_custom_call" in compiled.as_text()


# ------------------------------------------------------------------------------------------------ the report


@needs_cudnn
def test_bench_train_compiled_for_the_h200_reports_every_kind(capsys):
    assert bench.main(["train", "--size", "tiny", "--batch", "2", "--seq-len", "128", "--compile-for-h200"]) == 0
    out = capsys.readouterr().out
    kinds = ("dense", "dense (cudnn)", "focal (t=0.4)", "focal learned", "Focus hard top-1 (K=8, w=128, pallas)")
    for kind in kinds:
        assert re.search(rf"\| tiny +\| {re.escape(kind)} +\| [\d.]+ +\| [\d.]+ +\| [\d.]+ +\| \d+% +\|", out), kind


@needs_cuda
@needs_libtpu
def test_bench_compile_reports_both(capsys):
    assert bench.main(["compile", "--seq-len", "256", "--launch", "32:4:1", "--memory-lengths", "256",
                       "--tpus", "v5e:2x2"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 64 : 8 : 2 (default)") == 6 and out.count("| 32 : 4 : 1") == 6  # six kernels each
    assert "| 256 | Focus fused kernel " in out and "| v5e:2x2 | 256 " in out
    assert "does not compile" not in out
    assert re.search(r"\| wgmma +\|", out) and re.search(r"\| mma\.sync +\|", out), out
