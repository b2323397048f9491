"""An lm-evaluation-harness (`lm_eval`) adapter for focal_jax models: `FocalJaxLM`.

`FocalJaxLM(model, tokenizer)` wraps a focal_jax `Llama` or `GPT2` and its tokenizer (`focal_jax.data.tokenizer`:
SentencePiece or Hugging Face tokenizer.json); `FocalJaxLM.from_workdir(DIR)` loads a training run's model and
tokenizer. It answers the three request kinds of the harness:

- `loglikelihood`: sum of log p(continuation | context) and whether the continuation is the greedy one. Pairs are
  tokenized as lm_eval's Hugging Face model does (trailing spaces of the context move to the continuation; the
  whole text is encoded and the continuation tokens are those past the context's own encoding), contexts are
  left-truncated to `max_length`, and requests are batched by length. Each request is one row, right-padded with
  segment id 0 (the row's tokens are segment 1, positions 0..n-1), so padding is invisible to attention, to the
  Sinkhorn column sums and to the learned-temperature means: a request scores the same alone or in any batch.
- `loglikelihood_rolling`: a document's total log-likelihood over lm_eval's disjoint rolling windows of
  `max_length` tokens (`lm_eval.utils.get_rolling_token_windows`), the first conditioned on the bos token (the
  eos for a tokenizer without bos, as training started documents).
- `generate_until`: greedy decoding (`focal_jax.eval.decode.greedy_decode`: a KV cache where every layer can
  decode with one, the full forward per step otherwise), stopped at the first stop string or after
  `max_gen_toks` tokens; the text is cut before the stop string.

Importing this module registers the model name 'focal_jax' with lm_eval (`model_args='workdir=DIR,batch_size=8'`).
Command line (prints the results table, writes them as JSON with `--output`):

  python -m focal_jax.eval.harness --workdir /tmp/run --tasks arc_easy,piqa --num_fewshot 0 --output res.json

How to run the papers' tasks: `focal_jax/eval/HARNESS.md`.
"""

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ModuleNotFoundError as error:
    if error.name != "lm_eval":
        raise
    raise ModuleNotFoundError("focal_jax.eval.harness is the lm-evaluation-harness adapter and needs it: "
                              "pip install 'focal_jax[eval]' (or pip install lm_eval)", name="lm_eval") from None
from tqdm import tqdm

from focal_jax._axes import split_rows
from focal_jax._validation import check_int, output_file_error
from focal_jax.data.tokenizer import load_tokenizer, tokenizer_file, workdir_tokenizer
from focal_jax.eval._cli import MESH_HELP, evaluation_mesh, mesh_shape, on_mesh, positive_int
from focal_jax.eval.decode import greedy_decode
from focal_jax.nn.gpt2 import GPT2
from focal_jax.nn.models import check_model

DEFAULT_MAX_LENGTH = 2048  # for a Llama without a run config (as lm_eval's Hugging Face model)
MIN_BUCKET = 16  # shortest padded row length; rows are padded to powers of two so few shapes compile


