"""Attention masks as functions of per-token ids (positions, segment ids, group membership).

Every function returns a boolean array that is True where query i may attend to key j. They broadcast over leading
batch dimensions: ids of shape [..., T] (queries) and [..., S] (keys) give a mask of shape [..., T, S].
"""

import jax.numpy as jnp


def causal_mask(q_pos, k_pos):
    """j <= i. `q_pos [..., T]`, `k_pos [..., S]` -> bool `[..., T, S]`."""
    return q_pos[..., :, None] >= k_pos[..., None, :]


def local_mask(q_pos, k_pos, window):
    """Key j is local to query i iff 0 <= i - j <= window (window + 1 keys, self included) -> bool `[..., T, S]`."""
    distance = q_pos[..., :, None] - k_pos[..., None, :]
    return (distance >= 0) & (distance <= window)


def segment_mask(q_seg, k_seg):
    """Only tokens of the same segment (packed document) see each other -> bool `[..., T, S]`."""
    return q_seg[..., :, None] == k_seg[..., None, :]


def group_mask(q_membership, k_membership):
    """Query and key share at least one group. `q_membership [..., T, K]`, `k_membership [..., S, K]` (bool)
    -> bool `[..., T, S]`."""
    shared = jnp.einsum("...tk,...sk->...ts", q_membership.astype(jnp.int32), k_membership.astype(jnp.int32))
    return shared > 0


def attention_mask(seq_len, *, batch=1, causal=True, window=None, segment_ids=None):
    """The mask of (windowed, segmented) causal self-attention -> bool `[batch, T, T]`.

    `window=None` means unbounded; `segment_ids [batch, T]` keeps packed documents apart.
    """
    pos = jnp.arange(seq_len)
    mask = jnp.ones((seq_len, seq_len), bool)
    if causal:
        mask &= causal_mask(pos, pos)
    if window is not None:
        distance = pos[:, None] - pos[None, :]
        mask &= distance <= window
        if not causal:
            mask &= distance >= -window
    mask = jnp.broadcast_to(mask, (batch, seq_len, seq_len))
    if segment_ids is not None:
        mask &= segment_mask(segment_ids, segment_ids)
    return mask
