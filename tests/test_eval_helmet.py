"""focal_jax.eval.helmet on tiny HELMET-format files written here, in the field layout of HELMET's data release.

Metrics are checked against hand-computed values and pytrec_eval's own NDCG cases; prompts against HELMET's
templates written out literally; sample and demonstration choice against the Hugging Face `datasets` library (when
installed); fitting against the budget (in tokens), the gold units and tightness (less than one unit of slack); the
scoring pipeline with decoders whose output is known (the reference answer scores 1.0, a wrong one 0.0, half and
half 0.5); the command line on a tiny real Llama (JSON, PNG, scores in [0, 1]), its removal of an earlier run's plot
when it writes none, its progress line per decoded batch; bad input raises naming the value (flags by their names,
before the model loads or decodes).
"""

import json
import math
import random
import re

import pytest
from flax import nnx

from focal_jax.data import train_tokenizer
from focal_jax.eval import helmet
from focal_jax.nn.gpt2 import GPT2, GPT2Config
from focal_jax.nn.llama import Llama, LlamaConfig
from helpers import stub_run_workdir, usage_error

pytestmark = pytest.mark.usefixtures("fast_compiles")

WORDS = ("river stone garden window silver orange market winter planet castle forest engine yellow bridge "
         "harbor candle mirror pillow rocket violin").split()


def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _hex(rng):
    return "".join(rng.choice("0123456789abcdef") for _ in range(8))


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _kv_context(pairs):
    """Lost in the Middle's JSON rendering (one pair per line)."""
    return "".join(("{" if i == 0 else " ") + f'"{k}": "{v}"' + (",\n" if i < len(pairs) - 1 else "}")
                   for i, (k, v) in enumerate(pairs))


def _make_data(root):
    rng = random.Random(0)
    # json_kv: context, question (a key), answer (its value), demos ([key, value] pairs), num_kvs
    rows = []
    for i in range(6):
        pairs = [(_hex(rng), _hex(rng)) for _ in range(12)]
        key, value = pairs[(3 * i + 1) % 12]
        rows.append({"context": _kv_context(pairs), "question": key, "answer": value,
                     "demos": [[_hex(rng), _hex(rng)] for _ in range(3)], "num_kvs": 12})
    _write(root / "json_kv/test_k50_dep6.jsonl", rows)

    # RULER niah: index, context, query, outputs, answer, length, type_needle_v
    def haystack(needles, n_sentences=14):
        sentences = [f"The {_words(rng, 3)} is {rng.choice(WORDS)}. " for _ in range(n_sentences)]
        for depth, needle in needles:
            sentences.insert(depth, needle + " ")
        return "".join(sentences).strip()

    for directory, n_values in (("niah_multikey_2", 1), ("niah_multivalue", 3)):
        rows = []
        for i in range(4):
            key, values = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{i}", [str(rng.randrange(10**6, 10**7))
                                                                          for _ in range(n_values)]
            needles = [(2 + 3 * j, f"One of the special magic numbers for {key} is: {v}.")
                       for j, v in enumerate(values)]
            needles.append((9, f"One of the special magic numbers for other-{i} is: {rng.randrange(10**6, 10**7)}."))
            rows.append({"index": i, "context": haystack(needles), "query": key, "outputs": values, "answer": values,
                         "length": 4096, "type_needle_v": "numbers"})
        _write(root / f"ruler/{directory}/validation_4096.jsonl", rows)

    # KILT RAG: question, answers, ctxs [{title, text, has_answer}] (popqa: id, s_pop, and no has_answer)
    def passages(answer, gold_at, n, flag=True):
        ctxs = []
        for j in range(n):
            text = f"{_words(rng, 8)} {answer} {_words(rng, 3)}." if j == gold_at else f"{_words(rng, 11)}."
            ctx = {"title": rng.choice(WORDS).title(), "text": text}
            if flag:
                ctx["has_answer"] = j == gold_at
            ctxs.append(ctx)
        return ctxs

    nq = []
    for i in range(5):
        answer = f"{rng.choice(WORDS)} {rng.choice(WORDS)}"
        nq.append({"question": f"where is the {_words(rng, 2)} number {i}?", "answers": [answer, answer.upper()],
                   "ctxs": passages(answer, (i * 2) % 8, 8)})
    nq.append({**nq[1], "ctxs": passages(nq[1]["answers"][0], 7, 8)})  # one question at a second depth
    _write(root / "kilt/nq-dev-multikilt_1000_k20_dep6.jsonl", nq)
    _write(root / "kilt/nq-train-multikilt_1000_k3_dep6.jsonl",
           [{"question": f"who made the {_words(rng, 2)} {i}?", "answers": [f"{rng.choice(WORDS)} {i}"],
             "ctxs": passages("x", 0, 3)} for i in range(5)])
    popqa = []
    for i in range(6):
        answer = rng.choice(WORDS) + f" {i}"
        popqa.append({"id": 100 + i, "question": f"what is {_words(rng, 2)} {i}?", "answers": [answer],
                      "s_pop": 50 if i != 2 else 5000, "ctxs": passages(answer, i % 5, 5, flag=False)})
    _write(root / "kilt/popqa_test_1000_k20_dep6.jsonl", popqa)
    _write(root / "kilt/popqa_test_1000_k3_dep6.jsonl",
           [{**row, "ctxs": row["ctxs"][:3]} for row in popqa])

    # MS MARCO re-ranking: qid, query, ctxs [{id, title, text, label}]
    def rerank_rows(n_rows, n_ctxs, start):
        out = []
        for i in range(n_rows):
            ids = rng.sample(range(1000, 9999), n_ctxs)
            out.append({"qid": str(start + i), "query": f"best {_words(rng, 2)}",
                        "ctxs": [{"id": str(d), "title": rng.choice(WORDS), "text": _words(rng, 6),
                                  "label": rng.choice([0, 0, 1, 2, 3])} for d in ids]})
        return out

    _write(root / "msmarco/test_reranking_data_k14_dep3.jsonl", rerank_rows(3, 6, 1))
    _write(root / "msmarco/test_reranking_data_k10_dep3.jsonl", rerank_rows(5, 3, 50))

    # ICL (Hugging Face datasets exported as jsonl): text + the label field
    for name, label_field in (("banking77", "label"), ("trec_coarse", "coarse_label")):
        for split, count in (("train", 6), ("test", 3)):
            rows = [{"text": f"{_words(rng, 4)} {split} {label} {k}", label_field: label, "fine_label": 0}
                    for label in range(4) for k in range(count)]
            rng.shuffle(rows)
            _write(root / f"icl/{name}/{split}.jsonl", rows)

    # InfiniteBench: id, context, input, answer (list), options
    mc = []
    for i in range(4):
        options = [f"the {rng.choice(WORDS)} {i}{c}" for c in "abcd"]
        mc.append({"id": i, "context": " ".join(f"{_words(rng, 9)}." for _ in range(40)),
                   "input": f"what did {rng.choice(WORDS)} see {i}?", "answer": [options[i % 4]], "options": options})
    _write(root / "infbench/longbook_choice_eng.jsonl", mc)
    _write(root / "infbench/longbook_qa_eng.jsonl",
           [{"id": i, "context": " ".join(f"{_words(rng, 9)}." for _ in range(40)),
             "input": f"who is {rng.choice(WORDS)} {i}?", "answer": [f"{rng.choice(WORDS)} {i}"], "options": []}
            for i in range(3)])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("helmet")
    _make_data(root)
    return root


