"""Shared pieces of experiment configs: the argument string, the Focal paper's recipe, the Focus paper's settings,
data files, runs to start from, the runlocal shrink.

An experiment file defines `get_config(arg)`; `arg` is the text after the colon in
`--config experiments/X.py:ARG`, e.g. `runlocal,size=400M,variant=focal`.
"""

import math
import os

import ml_collections

from focal_jax.nn.llama import focal_config
from focal_jax.train.config import built_model_section, default_config, model_config, task_kwargs_dict

# Peak learning rates of the Focal paper's sizes (FOCAL_SPEC.md section 3.1, Table 4).
FOCAL_LR = {"400M": 4e-3, "777M": 2e-3, "1.3B": 1e-3, "2.7B": 5e-4, "6.7B": 4e-4, "9.5B": 4e-4}

# Attention settings of the Focal paper's three variants, for its head_dim 128 (`focal_variant` for others).
FOCAL_VARIANTS = {
    "baseline": {"kind": "dense"},
    "focal": {"kind": "focal", "focal_t": 0.4},
    "learned": {"kind": "focal_learned", "tau_min": 5.0, "tau_max": 10.0},
}


def focal_variant(name: str, head_dim: int = 128) -> dict:
    """The attention settings of the Focal paper's variant `name` (a key of `FOCAL_VARIANTS`) for heads of
    `head_dim`. The learned temperature replaces sqrt(head_dim), so its clip range [5, 10], tuned at head_dim 128,
    is rescaled by sqrt(head_dim / 128) for other head dims (FOCAL_SPEC.md OQ-F6): [2.5, 5] at 32."""
    check_choice("variant", name, FOCAL_VARIANTS)
    return rescaled_tau_range(FOCAL_VARIANTS[name], 128, head_dim)


def rescaled_tau_range(attn: dict, from_head_dim: int, to_head_dim: int) -> dict:
    """`attn` with a learned temperature's `tau_min` / `tau_max` (if set) times sqrt(to_head_dim / from_head_dim):
    the same range relative to sqrt(head_dim) (FOCAL_SPEC.md OQ-F6)."""
    factor = math.sqrt(to_head_dim / from_head_dim)
    return {key: value * factor if key in ("tau_min", "tau_max") and attn.get("kind") == "focal_learned" else value
            for key, value in attn.items()}


# The Focal paper's batches in tokens (FOCAL_SPEC.md sections 3.1 and 3.3): "0.26M" = 2^18 = 128 x 2048 and
# "2.1M" = 2^21 = 1024 x 2048.
FOCAL_BATCH_TOKENS = 2**18
FOCAL_LARGE_BATCH_TOKENS = 2**21

# The Focus paper's routing defaults (FOCUS_SPEC.md App. B and section 2.5): d_g 16, window 128, Sinkhorn tau 0.1
# and 10 iterations, the literal Eq. 2 gate with lambda 10 (the paper gives no lambda; OQ-1), non-causal Sinkhorn.
FOCUS_ROUTING = {"dim": 16, "window": 128, "tau": 0.1, "iters": 10, "gate": "paper", "lam": 10.0, "causal": False,
                 "sink": 0}

# Mistral-7B's architecture (v0.1 config, without its 4096-token sliding window): the Focus paper's from-scratch
# model (FOCUS_SPEC.md section 6.3).
MISTRAL_7B = {"vocab_size": 32000, "d_model": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8,
              "intermediate": 14336, "rope_theta": 10000.0, "norm_eps": 1e-5}

# Data file types by name ending (`data=` arguments).
DATA_SOURCES = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet", ".array_record": "array_record"}


def check_choice(name: str, value, choices):
    """Raise ValueError naming the config argument unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"config argument {name}={value!r} is not one of {tuple(choices)}")


def check_positive(name: str, value):
    """Raise ValueError naming the config argument unless `value` is a number > 0."""
    if not value > 0:
        raise ValueError(f"config argument {name}={value!r} must be > 0")


def batch_size(batch_tokens: int, seq_len: int) -> int:
    """Sequences per step for a batch of `batch_tokens` tokens, e.g. `batch_size(2**18, 4096) == 64`."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"config argument seq_len={seq_len!r} must be an integer >= 1")
    if batch_tokens % seq_len:
        raise ValueError(f"a batch of {batch_tokens} tokens is not a whole number of {seq_len}-token sequences")
    return batch_tokens // seq_len