def score_window(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """The model input and targets that score `continuation` after `context` (token lists) in at most `max_length`
    positions: `(inputs [n], targets [n])`, n = min(len(context) + len(continuation) - 1, max_length), the last
    `len(continuation)` targets being the continuation. Context tokens beyond the window are dropped from the left.
    """
    if not continuation:
        raise ValueError("continuation must hold at least one token, got an empty continuation")
    if not context:
        raise ValueError("context must hold at least one token (the bos / prefix token for an empty context)")
    if len(continuation) > max_length:
        raise ValueError(f"a continuation of {len(continuation)} tokens does not fit max_length={max_length}")
    window = (list(context) + list(continuation))[-(max_length + 1):]
    return window[:-1], window[1:]


def padded_length(n: int, max_length: int) -> int:
    """Row length for a batch whose longest row has `n` tokens: the next power of two >= max(n, 16), at most
    `max_length` (so that few shapes compile)."""
    return min(max(MIN_BUCKET, 1 << (n - 1).bit_length()), max(max_length, n))


def pack_rows(rows: list[tuple[list[int], list[int], int]], length: int, batch_size: int) -> dict[str, np.ndarray]:
    """One request per row, right-padded to `length`, with `batch_size - len(rows)` all-padding rows.

    rows: `(inputs, targets, n_scored)` each; the last `n_scored` targets are scored.
    Returns int32 `inputs`, `targets`, `positions` (0..n-1, 0 on padding), `segment_ids` (1 on tokens, 0 on
    padding) and float32 `score_mask` (1 on the scored targets), each `[batch_size, length]`.
    """
    if len(rows) > batch_size:
        raise ValueError(f"{len(rows)} rows do not fit batch_size={batch_size}")
    shape = (batch_size, length)
    out = {key: np.zeros(shape, np.int32) for key in ("inputs", "targets", "positions", "segment_ids")}
    out["score_mask"] = np.zeros(shape, np.float32)
    for i, (inputs, targets, n_scored) in enumerate(rows):
        n = len(inputs)
        if n > length or len(targets) != n or not 0 < n_scored <= n:
            raise ValueError(f"row {i}: {n} inputs, {len(targets)} targets, {n_scored} scored do not fit length "
                             f"{length}")
        out["inputs"][i, :n] = inputs
        out["targets"][i, :n] = targets
        out["positions"][i, :n] = np.arange(n)
        out["segment_ids"][i, :n] = 1
        out["score_mask"][i, n - n_scored:n] = 1.0
    return out


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score_batch(graphdef, state, batch):
    """Per row: sum of log p(target) over the scored positions, and whether every scored target is the argmax."""
    model = nnx.merge(graphdef, state)
    batch = jax.tree.map(split_rows, batch)  # (under a mesh with data / fsdp axes: data-parallel scoring)
    logits = model(batch["inputs"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_logp = jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    scored = batch["score_mask"] > 0
    greedy = jnp.argmax(logits, axis=-1) == batch["targets"]
    return jnp.sum(jnp.where(scored, target_logp, 0.0), axis=1), jnp.all(greedy | ~scored, axis=1)


def generation_settings(gen_kwargs: dict, default_max_gen_toks: int) -> tuple[list[str], int]:
    """`(until, max_gen_toks)` of an lm_eval `generate_until` request's `gen_kwargs`.

    `until` (a string or a list of strings) defaults to none; `max_gen_toks` to `default_max_gen_toks`. Sampling
    (`do_sample=True` or `temperature > 0`) raises ValueError: the adapter decodes greedily. Other keys (top_p,
    top_k, ...) only shape sampling and are ignored.
    """
    if not isinstance(gen_kwargs, dict):
        raise ValueError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}: {gen_kwargs!r}")
    if gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature") or 0.0) > 0:
        raise ValueError(f"FocalJaxLM decodes greedily only; got do_sample={gen_kwargs.get('do_sample')!r}, "
                         f"temperature={gen_kwargs.get('temperature')!r}")
    until = gen_kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    if not all(isinstance(s, str) and s for s in until):
        raise ValueError(f"until must be a non-empty string or a list of them, got until={gen_kwargs['until']!r}")
    max_gen_toks = check_int("max_gen_toks", gen_kwargs.get("max_gen_toks", default_max_gen_toks), 1)
    return until, max_gen_toks


def cut_at_stop(text: str, until: list[str]) -> str:
    """`text` up to (not including) the earliest occurrence of any string of `until`; all of it if none occurs."""
    ends = [text.find(s) for s in until if s in text]
    return text[:min(ends)] if ends else text


@register_model("focal_jax")
class FocalJaxLM(TemplateLM):
    """lm_eval language model over a focal_jax `Llama` / `GPT2` and its `Tokenizer`.

    Args:
      model: the focal_jax model (its parameters are read at each call, so later in-place updates are seen).
      tokenizer: a `focal_jax.data.tokenizer.Tokenizer` (or any object with `encode(str) -> list[int]`,
        `decode(ids) -> str`, `bos_id`, `eos_id`, `vocab_size`, `path`).
      batch_size: rows per forward pass (integer >= 1).
      max_length: tokens per row (the model's context for scoring; prompt plus generated tokens for generation).
        None: GPT-2's `n_positions`, else 2048.
      max_gen_toks: default number of generated tokens when a request does not set `max_gen_toks`.
      add_bos_token: whether encoded contexts and generation prompts start with the document-start token: bos, or
        eos when the tokenizer has none (`prefix_token_id`; focal_jax runs train documents as
        `[bos or eos, ..., eos]`).
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool = True):
        super().__init__()
        check_model(model)
        missing = [a for a in ("encode", "decode", "bos_id", "eos_id", "vocab_size") if not hasattr(tokenizer, a)]
        if missing:
            raise ValueError(f"tokenizer must be a focal_jax Tokenizer; {type(tokenizer).__name__} lacks {missing}")
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer's vocab_size={tokenizer.vocab_size} exceeds the model's "
                             f"vocab_size={model.config.vocab_size}")
        if tokenizer.eos_id is None or tokenizer.eos_id < 0:
            raise ValueError(f"the tokenizer has no eos token (eos_id={tokenizer.eos_id!r})")
        if not isinstance(add_bos_token, bool):
            raise ValueError(f"add_bos_token must be a bool, got add_bos_token={add_bos_token!r}")
        n_positions = model.config.n_positions if isinstance(model, GPT2) else None
        if max_length is None:
            max_length = n_positions or DEFAULT_MAX_LENGTH
        check_int("max_length", max_length, 2)
        if n_positions is not None and max_length > n_positions:
            raise ValueError(f"max_length={max_length} exceeds the model's n_positions={n_positions}")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = check_int("batch_size", batch_size, 1)
        self._max_length = int(max_length)
        self._max_gen_toks = check_int("max_gen_toks", max_gen_toks, 1)
        self.add_bos_token = add_bos_token

    @classmethod
    def from_workdir(cls, workdir: str, *, step: int | None = None, mesh=None, **kwargs) -> "FocalJaxLM":
        """The model of a focal_jax run directory (latest checkpoint, or checkpoint `step`;
        `focal_jax.train.trainer.load_model`, its parameters placed on `mesh` when given: evaluate under
        `jax.set_mesh(mesh)`) and the tokenizer it was trained with (its workdir copy:
        `focal_jax.data.tokenizer.workdir_tokenizer`). `max_length` defaults to the run's `data.seq_len`; other
        keyword arguments as the constructor."""
        from focal_jax.train import checkpoint, trainer  # the training stack only when loading a run

        workdir = os.path.abspath(os.path.expanduser(workdir))
        tokenizer = workdir_tokenizer(workdir)  # FileNotFoundError naming the files when there is none
        _, meta = checkpoint.read_meta(workdir)
        if kwargs.get("max_length") is None:
            kwargs["max_length"] = meta["config"]["data"]["seq_len"]
        return cls(trainer.load_model(workdir, step=step, mesh=mesh), tokenizer, **kwargs)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "FocalJaxLM":
        """lm_eval's constructor from `model_args`: `workdir` (required), `step`, `batch_size`, `max_length`,
        `max_gen_toks` (integers, also as strings). `device` and `max_batch_size` are ignored (JAX places arrays)."""
        args = {**arg_dict, **{k: v for k, v in (additional_config or {}).items() if v is not None}}
        args.pop("device", None)
        args.pop("max_batch_size", None)
        workdir = args.pop("workdir", None)
        if not workdir:
            raise ValueError(f"model_args must give workdir=DIR (a focal_jax run directory), got {arg_dict!r}")
        unknown = set(args) - {"step", "batch_size", "max_length", "max_gen_toks"}
        if unknown:
            raise ValueError(f"unknown model_args {sorted(unknown)}; expected workdir, step, batch_size, max_length, "
                             f"max_gen_toks")
        for key, value in args.items():
            if not str(value).isdigit():
                raise ValueError(f"model_args {key} must be a positive integer, got {key}={value!r}")
        return cls.from_workdir(str(workdir), **{k: int(v) for k, v in args.items()})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "FocalJaxLM":
        """lm_eval's constructor from `'workdir=DIR,batch_size=8'` (see `create_from_arg_obj`)."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # ------------------------------------------------------------------ tokenization (lm_eval's TemplateLM hooks)
    @property
    def eot_token_id(self) -> int:
        """The tokenizer's eos id: generation stops at it."""
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context and the first rolling window condition on: bos, or eos without one."""
        bos = self.tokenizer.bos_id
        return bos if bos is not None and bos >= 0 else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        """Tokens per row: scoring windows, and prompt plus generated tokens."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        """Generated tokens when a request does not say."""
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's file (keys lm_eval's request caches)."""
        return str(getattr(self.tokenizer, "path", type(self.tokenizer).__name__))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """`string` -> token ids, led by `prefix_token_id` (bos, or eos without one) when `add_special_tokens`
        (None: the `add_bos_token` setting)."""
        add_bos = self.add_bos_token if add_special_tokens is None else add_special_tokens and self.add_bos_token
        return ([self.prefix_token_id] if add_bos else []) + list(self.tokenizer.encode(string))

    def tok_decode(self, tokens: list[int]) -> str:
        """Token ids `[n]` -> text (bos / eos / pad dropped)."""
        return self.tokenizer.decode(tokens)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """`(log p(continuation | context), is_greedy)` for each `(key, context_tokens, continuation_tokens)`,
        in order. Rows are sorted by length (longest first) and scored `batch_size` at a time."""
        windows = []
        for _, context, continuation in requests:
            inputs, targets = score_window(context, continuation, self.max_length)
            windows.append((inputs, targets, len(continuation)))
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        graphdef, state = nnx.split(self.model)
        results = [None] * len(windows)
        with tqdm(total=len(windows), desc="focal_jax loglikelihood", disable=disable_tqdm) as progress:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                rows = [windows[i] for i in chunk]
                batch = pack_rows(rows, padded_length(len(rows[0][0]), self.max_length), self.batch_size)
                logprob, greedy = jax.device_get(_score_batch(graphdef, state, batch))
                for row, i in enumerate(chunk):
                    results[i] = (float(logprob[row]), bool(greedy[row]))
                    key = requests[i][0]
                    if key is not None:
                        self.cache_hook.add_partial("loglikelihood", key, results[i])
                progress.update(len(chunk))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's (`request.args == (text,)`) total log-likelihood: lm_eval's disjoint rolling windows of
        `max_length` tokens, the first conditioned on `prefix_token_id`, every token predicted exactly once."""
        owners, windows = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            tokens = self.tok_encode(text, add_special_tokens=False)
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                owners.append(index)
                windows.append((None, context, continuation))
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[index] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each `request.args == (context, gen_kwargs)`: at most `max_gen_toks` tokens
        (default `self.max_gen_toks`), stopped at eos or once the text holds a stop string of `until`, and returned
        cut before that string. The prompt (bos + context) is left-truncated to `max_length - max_gen_toks`."""
        groups: dict[tuple, list[int]] = {}
        prompts = []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            until, max_gen_toks = generation_settings(gen_kwargs, self.max_gen_toks)
            room = self.max_length - max_gen_toks
            if room < 1:
                raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for a prompt in max_length="
                                 f"{self.max_length}")
            prompts.append(self.tok_encode(context)[-room:])
            groups.setdefault((tuple(until), max_gen_toks), []).append(index)
        texts = [None] * len(requests)
        with tqdm(total=len(requests), desc="focal_jax generate_until", disable=disable_tqdm) as progress:
            for (until, max_gen_toks), indices in groups.items():
                def stop(new_tokens, until=until):
                    text = self.tok_decode(new_tokens)
                    return any(s in text for s in until)

                outputs = greedy_decode(self.model, [prompts[i] for i in indices], max_new_tokens=max_gen_toks,
                                        eos_id=self.eot_token_id, stop=stop if until else None,
                                        batch_size=self.batch_size)
                for i, new_tokens in zip(indices, outputs):
                    texts[i] = cut_at_stop(self.tok_decode(new_tokens), list(until))
                    self.cache_hook.add_partial("generate_until", requests[i].args, texts[i])
                progress.update(len(indices))
        return texts


