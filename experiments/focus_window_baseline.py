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

Evaluate with `python -m focal_jax.eval.perplexity --workdir DIR` and `python -m focal_jax.eval.harness --workdir
DIR --num_fewshot 0 --tasks hellaswag,arc_easy,piqa,lambada_openai`. Table 1's zero-shot row (no training: the
pretrained weights under the window) needs an evaluation that restricts a run's attention to a window (none has
that option yet); the fine-tuned form here is the stronger baseline.

Where the paper is silent, we chose: a plain sliding window (Longformer's global tokens are task-specific and the
paper gives none), w = 128 as Focus's; the fine-tuning recipe of `focus_finetune.py` (FOCUS_SPEC.md OQ-7); the base
run's tokenizer.

Not expressible yet: GPT-2 (neither `GPT2Config` nor a model loaded from a Hugging Face directory takes a sliding
window), so the base must be a focal_jax LLaMA-family run (`init_from`).

Arguments: init_from (a focal_jax LLaMA-family run; required), window (w), steps, data (a glob of training files;
default the base run's data), runlocal.
"""

from focal_jax.configs import common

WINDOWED_KINDS = ("dense", "focal", "focal_learned")


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, init_from="", window=128, steps=4000, data="")
    if not arg.init_from:
        raise ValueError("focus_window_baseline needs init_from=WORKDIR (a focal_jax LLaMA-family run)")
    if arg.window < 0:
        raise ValueError(f"config argument window={arg.window!r} must be >= 0")
    base = common.base_run(arg.init_from)
    model = dict(base["model"])
    if model.get("family", "llama") != "llama":
        raise ValueError(f"init_from={arg.init_from!r} is a model.family={model.get('family')!r} run; a sliding "
                         f"window exists only for the LLaMA family")
    attn = dict(model.get("attn") or {})
    if attn.get("kind", "dense") not in WINDOWED_KINDS:
        raise ValueError(f"init_from={arg.init_from!r} has attention kind={attn.get('kind')!r}; the window "
                         f"baseline starts from a model with attention kind in {WINDOWED_KINDS}")
    model["attn"] = {**attn, "window": arg.window}
    config = common.base_config()
    config.init_from = arg.init_from
    config.model = model
    config.data.update(base["data"])
    config.data.tokenizer = common.run_tokenizer(arg.init_from)
    config.optim.update(trainable="all", lr=5e-5, warmup_steps=100, weight_decay=0.0)
    common.set_data(config, arg.data)
    if arg.runlocal:
        model["attn"]["window"] = min(arg.window, 16)
        config.model = model
    config = common.finetune_schedule(config, steps=arg.steps, local=arg.runlocal)
    return config
