"""Focal paper, the large-data run: Table 1 (2.7B after 315B tokens, LM-eval tasks) and Figure 3 (token scaling,
read off the intermediate checkpoints; the claim: Focal at 210B tokens matches the baseline at 315B). 2.7B from
scratch in each variant, batch 2.1M tokens (2^21 = 1024 x 2048), peak LR 5e-4, 150K steps = 314.6B tokens
(FOCAL_SPEC.md section 3.3), otherwise the recipe of `focal_scaling.py`. A checkpoint every 10K steps (21.0B tokens)
is kept, all 15 of them (room for 5 more, e.g. preemption checkpoints).

  DATA=/data/redpajama/*.jsonl
  for variant in baseline focal learned; do
    python -m focal_jax.train --config "experiments/focal_token_scaling.py:variant=$variant,data=$DATA" \\
        --workdir /runs/focal_tokens/$variant --config.mesh.fsdp=8
  done

Table 1 is the LM-eval average of the final checkpoints (the seven tasks, zero-shot: FOCAL_SPEC.md OQ-F11):

  for variant in baseline focal learned; do
    python -m focal_jax.eval.harness --workdir /runs/focal_tokens/$variant --num_fewshot 0 \\
        --tasks arc_challenge,arc_easy,boolq,hellaswag,lambada_openai,piqa,winogrande
  done

Figure 3's loss curve is each run's own held-out loss, logged every 5000 steps (10.5B tokens; WORKDIR/metrics.jsonl);
its accuracy curve evaluates the kept checkpoints one by one (steps 10K ... 150K; 100K steps = 210B tokens):

  for variant in baseline focal learned; do
    for step in $(seq 10000 10000 150000); do
      python -m focal_jax.eval.harness --workdir /runs/focal_tokens/$variant --step $step --num_fewshot 0 \\
          --tasks arc_challenge,arc_easy,boolq,hellaswag,lambada_openai,piqa,winogrande \\
          --output /runs/focal_tokens/$variant/lm_eval_$step.json
    done
  done

The baseline and focal runs are the starting points of `focal_adapt.py` and `focal_long_context.py`.

Where the paper is silent (section 3.3 does not restate them), we chose: 2000 warmup steps and a cosine to 10% of the
peak, as in section 3.1; the text's "300B" is 315B (section 8, item 3). Data, tokenizer, learned-tau form and
`impl` as in `focal_scaling.py`.

Arguments: variant (baseline | focal | learned), data (a glob of training files; default the builtin corpus), impl,
runlocal.
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, variant="focal", data="", impl="xla")
    attn = {**common.focal_variant(arg.variant), "impl": arg.impl}
    config = common.focal_pretraining("2.7B", attn, batch_tokens=common.FOCAL_LARGE_BATCH_TOKENS, steps=150_000,
                                      lr=5e-4)
    config.ckpt_every = 10_000
    config.keep_checkpoints = 20
    common.set_data(config, arg.data)
    if arg.runlocal:
        config.model.attn.impl = "xla"
        config = common.runlocal(config)
    return config
