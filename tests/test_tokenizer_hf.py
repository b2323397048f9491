"""Hugging Face `tokenizer.json` tokenizers (GPT-2, Qwen, OLMo) in the data pipeline, the run's workdir copy, and a
GPT-2 style Focus retrofit that trains through them.

The reference is the `tokenizers` library itself (`tokenizers.Tokenizer.from_file`), never our wrapper: a tiny
byte-level BPE (GPT-2's kind: no bos, eos `<|endoftext|>` as the last id) is trained on a few sentences in memory.
"""

import json
import os

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from focal_jax.data import DataConfig, build_data, load_tokenizer, tokenizer_file, workdir_tokenizer
from helpers import load_experiment

EOS = "<|endoftext|>"
SENTENCES = [
    "The model attends to its local window and to the distant tokens of its own group.",
    "Focus learns centroids that assign tokens to balanced groups with Sinkhorn iterations.",
    "Focal attention sharpens the softmax with a temperature, constant or learned.",
    "Numbers such as 1024, 4096 and 3.14159 split into byte pieces; so do accents: café, naïve.",
]
TEXTS = ["the model attends locally", "  two spaces\nand a newline\t tab", "é 中 😀 café", "x=1234", "", EOS]


def make_tokenizer_json(directory, **config):
    """A byte-level BPE trained on SENTENCES, `<|endoftext|>` added last (GPT-2's layout), saved as
    DIRECTORY/tokenizer.json, with DIRECTORY/config.json holding `config` (default: an eos and no bos)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    tok.add_special_tokens([EOS])
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    eos = tok.token_to_id(EOS)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config or {"eos_token_id": eos, "bos_token_id": None}, f)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """(path of the tokenizer.json, the reference `tokenizers.Tokenizer` read from it, the eos id)."""
    path = make_tokenizer_json(str(tmp_path_factory.mktemp("hf_tokenizer")))
    reference = tokenizers.Tokenizer.from_file(path)
    return path, reference, reference.token_to_id(EOS)


def test_load_tokenizer_matches_the_tokenizers_library(hf_tokenizer):
    path, reference, eos = hf_tokenizer
    tok = load_tokenizer(path)
    assert eos == reference.get_vocab_size() - 1 > 256  # the special token is the last id, as in GPT-2
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.start_id) == (
        "huggingface", reference.get_vocab_size(), None, eos, None, eos)
    for text in TEXTS:
        ids = reference.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == ids
        assert tok.decode(ids) == reference.decode(ids)
        if text != EOS:
            assert tok.decode(np.array([eos] + ids + [eos])) == text  # byte-level: exact; eos dropped
    assert tok.encode_batch(TEXTS) == [e.ids for e in reference.encode_batch(TEXTS, add_special_tokens=False)]
    assert tok.encode(EOS) == [eos]
    assert len(tok.encode(SENTENCES[0])) < len(SENTENCES[0])  # merges were learned


def test_special_ids_from_the_directorys_config_files(tmp_path):
    path = make_tokenizer_json(str(tmp_path))
    reference = tokenizers.Tokenizer.from_file(path)
    eos, the = reference.token_to_id(EOS), reference.token_to_id("Ġthe")  # " the"
    assert the is not None
    config, tokenizer_config = tmp_path / "config.json", tmp_path / "tokenizer_config.json"

    # config.json as GPT-2 ships it: bos == eos == <|endoftext|>; a list of eos ids (LLaMA 3 instruct): the first.
    config.write_text(json.dumps({"bos_token_id": eos, "eos_token_id": [the, eos], "pad_token_id": -1}))
    tok = load_tokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.start_id) == (eos, the, None, eos)
    # tokenizer_config.json (token strings, or {"content": ...}, or null) wins over config.json, key by key.
    tokenizer_config.write_text(json.dumps({"bos_token": None, "eos_token": {"content": EOS}, "pad_token": "Ġthe"}))
    tok = load_tokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.start_id) == (None, eos, the, eos)

    # A post-processor that adds a token (LLaMA 3 adds its bos this way) does not leak into encode.
    with_template = tokenizers.Tokenizer.from_file(path)
    with_template.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, eos)])
    with_template.save(path)
    assert tokenizers.Tokenizer.from_file(path).encode(" the").ids == [eos, the]
    assert load_tokenizer(path).encode(" the") == [the]

    def fails(config_text, tokenizer_config_text, *needles):
        config.write_text(config_text)
        tokenizer_config.write_text(tokenizer_config_text)
        with pytest.raises(ValueError) as info:
            load_tokenizer(path)
        assert all(n in str(info.value) for n in needles), str(info.value)

    fails("{}", "{}", "no eos token", "eos_token_id", str(tmp_path / "tokenizer.json"))
    fails(json.dumps({"eos_token_id": 10_000}), "{}", "eos_token_id=10000", "below the vocabulary size")
    fails("{}", json.dumps({"eos_token": "<|missing|>"}), "eos_token='<|missing|>' is not a token of")
    fails("{}", json.dumps({"eos_token": 5}), "eos_token=5", "tokenizer_config.json")
    fails(json.dumps({"eos_token_id": 1}), json.dumps({"eos_token": {"special": True}}),  # was: no eos token
          "eos_token={'special': True}", "{'content': string}")


def test_build_data_frames_documents_with_eos_and_copies_the_tokenizer(hf_tokenizer, tmp_path):
    path, reference, eos = hf_tokenizer
    docs = [" ".join(SENTENCES[i:] + SENTENCES[:i]) for i in range(len(SENTENCES))]
    for i, doc in enumerate(docs):
        (tmp_path / f"doc{i}.txt").write_text(doc)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "tokenizer.model").write_text("a stale tokenizer of another kind")
    config = DataConfig(source="text", paths=(str(tmp_path / "doc*.txt"),), tokenizer=path, seq_len=16,
                        eval_fraction=0.0, shuffle=False)
    data = build_data(config, global_batch=2, seed=0, workdir=str(workdir), process_index=0, process_count=1)

    # The packed stream is every document as [eos] + tokens + [eos], in file order (GPT-2's <|endoftext|> framing).
    expected = [t for doc in docs for t in [eos] + reference.encode(doc).ids + [eos]]
    steps = data.n_train_rows // 2
    inputs = np.concatenate([data.train[s]["inputs"] for s in range(steps)]).ravel().tolist()
    assert steps >= 2 and len(inputs) <= len(expected) and inputs == expected[:len(inputs)]

    # The workdir keeps the tokenizer's kind: tokenizer.json plus the special tokens it needs, no tokenizer.model.
    assert sorted(os.listdir(workdir)) == ["tokenizer.json", "tokenizer_config.json"]
    assert data.tokenizer.path == str(workdir / "tokenizer.json")
    assert json.loads((workdir / "tokenizer_config.json").read_text()) == {
        "bos_token": None, "eos_token": EOS, "pad_token": None, "unk_token": None}
    copy = workdir_tokenizer(str(workdir))
    assert (copy.kind, copy.vocab_size, copy.bos_id, copy.eos_id) == ("huggingface", data.tokenizer.vocab_size,
                                                                        None, eos)
    for text in TEXTS + docs:
        assert copy.encode(text) == reference.encode(text, add_special_tokens=False).ids


def test_gpt2_hugging_face_directory_retrofits_through_its_tokenizer_json(hf_tokenizer, tmp_path):
    """experiments/focus_retrofit.py:runlocal,hf=DIR on a GPT-2 style directory (tiny random GPT2LMHeadModel,
    safetensors, tokenizer.json and no tokenizer.model) trains 2 steps; the run keeps the tokenizer.json."""
    import torch
    import transformers

    from focal_jax.train import train
    from focal_jax.train.metrics import read_metrics

    path, reference, eos = hf_tokenizer
    hf_dir = tmp_path / "gpt2"
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=reference.get_vocab_size(), n_positions=128, n_embd=32, n_layer=2,
                                        n_head=4, bos_token_id=None, eos_token_id=eos)
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(hf_dir, safe_serialization=True)
    (hf_dir / "tokenizer.json").write_bytes(open(path, "rb").read())
    assert not (hf_dir / "tokenizer.model").exists()
    for i in range(12):
        (tmp_path / f"doc{i}.txt").write_text(" ".join(SENTENCES[i % 4:] + SENTENCES[:i % 4]))

    config = load_experiment("focus_retrofit", f"runlocal,hf={hf_dir}")
    assert config.data.tokenizer == str(hf_dir / "tokenizer.json")
    assert load_experiment("lora_baseline", f"runlocal,hf={hf_dir}").data.tokenizer == config.data.tokenizer
    config.data.update(source="text", paths=(str(tmp_path / "doc*.txt"),))
    config.update(total_steps=2, batch_size=8, eval_batches=0)
    workdir = tmp_path / "run"
    train(config, str(workdir))
    losses = {r["step"]: r["loss"] for r in read_metrics(str(workdir), kind="train")}
    assert sorted(losses) == [1, 2] and np.isfinite(list(losses.values())).all()
    assert tokenizer_file(str(workdir)) == str(workdir / "tokenizer.json")
    assert not (workdir / "tokenizer.model").exists()
    tok = workdir_tokenizer(str(workdir))
    assert (tok.bos_id, tok.eos_id) == (None, eos)
    assert tok.encode(SENTENCES[1]) == reference.encode(SENTENCES[1]).ids


def test_directory_without_a_tokenizer_names_both_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    for name in ("focus_retrofit", "lora_baseline"):
        with pytest.raises(ValueError, match=r"hf=.*holds neither tokenizer\.model .* nor tokenizer\.json"):
            load_experiment(name, f"runlocal,hf={tmp_path}")
    with pytest.raises(FileNotFoundError, match=r"neither tokenizer\.model .* nor tokenizer\.json"):
        workdir_tokenizer(str(tmp_path))


def test_truncation_and_padding_saved_in_the_file_are_ignored(tmp_path):
    """A tokenizer.json saved with truncation or padding on would cut or pad every document (encode applies them):
    documents are encoded whole, each to its own length."""
    path = make_tokenizer_json(str(tmp_path))
    reference = tokenizers.Tokenizer.from_file(path)
    saved = tokenizers.Tokenizer.from_file(path)
    saved.enable_truncation(4)
    saved.enable_padding(pad_id=0)
    saved.save(path)
    tok = load_tokenizer(path)
    texts = [SENTENCES[0], "the"]
    assert len(reference.encode(SENTENCES[0]).ids) > 4
    assert tok.encode(SENTENCES[0]) == reference.encode(SENTENCES[0]).ids
    assert tok.encode_batch(texts) == [reference.encode(t).ids for t in texts]


def test_a_json_file_that_is_not_a_tokenizer_is_named(tmp_path):
    for name, text in (("config.json", '{"eos_token_id": 3'), ("empty.json", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"{name}' is not a Hugging Face tokenizer\.json"):
            load_tokenizer(str(tmp_path / name))


def test_a_documents_own_special_token_text_is_ordinary_text(hf_tokenizer, tmp_path):
    """A document that mentions `<|endoftext|>` keeps it as text: the only eos ids of its packed segment are its
    framing (first and last), in memory and streamed, and the tokens decode back to the document."""
    path, reference, eos = hf_tokenizer
    doc = f"GPT-2 separates its documents with {EOS} between them. {SENTENCES[0]}"
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": doc}) + "\n" + json.dumps({"text": SENTENCES[1]}) + "\n")
    settings = dict(source="jsonl", paths=(str(tmp_path / "docs.jsonl"),), tokenizer=path, seq_len=512,
                    eval_fraction=0.0, shuffle=False)
    for streaming in (False, True):
        data = build_data(DataConfig(**settings, streaming=streaming, prefetch=0 if streaming else 2),
                          global_batch=1, seed=0, process_index=0, process_count=1)
        row = next(iter(data.train))["inputs"][0] if streaming else data.train[0]["inputs"][0]
        tokens = row.tolist()
        first = tokens[:tokens.index(eos, 1) + 1]  # [eos] + the document's tokens + [eos]
        assert first[0] == eos and eos not in first[1:-1], streaming
        plain = tokenizers.Tokenizer.from_file(path)
        plain.encode_special_tokens = True  # the reference: the tokenizers library reading the text as text
        assert first[1:-1] == plain.encode(doc, add_special_tokens=False).ids
        assert reference.decode(first[1:-1]) == doc
    assert load_tokenizer(path).encode(EOS) == [eos]  # `encode` itself still reads special tokens


def test_a_special_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    """config.json's ids must be below the vocabulary size: the largest valid id is vocab_size - 1, and vocab_size
    itself (one past the embedding table) is refused."""
    path = make_tokenizer_json(str(tmp_path))
    size = tokenizers.Tokenizer.from_file(path).get_vocab_size()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": size}))
    with pytest.raises(ValueError, match=f"eos_token_id={size}"):
        load_tokenizer(path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": size - 1}))
    assert load_tokenizer(path).eos_id == size - 1


def test_decode_drops_an_eos_that_is_an_ordinary_token(tmp_path):
    """decode drops the bos / eos / pad ids even when the tokenizer.json does not mark them special (here config.json
    names the ordinary token ' the' as eos), not only the special tokens the tokenizers library skips."""
    path = make_tokenizer_json(str(tmp_path))
    reference = tokenizers.Tokenizer.from_file(path)
    the = reference.token_to_id("Ġthe")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": the}))
    tok = load_tokenizer(path)
    ids = reference.encode("x=1234", add_special_tokens=False).ids
    assert tok.eos_id == the and reference.decode([the] + ids) == " thex=1234"
    assert tok.decode([the] + ids + [the]) == "x=1234"
