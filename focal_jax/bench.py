"""Benchmarks: speed and memory of the attention functions, ratios side by side in one run.

    python -m focal_jax.bench attention [--lengths 2048 4096 8192] [--repeats 7] [--block-size N]
                                        [--skip-soft-above 8192] [--budget-s 240] [--heads 8] [--sinks 4 ...]
                                        [--backward]
    python -m focal_jax.bench train [--repeats 5] [--skip-124m]
    python -m focal_jax.bench train --size 400M [--batch 8] [--seq-len 2048] [--remat]   (for a GPU / TPU)
    python -m focal_jax.bench train --size 400M --compile-for-h200     (no device: in .venv-compile, JAX_PLATFORMS=cpu)
    python -m focal_jax.bench kernel [--lengths 4096 16384 32768 65536] [--heads 16] [--head-dim 128] [--repeats 5]
    python -m focal_jax.bench plan [--lengths 4096 16384 32768 65536] [--block-size 64]
    python -m focal_jax.bench compile [--seq-len 16384] [--launch 64:8:2 64:8:2:64 ...] [--memory-lengths ...]
                                      [--tpus v5e:2x2 ...]   (no device: in .venv-compile, JAX_PLATFORMS=cpu)
    python -m focal_jax.bench sinkhorn [--lengths 2048] [--batch 4] [--groups 8] [--documents 4] [--repeats 20]
    python -m focal_jax.bench shard [--mesh 2 2 2] [--batch 8] [--seq-len 256] [--heads 8] [--kv-heads 4]
                                    (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)
    python -m focal_jax.bench load [--dir HF_DIR | --d-model 1024 --layers 8 --vocab 32000] [--dtype bfloat16]
                                   [--repeats 3]   (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)
    python -m focal_jax.bench init [--size 400M] [--repeats 2]   (CPU: XLA_FLAGS=...device_count=8)

``init``: a Focal paper model drawn from scratch onto a mesh of every device (``fsdp`` = the device count), as the
trainer drew it before 0.6.29 (op by op in host memory, then placed on the mesh) and with ``drawn_on_mesh`` (one
jitted draw straight into the shardings, compiled at each call as a run compiles it once): seconds of the first call
and the median of ``--repeats`` later ones.

``load``: reading a Hugging Face directory (``--dir``, or a random LLaMA checkpoint of the given size written to a
temporary directory): ``from_hf`` as it was before 0.6.27 (every tensor read whole by the ``safetensors``
package's flax reader, then the same assignment), ``from_hf`` onto the default device, and ``from_hf`` straight
onto a mesh of every device (``fsdp`` = the device count, ``sharding=param_sharding(mesh)``), side by side: seconds
(median of ``--repeats``, the files in the page cache after the first read) and the MiB this process copied out of
the files.

``sinkhorn``: the routing's balancing (``focal_jax.attention.sinkhorn``, 10 iterations) with its iterations unrolled
(the default) and as a ``lax.scan`` (``unroll=False``), side by side: seconds to trace and lower, seconds to
compile, and the milliseconds of a call (median of ``--repeats`` after one warm-up), of the forward + backward of
``sum(g * w)``, with packed documents (``--documents`` segments per row) and without, non-causal and causal.

``shard``: no timing; what XLA compiles for the jitted loss and gradients of Focus through the Pallas kernel
(``focus_sparse_attention(impl='pallas')``, K = 8, w = 128, top-1) on a ``(data, fsdp, tensor)`` mesh, with the
batch split over data x fsdp and the heads over tensor, called without and inside ``jax.set_mesh(mesh)``: the
all-gathers in the compiled HLO, the temporary memory per device and the FLOPs of the compiled program. Without the
mesh context the kernel is opaque to the partitioner, which gathers its operands; inside it the kernel runs per shard
(``kernels/partition.py``).

``compile``: no timing and no device; the kernels compiled for an H200 from its description and for TPUs from their
topology names (``focal_jax.kernels.compile_only``; needs jaxlib's CUDA plugin, ``ptxas`` and libtpu, as
``make compile-check`` installs in ``.venv-compile``): per Triton kernel of the fused Focus forward + backward (bf16,
H = 16, D = 128, K = 8, w = 128, top-1), its grid, threads, shared memory, registers, register spills and
tensor-core instructions, for each ``--launch`` (block : warps : stages, and optionally the band's tiles) next to
the library's default; then the temporary memory that XLA's buffer assignment gives the forward + backward on the
H200 for the decomposed path and the fused kernel at each of ``--memory-lengths`` (cuDNN's needs cuDNN, which that
environment lacks), and on each of ``--tpus`` for the decomposed path and the Mosaic kernels; for the fused kernel
also the bytes that XLA's own ops around it read and write (``compile_only.xla_traffic``). For the Mosaic
kernels, first what one step of each one's walk copies into VMEM, as the TPU's tiles store it and as data
(``walked_step_bytes``; traced, the same on every generation).

``plan``: no timing; the work the kernels' block plan schedules (`kernels/focus_sparse.plan`), counted: visited
block area over the allowed pairs for K = 8 balanced random top-1 groups, w = 128 (set A entry blocks of
``--block-size``, default 64 as on GPUs; set B token tiles of 32), next to what one fused pass over the group-sorted
order would visit (set A's blocks plus, per query block, the blocks of every other group that hold its local keys),
and the speedup limits over dense causal attention that follow.

``kernel``: the Pallas kernels on the device (a GPU; on CPU they run in interpret mode, so only tiny sizes make
sense there): bf16 (float32 on CPU), K = 8 balanced groups, w = 128, top-1; dense causal
``jax.nn.dot_product_attention`` (cuDNN on GPU), focal attention through the kernel (no groups), the decomposed
path, and the fused kernel, forward and forward + backward, with the pair ratio and the TFLOP/s achieved on the pairs
each one computes (4 D FLOPs per pair forward, 2.5 times that backward).

``train``: tokens/s of the trainer's jitted step (forward, backward, AdamW update; float32) for the quickstart model
(1.3M parameters, B = 16, T = 128) with each attention kind side by side, and for GPT-2 124M (B = 1, T = 512),
full training and a Focus retrofit that trains the centroids only. Median of ``--repeats`` steps after one warm-up.

``attention``: for each T (B = 1, H = 8, D = 64, float32, this machine's default backend) it times the forward pass of
dense causal attention, Focal (t = 0.4), Focus soft (K = 8, w = 128, gate 'paper') and the exact Focus fast path
(``impl='decomposed'``, K = 8, w = 128, top-1 membership from ``sinkhorn(routing_scores(h))`` on structured random
hidden states, so groups are as (im)balanced as Sinkhorn leaves them; ``max_groups=1``, and the same call without it,
whose group-sorted arrays hold K * T entries, and with an attention sink of 4 tokens (``--sinks``: of each size given),
without segment ids (a slice of the row's first keys) and with one segment (the per-document path: rows sorted by
segment, blocks of 16 queries; ``focal_jax.attention.sink``), as rows of their own), plus the routing itself
(``routing_scores`` + ``sinkhorn``) as its own row. ``--backward`` times the forward + backward of every row instead
(the gradients of ``sum(out)`` with respect to q, k and v; of h, W_g and the centroids for the routing).
``jax.nn.dot_product_attention`` (XLA, causal) is timed too, as a baseline from outside the library: it shows whether
"dense" is a fair denominator. Columns:

* time: median of ``--repeats`` jitted forward (``--backward``: forward + backward) calls after one warm-up call,
  ``block_until_ready``. The calls of one length are timed round-robin (one call of each per round), so load drift on
  a shared machine hits all alike; after 3 rounds, rounds stop once they took ``--budget-s`` seconds (stderr says so);
* speedup: dense time / time;
* theoretical: 1 / pair fraction, pair fraction = allowed pairs / causal pairs of the hard mask (counted per group,
  without a [T, T] mask); 1 for dense, Focal and Focus soft, which compute every causal pair;
* achieved: speedup / theoretical;
* peak memory: temp + output + argument bytes of the compiled executable's memory analysis.

Everything is compiled before anything runs; a call whose memory estimate exceeds 3/4 of the machine's available
memory is not run (its row says so), so Focus soft at 8K cannot take a 24 GiB machine down. Progress goes to stderr;
stdout is a markdown report (command, date, jax version, CPU, table, targets) ready for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import shlex
import statistics
import sys
import time
from typing import Any, Sequence

import jax

from focal_jax import _inputs, attention

HEAD_DIM = 64
MEMORY_FRACTION = 0.75  # of MemAvailable that one call may use
REFERENCE = "jax.nn.dot_product_attention (xla)"
BLOCKWISE = "blockwise causal (decomposed, K=1)"
SOFT = f"Focus soft (K={_inputs.N_GROUPS}, w={_inputs.WINDOW}, gate=paper)"
ROUTING = "routing (routing_scores + sinkhorn)"
SINKS = (4,)  # the attention sinks of the sink rows (StreamingLLM's 4 tokens), `--sinks`
HEADERS = ["T", "variant", "time (ms)", "speedup vs dense", "theoretical (1/pairs)", "achieved / theoretical",
           "peak memory (MiB)", "notes"]


@dataclasses.dataclass
class Entry:
    """One benchmarked call at one length: what to run, and what the table needs."""

    name: str
    fn: Any  # None: a placeholder row (skipped)
    args: tuple[Any, ...] = ()
    pair_fraction: float | None = 1.0  # None: not an attention variant (the routing row)
    membership: Any = None
    compiled: Any = None
    mib: float | None = None
    seconds: float | None = None
    note: str = ""


def _entries(seq_len: int, args: argparse.Namespace) -> list[Entry]:
    """The calls to time at one length: dense, the jax.nn baseline, focal, Focus soft, Focus decomposed, routing."""
    x = _inputs.make_inputs(seq_len, args.heads, HEAD_DIM, seed=args.seed)
    g = jax.jit(_inputs.route)(x.h, x.w_g, x.centroids)
    soft = seq_len <= args.skip_soft_above
    variants = _inputs.attention_variants(g, top_ks=(1,), block_size=args.block_size, soft=soft)
    variants.insert(1, _inputs.Variant(REFERENCE, functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                                                     implementation="xla")))
    # One group holding every token: the decomposed machinery computing all causal pairs, i.e. flash-style
    # blockwise dense attention. Focus decomposed over this row is the speedup that comes from the pairs alone.
    one_group = jax.numpy.ones(g.shape[:2] + (1,), bool)
    blockwise = functools.partial(attention.focus_sparse_attention, window=_inputs.WINDOW, impl="decomposed",
                                  block_size=args.block_size)
    variants.insert(2, _inputs.Variant(BLOCKWISE, blockwise, (one_group,)))
    # The same top-1 Focus without `max_groups`: its group-sorted arrays hold K * T entries, K - 1 of K padding.
    top1 = next(v for v in variants if v.membership is not None)
    variants.append(_inputs.Variant(f"{top1.name[:-1]}, K * T entries)", functools.partial(
        attention.focus_sparse_attention, window=_inputs.WINDOW, impl="decomposed", block_size=args.block_size),
        top1.extra, top1.membership))
    # The same top-1 Focus with an attention sink: the fast path plus set C (each document's first tokens), merged
    # outside it (`focal_jax.attention.sink`); without segment ids its keys are a slice, with them (here one segment,
    # so the pairs are the same) the rows are sorted by segment and read in blocks of queries.
    one_segment = jax.numpy.zeros(g.shape[:2], jax.numpy.int32)
    sinks = {}  # variant name: its sink
    for sink in args.sinks:
        for name, segment_ids in ((f"sink {sink}", None), (f"sink {sink}, segment ids", one_segment)):
            name = f"{top1.name[:-1]}, {name})"
            sinks[name] = sink
            variants.append(_inputs.Variant(name, functools.partial(
                attention.focus_sparse_attention, window=_inputs.WINDOW, impl="decomposed",
                block_size=args.block_size, max_groups=1, sink=sink, segment_ids=segment_ids),
                top1.extra, top1.membership))
    entries = []
    for variant in variants:
        entry = Entry(variant.name, variant.fn, (x.q, x.k, x.v, *variant.extra), membership=variant.membership)
        if variant.membership is not None:
            allowed, causal = _inputs.count_focus_pairs(variant.membership, _inputs.WINDOW)
            allowed += sinks.get(variant.name, 0) * seq_len  # at most `sink` more per query: an upper bound
            entry.pair_fraction = allowed / causal
            entry.note = f"pair fraction {entry.pair_fraction:.3f}, group sizes {_group_sizes(variant.membership)}"
        entries.append(entry)
    if not soft:  # where its row is when it runs: after focal's
        focal = next(i for i, e in enumerate(entries) if e.name.startswith("focal"))
        entries.insert(focal + 1, Entry(SOFT, None, note=f"skipped: T > --skip-soft-above={args.skip_soft_above}"))
    entries.append(Entry(ROUTING, _inputs.route, (x.h, x.w_g, x.centroids), pair_fraction=None))
    if args.backward:
        for entry in entries:
            entry.fn = None if entry.fn is None else _sum_grad(entry.fn)
    return entries


def _compile(entry: Entry, memory_limit: float | None) -> None:
    """Compiles an entry and reads its memory estimate; leaves it uncompiled (not run) if over the limit."""
    compiled = _inputs.compile_jit(entry.fn, *entry.args)
    entry.mib = _inputs.memory_mib(compiled)
    if memory_limit is not None and entry.mib is not None and entry.mib > memory_limit:
        entry.note = f"not run: needs ~{entry.mib / 1024:.1f} GiB, limit {memory_limit / 1024:.1f} GiB"
    else:
        entry.compiled = compiled


def bench_length(seq_len: int, args: argparse.Namespace) -> tuple[list[list[str]], dict[str, float | None]]:
    """All rows of the attention benchmark at one length, and the numbers the targets need.

    Every entry is compiled first, then all are warmed up and timed round-robin (``_inputs.interleaved_times``).
    """
    available = _inputs.available_memory_mib()
    memory_limit = None if available is None else MEMORY_FRACTION * available
    entries = _entries(seq_len, args)
    for entry in entries:
        if entry.fn is not None:
            start = time.perf_counter()
            _compile(entry, memory_limit)
            _log(f"  T={seq_len} compiled {entry.name} in {time.perf_counter() - start:.1f} s, "
                 f"~{_fmt_mib(entry.mib)} MiB{'' if entry.compiled else ': ' + entry.note}")
    runnable = [e for e in entries if e.compiled is not None]
    _log(f"  T={seq_len} timing {len(runnable)} calls round-robin, after one warm-up each")
    times = _inputs.interleaved_times([(e.compiled, e.args) for e in runnable], repeats=args.repeats,
                                      budget_s=args.budget_s, progress=lambda m: _log(f"  T={seq_len} {m}"))
    for entry, entry_times in zip(runnable, times):
        entry.seconds = statistics.median(entry_times)
    if runnable and len(times[0]) < args.repeats:
        _log(f"  T={seq_len}: {len(times[0])} rounds instead of {args.repeats} (--budget-s {args.budget_s:g})")
    numbers = {_key(e): e.seconds for e in entries}
    numbers["theoretical"] = next((1 / e.pair_fraction for e in entries if e.membership is not None), None)
    return _rows(seq_len, entries), numbers


def _key(entry: Entry) -> str:
    """Short name of an entry for the targets: dense, jax.nn.dot_product_attention, focal, Focus, decomposed,
    routing."""
    if entry.membership is not None:
        return "decomposed" + (" K * T" if entry.name.endswith("K * T entries)") else "")
    return {ROUTING: "routing", BLOCKWISE: "blockwise"}.get(entry.name, entry.name.split(" ")[0])


def _rows(seq_len: int, entries: list[Entry]) -> list[list[str]]:
    """Table rows: time, speedup vs dense, theoretical speedup (1 / pair fraction), achieved fraction of it, memory,
    note; the routing row gives its share of dense attention time instead of ratios."""
    dense = entries[0].seconds
    rows = []
    for e in entries:
        if e.pair_fraction is None:
            share = "" if not (e.seconds and dense) else f"{100 * e.seconds / dense:.2f}% of dense attention time"
            rows.append([str(seq_len), e.name, _fmt_ms(e.seconds), "-", "-", "-", _fmt_mib(e.mib), share])
            continue
        theoretical = 1.0 / e.pair_fraction
        speedup = None if not (e.seconds and dense) else dense / e.seconds
        rows.append([str(seq_len), e.name, _fmt_ms(e.seconds), _fmt_ratio(speedup), f"{theoretical:.2f}",
                     _fmt_ratio(None if speedup is None else speedup / theoretical), _fmt_mib(e.mib), e.note])
    return rows


def target_lines(results: dict[int, dict[str, float | None]]) -> list[str]:
    """The issue's targets for this 2-core CPU, checked against the measured numbers (where measured)."""
    ratio = lambda a, b: None if not (a and b) else a / b
    lines = []
    for seq_len, n in results.items():
        focal = ratio(n.get("focal"), n.get("dense"))
        if focal is not None:
            lines.append(f"- T={seq_len}: focal time / dense time = {focal:.3f} (target <= 1.03)")
    if 8192 in results:
        n = results[8192]
        speedup = ratio(n.get("dense"), n.get("decomposed"))
        if speedup is not None:
            lines.append(f"- T=8192: decomposed speedup over dense {speedup:.2f}x = {speedup / n['theoretical']:.2f} "
                         f"of the theoretical {n['theoretical']:.2f}x (target >= 0.6)")
        for name, key in ((REFERENCE, "jax.nn.dot_product_attention"), (BLOCKWISE, "blockwise")):
            baseline = ratio(n.get(key), n.get("decomposed"))
            if baseline is not None:
                lines.append(f"- T=8192: decomposed speedup over {name} {baseline:.2f}x = "
                             f"{baseline / n['theoretical']:.2f} of the theoretical")
    if 4096 in results:
        n = results[4096]
        for name in ("dense", "decomposed"):
            share = ratio(n.get("routing"), n.get(name))
            if share is not None:
                lines.append(f"- T=4096: routing = {100 * share:.2f}% of {name} attention time (target < 5%)")
    return lines


