"""Pallas kernels, installed as ``focal_jax.kernels``.

``focus_sparse``: hard Focus attention as block-sparse flash-attention kernels (forward and backward) whose masks
are computed inside the kernel from per-token ids; also dense / focal attention through the same kernels. Reached as
``focal_jax.attention.focus_sparse_attention(..., impl='pallas')`` and the models' ``impl='pallas'``.
``partition``: the kernels per shard under a mesh (``shard_map``).
``compile_only``: the kernels compiled for an H200 or a TPU without one (registers, spills, shared memory, VMEM).
"""

if __name__ == "kernels":
    # This directory imported as a top-level `kernels`: Python runs in the repository root (`python -m`, pytest),
    # whose entry on sys.path shadows Hugging Face's `kernels` package, which transformers (>= 5.25) imports. Hand the
    # name over to the installed one; without one, `kernels` is not installed, as outside the repository.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [p for p in sys.path if os.path.realpath(p or os.curdir) != _root])
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (the repository's kernels/ is focal_jax.kernels)",
                                  name=__name__)
    _installed = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _installed
    _spec.loader.exec_module(_installed)
