"""Focus paper, full fine-tuning (FOCUS_SPEC.md section 6.2: Table 5, the other domains, the FT column of Table 9,
the two-phase study of section 7; Table 1's "Full attention FT" row): phase 2 of the two-phase protocol. Phase 1 is
a centroid-only run of `focus_retrofit.py` (groups form with the weights frozen); this run starts from it, keeps its
Focus settings and trained centroids and fine-tunes every weight: LR 5e-5, 4000 steps of 1024 tokens, batch 8.
`attn=dense` is the control: the base model fine-tuned the same way with full attention.

  python -m focal_jax.train --config experiments/focus_retrofit.py:init_from=/tmp/quickstart,groups=8 \\
      --workdir /tmp/focus_retrofit_K8
  python -m focal_jax.train --config experiments/focus_finetune.py:init_from=/tmp/focus_retrofit_K8 \\
      --workdir /tmp/focus_finetune_K8
  python -m focal_jax.train --config experiments/focus_finetune.py:init_from=/tmp/quickstart,attn=dense \\
      --workdir /tmp/focus_finetune_dense

Table 5 (K = 8, single membership, w = 128; PG-19), phase 1 then phase 2, and the full-attention control:

  DATA=/data/pg19/train/*.txt
  for model in gpt2 gpt2-large gpt2-xl; do
    python -m focal_jax.train --config "experiments/focus_retrofit.py:hf=/models/$model,groups=8,data=$DATA" \\
        --workdir /runs/focus_retrofit/$model-K8
    python -m focal_jax.train --config experiments/focus_finetune.py:init_from=/runs/focus_retrofit/$model-K8 \\
        --workdir /runs/focus_finetune/$model-K8
    python -m focal_jax.train --config "experiments/focus_finetune.py:hf=/models/$model,attn=dense,data=$DATA" \\
        --workdir /runs/focus_finetune/$model-dense
  done

The other domains of section 6.2 (GPT-2 124M) and the FT column of Table 9 (phase 2 of each ablation run of
`focus_retrofit.py`):

  for domain in wikitext103 openwebtext; do
    DATA="/data/$domain/*.parquet"
    python -m focal_jax.train --config "experiments/focus_retrofit.py:hf=/models/gpt2,groups=8,data=$DATA" \\
        --workdir /runs/focus_retrofit/gpt2-$domain-K8
    python -m focal_jax.train --config experiments/focus_finetune.py:init_from=/runs/focus_retrofit/gpt2-$domain-K8 \\
        --workdir /runs/focus_finetune/gpt2-$domain-K8
    python -m focal_jax.train --config "experiments/focus_finetune.py:hf=/models/gpt2,attn=dense,data=$DATA" \\
        --workdir /runs/focus_finetune/gpt2-$domain-dense
  done
  for name in K4 K8 K16 K32 K8-w64 K8-w256 K8-w512 K8-tau0.05 K8-tau0.2 K8-tau0.5 K8-iters3 K8-iters5 K8-iters20; do
    python -m focal_jax.train --config experiments/focus_finetune.py:init_from=/runs/focus_retrofit/gpt2-$name \\
        --workdir /runs/focus_finetune/gpt2-$name
  done

Evaluate with `python -m focal_jax.eval.perplexity --workdir DIR --topk all`: the soft-gated and the hard top-k
perplexity and the group dominance (Table 9's and the two-phase study's measure); `focal_jax.eval.diagnostics` gives
the group sizes, confidence and top tokens of each layer.

Where the paper is silent, we chose (FOCUS_SPEC.md OQ-7): AdamW at LR 5e-5 (the top of the 1e-5 to 5e-5 range; the
paper's full fine-tuning baseline moves GPT-2 from 42.8 to 36.4 PPL in 4000 steps in Table 1, and reaches 31.4 in
Table 5, steps not stated), 100 warmup steps, cosine to 10%, no weight decay, batch 8, and the rest of the Focal
paper's recipe (`common.base_config`: betas (0.9, 0.95), global-norm clip 1.0, bf16 compute); that Table 5 used the
two-phase protocol (inferred in section 6.2); the phase-2 data and tokenizer are phase 1's unless `data=` is given.
The data names: PG-19 (one book per .txt file), WikiText-103 and OpenWebText (parquet files with a 'text' column).

Arguments: init_from (attn=focus: the phase-1 `focus_retrofit.py` workdir; attn=dense: a focal_jax base run), hf (a
Hugging Face directory, attn=dense only), attn (focus | dense), steps, data (a glob of training files), runlocal.
"""

from focal_jax.configs import common
from focal_jax.nn.retrofit import FocusConfig

# The attention kind of a model after Focus is added to a layer of each kind (focal_jax.nn.retrofit's rule).
FOCUS_KIND = {"dense": "focus", "focal": "focal+focus", "focus": "focus", "focal+focus": "focal+focus"}


def with_focus(model: dict, focus: dict) -> dict:
    """The model section `model` (family llama or gpt2) with the attention of a Focus retrofit `focus`."""
    fields = {k: v for k, v in FocusConfig(**focus).attention_fields().items() if v is not None}
    attn = dict(model.get("attn") or {}) if model.get("family", "llama") == "llama" else model
    kind = attn.get("kind", "dense")
    if kind not in FOCUS_KIND:
        raise ValueError(f"the phase-1 model has attention kind={kind!r}, which has no Focus form")
    attn = {**attn, **fields, "kind": FOCUS_KIND[kind]}
    return {**model, "attn": attn} if model.get("family", "llama") == "llama" else attn


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, init_from="", hf="", attn="focus", steps=4000, data="")
    common.check_choice("attn", arg.attn, ("focus", "dense"))
    if arg.hf and arg.attn != "dense":
        raise ValueError(f"hf={arg.hf!r} starts the full-attention control (attn=dense); phase 2 of Focus "
                         f"starts from its phase-1 run: init_from=WORKDIR of focus_retrofit.py")
    config = common.base_config()
    base = common.start_from(config, init_from=arg.init_from, hf=arg.hf, experiment="focus_finetune")
    if base is not None:
        focus = (base.get("retrofit") or {}).get("focus")
        if arg.attn == "focus" and not focus:
            raise ValueError(f"attn=focus starts from a phase-1 run of focus_retrofit.py; init_from="
                             f"{arg.init_from!r} has no Focus retrofit (use attn=dense for its full-attention "
                             f"fine-tuning)")
        if arg.attn == "dense" and focus:
            raise ValueError(f"attn=dense fine-tunes a base model; init_from={arg.init_from!r} is a Focus retrofit "
                             f"run: give its base ({base.get('init_from')!r})")
        if focus and base["model"].get("family") != "hf":
            config.model = with_focus(base["model"], focus)
        # A phase 1 on a Hugging Face directory (family 'hf') has no model section to change: the trainer rebuilds
        # that run's whole model (its base, its Focus retrofit, its trained centroids) from init_from.
    config.optim.update(trainable="all", lr=5e-5, warmup_steps=100, weight_decay=0.0)
    common.set_data(config, arg.data)
    config = common.finetune_schedule(config, steps=arg.steps, local=arg.runlocal)
    return config