def _log(message: str) -> None:
    """Progress goes to stderr, so stdout stays a clean markdown report."""
    print(message, file=sys.stderr, flush=True)


def _print_header(title: str, argv: Sequence[str]) -> None:
    """A report's heading (`## title`) and its environment lines: the command as run, date, jax version, CPU."""
    command = "python -m focal_jax.bench " + " ".join(shlex.quote(a) for a in argv)
    print(f"## {title}\n")
    print(_inputs.environment_header(command) + "\n", flush=True)


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:,.1f}"


def _fmt_mib(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib:,.0f}"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _group_sizes(membership: Any) -> str:
    """Smallest..largest number of tokens per group: how balanced Sinkhorn left the groups."""
    sizes = jax.numpy.sum(membership, axis=(0, 1))
    return f"{int(sizes.min())}..{int(sizes.max())}"


def run_attention(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``attention`` subcommand: prints the header and one markdown table covering every length."""
    _print_header(f"attention{' forward + backward' if args.backward else ''} (B=1, H={args.heads}, D={HEAD_DIM}, "
                  f"float32, K={_inputs.N_GROUPS}, w={_inputs.WINDOW}, top-1, repeats={args.repeats}, "
                  f"block_size={args.block_size or 'library default'})", argv)
    rows, results = [], {}
    for seq_len in args.lengths:
        _log(f"T={seq_len} ...")
        length_rows, results[seq_len] = bench_length(seq_len, args)
        rows += length_rows
    print(_inputs.markdown_table(HEADERS, rows))
    targets = [] if args.backward else target_lines(results)  # (the targets are the forward's)
    if targets:
        print("\nTargets (issue 2, section 4):\n" + "\n".join(targets))
    print(f"\n{'Forward + backward' if args.backward else 'Forward only'}, jitted, median after one warm-up, timed "
          f"round-robin. The machine is shared and noisy: compare ratios within one run, not absolute times across "
          f"runs.")
    return 0


def _train_step_and_args(model, optim, batch_size: int, seq_len: int, compute_dtype=jax.numpy.float32):
    """The trainer's step (`make_steps`) for `model`, and its arguments: (trainable, opt_state, frozen, batch) on
    random tokens (one packed document per row)."""
    import numpy as np

    from focal_jax.train.optimizer import make_optimizer, split_trainable
    from focal_jax.train.trainer import make_steps, routing_param_paths

    graphdef, trainable, frozen = split_trainable(model, optim)
    tx = make_optimizer(optim, total_steps=100)
    step = make_steps(graphdef, tx, compute_dtype, keep_float32=routing_param_paths(model))[0]
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, model.config.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)),
             "segment_ids": np.ones((batch_size, seq_len), np.int32),
             "loss_mask": np.ones((batch_size, seq_len), np.float32)}
    return step, (trainable, jax.eval_shape(tx.init, trainable) if _is_abstract(trainable) else tx.init(trainable),
                  frozen, batch)


def _is_abstract(tree) -> bool:
    """Whether `tree` holds shapes (`jax.ShapeDtypeStruct`, as from `nnx.eval_shape`) rather than arrays."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _train_step_seconds(model, optim, batch_size: int, seq_len: int, repeats: int,
                        compute_dtype=jax.numpy.float32) -> float:
    """Median seconds of the trainer's jitted step on random tokens (one packed document per row)."""
    return _step_seconds(*_train_step_and_args(model, optim, batch_size, seq_len, compute_dtype), repeats)


