"""configs/common.py and the experiments' argument strings (`--config FILE:ARG`)."""

import os

import pytest

from focal_jax.configs import common
from helpers import load_experiment


def test_parse_arg_refuses_a_name_given_twice():
    with pytest.raises(ValueError, match=r"config argument 'attn' is given twice \('attn=focal' and 'attn=baseline'\)"):
        common.parse_arg("runlocal,attn=focal,attn=baseline", runlocal=False, attn="focal")
    with pytest.raises(ValueError, match=r"config argument 'runlocal' is given twice"):
        common.parse_arg("runlocal,runlocal", runlocal=False)
    with pytest.raises(ValueError, match=r"config argument 'variant' is given twice"):
        load_experiment("focal_scaling", "variant=focal,size=400M,variant=baseline")
    assert common.parse_arg("runlocal,attn=baseline", runlocal=False, attn="focal").to_dict() == {
        "runlocal": True, "attn": "baseline"}


@pytest.mark.parametrize("seq_len", ["0", "-1", "-2048"])
def test_a_sequence_length_below_one_is_named(seq_len):
    with pytest.raises(ValueError, match=rf"config argument seq_len={seq_len} must be an integer >= 1"):
        load_experiment("focal_scaling", f"seq_len={seq_len}")
    with pytest.raises(ValueError, match=r"seq_len=0 must be an integer >= 1"):
        common.batch_size(2**18, 0)


@pytest.mark.parametrize("local", ["", "runlocal,"])
def test_focus_sparse_from_a_run_reads_with_that_runs_tokenizer(tmp_path, monkeypatch, local):
    """A run that starts from another one's weights must tokenize as that run did (its workdir copy), as every
    other experiment with init_from does; a trained tokenizer of its own gives the token ids another meaning."""
    (tmp_path / "tokenizer.model").write_bytes(b"")
    monkeypatch.setattr(common, "base_run", lambda workdir: {"model": {
        "family": "llama", "size": "tiny", "attn": {"kind": "focus", "focus_groups": 4, "focus_window": 8}}})
    config = load_experiment("focus_sparse", f"{local}init_from={tmp_path}")
    assert config.init_from == str(tmp_path)
    assert config.data.tokenizer == str(tmp_path / "tokenizer.model")
    assert load_experiment("focus_sparse", local.rstrip(",")).data.tokenizer is None
    with pytest.raises(ValueError, match="is not a focal_jax run directory with its tokenizer"):
        load_experiment("focus_sparse", f"{local}init_from={tmp_path / 'missing'}")


def test_focal_runs_from_a_base_check_its_variant(tmp_path, monkeypatch):
    """focal_long_context's variant is the base run's and focal_adapt starts from a baseline: a base run of another
    attention kind is refused by name (before, a baseline extended with the default variant=focal trained t = 0.4)."""
    kinds = {"baseline": "dense", "focal": "focal"}
    base = {name: str(tmp_path / name) for name in kinds}
    for name in kinds:
        (tmp_path / name).mkdir()
    monkeypatch.setattr(common, "base_run", lambda workdir: {"model": {
        "family": "llama", "size": "2.7B", "attn": {"kind": kinds[os.path.basename(workdir)]}}})
    monkeypatch.setattr(common, "run_tokenizer", lambda workdir: os.path.join(workdir, "tokenizer.model"))
    for variant in kinds:
        config = load_experiment("focal_long_context", f"init_from={base[variant]},variant={variant}")
        assert config.model.attn.kind == kinds[variant]
    with pytest.raises(ValueError, match=r"kind='dense', but variant=focal starts from a LLaMA run with kind in "
                                         r"\('focal',\)"):
        load_experiment("focal_long_context", f"init_from={base['baseline']}")  # the default variant is focal
    with pytest.raises(ValueError, match=r"kind='focal', but variant=baseline"):
        load_experiment("focal_long_context", f"init_from={base['focal']},variant=baseline")
    for t in ("0.4", "1.0"):
        assert load_experiment("focal_adapt", f"init_from={base['baseline']},t={t}").init_from == base["baseline"]
    with pytest.raises(ValueError, match=r"kind='focal', but focal_adapt \(a baseline"):
        load_experiment("focal_adapt", f"init_from={base['focal']},t=0.4")


