"""Sparse training with hard Focus masks through the Pallas kernels (`focal_jax.kernels.focus_sparse`): a LLaMA
whose every layer attends to its local window (w = 128) and, at long range, only to tokens of its own top-1 group
(K = 8, causal routing), so the attention work is O(T (w + T / K)) instead of the soft gate's O(T^2) (the paper
trains with the soft gate; FOCUS_SPEC.md). Reproduces no paper figure: it is the training the kernel makes possible.

The hard top-k has no gradient, so the routing parameters keep their initial values unless the run starts from a
soft-gate Focus run (`init_from`, e.g. of `focus_scratch.py`), whose learned centroids then fix the groups. Such a
run is that run's model (its size, K, window and routing, causal or not) made hard top-`topk` through the kernels,
so `size` and `groups` are not used; it reads its data with the tokenizer of the run it starts from
(INIT_FROM/tokenizer.model), so that token ids keep their meaning.

  python -m focal_jax.train --config experiments/focus_sparse.py --workdir /tmp/focus_sparse
  python -m focal_jax.train --config experiments/focus_sparse.py:size=777M,groups=16 --workdir /tmp/focus_sparse

Arguments: runlocal, size (a Focal paper size, default 400M), groups (K), topk, init_from.
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, size="400M", groups=8, topk=1, init_from="")
    if arg.size not in common.FOCAL_LR:
        raise ValueError(f"size={arg.size!r} is not one of {tuple(common.FOCAL_LR)}")
    config = common.base_config()
    config.model = {"family": "llama", "size": arg.size,
                    "attn": {"kind": "focus", "impl": "pallas", "focus_groups": arg.groups, "focus_window": 128,
                             "focus_topk": arg.topk, "focus_causal": True}}
    config.init_from = arg.init_from or None
    if arg.init_from:  # its model, routed by its centroids; its weights were trained on that run's token ids
        base_model = common.check_base_kind(arg.init_from, ("focus", "focal+focus"),
                                            "focus_sparse (routing by a soft-gate Focus run's centroids)")["model"]
        config.model = {**base_model, "attn": {**dict(base_model.get("attn") or {}), "impl": "pallas",
                                               "focus_topk": arg.topk}}
        config.data.tokenizer = common.run_tokenizer(arg.init_from)
    config.data.update(source="builtin", vocab_size=32000, seq_len=4096)
    config.batch_size = 64
    config.total_steps = 20000
    config.log_every = 50
    config.eval_every = 1000
    config.ckpt_every = 1000
    config.optim.lr = common.FOCAL_LR[arg.size]
    if arg.runlocal:
        config = common.runlocal(config, model=config.model.to_dict() if arg.init_from else None)
    return config