# ---------------------------------------------------------------------- command line
def unknown_tasks(tasks: list[str], registered: list[str]) -> str:
    """A message naming each of `tasks` that is neither a `registered` lm_eval name (task, group or tag) nor a task
    YAML file, with the registered names closest to it; '' when every one is known."""
    import difflib

    lines = []
    for task in tasks:
        if task not in registered and not os.path.isfile(os.path.expanduser(task)):
            close = difflib.get_close_matches(task, registered, n=3)
            lines.append(f"unknown lm_eval task {task!r}" + (f"; closest: {', '.join(close)}" if close else "")
                         + " (--include_path DIR adds a directory of task YAML files)")
    return "\n".join(lines)


def hf_model(directory: str, *, mesh=None):
    """The model of a Hugging Face directory (`focal_jax.convert.hf.from_hf`, float32); with a `mesh`, each
    parameter read straight onto the mesh as `focal_jax.train.trainer.load_model` places a run's
    (`focal_jax.train.sharding.param_sharding`), each process reading only its own shards."""
    from focal_jax.convert.hf import from_hf

    if mesh is None:
        return from_hf(directory)
    from focal_jax.train.sharding import param_sharding

    return from_hf(directory, sharding=param_sharding(mesh))


def main(argv=None) -> dict:
    """`python -m focal_jax.eval.harness (--workdir DIR [--step S] | --hf DIR) --tasks T1,T2 [--num_fewshot N]
    [--batch_size 8] [--max_length L] [--limit N] [--include_path DIR] [--mesh AXIS=N,...] [--output FILE]`: evaluate
    a focal_jax run (or a Hugging Face directory as loaded by `focal_jax.convert.hf.from_hf`, with its
    `tokenizer.model`, else its `tokenizer.json`, or `--tokenizer`) on lm_eval tasks, print the results table, and
    write the results (JSON)."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.eval.harness", description=main.__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a focal_jax run directory")
    source.add_argument("--hf", help="a Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--step", type=int, default=None, help="--workdir's checkpoint step (default: the latest)")
    parser.add_argument("--tokenizer", default=None, help="SentencePiece model or tokenizer.json for --hf "
                        "(default DIR/tokenizer.model, else DIR/tokenizer.json)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm_eval task names")
    parser.add_argument("--num_fewshot", type=int, default=None, help="default: each task's own")
    parser.add_argument("--batch_size", type=positive_int, default=8)
    parser.add_argument("--max_length", type=positive_int, default=None)
    parser.add_argument("--max_gen_toks", type=positive_int, default=256)
    parser.add_argument("--limit", type=float, default=None, help="examples per task (testing only)")
    parser.add_argument("--include_path", default=None, help="directory of extra task YAML files")
    parser.add_argument("--bootstrap_iters", type=int, default=100000, help="0 skips the standard errors")
    parser.add_argument("--mesh", type=mesh_shape, default=None, help=MESH_HELP)
    parser.add_argument("--output", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.output and (problem := output_file_error("--output", args.output, make_folder=False)):
        parser.error(problem)  # now, not after the evaluation
    mesh = evaluation_mesh(parser, args.mesh, rows=("--batch_size", args.batch_size))

    import lm_eval
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=args.include_path)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = unknown_tasks(tasks, task_manager.all_tasks)
    if unknown or not tasks:
        parser.error(unknown or f"--tasks names no task: {args.tasks!r}")
    options = dict(batch_size=args.batch_size, max_length=args.max_length, max_gen_toks=args.max_gen_toks)
    try:
        if args.workdir:
            lm = FocalJaxLM.from_workdir(args.workdir, step=args.step, mesh=mesh, **options)
        else:
            lm = FocalJaxLM(hf_model(args.hf, mesh=mesh), load_tokenizer(args.tokenizer or tokenizer_file(args.hf)),
                            **options)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(f"focal_jax: evaluating {type(lm.model).__name__} (max_length {lm.max_length}, batch {lm.batch_size}) "
          f"on {args.tasks}", flush=True)
    with on_mesh(mesh):
        results = lm_eval.simple_evaluate(
            model=lm, tasks=tasks, num_fewshot=args.num_fewshot,
            limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit,
            bootstrap_iters=args.bootstrap_iters, log_samples=False, task_manager=task_manager)
    print(lm_utils.make_table(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({k: results[k] for k in ("results", "versions", "n-shot", "config") if k in results}, f,
                      indent=2, default=str)
        print(f"focal_jax: results written to {args.output}")
    return results


if __name__ == "__main__":
    main()
