"""A trained focal_jax run as a Hugging Face directory that `transformers` loads, with its tokenizer:

  python -m focal_jax.convert.export --workdir RUN --out DIR [--step S] [--dtype bfloat16] [--as-dense]

then `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)`. The model goes through
`focal_jax.convert.hf.to_hf`: dense attention, or Focal with a constant t folded into the queries; LoRA factors are
merged into the kernels first. The tokenizer and the special token ids:
- a run that descends from a Hugging Face directory (its `init_from`, or its base run's, recursively) and trained
  with its tokenizer takes that directory's tokenizer files, generation config and special token ids
  (`to_hf(source=)`);
- any other run writes its own tokenizer (the workdir's copy): a SentencePiece `tokenizer.model` with a
  `tokenizer_config.json` for transformers' `LlamaTokenizer` that encodes as the run's data pipeline did (its bos
  first, no space put before the text), or a `tokenizer.json` with its special tokens; their ids go into
  config.json (`bos_token_id`, `eos_token_id`, `pad_token_id`), so that `generate` stops at the run's eos.

Focus and learned-Focal attention have no transformers layer. A Focus model is refused unless `--as-dense`, which
writes it with dense attention (Focal's constant t kept for 'focal+focus'): every pair visible, so its logits equal
the run's only on inputs of at most window + 1 tokens. A learned temperature depends on each input and cannot
be folded into the weights: it is always refused.
"""

import argparse
import filecmp
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from focal_jax._validation import output_dir_error
from focal_jax.convert.hf import to_hf
from focal_jax.data.tokenizer import HF_CONFIG_FILE, copy_tokenizer, tokenizer_file, workdir_tokenizer
from focal_jax.nn.lora import LoRA, merge_lora
from focal_jax.nn.models import attention_layers
from focal_jax.nn.retrofit import replace_attention
from focal_jax.train import checkpoint
from focal_jax.train.config import DTYPES

FOCUS_AS_DENSE = {"focus": "dense", "focal+focus": "focal"}


def hf_source(workdir: str) -> str | None:
    """The Hugging Face directory the run in `workdir` descends from: its `init_from`, or that of the run it
    started from, recursively; None for a run from scratch (or from runs from scratch)."""
    init_from = checkpoint.stored_config(checkpoint.read_meta(workdir)[1]).get("init_from")
    if not init_from:
        return None
    return init_from if checkpoint.is_hf_directory(init_from) else hf_source(init_from)


def exportable(model, *, as_dense: bool = False, progress=print):
    """`model` (a `Llama` or `GPT2`) changed in place into what `to_hf` writes: LoRA merged into the kernels, and
    with `as_dense`, Focus attention viewed as dense ('focal+focus' as 'focal', its t kept; the routing parameters
    stay, unused). ValueError for a Focus model without `as_dense`, and for a learned temperature."""
    kinds = sorted({layer.config.kind for layer in attention_layers(model)})
    if "focal_learned" in kinds:
        raise ValueError(f"the model's attention kind is {kinds}: a learned temperature depends on each input, so it "
                         f"cannot be folded into the weights, and transformers has no such layer")
    focus = [kind for kind in kinds if kind in FOCUS_AS_DENSE]
    if focus and not as_dense:
        raise ValueError(f"the model's attention kind is {focus[0]!r}, which transformers has no layer for: "
                         f"--as-dense (as_dense=True) writes it with {FOCUS_AS_DENSE[focus[0]]!r} attention, every "
                         f"pair visible, which equals the run only on inputs of at most window + 1 tokens")
    if jax.tree.leaves(nnx.state(model, LoRA)):
        merge_lora(model)
        progress("export: LoRA factors merged into the kernels")
    if focus:
        replace_attention(model, kind=FOCUS_AS_DENSE[focus[0]], allow_unused=True)
        progress(f"export: {focus[0]!r} attention written as {FOCUS_AS_DENSE[focus[0]]!r}; its routing "
                 f"(centroids and projections) is left out")
    return model