@pytest.mark.parametrize("name, extra", [("focus_retrofit", ""), ("focus_finetune", ",attn=dense"),
                                         ("focus_window_baseline", ""), ("lora_baseline", "")])
def test_data_of_a_run_from_a_base_holds_out_its_own_documents(tmp_path, monkeypatch, name, extra):
    """`data=GLOB` on a run that starts from a base run: the base's held-out files (and jsonl field) belong to the
    base's corpus; kept, they were read as the new source type (a .txt eval file parsed as jsonl: 'not valid
    JSON'), or evaluated the new run on the old domain."""
    (tmp_path / "base").mkdir()
    base = {"model": {"family": "llama", "size": "tiny", "attn": {"kind": "dense"}}, "retrofit": {},
            "data": {"source": "jsonl", "paths": ["/old/*.jsonl"], "eval_paths": ["/old_val/*.jsonl"],
                     "field": "content", "streaming": True}}
    monkeypatch.setattr(common, "base_run", lambda workdir: base)
    monkeypatch.setattr(common, "run_tokenizer", lambda workdir: os.path.join(workdir, "tokenizer.model"))
    config = load_experiment(name, f"init_from={tmp_path / 'base'},data=/new/*.txt{extra}")
    assert (config.data.source, tuple(config.data.paths)) == ("text", ("/new/*.txt",))
    assert (tuple(config.data.eval_paths), config.data.field) == ((), "text")
    kept = load_experiment(name, f"init_from={tmp_path / 'base'}{extra}")  # no data=: the base run's data, whole
    assert (tuple(kept.data.eval_paths), kept.data.field) == (("/old_val/*.jsonl",), "content")


@pytest.mark.parametrize("alpha", ["inf"])
def test_lora_baseline_refuses_an_infinite_alpha(tmp_path, alpha):
    """`lora_baseline.py:...,alpha=inf` trained NaN from step 1 (the update inf * 0 at lora_b's zero init)."""
    from focal_jax.nn.lora import LoRAConfig
    from focal_jax.train.config import check_config

    (tmp_path / "tokenizer.model").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    config = load_experiment("lora_baseline", f"hf={tmp_path},alpha={alpha}")
    with pytest.raises(ValueError, match=rf"LoRAConfig: alpha must be a finite number > 0, got alpha={alpha}"):
        check_config(config)
    with pytest.raises(ValueError, match="alpha=inf"):
        LoRAConfig(rank=4, alpha=float("inf"))
    assert check_config(load_experiment("lora_baseline", f"hf={tmp_path},alpha=8")).retrofit[0].alpha == 8.0


def test_focus_scratch_dense_refuses_routing_arguments():
    """`attn=dense,groups=8` trained the dense control, silently ignoring the routing it was given."""
    with pytest.raises(ValueError, match=r"\{'groups': 8\} set the Focus routing, which attn=dense does not have"):
        load_experiment("focus_scratch", "runlocal,attn=dense,groups=8")
    assert load_experiment("focus_scratch", "runlocal,attn=dense").model.attn.kind == "dense"
    assert load_experiment("focus_scratch", "runlocal,groups=8").model.attn.focus_groups == 8


def test_the_focus_experiments_take_an_attention_sink(tmp_path):
    """`sink=n` (FOCUS_SPEC OQ-12) reaches the retrofit's Focus settings and the from-scratch model's layers; the
    dense control refuses it, as any routing argument. The retrofit takes `init=kmeans` too."""
    from focal_jax.train.config import check_config

    (tmp_path / "tokenizer.model").write_bytes(b"")
    (tmp_path / "config.json").write_text("{}")
    retrofit = check_config(load_experiment("focus_retrofit", f"hf={tmp_path},groups=8,sink=1"))
    assert retrofit.retrofit[0].attention_fields()["focus_sink"] == 1
    assert load_experiment("focus_retrofit", f"hf={tmp_path}").retrofit.focus.sink == 0
    kmeans = check_config(load_experiment("focus_retrofit", f"hf={tmp_path},init=kmeans"))  # FOCUS_SPEC OQ-6
    assert kmeans.retrofit[0].init == "kmeans" and "focus_init" not in kmeans.retrofit[0].attention_fields()
    assert load_experiment("focus_scratch", "runlocal,sink=2").model.attn.focus_sink == 2
    with pytest.raises(ValueError, match=r"\{'sink': 2\} set the Focus routing, which attn=dense does not have"):
        load_experiment("focus_scratch", "runlocal,attn=dense,sink=2")


