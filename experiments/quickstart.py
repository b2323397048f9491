"""Quickstart: a small LLaMA with Focal attention (constant t = 0.4) trained on the builtin corpus (the
documentation that ships with CPython), with a SentencePiece tokenizer trained on it (cached). It runs for a few
minutes on 2 CPU cores and shows a falling loss; `runlocal` takes seconds. Reproduces no paper figure.

  python -m focal_jax.train --config experiments/quickstart.py --workdir /tmp/quickstart
  python -m focal_jax.train --config experiments/quickstart.py:runlocal --workdir /tmp/quickstart_local
  python -m focal_jax.train --config experiments/quickstart.py:attn=baseline --workdir /tmp/quickstart_dense

Arguments: runlocal, attn (a Focal paper variant: baseline | focal | learned; learned clips tau to [2.5, 5], the
paper's [5, 10] rescaled to this head_dim 32, FOCAL_SPEC.md OQ-F6).
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, attn="focal")
    if arg.attn not in common.FOCAL_VARIANTS:
        raise ValueError(f"attn={arg.attn!r} is not one of {tuple(common.FOCAL_VARIANTS)}")
    config = common.base_config()
    config.model = {"family": "llama", "vocab_size": 2000, "d_model": 128, "n_layers": 4, "n_heads": 4,
                    "intermediate": 344, "qk_norm": "head", "attn": common.focal_variant(arg.attn, head_dim=32)}
    config.data.update(source="builtin", vocab_size=2000, seq_len=128)
    config.batch_size = 16
    config.total_steps = 600
    config.log_every = 20
    config.eval_every = 200
    config.eval_batches = 8
    config.ckpt_every = 200
    config.compute_dtype = "float32"  # bf16 matmuls are emulated, hence slow, on CPU
    config.optim.update(lr=3e-3, warmup_steps=50)
    if arg.runlocal:
        config = common.runlocal(config)
    return config
