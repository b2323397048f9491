"""Pallas kernels, installed as ``focal_jax.kernels``.

``focus_sparse``: hard Focus attention as block-sparse flash-attention kernels (forward and backward) whose masks
are computed inside the kernel from per-token ids; also dense / focal attention through the same kernels. Reached as
``focal_jax.attention.focus_sparse_attention(..., impl='pallas')`` and the models' ``impl='pallas'``.
``partition``: the kernels per shard under a mesh (``shard_map``).
``compile_only``: the kernels compiled for an H200 or a TPU without one (registers, spills, shared memory, VMEM).
"""