def set_data(config: ml_collections.ConfigDict, pattern: str) -> ml_collections.ConfigDict:
    """Read the training documents from the files matching `pattern` (a glob; the source type from its ending:
    .txt one document per file, .jsonl / .parquet the 'text' field or column, .array_record), streamed
    (`data.streaming`: read lazily while training, as the papers' corpora need; `--config.data.streaming=False`
    reads them into memory instead), held out by `data.eval_fraction` (the held-out files and the field of a
    base run's corpus, which `start_from` copied, belong to that corpus: `--config.data.eval_paths` sets files of
    this one); '' keeps the builtin corpus (or the base run's data)."""
    if pattern:
        ending = next((e for e in DATA_SOURCES if pattern.endswith(e)), None)
        if ending is None:
            raise ValueError(f"config argument data={pattern!r} must end in one of {tuple(DATA_SOURCES)}")
        config.data.update(source=DATA_SOURCES[ending], paths=(pattern,), streaming=True, eval_paths=(),
                           field="text")
    return config


def focal_pretraining(size: str, attn: dict, *, seq_len: int = 2048, batch_tokens: int = FOCAL_BATCH_TOKENS,
                      steps: int = 100_000, lr: float | None = None) -> ml_collections.ConfigDict:
    """The Focal paper's pretraining run (FOCAL_SPEC.md section 3.1): the model of `size` (Table 3) with attention
    settings `attn`, `batch_tokens` per step in `seq_len`-token sequences, `steps` steps at the size's peak LR
    (Table 4) unless `lr` is given, the recipe of `base_config`, a 32000-piece tokenizer (the paper's LLaMA
    tokenizer has 32000; we train a BPE of that size on the corpus unless `--config.data.tokenizer` is set), and
    FOCAL_SPEC.md section 2's choices where the paper is silent: RMSNorm eps 1e-5, weights drawn from N(0, 0.02^2)
    (`LlamaConfig.init_std`), and plain causal attention over each packed row (`data.doc_mask=False`, OQ-F9: the
    documents of a row are not masked from each other, nor from a learned temperature's prefix mean)."""
    check_choice("size", size, FOCAL_LR)
    config = base_config()
    config.model = {"family": "llama", "size": size, "attn": dict(attn), "norm_eps": 1e-5, "init_std": 0.02}
    config.data.update(source="builtin", vocab_size=32000, seq_len=seq_len, doc_mask=False)
    config.batch_size = batch_size(batch_tokens, seq_len)
    config.total_steps = steps
    config.optim.lr = FOCAL_LR[size] if lr is None else lr
    config.log_every = 100
    config.eval_every = 5000
    config.eval_batches = 20
    config.ckpt_every = 5000
    return config


def run_tokenizer(workdir: str) -> str:
    """The tokenizer file a focal_jax run was trained with (its workdir copy: WORKDIR/tokenizer.model, or
    WORKDIR/tokenizer.json with its tokenizer_config.json): a run that starts from it must tokenize as it did,
    whatever its own data."""
    from focal_jax.data.tokenizer import tokenizer_file

    try:
        return tokenizer_file(workdir)
    except FileNotFoundError as e:
        raise ValueError(f"init_from={workdir!r} is not a focal_jax run directory with its tokenizer: {e}") from None


def base_run(workdir: str) -> dict:
    """The stored config (a dict) of a focal_jax run directory, e.g. the base model of a retrofit."""
    from focal_jax.train.checkpoint import read_meta  # imported here: reading configs needs no checkpoint code

    if not os.path.isdir(os.path.expanduser(workdir)):
        raise ValueError(f"init_from={workdir!r} is not a directory (a focal_jax workdir)")
    return read_meta(os.path.expanduser(workdir))[1]["config"]


def check_base_kind(init_from: str, kinds: tuple, argument: str) -> dict:
    """The stored config (`base_run`) of the run `init_from` (family llama), after a ValueError unless its
    attention kind is one of `kinds` (what `argument`, e.g. 'variant=focal', says the base run is)."""
    base = base_run(init_from)
    model = base["model"]
    kind = dict(model.get("attn") or {}).get("kind", "dense")
    if model.get("family", "llama") != "llama" or kind not in kinds:
        raise ValueError(f"init_from={init_from!r} is a {model.get('family', 'llama')} run with attention "
                         f"kind={kind!r}, but {argument} starts from a LLaMA run with kind in {kinds}")
    return base


def norm_eps_of(model: dict) -> float:
    """The RMSNorm eps of a stored model section (a run that continues it must keep it: runs of `focal_pretraining`
    stored before 0.6.22 have `focal_config`'s 1e-6)."""
    return built_model_section(model)["norm_eps"]


