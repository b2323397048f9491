"""LoRA baseline for the Focus retrofit (FOCUS_SPEC.md section 6.1, Table 3: LoRA r = 4 and r = 16 vs centroids on
GPT-2 124M / PG-19; Table 4: LoRA r = 4 on Mistral-7B-Instruct at lr 1e-5, 5e-5, 1e-4). The claim under test: LoRA
lowers the domain perplexity more than the centroids do but degrades the general benchmarks (forgetting), while
centroid-only Focus leaves them unchanged. Freeze a base model, add LoRA of rank r to the attention projections and
train only the `LoRA` parameters, with the recipe of `experiments/focus_retrofit.py` so that the two are comparable:
4000 steps of 1024 tokens (the paper's, for GPT-2), batch 8, AdamW with 100 warmup steps and no weight decay, float32.

Our choices where the paper is silent (it gives neither the targets, alpha nor the GPT-2 LR):
- targets q_proj and v_proj: the paper's parameter counts are those of LoRA on q and v (GPT-2: 12 x 2 x r x
  (768 + 768) = 147,456 at r = 4 and 589,824 at r = 16, equal to LoRA on the fused c_attn; Mistral: 1,703,936 at
  r = 4); `targets=qkvo` adapts all four projections.
- alpha = 2 r (update scale 2), the common choice; `alpha=` sets it.
- the optimizer of `focus_retrofit.py`: 100 warmup steps, no weight decay, betas (0.9, 0.95), clip 1.0, cosine
  decay to 10%, bf16 compute (the Focal paper's recipe, `common.base_config`).
- lr 1e-4: the largest LoRA LR the paper reports (Table 4); `lr=1e-5` / `5e-5` give its other rows, and `steps=2000`
  its Mistral run length.

  python -m focal_jax.train --config experiments/lora_baseline.py:init_from=/tmp/quickstart,rank=4 \\
      --workdir /tmp/lora_r4

Table 3 (GPT-2 124M on PG-19, as `focus_retrofit.py`'s K = 4 run) and Table 4 (Mistral-7B-Instruct, 2000 steps, as
`focus_retrofit.py`'s K = 2 run):

  DATA=/data/pg19/train/*.txt
  for rank in 4 16; do
    python -m focal_jax.train --config "experiments/lora_baseline.py:hf=/models/gpt2,rank=$rank,data=$DATA" \\
        --workdir /runs/lora_baseline/gpt2-r$rank
  done
  MISTRAL=/models/Mistral-7B-Instruct-v0.2
  for lr in 1e-5 5e-5 1e-4; do
    python -m focal_jax.train --config "experiments/lora_baseline.py:hf=$MISTRAL,rank=4,lr=$lr,steps=2000,data=$DATA" \\
        --workdir /runs/lora_baseline/Mistral-7B-Instruct-r4-lr$lr
  done

Arguments: init_from (a focal_jax workdir: its model), hf (a Hugging Face directory), rank (4 or 16 in the paper),
alpha (default, or 0: 2 * rank), targets (letters of q, k, v, o; default qv), lr (default 1e-4), steps (default 4000),
data (a glob of training files; default: the base run's data, or the builtin corpus), runlocal. One of init_from /
hf is required. The checkpoints hold the LoRA parameters only and record the base model;
`focal_jax.nn.lora.merge_lora` folds them into the kernels for export.
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, init_from="", hf="", rank=4, alpha=0.0, targets="qv", lr=1e-4,
                           steps=4000, data="")
    config = common.base_config()
    common.start_from(config, init_from=arg.init_from, hf=arg.hf, experiment="lora_baseline")
    config.retrofit.lora = {"rank": arg.rank, "alpha": arg.alpha or 2.0 * arg.rank, "targets": arg.targets}
    config.optim.update(trainable="lora", lr=arg.lr, warmup_steps=100, weight_decay=0.0)
    common.set_data(config, arg.data)
    config = common.finetune_schedule(config, steps=arg.steps, local=arg.runlocal)
    return config