@pytest.mark.parametrize("name, arg, head_dim, tau_range", [
    ("focal_scaling", "variant=learned", 128, (5.0, 10.0)),
    ("focal_token_scaling", "variant=learned", 128, (5.0, 10.0)),
    ("focal_temperature_ablation", "learned,tau_min=3", 128, (3.0, 10.0)),
    ("quickstart", "attn=learned", 32, (2.5, 5.0)),
    ("focal_scaling", "runlocal,variant=learned", 16, (5.0 / 8**0.5, 10.0 / 8**0.5)),
    ("focal_temperature_ablation", "runlocal,learned,tau_min=3", 16, (3.0 / 8**0.5, 10.0 / 8**0.5)),
    ("quickstart", "runlocal,attn=learned", 16, (2.5 / 2**0.5, 5.0 / 2**0.5))])
def test_the_learned_temperature_range_follows_the_head_dim(name, arg, head_dim, tau_range):
    """The learned temperature replaces sqrt(head_dim), so the paper's [5, 10] (head_dim 128) is rescaled by
    sqrt(head_dim / 128) elsewhere (FOCAL_SPEC.md OQ-F6): the quickstart's head_dim 32 took [5, 10], a temperature
    1.25 to 2.5 times sqrt(32), softer than its baseline's."""
    from focal_jax.train.config import check_config
    attention = check_config(load_experiment(name, arg)).model.attention
    assert (attention.kind, attention.head_dim) == ("focal_learned", head_dim)
    assert (attention.tau_min, attention.tau_max) == pytest.approx(tau_range, rel=1e-12)


def test_focal_variant_refuses_an_unknown_name():
    assert common.focal_variant("focal", head_dim=32) == {"kind": "focal", "focal_t": 0.4}
    with pytest.raises(ValueError, match=r"config argument variant='sharp' is not one of \('baseline', 'focal', "):
        common.focal_variant("sharp")


@pytest.mark.parametrize("stored_eps, stored_doc_mask, eps, doc_mask", [(None, None, 1e-6, True),
                                                                         (1e-5, False, 1e-5, False)])
def test_focal_runs_from_a_base_keep_its_norm_eps_and_packing(tmp_path, monkeypatch, stored_eps, stored_doc_mask, eps,
                                                              doc_mask):
    """The Focal pretraining runs take FOCAL_SPEC section 2's RMSNorm eps 1e-5 and N(0, 0.02^2) weights (before
    0.6.22: 1e-6, `focal_config`'s, and Flax's initialisers) and OQ-F9's plain causal rows (before 0.6.23: documents
    masked); a run that continues one keeps its eps and its packing, whichever."""
    from focal_jax.train.config import check_config
    pretraining = check_config(load_experiment("focal_scaling", "size=2.7B"))
    assert (pretraining.model.norm_eps, pretraining.model.init_std, pretraining.data.doc_mask) == (1e-5, 0.02, False)
    (tmp_path / "base").mkdir()
    model = {"family": "llama", "size": "2.7B", "attn": {"kind": "dense"}}
    monkeypatch.setattr(common, "base_run", lambda workdir: {
        "model": {**model, **({} if stored_eps is None else {"norm_eps": stored_eps})},
        "data": {"source": "builtin", **({} if stored_doc_mask is None else {"doc_mask": stored_doc_mask})}})
    monkeypatch.setattr(common, "run_tokenizer", lambda workdir: os.path.join(workdir, "tokenizer.model"))
    for name, arg in (("focal_adapt", "t=0.4"), ("focal_long_context", "variant=baseline")):
        run = check_config(load_experiment(name, f"init_from={tmp_path / 'base'},{arg}"))
        assert (run.model.norm_eps, run.data.doc_mask) == (eps, doc_mask)