@pytest.fixture(scope="module")
def tokenizer(data_dir, tmp_path_factory):
    documents = [p.read_text() for p in sorted(data_dir.rglob("*.jsonl"))]
    documents += [helmet._RAG_USER, helmet._RERANK_USER, helmet._ICL_USER, helmet._JSON_KV_USER,
                  helmet._RULER_USER, helmet._INFBENCH_MC_USER]
    return train_tokenizer(documents, 500, tmp_path_factory.mktemp("tok") / "helmet.model")


def _llama(vocab):
    config = LlamaConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate=32,
                         rope_theta=500.0)
    return Llama(config, rngs=nnx.Rngs(0))


def _n_tokens(tokenizer, text):
    return 1 + len(tokenizer.encode(text))


# ----------------------------------------------------------------------------------------------------------------
# Metrics and parsing


def test_metrics_against_hand_computed_values():
    assert helmet.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert helmet.normalize_answer("An apple, a PEAR and the plum.") == "apple pear and plum"
    assert helmet.substring_exact_match("Answer: it is in Paris, France.", ["paris"]) == 1.0
    assert helmet.substring_exact_match("Answer: Lyon", ["Paris", "Marseille"]) == 0.0
    assert helmet.substring_exact_match("the answer is New-York", [["Boston"], ["new york"]]) == 0.0  # '-' removed
    assert helmet.substring_exact_match("the answer is NewYork", [["Boston"], ["new-york"]]) == 1.0
    assert helmet.exact_match("The Paris.", ["paris", "x"]) == 1.0
    assert helmet.exact_match("Paris France", "paris") == 0.0
    assert helmet.exact_match("", ["A", "A. the red one"]) == 1.0  # HELMET's quirk: "A" normalises to ""
    assert helmet.ruler_recall("numbers are 123, 456 and 7", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert helmet.ruler_recall("The KEY is abc", "key") == 1.0


def test_parse_output_and_rankings():
    assert helmet.parse_output("Answer: Paris\nAnswer: Lyon") == "Paris"
    assert helmet.parse_output("answer:answer: Paris  ") == "Paris"  # a repeated prefix is removed
    assert helmet.parse_output("  Paris, I think\nmore", "label:") == "Paris, I think"  # first line
    assert helmet.parse_output("label: 17\n", "label:") == "17"
    assert helmet.parse_output("Corresponding value: ab12 cd", "corresponding value:") == "ab12 cd"
    assert helmet.parse_rankings("Ranking: [ID: 3] > 1 > 2\nfoo") == {"3": 3, "1": 2, "2": 1}
    assert helmet.parse_rankings("Ranking: 5 > 6. Also ID7 > ID8 > ID5 > ID9") == {"7": 4, "8": 3, "5": 2, "9": 1}
    assert helmet.parse_rankings("Ranking: 4 > 4 > 2") == {"4": 3, "2": 1}
    assert helmet.parse_rankings("Ranking: none") == {"ranking none": 1}


def _example(answer, prefix, **kw):
    return helmet.Example("{context}", {}, [], "", answer, "", prefix, **kw)


def test_score_output_follows_helmets_post_processing():
    score = helmet.score_output
    # The system template is prepended before parsing: the answer is the rest of its line.
    icl = _example("7", "label:")
    assert score("banking77", icl, " 7\nlabel: 5") == (1.0, "7")
    assert score("banking77", icl, " 5\nlabel: 7") == (0.0, "5")
    assert score("banking77", icl, "\n7") == (0.0, "")
    # RAG and json_kv: SubEM of the whole text or of the parsed answer.
    rag = _example(["New York", "NYC"], "Answer:")
    assert score("nq", rag, " it is nyc.\nBoston")[0] == 1.0 and score("nq", rag, " Boston")[0] == 0.0
    kv = _example("ab12-cd", "Corresponding value:")
    assert score("json_kv", kv, " ab12-cd") == (1.0, "ab12-cd") and score("json_kv", kv, " ab12")[0] == 0.0
    # RULER: recall of the values anywhere in the text, case-insensitive, no parsing.
    assert score("ruler_niah_mv", _example(["123", "456"], "The numbers are"), " 456 and 7")[0] == 0.5
    # InfiniteBench multiple choice: exact letter, or the option written out anywhere.
    mc = _example(["B", "B. the red fox"], "Answer:")
    assert [score("infbench_mc", mc, out)[0] for out in (" B", " (B)", " b.", " C", " I pick B. The red fox",
                                                          " B because")] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert score("infbench_mc", _example(["A", "A. x"], "Answer:"), " \n")[0] == 1.0  # HELMET's quirk
    # Re-ranking: NDCG@10 of the parsed ranking against the judgements of the passages shown.
    rerank = _example({"11": 2, "22": 0, "33": 1}, "Ranking:", unit_ids=("11", "22", "33"))
    assert score("msmarco", rerank, " [33] > [11] > [22]", (0, 1, 2))[0] == helmet.ndcg_at_k(
        {"33": 3, "11": 2, "22": 1}, {"11": 2, "22": 0, "33": 1})
    assert score("msmarco", rerank, " 33 > 22", (1, 2))[0] == 1.0  # passage 11 was not shown


def test_ndcg_matches_trec_eval():
    # pytrec_eval's own test cases (trec_eval's ndcg_cut): one relevant document at rank 3, 2, 1.
    qrels = {"1": 0, "2": 1, "3": 0}
    assert helmet.ndcg_at_k({"1": 1.0, "2": 0.0, "3": 1.5}, qrels, 3) == 0.5
    assert helmet.ndcg_at_k({"1": 4.0, "2": 2.0, "3": 1.5}, qrels, 10) == round(0.6309297535714575, 5)
    assert helmet.ndcg_at_k({"1": 1.0, "2": 2.0, "3": 1.5}, qrels, 1) == 1.0
    assert helmet.ndcg_at_k({"1": 1.0, "2": 0.0, "3": 1.5}, qrels, 2) == 0.0
    # Graded: ranking 30 > 20 > 10 with labels 10:3, 20:0, 30:2, 40:1 (40 not retrieved).
    dcg = 2 / math.log2(2) + 0 + 3 / math.log2(4)
    idcg = 3 / math.log2(2) + 2 / math.log2(3) + 1 / math.log2(4)
    ranking = helmet.parse_rankings("Ranking: 30 > 20 > 10")
    assert helmet.ndcg_at_k(ranking, {"10": 3, "20": 0, "30": 2, "40": 1}) == round(dcg / idcg, 5) == 0.73501
    assert helmet.ndcg_at_k(ranking, {"10": 0, "20": 0}) == 0.0  # nothing relevant
    # Only the first 10 ranks count.
    deep = {str(i): 20 - i for i in range(20)}
    assert helmet.ndcg_at_k(deep, {"15": 1}) == 0.0 and helmet.ndcg_at_k(deep, {"9": 1}) == round(1 / math.log2(11), 5)


# ----------------------------------------------------------------------------------------------------------------
# Prompts


def test_rag_prompt_is_helmets_template_with_the_gold_passage(data_dir, tokenizer):
    examples = helmet.load_examples("nq", str(data_dir), 4096, n=None)
    rows = [json.loads(line) for line in (data_dir / "kilt/nq-dev-multikilt_1000_k20_dep6.jsonl").open()]
    demo_rows = [json.loads(line) for line in (data_dir / "kilt/nq-train-multikilt_1000_k3_dep6.jsonl").open()]
    assert len(examples) == len(rows)
    for ex, row in zip(examples, rows):
        prompt = helmet.build_prompt(ex, tokenizer, 4096 - 20)
        demo_blocks = prompt.text.split("Answer: [answer]\n\n", 1)[1].split("\n\nDocument (Title:")
        passages = "\n\n".join(f"Document (Title: {c['title']}): {c['text']}" for c in row["ctxs"])
        assert prompt.text.endswith(passages + f"\n\nQuestion: {row['question']}\nAnswer:")
        assert prompt.text.startswith("Use the given documents to write a concise and short answer to the question. "
                                      "Write your answer in the following format:\nAnswer: [answer]\n\n")
        demos = []
        for d in demo_rows:
            docs = "\n\n".join(f"Document (Title: {c['title']}): {c['text']}" for c in d["ctxs"])
            block = f"{docs}\n\nQuestion: {d['question']}\nAnswer: {d['answers'][0]}\n\n"
            if block in prompt.text:
                demos.append(d["question"])
        assert len(demos) == 2 and len(demo_blocks) > 2
        gold = next(c["text"] for c in row["ctxs"] if c["has_answer"])
        assert gold in prompt.text and prompt.kept == tuple(range(8))
        assert prompt.tokens == [tokenizer.bos_id] + tokenizer.encode(prompt.text)
        assert ex.answer == row["answers"] and ex.prefix == "Answer:"


def test_sample_and_demonstrations_match_hugging_face_datasets(data_dir):
    import datasets  # a dependency of lm_eval, declared in the test extra
    # json_kv / RULER: data.shuffle(seed).select(range(n))
    rows = [json.loads(line) for line in (data_dir / "json_kv/test_k50_dep6.jsonl").open()]
    expected = datasets.Dataset.from_list(rows).shuffle(seed=42).select(range(4))["question"]
    assert [ex.fields["question"] for ex in helmet.load_examples("json_kv", str(data_dir), 4096, n=4)] == expected
    # RAG demonstrations: demos.shuffle(seed=sha256(question) % 2**31), duplicates dropped, the first two
    demo_rows = [json.loads(line) for line in (data_dir / "kilt/nq-train-multikilt_1000_k3_dep6.jsonl").open()]
    demo_rows.append(dict(demo_rows[0]))  # a duplicated question is skipped
    path = data_dir / "kilt/nq-train-multikilt_1000_k3_dep6.jsonl"
    original = path.read_text()
    try:
        path.write_text("".join(json.dumps(r) + "\n" for r in demo_rows))
        for ex in helmet.load_examples("nq", str(data_dir), 4096, n=None):
            seed = int(__import__("hashlib").sha256(ex.fields["question"].encode()).hexdigest(), 16) % 2**31
            shuffled, chosen = datasets.Dataset.from_list(demo_rows).shuffle(seed=seed)["question"], []
            for q in shuffled:
                if q not in chosen:
                    chosen.append(q)
            positions = [ex.fields["demos"].index(f"Question: {q}\n") for q in chosen[:2]]
            assert positions == sorted(positions)
            assert not any(f"Question: {q}\n" in ex.fields["demos"] for q in chosen[2:])
    finally:
        path.write_text(original)
    # RAG sample: random.Random(42).sample(sorted(questions), n); every row of a sampled question is kept
    questions = sorted({json.loads(line)["question"] for line in
                        (data_dir / "kilt/nq-dev-multikilt_1000_k20_dep6.jsonl").open()})
    for n in (1, 2, 3):
        sampled = set(random.Random(42).sample(questions, n))
        got = [ex.fields["question"] for ex in helmet.load_examples("nq", str(data_dir), 4096, n=n)]
        assert set(got) == sampled and len(got) >= n


def _unit_tokens(tokenizer, example, joiner_tokens=3):
    return max(len(tokenizer.encode(u)) for u in example.units) + joiner_tokens


def _bounds(tokenizer, ex):
    """Prompt tokens with every unit, and with only the gold units (the least 'drop' can reach)."""
    full = _n_tokens(tokenizer, ex.render(ex.joiner.join(ex.units)))
    bare = _n_tokens(tokenizer, ex.render(ex.joiner.join(ex.units[i] for i in ex.gold)))
    return full, bare


@pytest.mark.parametrize("fraction", [0.8, 0.4, 0.1])
def test_drop_fits_the_budget_keeps_the_gold_passage_at_its_depth(data_dir, tokenizer, fraction):
    for ex in helmet.load_examples("nq", str(data_dir), 4096, n=None):
        full, bare = _bounds(tokenizer, ex)
        budget = int(bare + fraction * (full - bare))
        prompt = helmet.build_prompt(ex, tokenizer, budget)
        assert len(prompt.tokens) <= budget < full
        assert len(prompt.tokens) > budget - _unit_tokens(tokenizer, ex)  # no room for one more passage
        (g,) = ex.gold
        assert ex.units[g] in prompt.text and g in prompt.kept
        others = [i for i in prompt.kept if i != g]
        assert others == [i for i in range(len(ex.units)) if i != g][:len(others)]  # the first distractors
        if len(prompt.kept) > 1:
            depth = prompt.kept.index(g) / (len(prompt.kept) - 1)
            assert abs(depth - g / (len(ex.units) - 1)) <= 0.5 / (len(prompt.kept) - 1) + 1e-9
        assert prompt.text == ex.render("\n\n".join(ex.units[i] for i in prompt.kept))
        with pytest.raises(helmet.TooShort, match=f"budget of {bare - 1} tokens"):
            helmet.build_prompt(ex, tokenizer, bare - 1)


def test_popqa_filters_by_popularity_and_finds_gold_by_answer(data_dir, tokenizer):
    examples = helmet.load_examples("popqa", str(data_dir), 4096, n=None)
    assert [ex.info["id"] for ex in examples] == [100, 101, 103, 104, 105]  # s_pop 5000 dropped (log10 >= 3)
    for ex in examples:
        assert ex.gold == (ex.info["id"] % 100 % 5,)  # no has_answer field: the passage holding the answer
        assert f"Question: {ex.fields['question']}\n" not in ex.fields["demos"]  # not its own demonstration
        full, bare = _bounds(tokenizer, ex)
        prompt = helmet.build_prompt(ex, tokenizer, (full + bare) // 2)
        assert ex.units[ex.gold[0]] in prompt.text and len(prompt.tokens) <= (full + bare) // 2


def test_icl_demonstrations_are_balanced_mapped_and_dropped_to_fit(data_dir, tokenizer):
    train = [json.loads(line) for line in (data_dir / "icl/banking77/train.jsonl").open()]
    label_of = {row["text"]: row["label"] for row in train}
    examples = helmet.load_examples("banking77", str(data_dir), 4096, n=8)
    assert len(examples) == 8
    test_labels = sorted(int(ex.fields["question"].split()[5]) for ex in examples)
    assert test_labels == [0, 0, 1, 1, 2, 2, 3, 3]  # a label-balanced test sample
    for ex in examples:
        assert len(ex.units) == 180  # banking77's shot count at 4K
        shown = {}
        for unit in ex.units:
            text, label = unit.rsplit("\nlabel: ", 1)
            shown.setdefault(label_of[text], set()).add(label)
        for r in range(45):  # 180 shots = 45 rounds of one demonstration per class
            assert sorted(label_of[u.rsplit("\nlabel: ", 1)[0]] for u in ex.units[4 * r:4 * r + 4]) == [0, 1, 2, 3]
        assert all(len(labels) == 1 for labels in shown.values())  # one random integer label per class
        mapped = {c: labels.pop() for c, labels in shown.items()}
        assert len(set(mapped.values())) == 4 and all(0 <= int(v) < 77 for v in mapped.values())
        assert ex.answer == mapped[int(ex.fields["question"].split()[5])]
        budget = 300
        prompt = helmet.build_prompt(ex, tokenizer, budget)
        assert len(prompt.tokens) <= budget and prompt.kept == tuple(range(len(prompt.kept)))  # dropped from the end
        assert len(prompt.tokens) > budget - _unit_tokens(tokenizer, ex)
        assert prompt.text.startswith('Use the provided mapping from the text to label to assign a label to the '
                                      'text. Only output "label: {label}" and nothing else. \n\n' + ex.units[0])
        assert prompt.text.endswith(f"\n\n{ex.fields['question']}\nlabel:")


@pytest.mark.parametrize("name", ["json_kv", "ruler_niah_mk_2", "ruler_niah_mv"])
def test_needle_lines_survive_dropping(data_dir, tokenizer, name):
    for ex in helmet.load_examples(name, str(data_dir), 4096, n=None):
        assert "".join(ex.units) in ex.render("".join(ex.units))
        answers = helmet._answer_list(ex.answer)
        full, bare = _bounds(tokenizer, ex)
        for budget in (full - 1, bare + 5):
            prompt = helmet.build_prompt(ex, tokenizer, budget)
            assert len(prompt.tokens) <= budget and len(prompt.kept) < len(ex.units)
            assert all(a in prompt.text.split("\n\nExtract")[0].split("What ")[0] for a in answers)
            if name == "json_kv":
                shown = prompt.text.split("\n\nExtract")[0]
                assert shown.startswith("{") and shown.endswith("}")
                assert json.loads(shown)[ex.fields["question"]] == ex.answer  # still a JSON object
    if name == "ruler_niah_mv":
        assert ex.template.endswith("mentioned in the provided text?\nThe special magic {type_needle_v} for "
                                    "{query} mentioned in the provided text are")
        assert ex.prefix == f"The special magic numbers for {ex.fields['query']} mentioned in the provided text are"


def test_truncate_cuts_the_context_tail_as_helmet(data_dir, tokenizer):
    ex = helmet.load_examples("nq", str(data_dir), 4096, n=None)[0]
    context = "\n\n".join(ex.units)
    full, _ = _bounds(tokenizer, ex)
    budget = full - 60
    prompt = helmet.build_prompt(ex, tokenizer, budget, fit="truncate")
    head, tail = ex.render("\x00").split("\x00")
    assert prompt.text.startswith(head) and prompt.text.endswith(tail) and prompt.kept is None
    kept_context = prompt.text[len(head):len(prompt.text) - len(tail)]
    assert context.startswith(kept_context) and len(kept_context) < len(context)
    assert budget - 4 <= len(prompt.tokens) <= budget and prompt.cut_tokens > 0
    empty = _n_tokens(tokenizer, ex.render(""))
    with pytest.raises(helmet.TooShort, match=f"whole context cut \\({empty} tokens without it\\)"):
        helmet.build_prompt(ex, tokenizer, empty - 1, fit="truncate")


def test_infbench_prompts_cut_the_book_and_append_helmets_suffix(data_dir, tokenizer):
    rows = [json.loads(line) for line in (data_dir / "infbench/longbook_choice_eng.jsonl").open()]
    examples = helmet.load_examples("infbench_mc", str(data_dir), 4096, n=None)
    for ex, row in zip(examples, rows):
        letter = "ABCD"[row["options"].index(row["answer"][0])]
        assert ex.answer == [letter, f"{letter}. {row['answer'][0]}"]
        assert ex.fields["options"] == "\n".join(f"{c}. {o}" for c, o in zip("ABCD", row["options"]))
        assert ex.fields["demo"].startswith("For example:\n\n[story text]\nQuestion: ")
        assert ex.fields["demo"].count("[story text]") == 2 and row["input"] not in ex.fields["demo"]
        budget = _n_tokens(tokenizer, ex.render("")) + 120
        prompt = helmet.build_prompt(ex, tokenizer, budget)
        assert len(prompt.tokens) <= budget and helmet.TRUNCATION_SUFFIX + "\n\nQuestion: " in prompt.text
        kept = prompt.text.split("Now, read the following story:\n\n")[1].split(helmet.TRUNCATION_SUFFIX)[0]
        assert row["context"].startswith(kept) and len(kept) > 100
        assert prompt.text.endswith(f"\nOptions:\n{ex.fields['options']}\n\nAnswer:")


# ----------------------------------------------------------------------------------------------------------------
# The scoring pipeline, with decoders whose output is known

ALL = ["json_kv", "ruler_niah_mk_2", "ruler_niah_mv", "nq", "popqa", "msmarco", "banking77", "trec_coarse",
       "infbench_mc", "infbench_qa"]


def _stub_decoder(tokenizer, data_dir, datasets, lengths, wrong=lambda i: False):
    """A stand-in for greedy_decode: each prompt's reference answer (a space, the answer, a newline, eos), or
    ' zzz' for the calls where `wrong(call index)`; records the calls."""
    references = {}
    for name in datasets:
        spec = helmet.resolve_dataset(name)
        for length in lengths:
            for ex in helmet.load_examples(spec, str(data_dir), length, n=spec.max_samples):
                try:
                    text = helmet.build_prompt(ex, tokenizer, length - spec.generation_length).text
                except helmet.TooShort:
                    continue
                references[text] = ex.reference
    calls = []

    def decode(model, prompts, *, max_new_tokens, eos_id=None, stop=None, batch_size=8):
        calls.append(dict(n=len(prompts), max_new_tokens=max_new_tokens, eos_id=eos_id, stop=stop))
        out = []
        for prompt in prompts:
            bad = wrong(len(calls) - 1)
            text = " zzz\n" if bad else " " + references[tokenizer.decode(prompt)] + "\n"
            out.append(tokenizer.encode(text)[:max_new_tokens - 1] + [eos_id])
        return out

    return decode, calls


ONE_CALL = 1000  # a batch size above every cell's number of prompts: one decoder call per (dataset, length)


def test_pipeline_scores_the_reference_one_and_a_wrong_answer_zero(data_dir, tokenizer):
    decode, calls = _stub_decoder(tokenizer, data_dir, ALL, [4096])
    result = helmet.evaluate(None, tokenizer, str(data_dir), datasets=ALL, lengths=[4096], decode=decode,
                             batch_size=ONE_CALL)
    assert [r["dataset"] for r in result["rows"]] == ALL
    assert all(r["score"] == 1.0 and r["n"] > 0 for r in result["rows"]), [(r["dataset"], r["score"]) for r in
                                                                            result["rows"]]
    assert [c["max_new_tokens"] for c in calls] == [100, 50, 50, 20, 20, 200, 20, 20, 10, 10]
    assert [c["stop"] is not None for c in calls] == [False] * 3 + [True] * 5 + [False] * 2
    assert {c["eos_id"] for c in calls} == {tokenizer.eos_id}
    assert calls[0]["n"] == 6 and calls[3]["n"] == 6 and calls[6]["n"] == 12  # json_kv, nq (5 + 1 depth), ICL
    stop = calls[3]["stop"]
    assert stop(tokenizer.encode("Paris\n")) and not stop(tokenizer.encode("Paris"))
    groups = {(g["group"], g["length"]): g for g in result["groups"]}
    assert groups["recall", 4096]["datasets"] == ["json_kv", "ruler_niah_mk_2", "ruler_niah_mv"]
    assert all(g["score"] == 1.0 for g in result["groups"])

    decode, _ = _stub_decoder(tokenizer, data_dir, ALL, [4096], wrong=lambda i: True)
    result = helmet.evaluate(None, tokenizer, str(data_dir), datasets=ALL, lengths=[4096], decode=decode,
                             batch_size=ONE_CALL)
    assert all(r["score"] == 0.0 for r in result["rows"]), [(r["dataset"], r["score"]) for r in result["rows"]]

    # Wrong on every other call: the group means are the means of their datasets.
    decode, _ = _stub_decoder(tokenizer, data_dir, ALL, [4096], wrong=lambda i: i % 2 == 1)
    result = helmet.evaluate(None, tokenizer, str(data_dir), datasets=ALL, lengths=[4096], decode=decode,
                             batch_size=ONE_CALL)
    scores = {r["dataset"]: r["score"] for r in result["rows"]}
    assert scores == {name: float(i % 2 == 0) for i, name in enumerate(ALL)}
    groups = {g["group"]: g["score"] for g in result["groups"]}
    assert groups == {"recall": pytest.approx(2 / 3), "rag": 0.5, "rerank": 0.0, "icl": 0.5, "longqa": 0.5}


def test_rerank_is_scored_on_the_passages_shown(data_dir, tokenizer):
    ex = helmet.load_examples("msmarco", str(data_dir), 4096, n=None)[0]
    prompt = helmet.build_prompt(ex, tokenizer, len(helmet.build_prompt(ex, tokenizer, 10**6).tokens) - 30)
    assert len(prompt.kept) < len(ex.units)
    shown = [ex.unit_ids[i] for i in prompt.kept]
    ideal = " > ".join(sorted(shown, key=lambda d: ex.answer[d], reverse=True))
    if any(ex.answer[d] > 0 for d in shown):
        assert helmet.score_output("msmarco", ex, " " + ideal, prompt.kept)[0] == 1.0
    worst = " > ".join(sorted(shown, key=lambda d: ex.answer[d]))
    relevant = sorted((ex.answer[d] for d in shown if ex.answer[d] > 0), reverse=True)
    ranks = [ex.answer[d] for d in sorted(shown, key=lambda d: ex.answer[d])]
    dcg = sum(rel / math.log2(i + 2) for i, rel in enumerate(ranks) if rel > 0)
    idcg = sum(rel / math.log2(i + 2) for i, rel in enumerate(relevant))
    assert helmet.score_output("msmarco", ex, " " + worst, prompt.kept)[0] == (round(dcg / idcg, 5) if idcg else 0)


def test_a_length_too_short_for_a_prompt_skips_its_row(data_dir, tokenizer):
    kv = helmet.load_examples("json_kv", str(data_dir), 4096, n=None)
    short = max(_bounds(tokenizer, ex)[1] for ex in kv) + 100 + 20  # json_kv fits after dropping, msmarco not
    rerank = helmet.load_examples("msmarco", str(data_dir), 4096, n=None)
    assert all(_n_tokens(tokenizer, ex.render("")) > short - 200 for ex in rerank)
    decode, _ = _stub_decoder(tokenizer, data_dir, ["msmarco", "json_kv"], [short, 4096])
    logged = []
    result = helmet.evaluate(None, tokenizer, str(data_dir), datasets=["msmarco", "json_kv"], lengths=[short, 4096],
                             decode=decode, log=logged.append)
    skipped = result["rows"][0]
    assert (skipped["dataset"], skipped["length"], skipped["score"], skipped["n"]) == ("msmarco", short, None, 0)
    assert f"budget {short - 200} prompt tokens" in skipped["skipped"] and "skipped" in logged[0]
    assert [r["score"] for r in result["rows"][1:]] == [1.0, 1.0, 1.0] and "json_kv at 4096 tokens" in logged[3]
    assert result["rows"][2]["units_kept"] < 1.0  # json_kv pairs dropped, the key's line kept
    assert helmet.format_table(result).splitlines()[2] == "| msmarco | NDCG@10 | - | 1.000 |"


def test_plot_and_table(tmp_path):
    rows = [{"dataset": d, "group": g, "length": n, "metric": m, "score": s}
            for d, g, m, scores in [("nq", "rag", "substring_exact_match", (0.5, 0.25)),
                                    ("popqa", "rag", "substring_exact_match", (0.7, None)),
                                    ("json_kv", "recall", "substring_exact_match", (1.0, 0.0))]
            for n, s in zip((4096, 8192), scores)]
    result = {"rows": rows, "groups": helmet.group_scores(rows)}
    assert result["groups"][:2] == [{"group": "rag", "length": 4096, "score": pytest.approx(0.6),
                                     "datasets": ["nq", "popqa"]},
                                    {"group": "rag", "length": 8192, "score": 0.25, "datasets": ["nq"]}]
    table = helmet.format_table(result).splitlines()
    assert table[0] == "| dataset | metric | 4096 | 8192 |"
    assert "| popqa | substring_exact_match | 0.700 | - |" in table and "| **rag** | mean | 0.600 | 0.250 |" in table
    png = helmet.plot_helmet(result, str(tmp_path / "sub" / "helmet.png"))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="at least one group score"):
        helmet.plot_helmet({"rows": [], "groups": []}, str(tmp_path / "empty.png"))


# ----------------------------------------------------------------------------------------------------------------
# Errors and the command line


def test_errors_name_the_bad_value(data_dir, tokenizer, tmp_path):
    model = None  # the checks come before any decoding
    gpt2 = GPT2(GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=512, d_model=16, n_layers=1, n_heads=2),
                rngs=nnx.Rngs(0))
    d = str(data_dir)
    cases = [
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["nq", "squad"]), ValueError,
         "unknown HELMET dataset 'squad'; choices: ["),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["alce_asqa"]), ValueError,
         "google/t5_xxl_true_nli_mixture"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["narrativeqa"]), ValueError, "GPT-4o judge"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["summ"]), ValueError, "GPT-4o judge"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=[]), ValueError, "at least one dataset"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["nq"], lengths=[4096, 200000]), ValueError,
         "length=200000 exceeds HELMET's largest length 131072"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["nq"], lengths=[4096, 4096]), ValueError,
         "lengths must be distinct, got lengths=[4096, 4096]"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["nq"], lengths=[0]), ValueError, "length=0"),
        (lambda: helmet.evaluate(gpt2, tokenizer, d, datasets=["nq"], lengths=[256, 1024]), ValueError,
         "length=1024 exceeds the model's n_positions=512"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["msmarco"], lengths=[150]), ValueError,
         "length=150 leaves no room for a prompt: msmarco generates up to 200 tokens"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["nq"], fit="chop"), ValueError, "fit='chop'"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["nq"], n=0), ValueError, "n=0"),
        (lambda: helmet.evaluate(model, tokenizer, str(tmp_path / "nowhere"), datasets=["nq"]), FileNotFoundError,
         "nowhere' does not exist"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["nq"], lengths=[8192]), FileNotFoundError,
         "kilt/nq-dev-multikilt_1000_k50_dep6.jsonl (expected file name 'nq-dev-multikilt_1000_k50_dep6.jsonl'"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["ruler_niah_mk_3"], lengths=[4096]),
         FileNotFoundError, "ruler/niah_multikey_3/validation_4096.jsonl"),
        (lambda: helmet.evaluate(model, tokenizer, d, datasets=["clinic150"], lengths=[4096]),
         FileNotFoundError, "icl/clinic150/train.jsonl (expected file name 'train.jsonl'"),
    ]
    for fn, error, needle in cases:
        with pytest.raises(error, match=re.escape(needle)):
            fn()
    assert [s.name for s in helmet.resolve_datasets("kilt_nq,icl_banking77,rerank,nq")] == ["nq", "banking77",
                                                                                           "msmarco"]


