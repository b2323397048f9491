"""The demo and the benchmark run end to end at a small size, and the benchmark's pair count is right."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from focal_jax import _inputs, bench, demo
from focal_jax.attention import focus_mask, topk_membership


def test_demo_writes_table_and_png(tmp_path, capsys):
    assert demo.main(["--lengths", "256", "--heads", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for row in ("dense", "focal (t=0.4)", "Focus soft", "Focus hard k=1", "Focus hard k=2"):
        assert row in printed
    png = (tmp_path / "attention_maps.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_bench_prints_every_variant(capsys):
    """The attention benchmark's rows, with a sink row pair for each of `--sinks` (70: in steps of 16)."""
    assert bench.main(["attention", "--lengths", "256", "--repeats", "1", "--heads", "2", "--sinks", "4", "70"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 256 ")]
    names = [row.split("|")[2].strip() for row in rows]
    assert names == ["dense", bench.REFERENCE, bench.BLOCKWISE, "focal (t=0.4)", bench.SOFT,
                     "Focus hard k=1 (decomposed)", "Focus hard k=1 (decomposed, K * T entries)",
                     "Focus hard k=1 (decomposed, sink 4)", "Focus hard k=1 (decomposed, sink 4, segment ids)",
                     "Focus hard k=1 (decomposed, sink 70)", "Focus hard k=1 (decomposed, sink 70, segment ids)",
                     bench.ROUTING]
    assert bench.SINKS == (4,)
    assert all(row.split("|")[3].strip() not in ("", "-") for row in rows)  # every row was timed


def test_bench_attention_backward_times_the_gradients(capsys, monkeypatch):
    """`--backward`: every row (the routing's too) compiles and times the gradients of sum(out) with respect to its
    first three arguments (q, k, v; h, W_g, centroids), and the report says so and prints no forward targets."""
    compiled, compile_jit = [], _inputs.compile_jit

    def spied(fn, *args):
        compiled.append(jax.eval_shape(fn, *args))
        return compile_jit(fn, *args)

    monkeypatch.setattr(_inputs, "compile_jit", spied)
    assert bench.main(["attention", "--lengths", "128", "--repeats", "1", "--heads", "2", "--sinks", "20",
                       "--backward"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 128 ")]
    assert len(rows) == len(compiled) == 10 and all(row.split("|")[3].strip() not in ("", "-") for row in rows)
    assert all(isinstance(shapes, tuple) and len(shapes) == 3 for shapes in compiled)
    assert compiled[0][0].shape == (1, 128, 2, bench.HEAD_DIM)  # d/dq of dense attention
    assert "## attention forward + backward (B=1" in out and "Forward + backward, jitted" in out
    assert "Targets" not in out


def test_bench_attention_keeps_its_rows_in_order_when_soft_is_skipped(capsys):
    """Focus soft skipped (T > --skip-soft-above) keeps its row where it is when it runs, after focal's."""
    assert bench.main(["attention", "--lengths", "128", "--repeats", "1", "--heads", "1",
                       "--skip-soft-above", "64"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 128 ")]
    assert [row.split("|")[2].strip() for row in rows][3:5] == ["focal (t=0.4)", bench.SOFT]
    assert "skipped: T > --skip-soft-above=64" in rows[4]


@pytest.mark.parametrize("k,window", [(1, 0), (1, 5), (2, 3), (4, 7), (2, 100)])
def test_count_focus_pairs_equals_the_mask(k, window):
    scores = jax.random.normal(jax.random.key(k + window), (2, 60, 4))
    membership = topk_membership(scores, k)
    allowed, causal = _inputs.count_focus_pairs(membership, window)
    assert allowed == int(jnp.sum(focus_mask(membership, window=window)))
    assert causal == 2 * 60 * 61 // 2
    assert np.isclose(allowed / causal, 1.0) == (k == 4 or window >= 59)


def test_bench_train_prints_every_kind(capsys):
    assert bench.main(["train", "--repeats", "1", "--skip-124m"]) == 0
    out = capsys.readouterr().out
    for kind in ("dense", "focal (t=0.4)", "focal learned", "focus soft"):
        assert f"| {kind}" in out


def test_bench_load_prints_every_reader(capsys):
    """`bench load` reads a random LLaMA checkpoint three ways; each row copies every byte out of the files once
    (this process holds all 8 devices)."""
    assert bench.main(["load", "--d-model", "128", "--layers", "1", "--vocab", "8192", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [row[0].strip() for row in rows] == [
        "from_hf before 0.6.27: all read by the safetensors package (flax)", "from_hf, whole on the default device",
        "from_hf onto a mesh of 8 devices (fsdp=8)"]
    stored = re.search(r"Reading a Hugging Face directory: ([\d.]+) MiB", out)
    assert stored and {row[3].strip() for row in rows} == {stored.group(1)}


def test_bench_init_prints_both_draws(capsys):
    """`bench init` draws the tiny Focal model both ways onto the 8 fake devices and times each."""
    assert bench.main(["init", "--size", "tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "onto 8 device(s), fsdp=8" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "variant" not in line]
    assert [row[0].strip() for row in rows] == ["op by op in host memory, then placed (before 0.6.29)",
                                                "drawn_on_mesh: one jitted draw into the shardings"]
    assert rows[0][3].strip() == "1.00" and all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows)


def test_bench_kernel_prints_every_variant(capsys):
    assert bench.main(["kernel", "--lengths", "256", "--heads", "2", "--head-dim", "16", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("dense causal", "focal t=0.4 through the kernel", "Focus decomposed", "Focus fused kernel"):
        assert out.count(f"| {name}") == 2, name  # forward and forward + backward
    plan_table = out[out.index("| T   | plan (ms)"):]
    assert len([line for line in plan_table.splitlines() if line.startswith("| 256 |")]) == 1, plan_table


def test_bench_kernel_compares_triton_launches(capsys):
    assert bench.main(["kernel", "--lengths", "128", "--heads", "2", "--head-dim", "16", "--repeats", "1",
                       "--launch", "32:4:1", "64:8:2", "32:4:1:16"]) == 0
    out = capsys.readouterr().out
    for launch in ("(32, 4 warps, 1 stages)", "(64, 8 warps, 2 stages)", "(32, 4 warps, 1 stages, band 16)"):
        assert out.count(f"| Focus fused kernel {launch} ") == 2, launch
        dense = 0 if "band" in launch else 2  # dense attention has no band: not timed again
        assert out.count(f"| focal t=0.4 through the kernel {launch} ") == dense, launch
    for bad in ("64:8", "64:8:2:32:1"):
        with pytest.raises(SystemExit):
            bench.main(["kernel", "--launch", bad])


def test_bench_kernel_leaves_the_plan_to_each_call(monkeypatch, capsys):
    """The membership is an argument of every timed call: closed over, it is a constant, and XLA folds the plan (its
    sorts) into the compiled program, so the fused kernel and the decomposed path would be timed without it."""
    timed = []

    def interleaved_times(calls, **kwargs):
        timed.extend(calls)
        return [[1.0] for _ in calls]  # the times do not matter here

    monkeypatch.setattr(bench._inputs, "interleaved_times", interleaved_times)
    assert bench.main(["kernel", "--lengths", "128", "--heads", "2", "--head-dim", "16", "--repeats", "1"]) == 0
    sorting = [(fn, args) for fn, args in timed if "sort" in fn.lower(*args).as_text()]
    assert len(sorting) >= 5  # the decomposed path and the fused kernel, forward and backward, and the plan alone
    for fn, args in sorting:
        assert " sort(" in fn.lower(*args).compile().as_text()


@pytest.mark.parametrize("argv,message", [
    (["plan", "--lengths", "1024", "0"], "argument --lengths: expected an integer >= 1, got '0'"),
    (["plan", "--block-size", "-64"], "argument --block-size: expected an integer >= 1, got '-64'"),
    (["attention", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
    (["kernel", "--heads", "0"], "argument --heads: expected an integer >= 1, got '0'"),
    (["kernel", "--launch", "0:8:2"], "got '0:8:2'"),
    (["kernel", "--launch", "64:3:2"], "got '64:3:2'"),
    (["train", "--size", "4M"], "--size must be one of tiny, 400M"),
    (["train", "--compile-for-h200"], "train: --compile-for-h200 needs --size"),
    (["train", "--batch", "4", "--remat"], "train: --batch, --remat needs --size"),
    (["sinkhorn", "--documents", "0"], "argument --documents: expected an integer >= 1, got '0'"),
    (["shard", "--mesh", "0", "2", "2"], "argument --mesh: expected an integer >= 1, got '0'"),
    (["compile", "--memory-lengths", "-5"], "argument --memory-lengths: expected an integer >= 1, got '-5'"),
    (["kernel", "--lengths", "4096", "4096"], "kernel: --lengths must be distinct, got [4096, 4096]"),
    (["kernel", "--launch", "64:8:2", "64:8:2"], "kernel: --launch must be distinct"),
    (["shard", "--heads", "6", "--kv-heads", "4"], "shard: --kv-heads=4 must divide --heads=6"),
])
def test_bench_rejects_bad_arguments(argv, message, capsys):
    """A bad value is a usage error naming it and what was expected, before anything runs (not a traceback
    later, nor a run that ignores it)."""
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_compile_says_what_it_skips(capsys):
    """Without jaxlib's CUDA plugin and libtpu (the main environment) it says so instead of failing; it runs in
    `make compile-check`'s environment (tests/test_compile_only.py)."""
    from focal_jax.kernels import compile_only

    if compile_only.has_cuda_plugin() or compile_only.has_libtpu():
        pytest.skip("this environment can compile for a device: tests/test_compile_only.py runs the subcommand")
    assert bench.main(["compile", "--memory-lengths"]) == 0
    out = capsys.readouterr().out
    assert "H200: skipped, jaxlib's CUDA plugin is not installed" in out
    assert "TPUs: skipped, libtpu is not installed" in out


def test_bench_plan_prints_both_plans(capsys):
    assert bench.main(["plan", "--lengths", "1024"]) == 0
    out = capsys.readouterr().out
    assert "| 1,024" in out and "one fused pass" in out


@pytest.mark.parametrize("t, groups", [(300, 4), (1000, 8), (1024, 8)])
def test_fused_pass_count_covers_every_cross_group_local_pair(t, groups):
    """The blocks counted for one fused pass are, for each query block, the blocks holding keys at positions
    `[first - window, last]` of its queries that set A (from its first group's start to the diagonal) leaves out,
    each once (brute force over entries); they include every block holding a cross-group local key of the query
    block, so the comparison in `bench plan` does not flatter the two-pass plan."""
    window, block = 10, 16
    group = np.random.default_rng(0).integers(0, groups, t)
    order = np.lexsort((np.arange(t), group))
    entry_of = np.argsort(order)
    needed = expected = 0
    for query_block, first in enumerate(range(0, t, block)):
        queries = order[first:first + block]
        local = {entry_of[j] // block for i in queries for j in range(max(0, i - window), i + 1)
                 if group[j] != group[i]}
        spanned = {entry_of[j] // block for j in range(t) if queries.min() - window <= j <= queries.max()}
        set_a = set(range(int(np.sum(group < group[order[first]])) // block, query_block + 1))
        needed += len(local - set_a)
        expected += len(spanned - set_a)
    counted = bench._fused_pass_extra_blocks(group, window, block)
    assert counted == expected  # was: more at group boundaries inside a block (every group counted, some twice)
    assert counted >= needed


def test_bench_train_size_prints_every_kind(capsys):
    assert bench.main(["train", "--size", "tiny", "--batch", "2", "--seq-len", "32", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for kind in ("dense", "focal (t=0.4)", "focal learned", "Focus hard top-1"):
        assert f"| {kind}" in out
    assert "cudnn" not in out  # GPUs only
    assert re.search(r"\| dense +\| [\d.]+ +\| [\d,]+ +\| n/a \(peak unknown\) +\| \d+% +\|", out)


def test_matmul_flops_counts_precision_through_calls_and_scans():
    """2 M N K per product; a scan's body counts `length` times; nested jit and remat are entered; a cond counts its
    costliest branch; 16-bit only when both operands are; the products inside a Pallas kernel are left out."""
    from focal_jax.kernels.focus_sparse import dot_product_pallas

    a, b = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 16), jnp.bfloat16)
    assert bench.matmul_flops(lambda a, b: a @ b, a, b) == (2 * 4 * 8 * 16,) * 2
    assert bench.matmul_flops(lambda a, b: a.astype(jnp.float32) @ b, a, b) == (2 * 4 * 8 * 16, 0.0)

    def scanned(a, b):
        body = jax.checkpoint(lambda carry, _: (jax.jit(lambda c: c @ b @ b.T)(carry), None))
        return jax.lax.scan(body, a, None, length=3)[0]

    assert bench.matmul_flops(scanned, a, b) == (3 * 2 * 2 * 4 * 8 * 16,) * 2
    q = jnp.ones((1, 16, 2, 8), jnp.bfloat16)
    assert bench.matmul_flops(lambda q: dot_product_pallas(q, q, q, multiplier=1.0) @ jnp.ones((8, 8), q.dtype),
                              q) == (2 * 16 * 2 * 8 * 8,) * 2

    def branched(a, b):  # one product or two: only one branch runs
        return jax.lax.cond(a[0, 0] > 0, lambda: a @ b @ b.T, lambda: a @ b @ b.T @ b @ b.T)

    assert bench.matmul_flops(branched, a, b) == (4 * 2 * 4 * 8 * 16,) * 2  # was: both branches, 6 products


def test_bench_sinkhorn_prints_both_forms(capsys):
    assert bench.main(["sinkhorn", "--lengths", "32", "--batch", "1", "--groups", "2", "--documents", "2",
                       "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 ")]
    assert [row.split("|")[4].strip() for row in rows] == ["unrolled", "lax.scan"] * 4
    assert [row.split("|")[2].strip() for row in rows] == ["none"] * 4 + ["2 per row"] * 4
    assert all(row.split("|")[8].strip() == "1.00" for row in rows[::2])  # each pair's ratios are to its unrolled row


def test_bench_shard_prints_both_calls(capsys):
    """8 fake devices (conftest): the kernel under `jax.set_mesh` compiles without all-gathers; without it, with."""
    assert bench.main(["shard", "--batch", "4", "--seq-len", "64", "--heads", "4", "--kv-heads", "2",
                       "--head-dim", "16"]) == 0
    out = capsys.readouterr().out
    gathers = dict(re.findall(r"\| (no mesh context|inside jax.set_mesh) +\| (\d+)", out))
    assert int(gathers["no mesh context"]) > 0 and gathers["inside jax.set_mesh"] == "0", out
    with pytest.raises(SystemExit, match="needs 16 devices"):
        bench.main(["shard", "--mesh", "4", "2", "2"])