def _step_seconds(step, step_args, repeats: int) -> float:
    """Median seconds of `step(*step_args)` (a train step, from `_train_step_and_args`), jitted, after one call that
    compiles; the step's new parameters and optimizer state feed the next call."""
    trainable, opt_state, frozen, batch = step_args
    step = jax.jit(step, donate_argnums=(0, 1))
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        trainable, opt_state, metrics = step(trainable, opt_state, frozen, batch)
        jax.block_until_ready(metrics["loss"])
        if i:  # the first call compiles
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def traced_equations(jaxpr, times: int = 1):
    """Every equation of `jaxpr` and of the jaxprs nested in it (calls, loops, conds, custom VJPs), with how many
    times it runs as traced: a scan's body `length` times, a while loop's body once, every branch of a cond once. A
    `pallas_call` is yielded, its kernel body is not entered (its products are not XLA's)."""
    for eqn in jaxpr.eqns:
        yield eqn, times
        for sub, repeat in _nested_jaxprs(eqn, times):
            yield from traced_equations(sub, repeat)


def _nested_jaxprs(eqn, times: int):
    """`(jaxpr, times)` of each jaxpr nested in `eqn` (none in a `pallas_call`'s kernel): a scan's body runs
    `length` times per run of `eqn`."""
    if eqn.primitive.name == "pallas_call":
        return
    repeat = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
            if hasattr(sub, "eqns"):
                yield sub, repeat


def matmul_flops(fn, *args) -> tuple[float, float]:
    """`(all, 16-bit)`: FLOPs of the matrix products in `fn(*args)` as traced (its jaxpr, through nested calls and
    scans), and of those whose two operands are 16-bit (bf16 / fp16: the matmul units' full rate on a GPU or TPU).
    The products inside Pallas kernels are not counted; a while loop's body counts once, a cond its costliest
    branch (only one runs)."""
    return _jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args).jaxpr, 1)


def _jaxpr_matmul_flops(jaxpr, times: int) -> tuple[float, float]:
    total = low = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            (contracting, _), _ = eqn.params["dimension_numbers"]
            flops = times * 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in contracting)
            total += flops
            low += flops if lhs.dtype.itemsize == 2 and rhs.dtype.itemsize == 2 else 0.0
            continue
        nested = [_jaxpr_matmul_flops(sub, repeat) for sub, repeat in _nested_jaxprs(eqn, times)]
        if eqn.primitive.name == "cond" and nested:
            nested = [max(nested)]
        total += sum(t for t, _ in nested)
        low += sum(x for _, x in nested)
    return total, low


