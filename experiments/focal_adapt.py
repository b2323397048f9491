"""Focal paper, adapting a pretrained model to Focal attention (Table 2, FOCAL_SPEC.md section 3.5): start from the
2.7B baseline trained on 315B tokens (`focal_token_scaling.py:variant=baseline`), set t = 0.4 in every attention
layer and continue training all weights for 5K steps at LR 5e-5 with 0.26M-token batches (128 x 2048, 1.3B
tokens), next to a t = 1 continuation as the control.

  DATA=/data/redpajama/*.jsonl
  for t in 0.4 1.0; do
    python -m focal_jax.train \\
        --config "experiments/focal_adapt.py:init_from=/runs/focal_tokens/baseline,t=$t,data=$DATA" \\
        --workdir /runs/focal_adapt/t$t
  done

Table 2 is the LM-eval average of both runs next to the t = 0.4 model trained from scratch (`/runs/focal_tokens/focal`):

  for t in 0.4 1.0; do
    python -m focal_jax.eval.harness --workdir /runs/focal_adapt/t$t --num_fewshot 0 \\
        --tasks arc_challenge,arc_easy,boolq,hellaswag,lambada_openai,piqa,winogrande
  done

Where the paper is silent, we chose: the schedule is not stated, so 100 linear warmup steps then a constant LR
(FOCAL_SPEC.md section 3.5, project default); the optimizer state starts fresh (the base run's is not loaded); the
data is the base run's corpus (give the same `data=`), read with the base run's tokenizer (INIT_FROM/tokenizer.model)
and packed as it packed (`data.doc_mask`). It is read again from its start: the trainer does not carry a base run's
position in its data over, so the adaptation's 1.3B tokens are among the first the base run saw, not new ones (the
paper's continuation presumably read on). `impl` as in `focal_scaling.py`.

Arguments: init_from (the baseline's workdir; required), t (0.4 adapted, 1.0 the control), size (the base model's
size, default 2.7B), data (a glob of training files; default the builtin corpus), impl, runlocal.
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, init_from="", t=0.4, size="2.7B", data="", impl="xla")
    if not arg.init_from:
        raise ValueError("focal_adapt needs init_from=WORKDIR (the baseline run to adapt, e.g. "
                         "/runs/focal_tokens/baseline)")
    common.check_positive("t", arg.t)
    base = common.check_base_kind(arg.init_from, ("dense",), "focal_adapt (a baseline, t = 1, switched to t)")
    attn = {"kind": "dense"} if arg.t == 1.0 else {"kind": "focal", "focal_t": arg.t}
    config = common.focal_pretraining(arg.size, {**attn, "impl": arg.impl}, steps=5000, lr=5e-5)
    config.model.norm_eps = common.norm_eps_of(base["model"])
    config.data.doc_mask = common.doc_mask_of(base)
    config.init_from = arg.init_from
    config.data.tokenizer = common.run_tokenizer(arg.init_from)
    config.optim.update(warmup_steps=100, final_lr_fraction=1.0)
    config.eval_every = config.ckpt_every = 1000
    common.set_data(config, arg.data)
    if arg.runlocal:  # the base run's own (small) model
        config = common.runlocal(config, model={**base["model"], "attn": {**attn, "impl": "xla"}})
    return config
