"""Quickstart: a small LLaMA with Focal attention (constant t = 0.4) trained on the builtin corpus (the
documentation that ships with CPython), with a SentencePiece tokenizer trained on it (cached). It runs for a few
minutes on 2 CPU cores and shows a falling loss; `runlocal` takes seconds. Reproduces no paper figure.

  python -m focal_jax.train --config experiments/quickstart.py --workdir /tmp/quickstart
  python -m focal_jax.train --config experiments/quickstart.py:runlocal --workdir /tmp/quickstart_local
  python -m focal_jax.train --config experiments/quickstart.py:attn=baseline --workdir /tmp/quickstart_dense
  python -m focal_jax.train --config experiments/quickstart.py:attn=focus --workdir /tmp/quickstart_focus
  python -m focal_jax.train --config experiments/quickstart.py:runlocal,model=tiny,attn=focus \\
      --workdir /tmp/quickstart_focus_local --config.optim.lr=1e-3

Arguments:
- runlocal: a seconds-long smoke run (the tiny model, 64-token sequences, 20 steps).
- model: quickstart (the default: 4 layers, d_model 128, 4 heads of 32, 1.3M parameters) | tiny (the Focal paper
  sizes' tiny: 2 layers, d_model 64, 4 heads of 16).
- attn: a Focal paper variant, baseline | focal | learned (learned clips tau to the paper's [5, 10] rescaled to the
  head_dim, FOCAL_SPEC.md OQ-F6: [2.5, 5] at 32), or Focus trained from scratch, focus | focal+focus (t = 0.4 then
  the gate): K = 4 groups, d_g 16, a window of 32 tokens (a quarter of the 128-token sequences, so that most pairs
  are distant), the paper's Sinkhorn (tau 0.1, 10 iterations) and Eq. 2 gate (lambda 10) in training, and causal
  routing (column sums over the prefix: nothing leaks from later tokens, and the model decodes with a KV cache).
"""

from focal_jax.configs import common
from focal_jax.nn.retrofit import FocusConfig
from focal_jax.train.config import model_config

MODELS = {
    "quickstart": {"vocab_size": 2000, "d_model": 128, "n_layers": 4, "n_heads": 4, "intermediate": 344,
                   "qk_norm": "head"},
    "tiny": {"size": "tiny", "vocab_size": 2000},
}
FOCUS_KINDS = ("focus", "focal+focus")
FOCUS = FocusConfig(groups=4, **{**common.FOCUS_ROUTING, "window": 32, "causal": True})


def attention(kind: str, head_dim: int) -> dict:
    """The model's attention settings for the `attn` argument."""
    common.check_choice("attn", kind, (*common.FOCAL_VARIANTS, *FOCUS_KINDS))
    if kind in common.FOCAL_VARIANTS:
        return common.focal_variant(kind, head_dim=head_dim)
    routing = {name: value for name, value in FOCUS.attention_fields().items() if value is not None}
    return {"kind": kind, **routing, **({"focal_t": 0.4} if kind == "focal+focus" else {})}


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, model="quickstart", attn="focal")
    common.check_choice("model", arg.model, MODELS)
    config = common.base_config()
    head_dim = model_config({"family": "llama", **MODELS[arg.model]})[1].attention.head_dim
    config.model = {"family": "llama", **MODELS[arg.model], "attn": attention(arg.attn, head_dim)}
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