def walked_step_bytes(fn, *args) -> list[tuple[str, int, int]]:
    """Per TPU-form Pallas kernel of `focal_jax.kernels.focus_sparse` in `fn(*args)` (traced, not compiled):
    `(name, stored, data)`, the bytes that one step of its walk copies into its VMEM slots (one slot of each walked
    operand's two) as a TPU's tiles store them, 8 rows of 32-bit words (16 of 16-bit ones) by 128 lanes, and the
    bytes of data in them: a 32-bit `[128, 4]` block stores 64 KiB and holds 2."""
    rows_per_tile = {1: 32, 2: 16, 4: 8}
    result = []
    for eqn, _ in traced_equations(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name != "pallas_call":
            continue
        kernel = eqn.params["jaxpr"]
        scratch = [v.aval for v in kernel.invars[len(kernel.invars) - eqn.params["grid_mapping"].num_scratch_operands:]]
        stored = data = 0
        for slots in (a for a in scratch if len(a.shape) >= 3):  # `[2, ...block]` VMEM; semaphores are `[2]`
            *outer, rows, lanes = slots.shape[1:]
            size = jax.numpy.dtype(slots.dtype).itemsize
            tile = rows_per_tile[size]
            stored += math.prod(outer) * -(-rows // tile) * tile * -(-lanes // 128) * 128 * size
            data += math.prod(slots.shape[1:]) * size
        result.append((kernel.debug_info.func_name, stored, data))  # the `name` given to `pallas_call`
    return result


def _train_size_kinds(platform: str) -> dict[str, dict]:
    """The attention variants `train --size` compares; cuDNN on GPUs only."""
    kinds = {"dense": {}, "dense (cudnn)": {"impl": "cudnn"}, "focal (t=0.4)": {"kind": "focal"},
             "focal learned": {"kind": "focal_learned"},
             "Focus hard top-1 (K=8, w=128, pallas)": {"kind": "focus", "impl": "pallas", "focus_topk": 1,
                                                       "focus_causal": True}}
    if platform != "gpu":
        del kinds["dense (cudnn)"]
    return kinds


def run_train_size(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``train --size S``: tokens/s and MFU of a Focal paper model's train step (bf16 compute, float32 parameters
    and AdamW state, one device), per attention kind, with the share of its matrix-product FLOPs in 16 bits. With
    ``--compile-for-h200`` (no device; in .venv-compile): instead of timings, the memory of the step compiled for an
    H200."""
    from flax import nnx

    from focal_jax.kernels.focus_sparse import target_platform
    from focal_jax.nn.llama import Llama, focal_config
    from focal_jax.train.metrics import mfu, peak_flops, train_flops_per_token
    from focal_jax.train.optimizer import OptimConfig
    from focal_jax.train.trainer import matmul_param_count

    bf16 = jax.numpy.bfloat16
    how = "compiled for an H200, no device" if args.compile_for_h200 else (
        f"median of {args.repeats} after one warm-up")
    _print_header(f"train step, {args.size} (bf16 compute, AdamW, B={args.batch}, T={args.seq_len}, {how})", argv)
    if args.compile_for_h200:
        from focal_jax.kernels import compile_only

        device, platform = compile_only.gpu_device(), "gpu"
    else:
        platform = jax.default_backend()
    rows, peak = [], peak_flops()
    for name, attn in _train_size_kinds(platform).items():
        _log(f"{args.size} {name} ...")
        config = focal_config(args.size, attn=attn, remat=args.remat)
        build = lambda: Llama(config, rngs=nnx.Rngs(0))
        model = nnx.eval_shape(build) if args.compile_for_h200 else build()  # shapes only when compiling
        step, step_args = _train_step_and_args(model, OptimConfig(), args.batch, args.seq_len, bf16)
        with target_platform(platform):  # the platform compiled for, if not this process's
            total, low = matmul_flops(step, *step_args)
        if args.compile_for_h200:
            memory = compile_only.compile_for(step, *step_args, device=device).memory_analysis()
            state = memory.argument_size_in_bytes + memory.output_size_in_bytes
            rows.append([args.size, name, f"{memory.temp_size_in_bytes / 2**30:.2f}", f"{state / 2**30:.2f}",
                         f"{total / 1e12:.1f}", f"{100 * low / total:.0f}%"])
            continue
        flops = train_flops_per_token(matmul_param_count(model), config.n_layers, args.seq_len, config.d_model)
        del model  # the step's arguments hold the parameters
        seconds = _step_seconds(step, step_args, args.repeats)
        del step_args
        tokens_per_s = args.batch * args.seq_len / seconds
        utilisation = mfu(tokens_per_s, flops, 1, peak)
        rows.append([args.size, name, _fmt_ms(seconds), f"{tokens_per_s:,.0f}",
                     "n/a (peak unknown)" if utilisation is None else f"{100 * utilisation:.1f}%",
                     f"{100 * low / total:.0f}%"])
    if args.compile_for_h200:
        print(_inputs.markdown_table(["model", "attention", "temporary memory (GiB)", "arguments + outputs (GiB)",
                                      "matmul TFLOP per step (XLA)", "of which 16-bit"], rows))
        print("\nMemory: XLA's buffer assignment for the H200 (141 GB); the arguments and outputs are the "
              "parameters, AdamW state and batch (the step does not donate them here). Matmul FLOPs: the step's "
              "traced products, outside the Pallas kernels and cuDNN's attention (which take bf16 operands with "
              "float32 accumulation).")
        return 0
    print(_inputs.markdown_table(["model", "attention", "step (ms)", "tokens/s", "MFU",
                                  "matmul FLOPs in 16-bit (XLA's; kernels apart)"], rows))
    return 0


def run_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``train`` subcommand: tokens/s of the train step, attention kinds side by side."""
    if args.size:
        return run_train_size(args, argv)
    from flax import nnx

    from focal_jax.nn.gpt2 import GPT2, GPT2Config
    from focal_jax.nn.llama import Llama, LlamaConfig
    from focal_jax.nn.retrofit import FocusConfig, retrofit
    from focal_jax.train.optimizer import OptimConfig

    _print_header(f"train step (float32, AdamW, median of {args.repeats} after one warm-up)", argv)
    quickstart = dict(vocab_size=2000, d_model=128, n_layers=4, n_heads=4, intermediate=344, qk_norm="head")
    kinds = {"dense": {"kind": "dense"}, "focal (t=0.4)": {"kind": "focal", "focal_t": 0.4},
             "focal learned": {"kind": "focal_learned"},
             "focus soft (K=8, w=32)": {"kind": "focus", "focus_groups": 8, "focus_window": 32}}
    rows, dense = [], None
    for name, attn in kinds.items():
        _log(f"quickstart {name} ...")
        model = Llama(LlamaConfig(**quickstart, attn=attn), rngs=nnx.Rngs(0))
        seconds = _train_step_seconds(model, OptimConfig(), 16, 128, args.repeats)
        dense = dense or seconds
        rows.append(["quickstart 1.3M, B=16, T=128", name, _fmt_ms(seconds), f"{16 * 128 / seconds:,.0f}",
                     _fmt_ratio(dense / seconds)])
    if not args.skip_124m:
        full = None
        for name in ("full training", "Focus retrofit, centroids only (K=4, d_g=16, w=128)"):
            _log(f"GPT-2 124M {name} ...")
            model = GPT2(GPT2Config(), rngs=nnx.Rngs(0))
            optim = OptimConfig()
            if full is not None:
                model = retrofit(model, FocusConfig(groups=4, dim=16, window=128))
                optim = OptimConfig(trainable="centroids")
            seconds = _train_step_seconds(model, optim, 1, 512, args.repeats)
            full = full or seconds
            rows.append(["GPT-2 124M, B=1, T=512", name, _fmt_ms(seconds), f"{512 / seconds:,.0f}",
                         _fmt_ratio(full / seconds)])
    print(_inputs.markdown_table(["model", "variant", "step (ms)", "tokens/s", "speed vs first row"], rows))
    return 0


def _balanced_membership(seq_len: int, groups: int, seed: int):
    """Top-1 membership with exactly T / K tokens per group, in random order: `[1, T, K]` bool."""
    import numpy as np

    group = np.random.default_rng(seed).permutation(np.arange(seq_len) % groups)
    return jax.numpy.asarray(group[None, :, None] == np.arange(groups))


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a length, a count of repeats, heads, ...)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _launch(text: str) -> tuple[int, int, int, int | None]:
    """'64:8:2' -> (block_size, num_warps, num_stages, None); '64:8:2:64' also sets the band's tiles
    (band_block_size; default min(32, block)). Warps: 1, 2, 4, 8 or 16 (Triton's); the others >= 1."""
    try:
        numbers = [int(x) for x in text.split(":")]
        if len(numbers) not in (3, 4) or min(numbers) < 1 or numbers[1] not in (1, 2, 4, 8, 16):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BLOCK:WARPS:STAGES[:BAND] such as 64:8:2 or 64:8:2:64 (integers "
                                         f">= 1, warps 1, 2, 4, 8 or 16), got {text!r}") from None
    return tuple(numbers) + (None,) * (4 - len(numbers))


def _launch_label(launch) -> str:
    """'64 : 8 : 2', with ' : band 64' when the launch sets the band's tiles."""
    block, warps, stages, band = launch
    return f"{block} : {warps} : {stages}" + ("" if band is None else f" : band {band}")


def run_kernel(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``kernel`` subcommand: dense (cuDNN) vs focal through the kernel vs decomposed vs the fused kernel."""
    from focal_jax.kernels.focus_sparse import (block_sizes, default_backend, dot_product_pallas,
                                                focus_sparse_pallas, plan)

    jnp = jax.numpy
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    _print_header(f"kernel (B=1, H={args.heads}, D={args.head_dim}, {jnp.dtype(dtype).name}, K={_inputs.N_GROUPS} "
                  f"balanced, w={_inputs.WINDOW}, top-1, repeats={args.repeats})", argv)
    rows, plan_rows = [], []
    scale = args.head_dim ** -0.5
    blocks = block_sizes(default_backend())
    make_plan = jax.jit(lambda m: jax.vmap(lambda m, s: plan(m, s, *blocks, max_groups=1))(
        m, jnp.zeros(m.shape[:2], jnp.int32)))
    for seq_len in args.lengths:
        _log(f"T={seq_len} ...")
        keys = jax.random.split(jax.random.key(args.seed), 3)
        q, k, v = (jax.random.normal(key, (1, seq_len, args.heads, args.head_dim), dtype) for key in keys)
        membership = _balanced_membership(seq_len, _inputs.N_GROUPS, args.seed)
        allowed, causal = _inputs.count_focus_pairs(membership, _inputs.WINDOW)
        variants = {
            f"dense causal (jax.nn, {'cudnn' if on_gpu else 'xla'})": (lambda q, k, v, m: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, scale=scale, implementation="cudnn" if on_gpu else None), causal),
            "Focus decomposed": (lambda q, k, v, m: attention.focus_sparse_attention(
                q, k, v, m, window=_inputs.WINDOW, impl="decomposed", max_groups=1), allowed),
        }
        for launch in args.launch or [None]:
            block, warps, stages, band = launch or (None, None, None, None)
            label = "" if launch is None else f" ({block}, {warps} warps, {stages} stages" + (
                "" if band is None else f", band {band}") + ")"
            if band is None:  # dense attention has no band
                variants[f"focal t=0.4 through the kernel{label}"] = (lambda q, k, v, m, b=block, w=warps, s=stages: (
                    dot_product_pallas(q, k, v, multiplier=scale / _inputs.FOCAL_T, block_size=b, num_warps=w,
                                       num_stages=s)), causal)
            variants[f"Focus fused kernel{label}"] = (lambda q, k, v, m, b=block, w=warps, s=stages, bb=band: (
                focus_sparse_pallas(q, k, v, m, multiplier=scale, window=_inputs.WINDOW, block_size=b,
                                    band_block_size=bb, max_groups=1, num_warps=w, num_stages=s)), allowed)
        calls, names = [], []
        for name, (fn, pairs) in variants.items():  # the membership an argument: as a constant, XLA folds the plan
            calls += [(jax.jit(fn), (q, k, v, membership)), (jax.jit(_sum_grad(fn)), (q, k, v, membership))]
            names += [(name, "forward", pairs, 1.0), (name, "forward + backward", pairs, 3.5)]
        times = _inputs.interleaved_times(calls + [(make_plan, (membership,))], repeats=args.repeats, progress=_log)
        medians = [statistics.median(t) for t in times[:-1]]
        fused = medians[names.index(("Focus fused kernel", "forward", allowed, 1.0))] if not args.launch else None
        plan_rows.append([str(seq_len), _fmt_ms(statistics.median(times[-1])), _fmt_ms(fused),
                          _fmt_ratio(statistics.median(times[-1]) / fused) if fused else ""])
        for (name, direction, pairs, flop_factor), seconds in zip(names, medians):
            dense_seconds = medians[names.index((names[0][0], direction, causal, flop_factor))]
            theoretical = causal / pairs
            speedup = dense_seconds / seconds
            tflops = 4 * args.head_dim * args.heads * pairs * flop_factor / seconds / 1e12
            rows.append([str(seq_len), name, direction, _fmt_ms(seconds), _fmt_ratio(speedup),
                         _fmt_ratio(theoretical), _fmt_ratio(speedup / theoretical), f"{tflops:.3g}"])
    print(_inputs.markdown_table(["T", "variant", "pass", "time (ms)", "speedup vs dense", "theoretical (1/pairs)",
                                  "achieved / theoretical", "TFLOP/s on its pairs"], rows))
    print("\nThe fused kernel's plan alone (the sort by group, the per-block key ranges and ids: `kernels.focus_sparse."
          "plan`), part of each of its calls above:\n")
    print(_inputs.markdown_table(["T", "plan (ms)", "fused kernel forward (ms)", "plan / forward"], plan_rows))
    if not on_gpu:
        print("\nNot a GPU: the kernels ran in Pallas interpret mode; these times say nothing about their speed.")
    return 0


def _fused_pass_extra_blocks(group, window: int, block: int) -> int:
    """Blocks one fused pass over the (group, position)-sorted order would visit beyond set A's: for each query
    block, the blocks holding keys at positions `[first - window, last]` of its queries (of any group; each block
    once) that set A does not visit (from the start of the block's first group to the diagonal)."""
    import numpy as np

    t, groups = len(group), int(group.max()) + 1
    order = np.lexsort((np.arange(t), group))  # token of each sorted entry
    sorted_group = group[order]
    starts = np.searchsorted(sorted_group, np.arange(groups))
    ends = np.searchsorted(sorted_group, np.arange(groups), side="right")
    extra = 0
    for query_block, first in enumerate(range(0, t, block)):
        tokens = order[first:first + block]
        low, high = tokens.min() - window, tokens.max()
        visited = set()
        for g in range(groups):
            positions = order[starts[g]:ends[g]]
            lo = starts[g] + np.searchsorted(positions, low)
            hi = starts[g] + np.searchsorted(positions, high, side="right")
            visited.update(range(lo // block, (hi - 1) // block + 1) if hi > lo else ())
        set_a = range(starts[sorted_group[first]] // block, query_block + 1)
        extra += len(visited.difference(set_a))
    return extra


def run_plan(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``plan`` subcommand: visited block area of the kernels' plan vs the allowed pairs (no timing)."""
    import numpy as np

    from focal_jax.kernels import focus_sparse as ks

    block, band_block, window, groups = args.block_size, 32, _inputs.WINDOW, _inputs.N_GROUPS
    _print_header(f"block plan (K={groups} balanced random top-1, w={window}, set A blocks {block}, set B tiles "
                  f"{band_block})", argv)
    rows = []
    for seq_len in args.lengths:
        _log(f"T={seq_len} ...")
        membership = _balanced_membership(seq_len, groups, args.seed)
        allowed, causal = _inputs.count_focus_pairs(membership, window)
        p = ks.plan(membership[0], jax.numpy.zeros(seq_len, jax.numpy.int32), block, band_block, max_groups=1)
        first = np.asarray(p.first_key_block)
        a_blocks = int(np.sum(np.maximum(np.arange(len(first)) - first + 1, 0)))
        b_blocks = 0
        for query_block in range(-(-seq_len // band_block)):
            start, end = (int(x) for x in ks.band_key_blocks(query_block, window=window, block=band_block))
            b_blocks += end - start + 1
        split = a_blocks * block ** 2 + b_blocks * band_block ** 2
        group = np.argmax(np.asarray(membership[0]), axis=-1)
        fused = (a_blocks + _fused_pass_extra_blocks(group, window, block)) * block ** 2
        rows.append([f"{seq_len:,}", f"{allowed:,}", f"{split / allowed:.3f}", _fmt_ratio(causal / allowed),
                     _fmt_ratio(causal / split), f"{fused / allowed:.3f}", _fmt_ratio(causal / fused)])
    print(_inputs.markdown_table(
        ["T", "allowed pairs", "visited / allowed (two passes + merge)", "pair limit (causal / allowed)",
         "limit of the visited blocks", "visited / allowed (one fused pass)", "limit of one fused pass"], rows))
    return 0


def run_shard(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``shard`` subcommand: the compiled loss + gradients of the Pallas Focus kernel on a mesh, without and inside
    ``jax.set_mesh``: all-gathers, temporary memory and FLOPs per device (no timing)."""
    import math
    import re

    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    jnp = jax.numpy
    devices = math.prod(args.mesh)
    if jax.device_count() < devices:
        raise SystemExit(f"--mesh {' '.join(map(str, args.mesh))} needs {devices} devices, this process has "
                         f"{jax.device_count()} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={devices})")
    mesh = jax.make_mesh(tuple(args.mesh), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:devices])
    _print_header(f"Pallas kernel under a mesh (mesh {dict(mesh.shape)}, B={args.batch}, T={args.seq_len}, "
                  f"H={args.heads}, kv heads {args.kv_heads}, D={args.head_dim}, K={_inputs.N_GROUPS}, "
                  f"w={_inputs.WINDOW}, top-1; loss and gradients)", argv)
    keys = jax.random.split(jax.random.key(args.seed), 3)
    shapes = [(args.batch, args.seq_len, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    qkv = [jax.random.normal(key, shape, jnp.float32) for key, shape in zip(keys, shapes)]
    membership = jnp.concatenate([_balanced_membership(args.seq_len, _inputs.N_GROUPS, args.seed + i)
                                  for i in range(args.batch)])
    split = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None, "tensor"))
    qkv = [jax.device_put(x, split) for x in qkv]
    membership = jax.device_put(membership, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))

    def loss(q, k, v, membership):
        out = attention.focus_sparse_attention(q, k, v, membership, window=_inputs.WINDOW, impl="pallas")
        return jnp.sum(out * out)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    rows = []
    for name, context in (("no mesh context", None), ("inside jax.set_mesh", mesh)):
        _log(f"compiling: {name} ...")
        if context is None:
            compiled = step.lower(*qkv, membership).compile()
        else:
            with jax.set_mesh(context):
                compiled = step.lower(*qkv, membership).compile()
        gathers = len(re.findall(r"= \S+ all-gather(?:-start)?\(", compiled.as_text()))
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        flops = cost.get("flops") if cost else None
        rows.append([name, str(gathers), _fmt_mib(memory.temp_size_in_bytes / 2 ** 20 if memory else None),
                     "-" if flops is None else f"{flops / 1e6:.1f}"])
    print(_inputs.markdown_table(["call", "all-gathers in the compiled HLO", "temp memory per device (MiB)",
                                  "XLA FLOPs per device (M)"], rows))
    if jax.default_backend() == "cpu":
        print("\nCPU: the kernel is compiled in Pallas interpret mode; XLA's FLOP count is of that program, not of "
              "the GPU kernel.")
    return 0


COMPILE_HEADS, COMPILE_DIM = 16, 128  # the ``compile`` subcommand's heads and head_dim (the benchmark shape)


def run_compile(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``compile`` subcommand: the kernels compiled for an H200 and for TPUs, without either."""
    from focal_jax.kernels import compile_only

    _print_header(f"the kernels compiled for devices this machine does not have (bf16, H={COMPILE_HEADS}, "
                  f"D={COMPILE_DIM}, K={_inputs.N_GROUPS}, w={_inputs.WINDOW}, top-1; forward + backward)", argv)
    if compile_only.has_cuda_plugin():
        _compile_for_the_h200(args, compile_only.gpu_device())
    else:
        print("H200: skipped, jaxlib's CUDA plugin is not installed (make compile-check builds .venv-compile)\n")
    if compile_only.has_libtpu():
        _compile_for_tpus(args)
    else:
        print("TPUs: skipped, libtpu is not installed (make compile-check builds .venv-compile)")
    return 0


def _compile_inputs(seq_len: int):
    """q (= k = v) and membership shapes of the ``compile`` subcommand."""
    jnp = jax.numpy
    return (jax.ShapeDtypeStruct((1, seq_len, COMPILE_HEADS, COMPILE_DIM), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, seq_len, _inputs.N_GROUPS), jnp.bool_))


def _fused_grad(backend: str, launch=(None, None, None, None), max_groups: int | None = 1, per_query: bool = False):
    """Gradients of the fused kernel's `sum(out)` (top-1 Focus, w = 128) through `backend` at `launch` (`_launch`).
    `per_query`: the multiplier an array `[B, T, H]` computed from q, as a learned temperature is from the layer's
    input (its gradient flows back into q), instead of the number `1 / sqrt(D)`."""
    from focal_jax.kernels.focus_sparse import focus_sparse_pallas

    def multiplier(q):
        if not per_query:
            return COMPILE_DIM ** -0.5
        tau = 5.0 + 5.0 * jax.nn.sigmoid(q[..., 0].astype(jax.numpy.float32))  # in (5, 10), the paper's range
        return 1.0 / tau

    block, warps, stages, band = launch
    return _sum_grad(lambda q, k, v, m: focus_sparse_pallas(
        q, k, v, m, multiplier=multiplier(q), window=_inputs.WINDOW, backend=backend, block_size=block,
        band_block_size=band, max_groups=max_groups, num_warps=warps, num_stages=stages))


def _decomposed_grad():
    return _sum_grad(lambda q, k, v, m: attention.focus_sparse_attention(
        q, k, v, m, window=_inputs.WINDOW, impl="decomposed", max_groups=1))


def _temp_mib(fn, seq_len: int, device) -> tuple[str, str]:
    """`(temporary memory in MiB, GB that XLA's own ops outside the kernels read and write)` of `fn` compiled for
    `device` at `seq_len` (`compile_only.xla_traffic`), or `(the first line of the error, '')`."""
    from focal_jax.kernels import compile_only

    q, membership = _compile_inputs(seq_len)
    try:
        compiled = compile_only.compile_for(fn, q, q, q, membership, device=device)
    except Exception as error:  # the compiler's own message, e.g. the VMEM a kernel asked for
        return "does not compile: " + str(error).splitlines()[0][:100], ""
    temp = _fmt_mib(compiled.memory_analysis().temp_size_in_bytes / 2 ** 20)
    return temp, f"{compile_only.xla_traffic(compiled)[1] / 1e9:.2f}"


def _compile_for_the_h200(args: argparse.Namespace, device) -> None:
    """Per Triton kernel and launch: grid, threads, shared memory, registers, spills; then memory per length."""
    from focal_jax.kernels import compile_only
    from focal_jax.kernels.focus_sparse import triton_launch

    default = (64,) + triton_launch(jax.numpy.bfloat16) + (None,)
    q, membership = _compile_inputs(args.seq_len)
    rows = []
    for launch in [default] + [x for x in (args.launch or []) if x != default]:
        name = _launch_label(launch) + (" (default)" if launch == default else "")
        _log(f"H200: compiling T={args.seq_len}, launch {name} ...")
        try:
            kernels = compile_only.kernel_resources(_fused_grad("triton", launch), q, q, q, membership,
                                                    device=device)
        except Exception as error:  # XLA's own message, e.g. the shared memory a kernel asked for
            rows.append([name, "does not compile", str(error).splitlines()[0][:120], "", "", "", "", ""])
            continue
        for r in kernels:
            rows.append([name, r.name, "x".join(map(str, r.grid)), str(r.threads), f"{r.shared_memory / 1024:.0f}",
                         str(r.registers), f"{r.spill_stores} / {r.spill_loads}", r.matmul])
    print(f"H200 (Triton), T={args.seq_len:,}:\n")
    print(_inputs.markdown_table(["block : warps : stages", "kernel", "grid", "threads", "shared memory (KiB)",
                                  "registers / thread", "spill stores / loads (bytes / thread)", "tensor cores"],
                                 rows))
    print("\n'tensor cores': the MMA instructions in the kernel's PTX, Hopper's warpgroup `wgmma` (blocks of 64 rows "
          "or more) or the warp-level `mma.sync`.")
    variants = {"Focus decomposed": _decomposed_grad(), "Focus fused kernel": _fused_grad("triton"),
                "Focus fused kernel, max_groups=None (K * T entries)": _fused_grad("triton", max_groups=None),
                "Focus fused kernel, per-query temperature": _fused_grad("triton", per_query=True)}
    rows = []
    for seq_len in args.memory_lengths:
        _log(f"H200: compiling T={seq_len} (memory) ...")
        for name, fn in variants.items():
            temp, traffic = _temp_mib(fn, seq_len, device)
            rows.append([f"{seq_len:,}", name, temp, "(loops)" if name == "Focus decomposed" else traffic])
    print("\n" + _inputs.markdown_table(["T", "forward + backward", "temp memory on the H200 (MiB)",
                                          "GB read + written by XLA's ops around the kernels"], rows) + "\n")
    print("The last column sums the operands and results of the compiled program's top-level XLA ops (the kernels "
          "apart): a floor on their memory traffic, at the H200's 4.8 TB/s about 0.21 ms per GB. A loop counts "
          "once, so the decomposed path (XLA loops) has no figure.\n")


def _compile_for_tpus(args: argparse.Namespace) -> None:
    """Per Mosaic kernel the bytes one walked step copies; per TPU generation and length the temporary memory of
    the decomposed path and of the Mosaic kernels."""
    from focal_jax.kernels import compile_only

    q, membership = _compile_inputs(args.seq_len)
    steps = walked_step_bytes(_fused_grad("mosaic"), q, q, q, membership)
    print("TPUs (Mosaic, default blocks of 128): what one step of each kernel's walk copies into VMEM (KiB)\n")
    rows = [[name, f"{stored / 1024:.1f}", f"{data / 1024:.1f}"] for name, stored, data in steps]
    print(_inputs.markdown_table(["kernel", "as the (8, 128) tiles store it", "data"], rows))
    print()
    rows = []
    for topology in args.tpus:
        device = compile_only.tpu_device(topology)
        for seq_len in args.memory_lengths:
            _log(f"{topology}: compiling T={seq_len} ...")
            rows.append([topology, f"{seq_len:,}", _temp_mib(_decomposed_grad(), seq_len, device)[0],
                         *_temp_mib(_fused_grad("mosaic"), seq_len, device)])
    print("TPUs (Mosaic, default blocks of 128): temporary memory (MiB) of the forward + backward\n")
    print(_inputs.markdown_table(["TPU", "T", "Focus decomposed", "Focus fused kernel",
                                  "fused: GB read + written by XLA's ops around the kernels"], rows))


def run_sinkhorn(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``sinkhorn`` subcommand: the routing's balancing, unrolled vs as a ``lax.scan``: trace, compile, call times."""
    import numpy as np

    from focal_jax.attention import sinkhorn

    _print_header(f"Sinkhorn: unrolled iterations vs lax.scan, forward + backward (B={args.batch}, "
                  f"K={args.groups}, float32)", argv)
    rows = []
    for seq_len in args.lengths:
        rng = np.random.default_rng(args.seed)
        scores = jax.numpy.asarray(rng.normal(size=(args.batch, seq_len, args.groups)) / 0.1, jax.numpy.float32)
        weights = jax.numpy.asarray(rng.normal(size=(args.groups,)), jax.numpy.float32)
        segment_ids = jax.numpy.asarray(np.sort(rng.integers(0, args.documents, (args.batch, seq_len)), axis=1))
        for segments in (None, segment_ids):
            for causal in (False, True):
                measured = {}
                for unroll in (True, False):
                    _log(f"T={seq_len} segments={segments is not None} causal={causal} unroll={unroll} ...")
                    loss = lambda s, ids: jax.numpy.sum(sinkhorn(s, segment_ids=ids, causal=causal,
                                                                 unroll=unroll) * weights)
                    start = time.perf_counter()
                    lowered = jax.jit(jax.value_and_grad(loss)).lower(scores, segments)
                    lowered_at = time.perf_counter()
                    compiled = lowered.compile()
                    compiled_at = time.perf_counter()
                    times = []
                    for _ in range(args.repeats + 1):
                        call = time.perf_counter()
                        jax.block_until_ready(compiled(scores, segments))
                        times.append(time.perf_counter() - call)
                    measured[unroll] = (lowered_at - start, compiled_at - lowered_at, statistics.median(times[1:]))
                for unroll, (lower_s, compile_s, call_s) in measured.items():
                    rows.append([f"{seq_len:,}", f"{args.documents} per row" if segments is not None else "none",
                                 "yes" if causal else "no", "unrolled" if unroll else "lax.scan", f"{lower_s:.2f}",
                                 f"{compile_s:.2f}", _fmt_ms(call_s),
                                 _fmt_ratio(compile_s / measured[True][1]), _fmt_ratio(call_s / measured[True][2])])
    print(_inputs.markdown_table(["T", "segments", "causal", "iterations", "trace + lower (s)", "compile (s)",
                                  "call (ms)", "compile vs unrolled", "call vs unrolled"], rows))
    return 0


def _write_checkpoint(directory: str, args: argparse.Namespace) -> str:
    """A random LLaMA of the ``load`` arguments' size written by ``to_hf`` in ``args.dtype``; returns `directory`."""
    from flax import nnx

    from focal_jax.convert.hf import to_hf
    from focal_jax.nn.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers,
                         n_heads=max(1, args.d_model // 128), intermediate=args.d_model * 8 // 3 // 64 * 64)
    model = Llama(config, rngs=nnx.Rngs(args.seed))
    dtype = jax.numpy.dtype(args.dtype)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model)))
    to_hf(model, directory)
    return directory


def run_load(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``load`` subcommand: a Hugging Face directory read by the safetensors package vs ``from_hf`` whole vs
    ``from_hf`` onto a mesh of every device."""
    import tempfile

    import numpy as np
    from flax import nnx
    from safetensors import safe_open

    from focal_jax.convert.hf import LOADERS, _Tensors, from_hf, read_hf_config
    from focal_jax.convert.safetensors_io import StoredTensors, TensorsInMemory, safetensors_files
    from focal_jax.train.sharding import make_mesh, param_sharding

    dtype = jax.numpy.dtype(args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if args.dir is None:
            _log(f"writing a random LLaMA (d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}) ...")
        directory = args.dir or _write_checkpoint(tmp, args)
        stored_mib = StoredTensors(directory).nbytes / 2**20

        def package_read():  # from_hf as it was: every tensor read whole by the flax reader, then assigned
            tensors = {}
            for path in safetensors_files(directory):
                with safe_open(path, framework="flax") as f:
                    tensors.update((name, np.asarray(f.get_tensor(name))) for name in f.keys())
            hf_config = read_hf_config(directory)
            model = LOADERS[hf_config["model_type"]](hf_config, _Tensors(TensorsInMemory(tensors, directory)), dtype)
            jax.block_until_ready(nnx.state(model))
            return sum(x.nbytes for x in tensors.values())

        def load(sharding):
            lines = []
            model = from_hf(directory, dtype=dtype, sharding=sharding, progress=lines.append)
            jax.block_until_ready(nnx.state(model))
            return float(lines[0].split(" MiB")[0].removeprefix("read ").replace(",", "")) * 2**20

        n = jax.device_count()
        variants = [("from_hf before 0.6.27: all read by the safetensors package (flax)", package_read),
                    ("from_hf, whole on the default device", lambda: load(None))]
        if n > 1:
            mesh = make_mesh({"fsdp": n})
            variants.append((f"from_hf onto a mesh of {n} devices (fsdp={n})", lambda: load(param_sharding(mesh))))
        _print_header(f"Reading a Hugging Face directory: {stored_mib:,.0f} MiB of tensors, read as {dtype.name}",
                      argv)
        rows, base = [], None
        for name, fn in variants:
            times = []
            for _ in range(args.repeats + 1):  # the first read warms the page cache
                _log(f"{name} ...")
                start = time.perf_counter()
                read = fn()
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times[1:])
            base = base or seconds
            rows.append([name, f"{seconds:.2f}", _fmt_ratio(seconds / base), f"{read / 2**20:,.0f}"])
    print(_inputs.markdown_table(["variant", "time (s)", "vs before 0.6.27", "MiB read (copied out)"], rows))
    return 0


def run_init(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``init`` subcommand: a Focal paper model drawn from scratch onto a mesh of every device (fsdp), as the trainer
    drew it before 0.6.29 (op by op in host memory, then placed) vs ``drawn_on_mesh`` (one jitted draw straight into
    the shardings, compiled afresh at each call, as a run does once)."""
    from flax import nnx

    from focal_jax.nn.llama import Llama, focal_config
    from focal_jax.train.sharding import _jitted_draw, drawn_on_mesh, make_mesh, place_model
    from focal_jax.train.trainer import host_device

    config = focal_config(args.size)
    n = jax.device_count()
    mesh = make_mesh({"fsdp": n})

    def host_then_placed():
        with jax.default_device(host_device()):
            model = Llama(config, rngs=nnx.Rngs(args.seed))
        return place_model(model, mesh)

    def jitted():
        _jitted_draw.cache_clear()  # as a run: compiled once, at its start
        return drawn_on_mesh(Llama, config, args.seed, mesh)

    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))))
    _print_header(f"Drawing the {args.size} model from scratch ({n_params / 1e6:,.0f}M parameters) onto {n} "
                  f"device(s), fsdp={n}", argv)
    rows, base = [], None
    for name, fn in (("op by op in host memory, then placed (before 0.6.29)", host_then_placed),
                     ("drawn_on_mesh: one jitted draw into the shardings", jitted)):
        times = []
        for _ in range(args.repeats + 1):
            _log(f"{name} ...")
            start = time.perf_counter()
            jax.block_until_ready(nnx.state(fn()))
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times[1:])
        base = base or seconds
        rows.append([name, f"{times[0]:.2f}", f"{seconds:.2f}", _fmt_ratio(seconds / base)])
    print(_inputs.markdown_table(["variant", "first call (s)", "later calls (s, median)", "vs before 0.6.29"], rows))
    return 0


def _sum_grad(fn):
    """`fn(q, k, v, *rest)` -> gradients of `sum(out)` (in float32) with respect to q, k, v."""
    return jax.grad(lambda *args: jax.numpy.sum(fn(*args).astype(jax.numpy.float32)), argnums=(0, 1, 2))


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per benchmark (``attention``, ``train``, ``kernel``, ``plan``, ``compile``,
    ``sinkhorn``, ``shard``, ``load``, ``init``)."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="benchmark", required=True)
    attn = sub.add_parser("attention", help="dense vs Focal vs Focus soft vs Focus decomposed, plus routing")
    attn.add_argument("--lengths", type=_positive_int, nargs="+", default=[2048, 4096, 8192], help="sequence lengths T")
    attn.add_argument("--repeats", type=_positive_int, default=7, help="timing rounds (median), after one warm-up")
    attn.add_argument("--budget-s", type=float, default=240.0,
                      help="per length: stop after 3 rounds once the timed rounds took this many seconds")
    attn.add_argument("--block-size", type=_positive_int, default=None,
                      help="block size of impl='decomposed' (default: its own)")
    attn.add_argument("--skip-soft-above", type=int, default=8192,
                      help="run Focus soft (dense O(T^2) with the gate) only for T <= this")
    attn.add_argument("--heads", type=_positive_int, default=8, help="attention heads (head_dim 64)")
    attn.add_argument("--sinks", type=_positive_int, nargs="+", default=list(SINKS),
                      help="attention sinks of the top-1 sink rows (each without and with segment ids)")
    attn.add_argument("--backward", action="store_true",
                      help="time forward + backward (the gradients of sum(out)) instead of the forward")
    attn.add_argument("--seed", type=int, default=0)
    attn.set_defaults(run=run_attention)
    train = sub.add_parser("train", help="tokens/s of the train step: quickstart model per attention kind, GPT-2 124M")
    train.add_argument("--repeats", type=_positive_int, default=5, help="timed steps (median), after one warm-up")
    train.add_argument("--skip-124m", action="store_true", help="only the quickstart model")
    train.add_argument("--size", default=None, help="instead: a Focal paper size (e.g. 400M), MFU on one device")
    train.add_argument("--batch", type=_positive_int, default=None, help="with --size: sequences per step (8)")
    train.add_argument("--seq-len", type=_positive_int, default=None, help="with --size: tokens per sequence (2048)")
    train.add_argument("--remat", action="store_true", help="with --size: rematerialise each block")
    train.add_argument("--compile-for-h200", action="store_true",
                       help="with --size: no timing, the step's memory compiled for an H200 (in .venv-compile)")
    train.set_defaults(run=run_train)
    kernel = sub.add_parser("kernel", help="dense (cuDNN) vs focal through the kernel vs decomposed vs fused kernel")
    kernel.add_argument("--lengths", type=_positive_int, nargs="+", default=[4096, 16384, 32768, 65536])
    kernel.add_argument("--heads", type=_positive_int, default=16)
    kernel.add_argument("--head-dim", type=_positive_int, default=128)
    kernel.add_argument("--repeats", type=_positive_int, default=5)
    kernel.add_argument("--seed", type=int, default=0)
    kernel.add_argument("--launch", type=_launch, nargs="+", default=None, metavar="BLOCK:WARPS:STAGES[:BAND]",
                        help="Triton launches of the kernel rows to compare (default: the library's own); BAND: "
                             "the band's tiles (default min(32, BLOCK))")
    kernel.set_defaults(run=run_kernel)
    plan = sub.add_parser("plan", help="visited block area of the kernels' plan vs allowed pairs (no timing)")
    plan.add_argument("--lengths", type=_positive_int, nargs="+", default=[4096, 16384, 32768, 65536])
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--block-size", type=_positive_int, default=64, help="set A's blocks (the GPU default is 64)")
    plan.set_defaults(run=run_plan)
    comp = sub.add_parser("compile", help="the kernels compiled for an H200 and TPUs without them (no timing)")
    comp.add_argument("--seq-len", type=_positive_int, default=16384)
    comp.add_argument("--launch", type=_launch, nargs="+", default=None, metavar="BLOCK:WARPS:STAGES[:BAND]",
                      help="Triton launches to compare with the default; BAND: the band's tiles (default min(32, "
                           "BLOCK))")
    comp.add_argument("--memory-lengths", type=_positive_int, nargs="*", default=[4096, 16384, 32768, 65536])
    comp.add_argument("--tpus", nargs="*", default=["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2"],
                      help="TPU topologies to compile for (generation:shape)")
    comp.set_defaults(run=run_compile)
    sink = sub.add_parser("sinkhorn", help="Sinkhorn's iterations unrolled vs lax.scan: compile and call time")
    sink.add_argument("--lengths", type=_positive_int, nargs="+", default=[2048])
    sink.add_argument("--batch", type=_positive_int, default=4)
    sink.add_argument("--groups", type=_positive_int, default=8)
    sink.add_argument("--documents", type=_positive_int, default=4, help="segments per row, for the packed rows")
    sink.add_argument("--repeats", type=_positive_int, default=20)
    sink.add_argument("--seed", type=int, default=0)
    sink.set_defaults(run=run_sinkhorn)
    shard = sub.add_parser("shard", help="the Pallas kernel on a mesh without / inside jax.set_mesh (no timing)")
    shard.add_argument("--mesh", type=_positive_int, nargs=3, default=[2, 2, 2], metavar=("DATA", "FSDP", "TENSOR"))
    shard.add_argument("--batch", type=_positive_int, default=8)
    shard.add_argument("--seq-len", type=_positive_int, default=256)
    shard.add_argument("--heads", type=_positive_int, default=8)
    shard.add_argument("--kv-heads", type=_positive_int, default=4)
    shard.add_argument("--head-dim", type=_positive_int, default=64)
    shard.add_argument("--seed", type=int, default=0)
    shard.set_defaults(run=run_shard)
    load = sub.add_parser("load", help="a Hugging Face directory read: safetensors vs from_hf vs from_hf on a mesh")
    load.add_argument("--dir", default=None, help="a Hugging Face directory (default: a random LLaMA, below)")
    load.add_argument("--d-model", type=_positive_int, default=1024)
    load.add_argument("--layers", type=_positive_int, default=8)
    load.add_argument("--vocab", type=_positive_int, default=32000)
    load.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                      help="the stored and loaded dtype")
    load.add_argument("--repeats", type=_positive_int, default=3, help="timed reads (median), after one warm-up")
    load.add_argument("--seed", type=int, default=0)
    load.set_defaults(run=run_load)
    init = sub.add_parser("init", help="a model drawn from scratch: op by op on the host vs jitted onto the mesh")
    init.add_argument("--size", default="400M", help="a Focal paper size (default 400M)")
    init.add_argument("--repeats", type=_positive_int, default=2, help="timed calls after the first (median)")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(run=run_init)
    return parser


def _check_train_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``train``: ``--size`` one of the Focal paper's sizes, and the options that only ``--size`` reads not given
    without it (they would be ignored); fills in ``--batch`` and ``--seq-len``'s defaults."""
    from focal_jax.nn.llama import FOCAL_SIZES

    if args.size is None:
        given = [f"--{name.replace('_', '-')}" for name in ("batch", "seq_len", "remat", "compile_for_h200")
                 if getattr(args, name) not in (None, False)]
        if given:
            parser.error(f"train: {', '.join(given)} needs --size (the Focal paper model's step); without it, ignored")
    elif args.size not in FOCAL_SIZES:
        parser.error(f"train: --size must be one of {', '.join(FOCAL_SIZES)}, got --size={args.size!r}")
    args.batch = 8 if args.batch is None else args.batch
    args.seq_len = 2048 if args.seq_len is None else args.seq_len


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.benchmark == "train":
        _check_train_args(parser, args)
    for name in ("lengths", "memory_lengths", "launch"):
        values = getattr(args, name, None) or []
        if len(set(values)) < len(values):  # a row or a column per value: a repeat would overwrite one
            parser.error(f"{args.benchmark}: --{name.replace('_', '-')} must be distinct, got {values}")
    if args.benchmark == "shard" and args.heads % args.kv_heads:
        parser.error(f"shard: --kv-heads={args.kv_heads} must divide --heads={args.heads} (grouped-query attention)")
    return args.run(args, argv)


if __name__ == "__main__":
    sys.exit(main())