def test_command_line_on_a_tiny_model_writes_json_and_png(data_dir, tokenizer, tmp_path, monkeypatch, capsys):
    from focal_jax.train import checkpoint, trainer

    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "tokenizer.model").write_bytes(open(tokenizer.path, "rb").read())
    monkeypatch.setattr(trainer, "load_model", lambda path, step=None, mesh=None: _llama(tokenizer.vocab_size))
    monkeypatch.setattr(checkpoint, "read_meta", lambda path, step=None: (3, {"config": {"data": {"seq_len": 64}}}))
    out = tmp_path / "res" / "helmet.json"
    result = helmet.main(["--workdir", str(workdir), "--data", str(data_dir), "--datasets", "json_kv,nq",
                          "--lengths", "512,640", "--n", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["step"] == 3 and record["rows"] == json.loads(json.dumps(result["rows"]))
    assert [(r["dataset"], r["length"]) for r in record["rows"]] == [
        (d, n) for d in ("json_kv", "nq") for n in (512, 640)]
    for row in record["rows"]:
        assert 0.0 <= row["score"] <= 1.0 and row["n"] >= 2
        assert row["prompt_tokens"] <= row["length"] - {"json_kv": 100}.get(row["dataset"], 20)
        assert all(0.0 <= e["score"] <= 1.0 and isinstance(e["output"], str) for e in row["examples"])
    assert record["rows"][2]["units_kept"] < 1.0  # nq passages dropped at 512 tokens
    assert {g["group"] for g in record["groups"]} == {"recall", "rag"}
    assert (tmp_path / "res" / "helmet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "helmet: nq at 512 tokens" in printed and "| **rag** | mean |" in printed
    with pytest.raises(SystemExit):
        helmet.main(["--workdir", str(workdir), "--data", str(data_dir), "--datasets", "recall", "--lengths", "4096"])
    assert "niah_multikey_3/validation_4096.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        helmet.main(["--workdir", str(workdir), "--data", str(data_dir), "--datasets", "nq,cite"])
    assert "NLI model" in capsys.readouterr().err


def test_a_rows_score_is_the_mean_over_its_examples(data_dir, tokenizer):
    """One wrong answer per cell (the first prompt of every decoder call, one call per cell): each row scores
    (n - 1) / n, the mean of its per-example scores, and the group rows average them; nothing was cut to fit, so
    `truncated` is 0."""
    names = ["json_kv", "nq", "banking77"]
    decode, _ = _stub_decoder(tokenizer, data_dir, names, [4096])

    def first_wrong(model, prompts, **kwargs):
        out = decode(model, prompts, **kwargs)
        return [tokenizer.encode(" zzz\n") + [kwargs["eos_id"]]] + out[1:]

    result = helmet.evaluate(None, tokenizer, str(data_dir), datasets=names, lengths=[4096], decode=first_wrong,
                             batch_size=ONE_CALL)
    for row in result["rows"]:
        assert sorted(e["score"] for e in row["examples"]) == [0.0] + [1.0] * (row["n"] - 1), row["dataset"]
        assert row["n"] > 1 and row["score"] == pytest.approx((row["n"] - 1) / row["n"])
        assert row["truncated"] == 0 and row["units_kept"] == 1.0
    groups = {g["group"]: g["score"] for g in result["groups"]}
    assert groups == {row["group"]: pytest.approx(row["score"]) for row in result["rows"]}


def test_truncated_counts_the_prompts_whose_context_was_cut(data_dir, tokenizer):
    """`fit='truncate'` at a length every nq prompt overflows: every prompt is cut (`truncated` == n) and no
    context unit is dropped (`units_kept` 1.0); at 4096 tokens, where they all fit, none is cut."""
    examples = helmet.load_examples("nq", str(data_dir), 4096, n=None)
    full = [_bounds(tokenizer, ex)[0] for ex in examples]
    assert max(_n_tokens(tokenizer, ex.render("")) for ex in examples) < min(full) - 40  # the template fits
    length = min(full) - 30 + 20  # a budget 30 tokens short of the shortest full prompt
    row, fits = helmet.evaluate(None, tokenizer, str(data_dir), datasets=["nq"], lengths=[length, 4096], fit="truncate",
                                decode=lambda model, prompts, **kwargs: [[kwargs["eos_id"]] for _ in prompts])["rows"]
    assert row["n"] == len(examples) and row["truncated"] == row["n"] and row["units_kept"] == 1.0
    assert row["prompt_tokens"] <= length - 20
    assert fits["n"] == len(examples) and fits["truncated"] == 0


def test_a_length_equal_to_the_generation_length_is_refused_before_decoding(data_dir, tokenizer):
    """A target length that only fits the generated tokens leaves no prompt budget: refused by `check_data`,
    naming the dataset, before any decoding."""
    calls = []
    with pytest.raises(ValueError, match=re.escape("length=20 leaves no room for a prompt: nq generates up to 20")):
        helmet.evaluate(None, tokenizer, str(data_dir), datasets=["nq"], lengths=[20],
                        decode=lambda *args, **kwargs: calls.append(args))
    assert calls == []


def _stub_workdir(tmp_path, tokenizer, monkeypatch, attn=None):
    """A run directory with the tokenizer; loading it gives a tiny Llama of attention `attn` (step 3)."""
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                         intermediate=32, rope_theta=500.0, attn=attn or {})
    return stub_run_workdir(tmp_path, tokenizer, monkeypatch, lambda: Llama(config, rngs=nnx.Rngs(0)), step=3)


def _usage_error(capsys, argv, needle):
    usage_error(capsys, helmet.main, argv, needle)


def test_a_rerun_without_a_plot_removes_the_earlier_runs_plot(data_dir, tokenizer, tmp_path, monkeypatch, capsys):
    """A rerun in which no group has a score (json_kv at 110 tokens: a budget of 10 prompt tokens) writes its JSON
    and no plot: the PNG an earlier run left at --png, which would show results the new JSON does not hold, is
    removed, and the printed line says so."""
    workdir = _stub_workdir(tmp_path, tokenizer, monkeypatch)
    png = tmp_path / "res" / "helmet.png"
    png.parent.mkdir()
    png.write_bytes(b"\x89PNG\r\n\x1a\n an earlier run's plot")
    monkeypatch.setattr(helmet, "greedy_decode", lambda *args, **kwargs: pytest.fail("decoded a skipped cell"))
    argv = ["--workdir", str(workdir), "--data", str(data_dir), "--datasets", "json_kv", "--lengths", "110", "--n", "2",
            "--out", str(tmp_path / "res" / "helmet.json")]
    result = helmet.main(argv)
    assert result["rows"][0]["n"] == 0 and result["groups"][0]["score"] is None
    assert json.loads((tmp_path / "res" / "helmet.json").read_text())["rows"] == result["rows"]
    assert not png.exists()
    assert f"no plot; removed {png}, an earlier run's plot" in capsys.readouterr().out
    helmet.main(argv)
    assert capsys.readouterr().out.count("no plot\n") == 1  # nothing left to remove


def test_evaluate_logs_each_decoded_batch(data_dir, tokenizer):
    """json_kv's 6 prompts in batches of 4: two decoder calls of 4 prompts (the second filled with copies of its
    first prompt, as greedy_decode fills it), a progress line after each, every answer scored in example order."""
    decode, calls = _stub_decoder(tokenizer, data_dir, ["json_kv"], [4096])
    logged = []
    result = helmet.evaluate(None, tokenizer, str(data_dir), datasets=["json_kv"], lengths=[4096], batch_size=4,
                             decode=decode, log=logged.append)
    assert result["rows"][0]["score"] == 1.0 and result["rows"][0]["n"] == 6
    assert [c["n"] for c in calls] == [4, 4]
    assert [re.sub(r"\(\d+\.\ds\)", "(T)", line) for line in logged[:2]] == [
        "helmet: json_kv at 4096 tokens: batch 1/2 (T)", "helmet: json_kv at 4096 tokens: batch 2/2 (T)"]
    assert logged[2].startswith("helmet: json_kv at 4096 tokens (") and len(logged) == 3


@pytest.mark.parametrize("argv, needle", [
    (["--lengths", "0"], "argument --lengths: expected comma-separated distinct integers >= 1, got '0'"),
    (["--lengths", ","], "argument --lengths: expected comma-separated distinct integers >= 1, got ','"),
    (["--lengths", "4096,-1"], "argument --lengths: expected comma-separated distinct integers >= 1, got '4096,-1'"),
    (["--topk", "0"], "argument --topk: expected an integer >= 1, got '0'"),
    (["--topk", "-1"], "argument --topk: expected an integer >= 1, got '-1'"),
])
def test_bad_lengths_and_topk_are_refused_before_the_model_loads(argv, needle, monkeypatch, capsys):
    monkeypatch.setattr(helmet, "load_for_decoding", lambda *args, **kwargs: pytest.fail("loaded the model"))
    _usage_error(capsys, ["--workdir", "RUN", "--data", "DATA", *argv], needle)


def test_a_topk_the_model_cannot_take_names_the_flag_before_decoding(data_dir, tokenizer, tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(helmet, "greedy_decode", lambda *args, **kwargs: pytest.fail("decoded"))
    focus = dict(kind="focus", focus_window=2, focus_groups=4, focus_dim=8, focus_iters=2)
    argv = ["--data", str(data_dir), "--datasets", "json_kv", "--lengths", "4096", "--n", "2"]
    workdir = _stub_workdir(tmp_path / "focus", tokenizer, monkeypatch, attn=focus)
    _usage_error(capsys, ["--workdir", str(workdir), *argv, "--topk", "9"],
                 "--topk=9 is more than the model's 4 Focus groups (focus_groups)")
    workdir = _stub_workdir(tmp_path / "dense", tokenizer, monkeypatch)
    _usage_error(capsys, ["--workdir", str(workdir), *argv, "--topk", "2"], "--topk=2 needs a Focus model")