def doc_mask_of(run: dict) -> bool:
    """`data.doc_mask` of a stored run config (a run that continues it keeps it: runs stored before 0.6.23, which
    had no such setting, masked documents)."""
    return bool(run.get("data", {}).get("doc_mask", True))


def start_from(config: ml_collections.ConfigDict, *, init_from: str, hf: str, experiment: str) -> dict | None:
    """Points `config` at the model a run starts from: a focal_jax run directory `init_from` (its model, data
    settings and tokenizer) or a Hugging Face directory `hf` (model family 'hf'; its tokenizer.model, else its
    tokenizer.json). Exactly one of the two. Returns the base run's stored config (None for `hf`)."""
    if bool(init_from) == bool(hf):
        raise ValueError(f"{experiment} needs exactly one of init_from=WORKDIR or hf=DIRECTORY")
    config.init_from = init_from or hf
    if hf:
        from focal_jax.data.tokenizer import tokenizer_file

        config.model = {"family": "hf"}
        try:  # tokenizer.model (LLaMA, Mistral), else tokenizer.json (GPT-2, Qwen, OLMo)
            config.data.tokenizer = tokenizer_file(hf)
        except FileNotFoundError as e:
            raise ValueError(f"hf={hf!r} has no tokenizer: {e}") from None
        return None
    base = base_run(init_from)
    config.model = base["model"]
    config.data.update({**base["data"], "task_kwargs": task_kwargs_dict(base["data"].get("task_kwargs"))})
    config.data.tokenizer = run_tokenizer(init_from)
    return base


def finetune_schedule(config: ml_collections.ConfigDict, *, steps: int, local: bool) -> ml_collections.ConfigDict:
    """The schedule of the Focus paper's retrofits and fine-tuning runs: sequences of 1024 tokens, 8 per step,
    `steps` steps, logs every 20, evaluation and checkpoints every 500, float32; `local` shrinks it (`runlocal`)
    around the model the run starts from."""
    config.data.seq_len = 1024
    config.batch_size = 8
    config.total_steps = steps
    config.log_every = 20
    config.eval_every = 500
    config.ckpt_every = 500
    config.compute_dtype = "float32"
    if local:
        config = runlocal(config, model=config.model.to_dict())
    return config


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
    a bare name sets a boolean to True). Unknown names fail with the list of known ones, a name given twice with
    both values.

    Example:
      >>> parse_arg('runlocal,size=tiny,steps=5', runlocal=False, size='400M', steps=10).to_dict()
      {'runlocal': True, 'size': 'tiny', 'steps': 5}
    """
    result = ml_collections.ConfigDict(defaults)
    given = {}
    for item in filter(None, (arg or "").split(",")):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in defaults:
            raise ValueError(f"unknown config argument {name!r}; known: {sorted(defaults)}")
        if name in given:
            raise ValueError(f"config argument {name!r} is given twice ({given[name]!r} and {item.strip()!r}); "
                             f"give it once")
        given[name] = item.strip()
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


def runlocal(config: ml_collections.ConfigDict, *, steps: int = 20, model: dict | None = None
             ) -> ml_collections.ConfigDict:
    """Shrink any config to a seconds-long CPU smoke run: the tiny LLaMA (keeping the attention settings, the
    RoPE theta, norm eps and init std; a learned temperature's range rescaled to its head_dim 16, FOCAL_SPEC.md
    OQ-F6) or a tiny GPT-2, or `model` if given (the model section of a run that starts from another run: that
    run's model), short sequences, small batches, float32, frequent logs and checkpoints. A Focus window (of a
    retrofit or of the model's attention) and a retrofit's sliding window (`retrofit.window`) shrink to 16 so that
    the 64-token sequences reach past them."""
    if model is None:
        model = config.model.to_dict()
        if model.get("family", "llama") == "llama":
            head_dim = model_config(model)[1].attention.head_dim
            attn = rescaled_tau_range(dict(model.get("attn", {})), head_dim, focal_config("tiny").attention.head_dim)
            if "focus_window" in attn:
                attn["focus_window"] = min(attn["focus_window"], 16)
            model = {"family": "llama", "size": "tiny", "vocab_size": 512, "attn": attn,
                     **{key: model[key] for key in ("rope_theta", "norm_eps", "init_std") if key in model}}
        elif model["family"] == "gpt2":
            model.update(vocab_size=512, n_positions=128, d_model=64, n_layers=2, n_heads=4)
    config.model = ml_collections.ConfigDict(model)
    if config.retrofit.get("focus"):
        config.retrofit.focus.window = min(config.retrofit.focus.get("window", 128), 16)
    if config.retrofit.get("window") is not None:
        config.retrofit.window = min(config.retrofit.window, 16)
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
