"""Focus retrofit, centroids only (FOCUS_SPEC.md section 6.1, Table 2): freeze a pretrained model, put Focus
attention (K groups, d_g = 16, window w = 128, tau 0.1, 10 Sinkhorn iterations, the paper's soft gate) into every
layer and train only the `Centroid` parameters (W_g and C per layer): LR 1e-3, 4000 steps of 1024 tokens, batch 8
(FOCUS_SPEC OQ-7: the paper states neither LR nor batch). Routing is the paper's (non-causal) Sinkhorn.

  python -m focal_jax.train --config experiments/focus_retrofit.py:init_from=/tmp/quickstart \\
      --workdir /tmp/focus_retrofit
  python -m focal_jax.train --config experiments/focus_retrofit.py:hf=/models/gpt2,groups=8 \\
      --workdir /tmp/focus_retrofit_gpt2

Arguments: init_from (a focal_jax workdir: its model), hf (a Hugging Face directory, e.g. GPT-2 124M), groups (K,
4 or 8 in the paper), runlocal. One of init_from / hf is required. The checkpoints hold the centroids only and
record the base model.
"""

import os

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, init_from="", hf="", groups=4)
    if bool(arg.init_from) == bool(arg.hf):
        raise ValueError("focus_retrofit needs exactly one of init_from=WORKDIR or hf=DIRECTORY")
    config = common.base_config()
    config.init_from = arg.init_from or arg.hf
    if arg.hf:
        config.model = {"family": "hf"}
        config.data.tokenizer = os.path.join(arg.hf, "tokenizer.model")
        if not os.path.isfile(config.data.tokenizer):
            raise ValueError(f"hf={arg.hf!r} has no SentencePiece tokenizer.model (LLaMA / Mistral ship one); "
                             f"set --config.data.tokenizer to the model's SentencePiece file")
    else:
        from focal_jax.train.checkpoint import read_meta  # the base run's model settings

        _, meta = read_meta(arg.init_from)
        config.model = meta["config"]["model"]
        config.data.update(meta["config"]["data"])
    config.retrofit.focus = {"groups": arg.groups, "dim": 16, "window": 128, "tau": 0.1, "iters": 10,
                             "gate": "paper", "lam": 10.0}
    config.optim.update(trainable="centroids", lr=1e-3, warmup_steps=100, weight_decay=0.0)
    config.data.seq_len = 1024
    config.batch_size = 8
    config.total_steps = 4000
    config.log_every = 20
    config.eval_every = 500
    config.ckpt_every = 500
    config.compute_dtype = "float32"
    if arg.runlocal:
        config.data.seq_len = 64
        config.batch_size = 4
        config.total_steps = 20
        config.log_every = 1
        config.eval_every = config.ckpt_every = 20
        config.eval_batches = 1
        config.retrofit.focus.window = 16
        config.optim.warmup_steps = 5
    return config
