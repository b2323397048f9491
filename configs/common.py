"""Shared pieces of experiment configs: the argument string, the Focal paper's recipe, the runlocal shrink.

An experiment file defines `get_config(arg)`; `arg` is the text after the colon in
`--config experiments/X.py:ARG`, e.g. `runlocal,size=400M,variant=focal`.
"""

import ml_collections

from focal_jax.train.config import default_config

# Peak learning rates of the Focal paper's sizes (FOCAL_SPEC.md section 3.1, Table 4).
FOCAL_LR = {"400M": 4e-3, "777M": 2e-3, "1.3B": 1e-3, "2.7B": 5e-4, "6.7B": 4e-4, "9.5B": 4e-4}

# Attention settings of the Focal paper's three variants.
FOCAL_VARIANTS = {
    "baseline": {"kind": "dense"},
    "focal": {"kind": "focal", "focal_t": 0.4},
    "learned": {"kind": "focal_learned", "tau_min": 5.0, "tau_max": 10.0},
}


def _convert(name: str, text: str, default):
    if isinstance(default, bool):
        if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"config argument {name}={text!r} must be a boolean")
        return text.lower() in ("1", "true", "yes")
    if default is None or isinstance(default, str):
        return text
    try:
        return type(default)(text)
    except ValueError:
        raise ValueError(f"config argument {name}={text!r} must be a {type(default).__name__}") from None


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """Parse `'runlocal,size=400M'` into a ConfigDict over `defaults` (each known name with its default value;
    a bare name sets a boolean to True). Unknown names fail with the list of known ones.

    Example:
      >>> parse_arg('runlocal,size=tiny,steps=5', runlocal=False, size='400M', steps=10).to_dict()
      {'runlocal': True, 'size': 'tiny', 'steps': 5}
    """
    result = ml_collections.ConfigDict(defaults)
    for item in filter(None, (arg or "").split(",")):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in defaults:
            raise ValueError(f"unknown config argument {name!r}; known: {sorted(defaults)}")
        if not _:
            if not isinstance(defaults[name], bool):
                raise ValueError(f"config argument {name!r} needs a value ({name}=...)")
            value = "true"
        result[name] = _convert(name, value.strip(), defaults[name])
    return result


def base_config() -> ml_collections.ConfigDict:
    """The trainer's defaults (`focal_jax.train.config.default_config`) with the Focal paper's optimizer recipe:
    AdamW (0.9, 0.95), weight decay 0.05, clip 1.0, 2000 warmup steps, cosine to 10%, bf16 compute."""
    config = default_config()
    config.optim.update(b1=0.9, b2=0.95, weight_decay=0.05, clip=1.0, warmup_steps=2000, final_lr_fraction=0.1)
    config.compute_dtype = "bfloat16"
    return config


def runlocal(config: ml_collections.ConfigDict, *, steps: int = 20) -> ml_collections.ConfigDict:
    """Shrink any config to a seconds-long CPU smoke run: the tiny LLaMA (keeping the attention settings) or a
    tiny GPT-2, short sequences, small batches, float32, frequent logs and checkpoints."""
    model = config.model.to_dict()
    if model.get("family", "llama") == "llama":
        attn = model.get("attn", {})
        config.model = ml_collections.ConfigDict({"family": "llama", "size": "tiny",
                                                  "vocab_size": 512, "attn": attn})
    elif model["family"] == "gpt2":
        model.update(vocab_size=512, n_positions=128, d_model=64, n_layers=2, n_heads=4)
        config.model = ml_collections.ConfigDict(model)
    config.data.update(vocab_size=512, seq_len=64)
    config.batch_size = 4
    config.total_steps = steps
    config.log_every = 1
    config.eval_every = steps
    config.eval_batches = 1
    config.ckpt_every = steps
    config.compute_dtype = "float32"
    config.optim.warmup_steps = min(config.optim.warmup_steps, steps // 4)
    config.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
    return config
