"""Packing token documents into fixed-length rows with segment ids, positions and a next-token loss mask."""

import numpy as np

PACKED_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def pack(token_docs: list[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Concatenates documents in order and cuts the stream into rows of `seq_len` tokens.

    Args:
      token_docs: one 1-D integer array per document, already encoded as `bos + tokens + eos` (`eos + tokens +
        eos` for a tokenizer without bos; the data pipeline does this); each needs at least one token. Id 0 is the
        padding id.
      seq_len: tokens per row.

    Returns:
      A dict of `[n_rows, seq_len]` arrays, `n_rows = ceil(total_tokens / seq_len)`:
      - `inputs` int32: the token stream; the last row is padded with 0.
      - `targets` int32: the next token of the same document, 0 where there is none (document end, padding).
        Within a row `targets[r, t] == inputs[r, t + 1]`; at the last column the target is the first input of the
        next row when the document continues there, so every bigram of every document is trained on exactly once.
      - `segment_ids` int32: 1, 2, ... for the documents of the row, in order; 0 for padding.
      - `positions` int32: position in the segment, restarting at 0 at each segment start. A document that
        crosses a row boundary continues in the next row as a new segment starting again at position 0, so every
        row is self-contained (attention never needs another row).
      - `loss_mask` float32: 1 where `targets` is the next token of the same document, else 0.

    >>> out = pack([np.array([2, 7, 8, 3]), np.array([2, 9, 3])], seq_len=4)
    >>> out['inputs'].tolist(), out['targets'].tolist()
    ([[2, 7, 8, 3], [2, 9, 3, 0]], [[7, 8, 3, 0], [9, 3, 0, 0]])
    >>> out['segment_ids'].tolist(), out['positions'].tolist(), out['loss_mask'].tolist()
    ([[1, 1, 1, 1], [1, 1, 1, 0]], [[0, 1, 2, 3], [0, 1, 2, 0]], [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1, got seq_len={seq_len!r}")
    docs = [np.asarray(d) for d in token_docs]
    if not docs:
        raise ValueError("pack needs at least one document, got none")
    for i, d in enumerate(docs):
        if d.ndim != 1 or d.size == 0 or not np.issubdtype(d.dtype, np.integer):
            raise ValueError(f"token_docs[{i}] must be a non-empty 1-D integer array, got shape {d.shape} "
                             f"and dtype {d.dtype}")
        low, high = int(d.min()), int(d.max())
        if low < 0 or high > np.iinfo(np.int32).max:
            raise ValueError(f"token_docs[{i}] holds token id {low if low < 0 else high}: ids must lie in "
                             f"[0, {np.iinfo(np.int32).max}] (rows are int32)")
    lengths = np.array([d.size for d in docs])
    n_rows = -(-int(lengths.sum()) // seq_len)
    size = n_rows * seq_len + 1  # one extra slot: the target of the last input
    stream = _padded(np.concatenate(docs), size, 0)
    doc_of = _padded(np.repeat(np.arange(len(docs)), lengths), size, -1)

    inputs = stream[:-1].reshape(n_rows, seq_len)
    doc = doc_of[:-1].reshape(n_rows, seq_len)
    same_doc = (doc == doc_of[1:].reshape(n_rows, seq_len)) & (doc >= 0)
    targets = np.where(same_doc, stream[1:].reshape(n_rows, seq_len), 0)

    column = np.arange(seq_len)
    starts = np.ones_like(doc, dtype=bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    segment_ids = np.where(doc >= 0, np.cumsum(starts, axis=1), 0)
    start_column = np.maximum.accumulate(np.where(starts, column, 0), axis=1)
    positions = np.where(doc >= 0, column - start_column, 0)
    return dict(inputs=inputs.astype(np.int32), targets=targets.astype(np.int32),
                segment_ids=segment_ids.astype(np.int32), positions=positions.astype(np.int32),
                loss_mask=same_doc.astype(np.float32))


def merge_documents(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows of `pack` with the documents of each row as one sequence (`DataConfig.doc_mask=False`, FOCAL_SPEC.md
    OQ-F9): `segment_ids` 1 at every real token (0 stays padding) and `positions` the column in the row (0 at
    padding), so causal attention, Sinkhorn's column sums and a learned temperature's prefix mean run across the
    documents of a row, separated only by their bos / eos tokens. `inputs`, `targets` and `loss_mask` are kept: a
    document's last token still has no target, so the loss is over the same tokens as with document masking.

    Args:
      rows: dict with the keys of `pack`, each `[..., seq_len]`.

    Returns:
      A new dict with the same keys and shapes.

    >>> out = merge_documents(pack([np.array([2, 7, 3]), np.array([2, 9, 3])], seq_len=4))
    >>> out['segment_ids'].tolist(), out['positions'].tolist()
    ([[1, 1, 1, 1], [1, 1, 0, 0]], [[0, 1, 2, 3], [0, 1, 0, 0]])
    """
    missing = [k for k in ("segment_ids", "positions") if k not in rows]
    if missing:
        raise ValueError(f"merge_documents needs the keys of pack, got {sorted(rows)} (missing {missing})")
    real = np.asarray(rows["segment_ids"]) != 0
    column = np.broadcast_to(np.arange(real.shape[-1], dtype=np.int32), real.shape)
    return {**rows, "segment_ids": real.astype(np.int32), "positions": np.where(real, column, 0).astype(np.int32)}


def frame(ids, start_id: int, eos_id: int) -> np.ndarray:
    """A document's token ids `[n]` -> `[start_id, *ids, eos_id]`, int32 `[n + 2]`: the framing `pack` expects
    (start_id: the bos, or the eos for a tokenizer without bos)."""
    out = np.empty(len(ids) + 2, np.int32)
    out[0], out[1:-1], out[-1] = start_id, ids, eos_id
    return out


def _padded(x: np.ndarray, size: int, fill: int) -> np.ndarray:
    """`x` (1-D) extended with `fill` to `size` entries."""
    return np.concatenate([x, np.full(size - x.size, fill, dtype=x.dtype)])
