"""Focal paper, temperature ablations (Figure 8, FOCAL_SPEC.md section 6): the 2.7B model trained on 26B tokens with
the recipe of `focal_scaling.py` (0.26M-token batches of 128 x 2048, 100K steps, peak LR 5e-4), varying
- the constant temperature t in {0.3, 0.4, 0.5, 0.6} against t = 1 (the paper: every t < 1 beats t = 1, 0.4 best);
- the learned temperature's clip: tau_min in {1, ..., 7} with tau_max 10 (5 best), and tau_max 11.31 (= sqrt(128),
  the baseline's scale) against 10 (10 marginally better).

  DATA=/data/redpajama/*.jsonl
  for t in 0.3 0.4 0.5 0.6 1.0; do
    python -m focal_jax.train --config "experiments/focal_temperature_ablation.py:t=$t,data=$DATA" \\
        --workdir /runs/focal_ablation/t$t
  done
  for tau_min in 1 2 3 4 5 6 7; do
    python -m focal_jax.train \\
        --config "experiments/focal_temperature_ablation.py:learned,tau_min=$tau_min,data=$DATA" \\
        --workdir /runs/focal_ablation/tau_min$tau_min
  done
  python -m focal_jax.train --config "experiments/focal_temperature_ablation.py:learned,tau_max=11.31,data=$DATA" \\
      --workdir /runs/focal_ablation/tau_max11.31

t = 0.4, t = 1.0 and tau_min = 5 are the 2.7B focal, baseline and learned runs of `focal_scaling.py` (the same
config): reuse those if they exist. Figure 8 plots the LM-eval average of each run, evaluated as in
`focal_scaling.py` (`python -m focal_jax.eval.harness --workdir DIR --num_fewshot 0 --tasks ...`).

Where the paper is silent, we chose: the model size and token budget of the tau ablation are not stated, so it uses
the same 2.7B / 26B setup (FOCAL_SPEC.md section 6, inferred); t = 1 runs the plain dense attention (bit-identical
to focal with t = 1). The learned temperature starts at the middle of its clip (the bias b_tau, FOCAL_SPEC OQ-F4),
so the tau ablation moves the starting tau with the clip as well (5.5 at tau_min = 1, 7.5 at 5, 8.5 at 7; 8.155 at
tau_max = 11.31): it varies both, where the paper's literal form (no bias) starts every arm at tau_min. Data,
tokenizer, learned-tau form and `impl` as in `focal_scaling.py`.

Arguments: t (the constant temperature; 1.0 is the baseline), learned (use the learned temperature instead),
tau_min, tau_max (its clip, only with learned), size (default 2.7B), data, impl, runlocal.
"""

from focal_jax.configs import common


def get_config(arg=None):
    arg = common.parse_arg(arg, runlocal=False, t=0.4, learned=False, tau_min=5.0, tau_max=10.0, size="2.7B",
                           data="", impl="xla")
    if arg.learned:
        if arg.t != 0.4:
            raise ValueError(f"config argument t={arg.t!r} is the constant temperature; 'learned' learns it "
                             f"within [tau_min, tau_max]: drop t or drop learned")
        attn = {"kind": "focal_learned", "tau_min": arg.tau_min, "tau_max": arg.tau_max}
    else:
        if (arg.tau_min, arg.tau_max) != (5.0, 10.0):
            raise ValueError(f"config arguments tau_min={arg.tau_min!r}, tau_max={arg.tau_max!r} set the learned "
                             f"temperature's clip: add 'learned'")
        common.check_positive("t", arg.t)
        attn = {"kind": "dense"} if arg.t == 1.0 else {"kind": "focal", "focal_t": arg.t}
    config = common.focal_pretraining(arg.size, {**attn, "impl": arg.impl})
    common.set_data(config, arg.data)
    if arg.runlocal:
        config.model.attn.impl = "xla"
        config = common.runlocal(config)
    return config
