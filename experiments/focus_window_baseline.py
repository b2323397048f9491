"""Focus paper, the sliding-window baseline (FOCUS_SPEC.md section 6.1, Table 1's "Longformer (zero-shot)" row, and
the control that separates Focus's groups from its local window): the base model with every query restricted to its
local window (key j visible iff 0 <= i - j <= w, the Focus window, w = 128) and no long-range attention at all,
fine-tuned like `focus_finetune.py` (every weight, LR 5e-5, 4000 steps of 1024 tokens, batch 8), so that it
differs from Focus phase 2 only by the missing groups.

  python -m focal_jax.train --config experiments/focus_window_baseline.py:init_from=/tmp/quickstart \\
      --workdir /tmp/focus_window_baseline

A LLaMA-family base at paper scale, e.g. the 400M baseline of `focal_scaling.py`, next to Focus on the same base
(`focus_retrofit.py:init_from=...,groups=8`, then `focus_finetune.py`):

  DATA=/data/pg19/train/*.txt
  python -m focal_jax.train \\
      --config "experiments/focus_window_baseline.py:init_from=/runs/focal_scaling/400M-baseline,data=$DATA" \\
      --workdir /runs/focus_window/400M-w128

Table 5's GPT-2 models (K = 8, w = 128; PG-19), next to Focus phase 2 and the full-attention control of
`focus_finetune.py` on the same Hugging Face directories:

  DATA=/data/pg19/train/*.txt
  for model in gpt2 gpt2-large gpt2-xl; do
    python -m focal_jax.train --config "experiments/focus_window_baseline.py:hf=/models/$model,data=$DATA" \\
        --workdir /runs/focus_window/$model-w128
  done

How the window reaches the model: a LLaMA-family or GPT-2 base run (`init_from`) gets it in its model section
(`model.attn.window` / `model.window`); a Hugging Face directory (`hf`, model family 'hf': its architecture comes
from the directory) or a run that started from one gets it as `retrofit.window`, which the trainer puts on the
loaded model with `focal_jax.nn.retrofit.replace_attention` (no new parameters).

Evaluate with `python -m focal_jax.eval.perplexity --workdir DIR` and `python -m focal_jax.eval.harness --workdir
DIR --num_fewshot 0 --tasks hellaswag,arc_easy,piqa,lambada_openai`. Table 1's zero-shot row (no training: the
pretrained weights under the window) is the same config run for 0 steps, which evaluates and saves the starting
model; the fine-tuned form above is the stronger baseline:

  DATA=/data/pg19/train/*.txt
  RUN=/runs/focus_window/gpt2-w128-zeroshot
  python -m focal_jax.train --config "experiments/focus_window_baseline.py:hf=/models/gpt2,data=$DATA" \\
      --workdir $RUN --config.total_steps=0
  python -m focal_jax.eval.perplexity --workdir $RUN
  python -m focal_jax.eval.harness --workdir $RUN --num_fewshot 0 --tasks hellaswag,arc_easy,piqa,lambada_openai

For a focal_jax run, `python -m focal_jax.eval.perplexity --workdir RUN --window 128` evaluates it under the window
directly; in Python, `focal_jax.eval.diagnostics.attention_view(model, window=128)` is that model over the same
weights (in place: `focal_jax.nn.retrofit.replace_attention(model, window=128)`).

Where the paper is silent, we chose: a plain sliding window (Longformer's global tokens are task-specific and the
paper gives none), w = 128 as Focus's; the fine-tuning recipe of `focus_finetune.py` (FOCUS_SPEC.md OQ-7); the base
run's tokenizer and data (the Hugging Face directory's tokenizer and, unless `data=` is given, the builtin corpus).

Arguments: init_from (a focal_jax run: LLaMA family, GPT-2, or one started from a Hugging Face directory; dense or
Focal attention, no Focus), hf (a Hugging Face directory: GPT-2, LLaMA, Mistral, Qwen, OLMo), one of the two
required; window (w), steps, data (a glob of training files; default the base run's data), runlocal.
"""

from focal_jax.configs import common

WINDOWED_KINDS = ("dense", "focal", "focal_learned")


def _kind(model: dict) -> str:
    """The attention kind of a stored model section (family llama or gpt2)."""
    if model.get("family", "llama") == "gpt2":
        return model.get("kind", "dense")
    return dict(model.get("attn") or {}).get("kind", "dense")


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, init_from="", hf="", window=128, steps=4000, data="")
    if arg.window < 0:
        raise ValueError(f"config argument window={arg.window!r} must be >= 0")
    config = common.base_config()
    base = common.start_from(config, init_from=arg.init_from, hf=arg.hf, experiment="focus_window_baseline")
    model = {"family": "hf"} if base is None else dict(base["model"])
    family = model.get("family", "llama")
    window = min(arg.window, 16) if arg.runlocal else arg.window
    if base is not None:
        retrofits = {k: v for k, v in (base.get("retrofit") or {}).items() if v is not None}
        if "focus" in retrofits:
            raise ValueError(f"init_from={arg.init_from!r} is a Focus retrofit run: Focus has its own local window "
                             f"(retrofit.focus.window); the window baseline starts from its base "
                             f"({base.get('init_from')!r})")
        if family != "hf" and set(retrofits) - {"window"}:
            raise ValueError(f"init_from={arg.init_from!r} has retrofit {sorted(retrofits)}, which a model section "
                             f"cannot carry; start the window baseline from a run without a retrofit (or from the "
                             f"Hugging Face directory of a run that started from one)")
        if family != "hf" and _kind(model) not in WINDOWED_KINDS:
            raise ValueError(f"init_from={arg.init_from!r} has attention kind={_kind(model)!r}; the window "
                             f"baseline starts from a model with attention kind in {WINDOWED_KINDS}")
    if family == "llama":
        model["attn"] = {**dict(model.get("attn") or {}), "window": window}
    elif family == "gpt2":
        model["window"] = window
    else:  # the architecture comes from the Hugging Face directory: the window goes on the loaded model
        config.retrofit.window = window
    config.model = model
    config.optim.update(trainable="all", lr=5e-5, warmup_steps=100, weight_decay=0.0)
    common.set_data(config, arg.data)
    config = common.finetune_schedule(config, steps=arg.steps, local=arg.runlocal)
    return config
