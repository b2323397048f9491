"""Focus retrofit, centroids only (FOCUS_SPEC.md section 6.1: Tables 1, 2, 3 and 4, the d_g sweep, the centroid
column of Table 9; Table 7 and section 4.2 evaluate its runs): freeze a pretrained model, put Focus attention (K
groups, d_g = 16, window w = 128, tau 0.1, 10 Sinkhorn iterations, the paper's soft gate) into every layer and train
only the `Centroid` parameters (W_g and C per layer): LR 1e-3, 4000 steps of 1024 tokens, batch 8. Routing is the
paper's (non-causal) Sinkhorn unless `causal`.

  python -m focal_jax.train --config experiments/focus_retrofit.py:init_from=/tmp/quickstart \\
      --workdir /tmp/focus_retrofit

GPT-2 124M on PG-19 (Tables 1 and 3: K = 4, inferred for Table 1, whose K the paper does not state; K = 8 is the
default of the ablations and of the two-phase study):

  DATA=/data/pg19/train/*.txt
  for groups in 4 8; do
    python -m focal_jax.train --config "experiments/focus_retrofit.py:hf=/models/gpt2,groups=$groups,data=$DATA" \\
        --workdir /runs/focus_retrofit/gpt2-K$groups
  done

Table 2 (K = 4: Mistral's 11.6 equals Table 7's K = 4) and Table 4 (Mistral-7B-Instruct, K = 2, 2000 steps):

  DATA=/data/pg19/train/*.txt
  for model in gpt2-large Mistral-7B-v0.3 Qwen2.5-7B OLMo-2-1124-7B Llama-2-13b-hf Llama-2-70b-hf; do
    python -m focal_jax.train --config "experiments/focus_retrofit.py:hf=/models/$model,data=$DATA" \\
        --workdir /runs/focus_retrofit/$model-K4
  done
  python -m focal_jax.train \\
      --config "experiments/focus_retrofit.py:hf=/models/Mistral-7B-Instruct-v0.2,groups=2,steps=2000,data=$DATA" \\
      --workdir /runs/focus_retrofit/Mistral-7B-Instruct-K2

The d_g sweep (K = 4: the reported parameter counts fit K <= 4, section 2.5), Table 9's centroid column (defaults
K = 8, w = 128, tau 0.1, 10 iterations; one setting varied at a time), App. B's window study (K = 2) and the gate
forms (OQ-1):

  DATA=/data/pg19/train/*.txt
  retrofit() {  # retrofit ARGS NAME
    python -m focal_jax.train --config "experiments/focus_retrofit.py:hf=/models/gpt2,data=$DATA,$1" \\
        --workdir /runs/focus_retrofit/gpt2-$2
  }
  for dim in 16 32 128 768; do retrofit groups=4,dim=$dim K4-dg$dim; done
  for groups in 4 8 16 32; do retrofit groups=$groups K$groups; done
  for window in 64 128 256 512; do retrofit groups=8,window=$window K8-w$window; done
  for tau in 0.05 0.1 0.2 0.5; do retrofit groups=8,tau=$tau K8-tau$tau; done
  for iters in 3 5 10 20; do retrofit groups=8,iters=$iters K8-iters$iters; done
  for window in 16 128 512; do retrofit groups=2,window=$window K2-w$window; done
  retrofit groups=4,gate=log K4-log

An attention sink (FOCUS_SPEC OQ-12, not in the paper): does the first token of each document, visible to every
query, soften top-1's perplexity (Table 7's 82.9 against 42.8)? Train with it and compare the top-k sweeps:

  retrofit groups=8,sink=1 K8-sink1
  python -m focal_jax.eval.perplexity --workdir /runs/focus_retrofit/gpt2-K8-sink1 --topk all

Centroids initialised by k-means (FOCUS_SPEC OQ-6, as the Routing Transformer; not in the paper) against random ones:

  retrofit groups=8,init=kmeans K8-kmeans

The default cells (K4-dg16, K8-w128, K8-tau0.1, K8-iters10) repeat the runs gpt2-K4 and gpt2-K8.

Evaluation: soft-gated and hard top-k perplexity with pairs retained and dominance for every k (the top-k sweep of
Table 7; Table 9's dominance), at longer sequences (section 4.2: Mistral, centroids trained at 1024, evaluated up to
8192), and the zero-shot benchmarks (Tables 1 to 4; FOCUS_SPEC.md OQ-15: add long-prompt tasks such as gsm8k_cot):

  python -m focal_jax.eval.perplexity --workdir /runs/focus_retrofit/gpt2-K4 --topk all
  for n in 1024 2048 4096 8192; do
    python -m focal_jax.eval.perplexity --workdir /runs/focus_retrofit/Mistral-7B-v0.3-K4 --seq-len $n --topk all
  done
  python -m focal_jax.eval.harness --workdir /runs/focus_retrofit/gpt2-K4 --num_fewshot 0 \\
      --tasks hellaswag,arc_easy,piqa,lambada_openai
  python -m focal_jax.eval.harness --workdir /runs/focus_retrofit/Mistral-7B-Instruct-K2 --num_fewshot 0 \\
      --tasks truthfulqa_mc1,hellaswag,arc_easy,lambada_openai

Where the paper is silent, we chose (FOCUS_SPEC.md OQ-1, OQ-6, OQ-7): AdamW at LR 1e-3 with 100 warmup steps and no
weight decay, and otherwise the Focal paper's recipe (`common.base_config`: betas (0.9, 0.95), global-norm clip 1.0,
cosine decay to 10% of the LR, bf16 compute), batch 8 sequences; lambda 10 for the gate; cosine routing scores; the
base model's own tokenizer.
Data: the paper's PG-19 (one book per .txt file); WikiText-103 and OpenWebText for the other domains of section 6.2.

Tokenizer: the base model's own, the directory's SentencePiece tokenizer.model (LLaMA, Mistral) or else its Hugging
Face tokenizer.json (GPT-2, Qwen2.5, OLMo-2), with bos / eos from its tokenizer_config.json / config.json; without a
bos every document is framed `<eos> doc <eos>`, as GPT-2 was trained (`focal_jax.data.tokenizer`). Mistral v0.1's
sliding window would be refused (Focus brings its own window), hence v0.2 / v0.3.

Arguments: init_from (a focal_jax workdir: its model and tokenizer), hf (a Hugging Face directory: its config.json,
safetensors, and tokenizer.model or tokenizer.json), groups (K), dim (d_g), window (w), tau, iters (Sinkhorn), gate
(paper | log), lam (the gate's lambda), causal (prefix-causal Sinkhorn), sink (the first `sink` tokens of each
document visible to every query; default 0, the paper's), init (random | kmeans: the centroids fitted by k-means to
each layer's projected routing inputs on the first batch, FOCUS_SPEC OQ-6; default random, the paper's), steps, data
(a glob of training files; default: the base run's data, or the builtin corpus), runlocal. One of init_from / hf is
required. The checkpoints hold the centroids only and record the base model.
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, init_from="", hf="", groups=4, steps=4000, data="", init="random",
                           **common.FOCUS_ROUTING)
    config = common.base_config()
    common.start_from(config, init_from=arg.init_from, hf=arg.hf, experiment="focus_retrofit")
    config.retrofit.focus = {"groups": arg.groups, **{k: arg[k] for k in common.FOCUS_ROUTING}, "init": arg.init}
    config.optim.update(trainable="centroids", lr=1e-3, warmup_steps=100, weight_decay=0.0)
    common.set_data(config, arg.data)
    config = common.finetune_schedule(config, steps=arg.steps, local=arg.runlocal)
    return config