def same_tokenizer(workdir: str, source: str) -> bool:
    """Whether the run in `workdir` trained with the tokenizer of the Hugging Face directory `source` (the same
    file, byte for byte), which then has tokenizer files to copy."""
    try:
        theirs = tokenizer_file(source)
    except FileNotFoundError:
        return False
    ours = tokenizer_file(workdir)
    return os.path.basename(ours) == os.path.basename(theirs) and filecmp.cmp(ours, theirs, shallow=False)


def tokenizer_files(workdir: str, directory: str) -> dict:
    """Write the tokenizer of the run in `workdir` into the Hugging Face `directory` for `AutoTokenizer`, as the
    module docstring says; returns its special token ids `{'bos_token_id': ..., 'eos_token_id': ...,
    'pad_token_id': ...}` (the ones it has)."""
    tokenizer = copy_tokenizer(workdir_tokenizer(workdir), directory)
    special = tokenizer.special_tokens()
    if tokenizer.kind == "huggingface":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    else:
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": tokenizer.bos_id is not None,
                  "add_eos_token": False, "add_prefix_space": False, "legacy": False, **special}
    with open(os.path.join(directory, HF_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {key: value for key, value in ids.items() if value is not None}


def export_run(workdir: str, directory: str, *, step: int | None = None, dtype=jnp.float32, as_dense: bool = False,
               progress=print) -> str:
    """Write checkpoint `step` (default the latest) of the focal_jax run in `workdir` into the Hugging Face
    `directory` (created if missing; it must be empty), parameters as `dtype`, with its tokenizer (module
    docstring); returns `directory`. ValueError for a directory with files in it, a step the run has not saved, a
    model `exportable` refuses, or one `to_hf` cannot write (a logit softcap, a sliding window on GPT-2)."""
    from focal_jax.train.trainer import cast_floats, load_model  # the training stack, which imports this package

    if os.path.isdir(directory) and os.listdir(directory):
        raise ValueError(f"{directory!r} is not empty: give a new or empty directory (files left there would mix "
                         f"with the export's)")
    model = exportable(load_model(workdir, step=step), as_dense=as_dense, progress=progress)
    step = checkpoint.read_meta(workdir, step)[0]
    nnx.update(model, cast_floats(nnx.state(model), dtype))
    source = hf_source(workdir)
    if source is not None and not same_tokenizer(workdir, source):
        progress(f"export: the run's tokenizer is not that of {source}, so neither its tokenizer files nor its "
                 f"special token ids are taken")
        source = None
    to_hf(model, directory, source=source, allow_unused=as_dense)
    if source is None:
        ids = tokenizer_files(workdir, directory)
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({**config, **ids}, f, indent=2)
    size = os.path.getsize(os.path.join(directory, "model.safetensors")) / 2**20
    progress(f"export: {workdir} step {step} -> {directory} ({type(model).__name__}, {size:.1f} MiB of "
             f"{jnp.dtype(dtype).name} tensors; tokenizer {'and token ids of ' + source if source else 'of the run'})")
    return directory


def main(argv=None) -> str:
    """`python -m focal_jax.convert.export --workdir RUN --out DIR [--step S] [--dtype float32|bfloat16]
    [--as-dense]`: the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.convert.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="a focal_jax training run directory")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write (created if missing)")
    parser.add_argument("--step", type=int, default=None, help="a saved checkpoint step (default: the latest)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="of the written tensors (default float32)")
    parser.add_argument("--as-dense", action="store_true",
                        help="write a Focus model with dense attention (its routing left out)")
    args = parser.parse_args(argv)
    if problem := output_dir_error("--out", args.out):
        parser.error(problem)
    try:
        return export_run(args.workdir, args.out, step=args.step, dtype=DTYPES[args.dtype], as_dense=args.as_dense)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
