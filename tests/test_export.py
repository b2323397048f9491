"""`python -m focal_jax.convert.export`: a trained run as a Hugging Face directory. The references are transformers'
own model and tokenizer classes (PyTorch, CPU), loaded from the written directory: their token ids must equal the
run's data pipeline's (`[start_id] + encode(text)`), their logits the run's model's."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from focal_jax.convert import export, hf
from focal_jax.convert.export import main
from focal_jax.data.tokenizer import tokenizer_file, workdir_tokenizer
from focal_jax.nn.retrofit import replace_attention
from focal_jax.train import train, trainer
from helpers import hf_focus_retrofit_config, stored_run_config
from test_eval_perplexity import FOCUS_ATTN, tiny_focus_run
from test_tokenizer_hf import make_tokenizer_json

TEXTS = ["the model attends to its local window", "  two spaces\nand a newline\ttab", "é 中 😀 café", "x=1234", ""]
TOKENS = np.array([[2, 7, 100, 33, 250, 5, 61, 17, 90, 12, 3, 44]])


@pytest.fixture(scope="module")
def focal_run(tmp_path_factory):
    return tiny_focus_run(tmp_path_factory.mktemp("focal"), attn={"kind": "focal", "focal_t": 0.4})


@pytest.fixture(scope="module")
def focus_run(tmp_path_factory):
    return tiny_focus_run(tmp_path_factory.mktemp("focus"))


def hf_logits(directory, tokens=TOKENS) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def our_logits(model, tokens=TOKENS) -> np.ndarray:
    return np.asarray(model(jnp.asarray(tokens)))


def test_a_run_from_scratch_loads_in_transformers_with_its_tokenizer(focal_run, tmp_path, capsys):
    out = str(tmp_path / "hf")
    assert main(["--workdir", focal_run, "--out", out]) == out
    assert "tokenizer of the run" in capsys.readouterr().out
    ours = workdir_tokenizer(focal_run)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == [ours.start_id] + ours.encode(text), text
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 0)
    model = trainer.load_model(focal_run)
    np.testing.assert_allclose(hf_logits(out), our_logits(model), atol=1e-4)
    model_hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model_hf.generation_config.eos_token_id == ours.eos_id


def test_a_run_with_a_tokenizer_json_writes_it(tmp_path):
    """A run from scratch whose tokenizer is a Hugging Face tokenizer.json of GPT-2's kind (no bos: documents start
    with the eos, which a prompt then carries itself, as for GPT-2) writes it with its special tokens."""
    path = make_tokenizer_json(str(tmp_path / "tokenizer"))
    config = stored_run_config(tiny_focus_run(tmp_path / "base", attn={"kind": "dense"}))
    config.data.tokenizer = path
    workdir = str(tmp_path / "run")
    train(config, workdir)
    out = str(tmp_path / "hf")
    main(["--workdir", workdir, "--out", out])
    ours = workdir_tokenizer(workdir)
    assert ours.kind == "huggingface" and ours.bos_id is None
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == ours.encode(text), text
    assert tokenizer.eos_token_id == ours.eos_id == json.load(open(os.path.join(out, "config.json")))["eos_token_id"]
    tokens = [[ours.start_id] + ours.encode(TEXTS[0])]
    np.testing.assert_allclose(hf_logits(out, tokens), our_logits(trainer.load_model(workdir), tokens), atol=1e-4)


def test_bfloat16_and_an_earlier_step(tmp_path):
    workdir = tiny_focus_run(tmp_path, attn={"kind": "dense"}, steps=2)
    out = str(tmp_path / "hf")
    main(["--workdir", workdir, "--out", out, "--step", "1", "--dtype", "bfloat16"])
    with open(os.path.join(out, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    step1 = our_logits(trainer.load_model(workdir, step=1))
    assert not np.allclose(step1, our_logits(trainer.load_model(workdir, step=2)), atol=1e-3)
    np.testing.assert_allclose(hf_logits(out), step1, atol=0.05 * np.abs(step1).max())


def test_a_focus_run_is_refused_unless_written_as_dense(focus_run, tmp_path, capsys):
    out = str(tmp_path / "hf")
    with pytest.raises(SystemExit) as e:
        main(["--workdir", focus_run, "--out", out])
    assert e.value.code == 2
    assert "attention kind is 'focus', which transformers has no layer for: --as-dense" in capsys.readouterr().err
    assert not os.path.exists(out)
    main(["--workdir", focus_run, "--out", out, "--as-dense"])
    assert "'focus' attention written as 'dense'" in capsys.readouterr().out
    model = trainer.load_model(focus_run)
    dense = our_logits(replace_attention(trainer.load_model(focus_run), kind="dense", allow_unused=True))
    np.testing.assert_allclose(hf_logits(out), dense, atol=1e-4)
    # within the window (8) the dense view is the Focus model; beyond it, not
    short = FOCUS_ATTN["focus_window"] + 1
    np.testing.assert_allclose(hf_logits(out, TOKENS[:, :short]), our_logits(model, TOKENS[:, :short]), atol=1e-4)
    assert not np.allclose(dense, our_logits(model), atol=1e-3)


def test_a_learned_temperature_is_refused(tmp_path, capsys):
    workdir = tiny_focus_run(tmp_path, attn={"kind": "focal_learned", "tau_min": 1.5, "tau_max": 3.5})
    with pytest.raises(SystemExit):
        main(["--workdir", workdir, "--out", str(tmp_path / "hf"), "--as-dense"])
    assert "a learned temperature depends on each input" in capsys.readouterr().err


def test_lora_is_merged(focal_run, tmp_path):
    config = stored_run_config(focal_run)
    config.update(init_from=focal_run, total_steps=1)
    config.retrofit.lora = {"rank": 2, "alpha": 4.0}
    config.optim.update(trainable="lora", lr=0.05, warmup_steps=0)
    workdir = str(tmp_path / "lora")
    train(config, workdir)
    model = trainer.load_model(workdir)
    assert not np.allclose(our_logits(model), our_logits(trainer.load_model(focal_run)), atol=1e-4)
    out = str(tmp_path / "hf")
    main(["--workdir", workdir, "--out", out])
    np.testing.assert_allclose(hf_logits(out), our_logits(model), atol=1e-4)


@pytest.mark.parametrize("tokenizer", ["the run's", "none", "another"])
def test_a_run_from_a_hugging_face_directory_takes_its_tokenizer_files(focal_run, tmp_path, tokenizer, capsys):
    """A Focus retrofit of a Hugging Face directory, written as dense: the directory's tokenizer files, special ids
    and generation config are copied when the run trained with its tokenizer (also for a second run that started
    from the retrofit); a directory without a tokenizer, or with another one than the run's, gives the run's own.
    Either way, with the routing left out, the logits are the directory's."""
    source = str(tmp_path / "source")
    dense = trainer.load_model(focal_run)
    replace_attention(dense, kind="dense")
    hf.to_hf(dense, source)
    if tokenizer != "none":
        shutil.copy(os.path.join(focal_run, "tokenizer.model"), source)
        json.dump({"eos_token_id": 3, "marker": "source"}, open(os.path.join(source, "generation_config.json"), "w"))
    if tokenizer == "another":
        with open(os.path.join(source, "tokenizer.model"), "ab") as f:
            f.write(b"\0")
    config = hf_focus_retrofit_config(focal_run, source, window=4)
    runs = [str(tmp_path / "retrofit")]
    train(config, runs[0])
    if tokenizer == "the run's":  # a second phase, which descends from the directory through the first
        config.update(init_from=runs[0])
        config.retrofit.focus = None
        runs.append(str(tmp_path / "phase2"))
        train(config, runs[1])
    for i, workdir in enumerate(runs):
        assert export.hf_source(workdir) == source
        out = str(tmp_path / f"hf{i}")
        capsys.readouterr()
        main(["--workdir", workdir, "--out", out, "--as-dense"])
        printed = capsys.readouterr().out
        assert ("tokenizer and token ids of " + source in printed) == (tokenizer == "the run's")
        assert (f"the run's tokenizer is not that of {source}" in printed) == (tokenizer != "the run's")
        assert os.path.exists(os.path.join(out, "generation_config.json")) == (tokenizer == "the run's")
        with open(os.path.join(out, "tokenizer.model"), "rb") as f, open(tokenizer_file(workdir), "rb") as g:
            assert f.read() == g.read()
        if tokenizer != "the run's":
            assert json.load(open(os.path.join(out, "config.json")))["eos_token_id"] == 3
        np.testing.assert_allclose(hf_logits(out), hf_logits(source), atol=1e-5)


def test_bad_arguments_name_themselves(focal_run, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    for args, message in ((["--out", str(taken)], "is not empty"),
                          (["--out", str(tmp_path / "a"), "--step", "7"], "has no checkpoint at step=7"),
                          (["--out", str(tmp_path / "b"), "--dtype", "float16"], "invalid choice: 'float16'")):
        with pytest.raises(SystemExit):
            main(["--workdir", focal_run, *args])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workdir", str(tmp_path / "nothing"), "--out", str(tmp_path / "c")])
    assert "nothing" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        main(["--workdir", focal_run, "--out", str(tmp_path / "file")])
    assert "is a file; expected a directory" in capsys.readouterr().err
