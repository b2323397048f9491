"""Greedy decoding of a batch of prompts of different lengths, for every attention kind.

`greedy_decode(model, prompts, max_new_tokens=..., eos_id=..., stop=...)` returns the new tokens of each prompt. Two
ways to run the model, chosen per model:

- **KV cache** (every layer passes `focal_jax.nn.attention.check_decodable`: dense, focal, focal_learned, hard Focus
  with causal routing): the cache of `focal_jax.nn.generate.init_cache`. Rows of one batch share the cache index, so
  no padding ever enters the cache: the common prefix is prefilled at once, then each step feeds every row its next
  token: a prompt token while the row is still reading its prompt, else the token it generated last.
- **Full forward** (soft Focus, non-causal routing: a token's groups depend on later tokens, so a cache is not
  defined; dynamic NTK RoPE: the base grows with the sequence, so cached keys would keep a stale one): each step
  re-runs the model over the whole buffer. Prompts are right-padded; the padding is a segment of its own
  (`segment_ids` 0, the sequence 1) at positions after the sequence, so causal attention never sees it, and
  Sinkhorn's column sums and the NTK base (taken per segment) leave it out: each row's logits are those of its
  prompt alone.

Lengths are padded to a few buckets (8, 10, 12, 14, 16, 20, 24, ...: four per octave) and the batch to `batch_size`
rows, so that jit compiles once per bucket, not once per prompt. Prompts are sorted by length before batching.
Greedy choices do not depend on the stopping rule, so stopping only cuts the output: `eos_id` is checked on the
device (a batch ends as soon as every row has emitted it), `stop` on the host after every chunk of 16 steps.
Under a mesh (`jax.set_mesh`) whose 'data' / 'fsdp' axes divide the batch, each batch's rows are split over them
(data-parallel decoding); the model's parameters stay where they are placed.

Example:
  >>> from flax import nnx
  >>> from focal_jax.nn.gpt2 import GPT2, GPT2Config
  >>> model = GPT2(GPT2Config(vocab_size=50, n_positions=32, d_model=32, n_layers=2, n_heads=4), rngs=nnx.Rngs(0))
  >>> [len(new) for new in greedy_decode(model, [[1, 2, 3], [4]], max_new_tokens=5)]
  [5, 5]
"""

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from focal_jax._axes import auto_mesh, onto_auto_mesh, split_rows
from focal_jax._validation import check_int
from focal_jax.nn.attention import check_decodable
from focal_jax.nn.generate import _bucket, _bucket_floor, init_cache
from focal_jax.nn.models import attention_layers, check_model

_CHUNK = 16  # decoding steps per device call; `stop` is checked between calls


