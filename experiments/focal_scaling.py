"""Focal paper, model-size scaling (Figure 2) and context-length scaling (Figure 4): LLaMA-style models of the
paper's sizes (Table 3) trained from scratch in three variants, baseline (t = 1), Focal constant (t = 0.4) and
Focal learned (tau in [5, 10]), with the recipe of FOCAL_SPEC.md section 3.1: AdamW (0.9, 0.95), weight decay 0.05,
clip 1.0, 2000 warmup steps, cosine to 10% of the size's peak LR (Table 4: 400M 4e-3, 777M 2e-3, 1.3B 1e-3,
2.7B 5e-4, 6.7B and 9.5B 4e-4), 0.26M-token batches (2^18 tokens: 128 x 2048, 64 x 4096, 32 x 8192), 100K steps
(26.2B tokens), bf16 compute, RoPE theta 10K, per-head QK-norm.

Figure 2, model-size scaling (18 runs, context 2048):

  DATA=/data/redpajama/*.jsonl
  for size in 400M 777M 1.3B 2.7B 6.7B 9.5B; do
    for variant in baseline focal learned; do
      python -m focal_jax.train --config "experiments/focal_scaling.py:size=$size,variant=$variant,data=$DATA" \\
          --workdir /runs/focal_scaling/$size-$variant
    done
  done

Figure 4, context-length scaling (777M, 1.3B, 2.7B at 2048, 4096, 8192; the 2048 column is Figure 2's runs):

  DATA=/data/redpajama/*.jsonl
  for size in 777M 1.3B 2.7B; do
    for seq_len in 4096 8192; do
      for variant in baseline focal learned; do
        python -m focal_jax.train \\
            --config "experiments/focal_scaling.py:size=$size,seq_len=$seq_len,variant=$variant,data=$DATA" \\
            --workdir /runs/focal_context/$size-$seq_len-$variant
      done
    done
  done

Each point: the validation loss (Figures 2a, 4) and the average of the seven LM-eval tasks (Figure 2b; zero-shot,
FOCAL_SPEC.md OQ-F11, see focal_jax/eval/HARNESS.md):

  RUN=/runs/focal_scaling/1.3B-focal
  python -m focal_jax.eval.perplexity --workdir $RUN
  python -m focal_jax.eval.harness --workdir $RUN --num_fewshot 0 --output $RUN/lm_eval.json \\
      --tasks arc_challenge,arc_easy,boolq,hellaswag,lambada_openai,piqa,winogrande

Where the paper is silent, we chose (FOCAL_SPEC.md open questions):
- data: the paper's corpus is "a filtered mixture of public pretraining datasets similar to Open-LLaMA"; we name
  RedPajama (Open-LLaMA's corpus) as jsonl files, any `data=` glob works (.txt / .jsonl / .parquet). Tokenizer: a
  32000-piece BPE trained on the corpus, or the LLaMA tokenizer with `--config.data.tokenizer=PATH/tokenizer.model`.
- learned tau (OQ-F1 to OQ-F4, the model's defaults): one tau per layer from the causal prefix mean of the normed
  attention input, plus a bias initialised at the middle of the clip (7.5) so that tau starts inside it. The
  alternatives are settings: `--config.model.attn.tau_mode=sequence` (the paper's literal whole-row mean) or `token`,
  `tau_granularity=head`, `tau_bias=False` (no bias, w_tau ~ N(0, 0.02^2)), `tau_input=residual`, `tau_clip=smooth`.
- packing (OQ-F9): plain causal attention over each packed row, documents separated by their bos / eos tokens as in
  Open-LLaMA-style training (`data.doc_mask=False`; the learned tau's prefix mean runs across them too); give
  `--config.data.doc_mask=True` to mask the documents of a row from each other (the library's default).
- attention `impl`: 'xla' (anywhere); the paper used FlashAttention: `impl=cudnn` on GPUs (baseline and focal
  only) or `impl=pallas`. Large sizes need sharding, e.g. `--config.mesh.fsdp=8`.

Arguments: size (400M | 777M | 1.3B | 2.7B | 6.7B | 9.5B), variant (baseline | focal | learned), seq_len (tokens
per sequence; the batch stays 2^18 tokens), data (a glob of training files; default the builtin corpus), impl,
runlocal.
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, size="400M", variant="focal", seq_len=2048, data="", impl="xla")
    attn = {**common.focal_variant(arg.variant), "impl": arg.impl}
    config = common.focal_pretraining(arg.size, attn, seq_len=arg.seq_len)
    common.set_data(config, arg.data)
    if arg.runlocal:
        config.model.attn.impl = "xla"
        config = common.runlocal(config)
    return config