def _check_prompts(prompts, vocab_size):
    """Python int lists from `prompts` (a list of non-empty token lists, ids in [0, vocab_size))."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"prompts must be a list of token lists, got {type(prompts).__name__}")
    checked = []
    for i, prompt in enumerate(prompts):
        tokens = np.asarray(prompt)
        if tokens.ndim != 1 or not (tokens.size == 0 or np.issubdtype(tokens.dtype, np.integer)):
            raise ValueError(f"prompts[{i}] must be a list of integer token ids, got {prompt!r:.80}")
        if tokens.size == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token (e.g. bos)")
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
        if bad.size:
            raise ValueError(f"prompts[{i}] holds token id {int(bad[0])}, outside the model's vocabulary "
                             f"[0, {vocab_size})")
        checked.append([int(t) for t in tokens])
    return checked


def can_cache(model) -> bool:
    """True when every attention layer of `model` (a focal_jax `Llama` or `GPT2`) decodes with a KV cache
    (`focal_jax.nn.attention.check_decodable`: not, for one, under dynamic NTK RoPE)."""
    try:
        for attn in attention_layers(model):
            check_decodable(attn.config)
    except ValueError:
        return False
    return True


def _finish(tokens, lengths, produced, max_new_tokens, eos_id, stop, results, checked):
    """Host side, after a device call: fills `results[i]` (the new tokens of row i) for the rows that are done.

    Row i's new tokens are `tokens[i, lengths[i] : lengths[i] + produced[i]]`; it is done after eos (included),
    when `stop(new tokens so far)` is true, or after `max_new_tokens` tokens. `checked[i]` counts the tokens already
    tested, so `stop` sees every prefix once.
    """
    for i, result in enumerate(results):
        if result is not None:
            continue
        new = tokens[i, lengths[i]:lengths[i] + produced[i]].tolist()
        for k in range(checked[i] + 1, len(new) + 1):
            if new[k - 1] == eos_id or (stop is not None and stop(new[:k])):
                results[i] = new[:k]
                break
        else:
            if len(new) == max_new_tokens:
                results[i] = new
        checked[i] = len(new)


def _write(tokens, slot, nxt, write):
    """`tokens [B, S]` with column `slot` (a scalar or one per row `[B]`) set to `nxt [B]` where `write [B]`."""
    rows = jnp.arange(tokens.shape[0])
    slot = jnp.broadcast_to(jnp.minimum(slot, tokens.shape[1] - 1), rows.shape)
    return tokens.at[rows, slot].set(jnp.where(write, nxt, tokens[rows, slot]))


def _advance(nxt, write, produced, finished, eos_id, limit):
    """Counts the written tokens and marks the rows that wrote eos or reached `limit` new tokens."""
    produced = produced + write
    finished = finished | (write & (nxt == eos_id)) | (produced >= limit)
    return produced, finished


def _loop(step, carry, finished_index, n_steps):
    """Runs `step` on `(i, *carry)` until `n_steps` steps are done or every row is finished."""
    def cond(state):
        return (state[0] < n_steps) & ~jnp.all(state[1 + finished_index])

    def body(state):
        return (state[0] + 1, *step(*state[1:]))

    return jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), *carry))[1:]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _full_steps(graphdef, state, tokens, lengths, produced, finished, eos_id, limit, n_steps):
    """Up to `n_steps` greedy steps, each a full forward of `tokens [B, S]` (row i: its `lengths[i] + produced[i]`
    tokens, then padding in a segment of its own)."""
    model = nnx.merge(graphdef, state)
    tokens = split_rows(tokens)  # (under a mesh with data / fsdp axes: data-parallel decoding)
    b, s = tokens.shape
    slots = jnp.arange(s)
    positions = jnp.broadcast_to(slots, (b, s))

    def step(tokens, produced, finished):
        filled = lengths + produced
        segment_ids = (slots[None, :] < filled[:, None]).astype(jnp.int32)
        logits = model(tokens, positions=positions, segment_ids=segment_ids, logits_at=(filled - 1)[:, None])
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(tokens.dtype)
        write = ~finished
        tokens = _write(tokens, filled, nxt, write)
        return (tokens, *_advance(nxt, write, produced, finished, eos_id, limit))

    return _loop(step, (tokens, produced, finished), 2, n_steps)


@functools.partial(jax.jit, static_argnames=("graphdef", "prefill"))
def _cached_prefill(graphdef, state, tokens, lengths, *, prefill):
    """An empty KV cache of `S` slots filled with the first `prefill` tokens of every row (all prompt tokens), and
    the greedy token at slot `prefill` written for the rows whose prompt ends there."""
    model = nnx.merge(graphdef, state)
    tokens = split_rows(tokens)
    cache = init_cache(model, tokens.shape[0], tokens.shape[1])
    last = jnp.full((tokens.shape[0], 1), prefill - 1)
    logits, cache = model(tokens[:, :prefill], cache=cache, logits_at=last)  # [B, 1, vocab], not [B, prefill, vocab]
    nxt = jnp.argmax(logits[:, 0], axis=-1).astype(tokens.dtype)
    write = lengths <= prefill
    return _write(tokens, prefill, nxt, write), cache, write.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _cached_steps(graphdef, state, tokens, cache, lengths, produced, finished, eos_id, limit, n_steps):
    """Up to `n_steps` single-token steps through the cache: every row feeds slot `cache['index']` (a prompt token
    or its last generated one); rows past their prompt write the greedy token at the next slot."""
    model = nnx.merge(graphdef, state)
    tokens = split_rows(tokens)

    def step(tokens, cache, produced, finished):
        slot = cache["index"]
        logits, cache = model(jax.lax.dynamic_slice_in_dim(tokens, slot, 1, axis=1), cache=cache)
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(tokens.dtype)
        write = (slot + 1 >= lengths) & ~finished
        tokens = _write(tokens, slot + 1, nxt, write)
        return (tokens, cache, *_advance(nxt, write, produced, finished, eos_id, limit))

    return _loop(step, (tokens, cache, produced, finished), 3, n_steps)


def _decode_batch(graphdef, state, prompts, width, cached, *, max_new_tokens, eos_id, stop, n_real):
    """New tokens of the first `n_real` of `prompts` (all of one batch), in a buffer `[len(prompts), width]`."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, prompt in enumerate(prompts):
        tokens[i, :len(prompt)] = prompt
    results = [None] * n_real + [[]] * (len(prompts) - n_real)  # padding rows start done
    checked = [0] * len(prompts)
    eos = jnp.int32(-1 if eos_id is None else eos_id)
    limit = jnp.int32(max_new_tokens)
    lengths_dev, tokens = jnp.asarray(lengths), jnp.asarray(tokens)
    produced = jnp.zeros(len(prompts), jnp.int32)
    if cached:
        tokens, cache, produced = _cached_prefill(graphdef, state, tokens, lengths_dev,
                                                  prefill=_bucket_floor(int(lengths.min())))
    _finish(np.asarray(tokens), lengths, np.asarray(produced), max_new_tokens, eos_id, stop, results, checked)
    for _ in range(width // _CHUNK + 2):  # each call advances every unfinished row by _CHUNK slots
        if all(r is not None for r in results):
            return results[:n_real]
        finished = jnp.asarray([r is not None for r in results])
        if cached:
            tokens, cache, produced, _ = _cached_steps(graphdef, state, tokens, cache, lengths_dev, produced,
                                                       finished, eos, limit, jnp.int32(_CHUNK))
        else:
            tokens, produced, _ = _full_steps(graphdef, state, tokens, lengths_dev, produced, finished, eos, limit,
                                              jnp.int32(_CHUNK))
        _finish(np.asarray(tokens), lengths, np.asarray(produced), max_new_tokens, eos_id, stop, results, checked)
    if any(r is None for r in results):
        raise RuntimeError(f"greedy_decode did not finish rows {[i for i, r in enumerate(results) if r is None]}")
    return results[:n_real]


def greedy_decode(model, prompts: list[list[int]], *, max_new_tokens: int, eos_id: int | None = None,
                  stop: Callable[[list[int]], bool] | None = None, batch_size: int = 8) -> list[list[int]]:
    """Greedy (argmax) continuation of each prompt: `len(prompts)` lists of new token ids.

    Args:
      model: a focal_jax `Llama` or `GPT2`, any attention kind (KV cache when every layer can decode with one,
        else a full forward per step; see the module docstring).
      prompts: token id lists `[n_i]`, each non-empty, of any lengths; ids in `[0, vocab_size)`.
      max_new_tokens: integer >= 1, the most tokens generated per prompt.
      eos_id: a row stops after generating this id (included in its output); None: no eos.
      stop: `stop(new_tokens) -> bool`, called on each row's new tokens after every generated token; a row stops
        (keeping the token just generated) when it returns True.
      batch_size: integer >= 1, prompts decoded together.

    Returns:
      `[new_tokens_0, ...]`, python int lists of 1 to `max_new_tokens` tokens each, in the order of `prompts`.
      Equal to decoding each prompt alone with repeated argmax of the full forward.

    Raises:
      ValueError naming the bad value: an unsupported model, an empty prompt, ids outside the vocabulary,
      `max_new_tokens` / `batch_size` < 1, `eos_id` outside the vocabulary, a `stop` that is not callable, or (GPT-2)
      a prompt that with `max_new_tokens` exceeds `n_positions`.
    """
    check_model(model)
    vocab_size = model.config.vocab_size
    prompts = _check_prompts(prompts, vocab_size)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("batch_size", batch_size, 1)
    if eos_id is not None:
        check_int("eos_id", eos_id, 0)
        if eos_id >= vocab_size:
            raise ValueError(f"eos_id={eos_id} is outside the model's vocabulary [0, {vocab_size})")
    if stop is not None and not callable(stop):
        raise ValueError(f"stop must be a callable new_tokens -> bool or None, got stop={stop!r}")
    n_positions = getattr(model.config, "n_positions", None)  # GPT-2's learned position table
    if n_positions is not None:
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_new_tokens > n_positions:
                raise ValueError(f"prompts[{i}] has {len(prompt)} tokens: with max_new_tokens={max_new_tokens} it "
                                 f"exceeds the model's n_positions={n_positions}")
    if not prompts:
        return []

    with auto_mesh():  # under a mesh with Explicit axes, its jitted steps run with them Auto
        return _decode_all(model, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, stop=stop,
                           batch_size=batch_size, n_positions=n_positions)


def _decode_all(model, prompts, *, max_new_tokens, eos_id, stop, batch_size, n_positions):
    """`greedy_decode` of checked, non-empty `prompts`."""
    cached = can_cache(model)
    graphdef, state = nnx.split(model)
    state = onto_auto_mesh(state)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows = min(batch_size, len(prompts))
    outputs = [None] * len(prompts)
    for start in range(0, len(order), rows):
        batch = order[start:start + rows]
        batch_prompts = [prompts[i] for i in batch]
        batch_prompts += [batch_prompts[0]] * (rows - len(batch))  # a full batch keeps one compiled shape
        width = _bucket(max(map(len, batch_prompts)) + max_new_tokens)
        if n_positions is not None:
            width = min(width, n_positions)
        new = _decode_batch(graphdef, state, batch_prompts, width, cached, max_new_tokens=max_new_tokens,
                            eos_id=eos_id, stop=stop, n_real=len(batch))
        for i, tokens in zip(batch, new):
            outputs[i] = tokens
    return outputs
