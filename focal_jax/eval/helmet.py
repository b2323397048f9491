"""HELMET (Yen et al. 2025, arXiv 2410.02694; github.com/princeton-nlp/HELMET) for focal_jax models, from local files.

The Focal paper (FOCAL_SPEC 4.2-4.3, OQ-F11) reports HELMET's groups at 4K-64K tokens. This module runs the
datasets whose scoring needs no external model, with HELMET's data files, prompt templates, sample selection,
generation lengths, post-processing and metrics, on a focal_jax model decoded greedily
(`focal_jax.eval.decode.greedy_decode`). Nothing is downloaded: `data_dir` is the `data/` directory of HELMET's
release (`princeton-nlp/HELMET` on the Hugging Face hub, `data.tar.gz`), plus the files HELMET reads from the hub
at run time (ICL, InfiniteBench), exported once by the user (HARNESS.md, "HELMET").

Datasets (`DATASETS`; `GROUPS` as HELMET's `scripts/collect_results.py` averages them; HELMET's own names such as
`kilt_nq`, `msmarco_rerank_psg`, `icl_banking77`, `infbench_choice_eng` are accepted too):

- recall: json_kv (json_kv/test_k{50,105,220,440,900,1800}_dep6.jsonl for 4K, 8K, 16K, 32K, 64K, 128K; generates
  up to 100 tokens; substring_exact_match), ruler_niah_mk_2, ruler_niah_mk_3, ruler_niah_mv
  (ruler/niah_multikey_2/validation_{4096,...,131072}.jsonl, ...; 50, 100, 50 tokens; ruler_recall);
- ruler (not a HELMET group): ruler_niah_s_1, _s_2, _s_3, ruler_niah_mk_1, ruler_niah_mq (same layout; 50, mq 100);
- rag: nq, triviaqa, hotpotqa, popqa (kilt/nq-dev-multikilt_1000_k{20,50,105,220,440,1000}_dep6.jsonl and the
  demonstrations kilt/nq-train-multikilt_1000_k3_dep6.jsonl, ...; 20 tokens; substring_exact_match);
- rerank: msmarco (msmarco/test_reranking_data_k{14,50,130,285,600,1000}_dep3.jsonl, demonstrations
  msmarco/test_reranking_data_k10_dep3.jsonl; 200 tokens; NDCG@10);
- icl: trec_coarse, trec_fine, banking77, clinic150, nlu (icl/NAME/train.jsonl and test.jsonl: the Hugging Face
  datasets HELMET loads, exported; 20 tokens; exact_match);
- longqa: infbench_mc, infbench_qa (InfiniteBench's infbench/longbook_choice_eng.jsonl, longbook_qa_eng.jsonl; 10
  tokens; exact_match, rougeL_f1).

Not supported, with an error naming what they need: generation with citations (ALCE ASQA / QAMPARI: HELMET scores
citations with the NLI model google/t5_xxl_true_nli_mixture), summarization (InfiniteBench Sum, Multi-LexSum) and
NarrativeQA (a GPT-4o judge), and RULER's cwe / fwe / vt / qa tasks (not implemented; `focal_jax.eval.recall` has
frequent-word and needle tasks of its own).

What matches HELMET (data.py, model_utils.py, utils.py, eval.py, scripts/generate_configs.py of the repository):
- the test file of each length and the demonstration files; the sample of `n` examples (HELMET's
  `max_test_samples`, default 100, ICL 500) and the demonstrations of each example, from `seed` (default 42) with
  the same algorithms: Hugging Face `Dataset.shuffle(seed)` (numpy `default_rng(seed).permutation`),
  `random.Random(seed).sample` of the sorted question keys (RAG: every row of a sampled key is kept, so a RAG cell
  can have more than `n` rows), sha256-seeded demonstration shuffles, ICL's label-balanced demonstrations, label-
  balanced test sample and per-example random integer labels; 2 demonstrations for json_kv, RAG, re-ranking and
  LongQA, the many-shot counts of each length for ICL (e.g. banking77: 180 at 4K ... 5900 at 128K);
- the prompt templates, without a chat template, as HELMET runs its base-model configs (`use_chat_template: false`):
  user template, then HELMET's "system template" (e.g. "Answer:"), which is also prepended to the generated text
  before scoring, as HELMET does without a chat template;
- the budget: prompt tokens (a start token, the bos, included) at most `input_length - generation_length`;
- greedy decoding of at most the dataset's generation length, stopped at eos and, for RAG, re-ranking and ICL, at
  the first newline (HELMET's `stop_new_line`);
- post-processing (`parse_output`, `parse_rankings`) and metrics (SubEM and exact match on normalised answers,
  RULER's recall, NDCG@10 as trec_eval computes it, InfiniteBench's multiple-choice rule, ROUGE-L F1); scores are
  fractions in [0, 1] (HELMET prints them times 100), averaged per dataset, then over a group's datasets.

What differs:
- the tokenizer is the run's own, not HELMET's (Llama-2 for its data files, the evaluated model's for truncation).
  HELMET sized each length's files for Llama tokenizers and cuts the tail of the context when a prompt is still too
  long. Here `fit='drop'` (the default) removes whole context units instead until the prompt fits: distractor
  passages (RAG, re-ranking), demonstrations (ICL, taken from the end) or haystack lines and sentences (json_kv,
  RULER), keeping the first ones in order. The units that hold an answer are never dropped and keep their relative
  depth (a gold passage at 80% of the passages stays at 80%): RAG's passages that KILT marks `has_answer` (else
  those containing a normalised answer; if they alone overflow, only the first is kept), the lines holding the key or
  a value (json_kv, RULER), and json_kv's first and last lines, which open and close the JSON object. Re-ranking is
  scored against the judgements of the passages shown. `fit='truncate'` is HELMET's rule (the context's last tokens
  are cut, answers included), the prompt re-encoded and cut further while it is still over the budget (HELMET does
  not re-check);
- lengths other than HELMET's use the file of the next HELMET length up (and its ICL shot count), then fit;
- LongQA: HELMET cuts each book to `length - 200 - generation` Llama-2 tokens and appends " ... [the rest of the
  text is omitted]"; here the book is cut with the run's tokenizer so that the whole prompt fits, the same suffix
  appended. HELMET runs LongQA with a chat template; a base model has none, so the prompt ends with "Answer:".
  HELMET also drops books under 65536 Llama-2 tokens before sampling (data.py says none is that short); here no book
  is dropped, so the sample is HELMET's only if that holds;
- HELMET's LongQA group also averages NarrativeQA (not run here): the `longqa` mean is over En.MC and En.QA only,
  not comparable with HELMET's LongQA score;
- the InfiniteBench multiple-choice rule is kept as HELMET has it, quirk included: normalisation deletes the
  article "a", so the answer letter "A" normalises to "" and an empty answer counts as "A";
- newlines stop decoding when the decoded text holds one (HELMET stops at newline token ids).

Command line (progress lines, a table with one row per dataset and one column per length, then the group means;
writes JSON and a PNG of score against length per group):

  python -m focal_jax.eval.helmet --workdir DIR --data HELMET_DATA_DIR --datasets json_kv,nq,msmarco,banking77
      --lengths 4096,8192 [--n N] [--seed 42] [--fit drop|truncate] [--batch-size 8] [--topk K]
      [--mesh AXIS=N,...] [--out FILE.json] [--png FILE.png]

`--datasets` also takes group names (`recall,rag,rerank,icl,longqa,ruler`); the default is HELMET's five groups that
run here (recall, rag, rerank, icl, longqa).
"""

import argparse
import dataclasses
import hashlib
import json
import math
import numbers
import os
import random
import re
import string
import sys
import time
from typing import Callable

import numpy as np

from focal_jax._validation import check_distinct, check_int, output_file_error
from focal_jax.eval._cli import MESH_HELP, evaluation_mesh, mesh_shape, on_mesh, positive_int, rope_ntk_factor
from focal_jax.eval.decode import greedy_decode
from focal_jax.eval.recall import decode_in_batches, length_list, load_for_decoding, plot_by_length, remove_stale_plot

HELMET_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)  # HELMET's 4K ... 128K
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536)  # the Focal paper's "4K to 64K"
DEFAULT_SEED = 42
FITS = ("drop", "truncate")
TRUNCATION_SUFFIX = " ... [the rest of the text is omitted]"  # HELMET's truncate_llama2 postfix


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A HELMET dataset as this module runs it.

    `kind` chooses the loader and the scorer ('json_kv', 'ruler', 'rag', 'rerank', 'icl', 'infbench_mc',
    'infbench_qa'); `test_files` holds one path per `HELMET_LENGTHS` entry (relative to the data directory; ICL:
    the directory of train.jsonl / test.jsonl; InfiniteBench: one file for every length); `shots` is the number of
    demonstrations (ICL: one count per HELMET length); `options` kind-specific settings as (key, value) pairs.
    """

    name: str
    group: str
    kind: str
    metric: str
    generation_length: int
    test_files: tuple
    shots: object = 0
    stop_newline: bool = False
    max_samples: int = 100
    demo_file: str | None = None
    options: tuple = ()


def _per_length(template: str, ks) -> tuple:
    return tuple(template.format(k=k, length=length) for k, length in zip(ks, HELMET_LENGTHS))


def _ruler(name, directory, generation_length, group, multi=False):
    return Dataset(name, group, "ruler", "ruler_recall", generation_length,
                   _per_length(f"ruler/{directory}/validation_{{length}}.jsonl", HELMET_LENGTHS),
                   options=(("multi", multi),))


def _rag(name, stem, dep, demo, threshold=None):
    return Dataset(name, "rag", "rag", "substring_exact_match", 20,
                   _per_length(f"kilt/{stem}_k{{k}}_{dep}.jsonl", (20, 50, 105, 220, 440, 1000)), shots=2,
                   stop_newline=True, demo_file=f"kilt/{demo}", options=(("popularity_threshold", threshold),))


def _icl(name, label_field, num_labels, shots):
    return Dataset(name, "icl", "icl", "exact_match", 20, (f"icl/{name}",) * len(HELMET_LENGTHS), shots=shots,
                   stop_newline=True, max_samples=500,
                   options=(("label_field", label_field), ("num_labels", num_labels)))


DATASETS = {d.name: d for d in [
    Dataset("json_kv", "recall", "json_kv", "substring_exact_match", 100,
            _per_length("json_kv/test_k{k}_dep6.jsonl", (50, 105, 220, 440, 900, 1800)), shots=2),
    _ruler("ruler_niah_mk_2", "niah_multikey_2", 50, "recall"),
    _ruler("ruler_niah_mk_3", "niah_multikey_3", 100, "recall"),
    _ruler("ruler_niah_mv", "niah_multivalue", 50, "recall", multi=True),
    _ruler("ruler_niah_s_1", "niah_single_1", 50, "ruler"),
    _ruler("ruler_niah_s_2", "niah_single_2", 50, "ruler"),
    _ruler("ruler_niah_s_3", "niah_single_3", 50, "ruler"),
    _ruler("ruler_niah_mk_1", "niah_multikey_1", 50, "ruler"),
    _ruler("ruler_niah_mq", "niah_multiquery", 100, "ruler", multi=True),
    _rag("nq", "nq-dev-multikilt_1000", "dep6", "nq-train-multikilt_1000_k3_dep6.jsonl"),
    _rag("triviaqa", "triviaqa-dev-multikilt_1000", "dep6", "triviaqa-train-multikilt_1000_k3_dep6.jsonl"),
    _rag("hotpotqa", "hotpotqa-dev-multikilt_1000", "dep3", "hotpotqa-train-multikilt_1000_k3_dep3.jsonl"),
    _rag("popqa", "popqa_test_1000", "dep6", "popqa_test_1000_k3_dep6.jsonl", threshold=3.0),
    Dataset("msmarco", "rerank", "rerank", "NDCG@10", 200,
            _per_length("msmarco/test_reranking_data_k{k}_dep3.jsonl", (14, 50, 130, 285, 600, 1000)), shots=2,
            stop_newline=True, demo_file="msmarco/test_reranking_data_k10_dep3.jsonl"),
    _icl("trec_coarse", "coarse_label", 6, (200, 400, 800, 1600, 3300, 6600)),
    _icl("trec_fine", "fine_label", 50, (200, 400, 800, 1600, 3200, 6400)),
    _icl("banking77", "label", 77, (180, 360, 720, 1450, 2900, 5900)),
    _icl("clinic150", "intent", 151, (220, 440, 880, 1750, 3525, 7050)),
    _icl("nlu", "label", 68, (250, 510, 1020, 2040, 4080, 8296)),
    Dataset("infbench_mc", "longqa", "infbench_mc", "exact_match", 10,
            ("infbench/longbook_choice_eng.jsonl",) * len(HELMET_LENGTHS), shots=2),
    Dataset("infbench_qa", "longqa", "infbench_qa", "rougeL_f1", 10,
            ("infbench/longbook_qa_eng.jsonl",) * len(HELMET_LENGTHS), shots=2),
]}
GROUPS = {}
for _d in DATASETS.values():
    GROUPS.setdefault(_d.group, []).append(_d.name)
GROUPS = {group: tuple(names) for group, names in GROUPS.items()}
DEFAULT_GROUPS = ("recall", "rag", "rerank", "icl", "longqa")  # HELMET's groups that need no external model
ALIASES = {"kilt_nq": "nq", "kilt_triviaqa": "triviaqa", "kilt_hotpotqa": "hotpotqa", "kilt_popqa": "popqa",
           "kilt_popqa_3": "popqa", "msmarco_rerank_psg": "msmarco", "infbench_choice_eng": "infbench_mc",
           "infbench_choice": "infbench_mc", "infbench_qa_eng": "infbench_qa",
           **{f"icl_{name}": name for name in GROUPS["icl"]}}
_CITE = ("HELMET scores citations with the NLI model google/t5_xxl_true_nli_mixture (eval_alce.py), which "
         "focal_jax does not run")
_JUDGE = "HELMET scores it with a GPT-4o judge (scripts/eval_gpt4_*.py), which focal_jax does not run"
_RULER_OTHER = ("RULER's cwe / fwe / vt / qa tasks are not implemented here (focal_jax.eval.recall has "
                "frequent-word and needle tasks of its own)")
UNSUPPORTED = {
    "cite": _CITE, "alce_asqa": _CITE, "alce_qampari": _CITE, "alce_asqa_nocite": _CITE,
    "alce_qampari_nocite": _CITE,
    "summ": _JUDGE, "infbench_sum": _JUDGE, "infbench_sum_eng": _JUDGE, "multi_lexsum": _JUDGE,
    "narrativeqa": _JUDGE,
    "ruler_cwe": _RULER_OTHER, "ruler_fwe": _RULER_OTHER, "ruler_vt": _RULER_OTHER, "ruler_qa_1": _RULER_OTHER,
    "ruler_qa_2": _RULER_OTHER,
}

# HELMET's prompt templates (data.py), the user part and the "system" part that follows it.
_RAG_USER = ("Use the given documents to write a concise and short answer to the question. Write your answer in the "
             "following format:\nAnswer: [answer]\n\n{demos}{context}\n\nQuestion: {question}")
_RAG_PASSAGE = "Document (Title: {title}): {text}"
_RAG_DEMO = "{documents}\n\nQuestion: {question}\nAnswer: {answer}"
_JSON_KV_USER = ("{context}\n\nExtract the value corresponding to the specified key in the JSON object below.\n\n"
                 "{demos}Key: {question}")
_JSON_KV_DEMO = "Key: {key}\nCorresponding value:{value}"
_RERANK_USER = ("You are provided with a list of documents, each indicated by their ID. Rank each document based on "
                "their relevance to the question in descending order from most relelvant to least relevant texts. "
                "Include all documents in the rankings. Write your answer using the unique IDs, with the following "
                "format:\nRanking: ID3 > ID1 > ID2\n\n{demos}{context}\n\nQuery: {question}")
_RERANK_PASSAGE = "[ID: {id}] Document (Title: {title}): {text}"
_RERANK_PASSAGE_NO_TITLE = "[ID: {id}] Document: {text}"
_ICL_USER = ("Use the provided mapping from the text to label to assign a label to the text. Only output "
             "\"label: {{label}}\" and nothing else. \n\n{context}\n\n{question}")
_ICL_ITEM = "{text}\nlabel: {label}"
_RULER_USER = ("A special magic {type_needle_v} is hidden within the following text. Make sure to memorize it. I will "
               "quiz you about the {type_needle_v} afterwards.\n{context}\nWhat is the special magic {type_needle_v} "
               "for {query} mentioned in the provided text?")
_RULER_SYSTEM = "The special magic {type_needle_v} for {query} mentioned in the provided text is"
_RULER_MULTI_USER = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                     "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                     "magic {type_needle_v} for {query} mentioned in the provided text?")
_RULER_MULTI_SYSTEM = "The special magic {type_needle_v} for {query} mentioned in the provided text are"
_INFBENCH_MC_USER = ("You are given a story and a question with multiple choices. Choose the best answer from the "
                     "options provided. Only one of the following options is correct, output the answer using one "
                     "single letter (A, B, C, or D). Don't say anything else.\n\n{demo}{context}\n\nQuestion: "
                     "{question}\nOptions:\n{options}")
_INFBENCH_QA_USER = ("You are given a story and a question. Answer the question as concisely as you can, using a "
                     "single phrase if possible.\n\n{demo}{context}\n\nQuestion: {question}")


class TooShort(ValueError):
    """A prompt that cannot fit its token budget even with every droppable unit removed."""


# ----------------------------------------------------------------------------------------------------------------
# Metrics and output parsing (HELMET's utils.py)

_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / DrQA normalisation as HELMET's: lower case, punctuation removed, articles (a, an, the) removed,
    whitespace collapsed. `normalize_answer("The  Eiffel-Tower!") == "eiffeltower"`."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _answer_list(answers) -> list[str]:
    """`answers` (a string, a list of strings, or a list of lists of strings) as a flat list of strings."""
    if isinstance(answers, str):
        return [answers]
    flat = []
    for a in answers:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return [str(a) for a in flat]


def exact_match(prediction: str, answers) -> float:
    """1.0 when the normalised `prediction` equals a normalised answer (`answers`: str or list of str), else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in _answer_list(answers)))


def substring_exact_match(prediction: str, answers) -> float:
    """SubEM: 1.0 when a normalised answer is a substring of the normalised `prediction`, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(a) in pred for a in _answer_list(answers)))


def ruler_recall(prediction: str, answers) -> float:
    """RULER's score as HELMET computes it: the fraction of `answers` found (case-insensitive substring) in
    `prediction`."""
    answers = _answer_list(answers)
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)


def parse_output(output: str, prefix: str = "Answer:") -> str | None:
    """The answer in a generated `output`, as HELMET parses it: the rest of the line after the first `prefix`
    (case-insensitive), else the first line; stripped, with a repeated `prefix` removed.
    `parse_output("Answer: Paris\\nmore") == "Paris"`."""
    escaped = re.escape(prefix)
    for pattern in (re.compile(f"(?:{escaped})(.*)(?:\n|$)", flags=re.IGNORECASE),
                    re.compile(r"(?:^)(.*)(?:\n|$)")):
        match = pattern.search(output)
        if match is not None:
            return re.sub(f"^{escaped}", "", match[1].strip(), flags=re.IGNORECASE).strip()
    return None


def parse_rankings(output: str) -> dict[str, int]:
    """A generated ranking as HELMET parses it: `{doc_id: score}`, the longest run of integers joined by '>'
    (brackets, colons and 'id' removed), scores decreasing from the number of ids to 1 (a repeated id keeps its
    first place). Without any integer the whole cleaned text is the only "id" (it matches nothing).
    `parse_rankings("Ranking: [ID: 3] > 1 > 2") == {"3": 3, "1": 2, "2": 1}`."""
    text = re.sub(r"[\[\]:]", "", output).lower().replace("id", "")
    longest = ""
    for match in re.finditer(r"(\d+)(?:\s*>\s*(\d+))*", text):
        if len(match.group(0)) > len(longest):
            longest = match.group(0)
    ranking = [x.strip() for x in longest.split(">") if x.strip().isdigit()] if longest else [text]
    scores = {}
    for i, doc in enumerate(ranking):
        scores.setdefault(doc, len(ranking) - i)
    return scores


def ndcg_at_k(scores: dict[str, float], qrels: dict[str, int], k: int = 10) -> float:
    """NDCG@k of a run as trec_eval's `ndcg_cut` (hence pytrec_eval, which HELMET calls) computes it: documents
    sorted by score (descending; ties by id, descending), gain = the judged relevance (0 when unjudged), discount
    log2(rank + 1), normalised by the ideal ordering of the judgements; 0 without a relevant document. Rounded to 5
    decimals as HELMET's per-example metrics."""
    ranked = [doc for doc, _ in sorted(scores.items(), key=lambda item: (item[1], item[0]), reverse=True)][:k]
    dcg = sum(qrels.get(doc, 0) / math.log2(i + 2) for i, doc in enumerate(ranked) if qrels.get(doc, 0) > 0)
    ideal = sorted((rel for rel in qrels.values() if rel > 0), reverse=True)[:k]
    idcg = sum(rel / math.log2(i + 2) for i, rel in enumerate(ideal))
    return round(dcg / idcg, 5) if idcg > 0 else 0.0


def rouge_l_f1(prediction: str, answers) -> float:
    """ROUGE-L F1 (`rouge_score`, Porter stemmer, as HELMET's `calculate_metrics`), the best over `answers`. Needs
    the `rouge_score` package (installed with lm_eval: `pip install -e ".[eval]"`)."""
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise ImportError("infbench_qa is scored with ROUGE-L, which needs the rouge_score package: "
                          "pip install rouge_score (or pip install -e '.[eval]')") from None
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return max(scorer.score(target=a, prediction=prediction)["rougeL"].fmeasure for a in _answer_list(answers))


# ----------------------------------------------------------------------------------------------------------------
# Examples: reading HELMET's files and building its prompts


@dataclasses.dataclass
class Example:
    """One test example before fitting. Its prompt is `template.format(**fields, context=joiner.join(units))`.

    Attributes:
      template: HELMET's user template + separator + system template, with a `{context}` field.
      fields: the template's other fields (str values).
      units: the context's pieces (passages, demonstrations, lines or sentences), `joiner.join(units)` is HELMET's
        context.
      joiner: what joins the units ('\\n\\n' between passages and demonstrations, '' between text pieces).
      gold: indices of the units that `fit='drop'` never removes (those that hold an answer).
      answer: what the metric compares with: a string, a list of strings, or re-ranking judgements `{id: label}`.
      reference: a correct output text (HELMET's 'answer' field: the answer, the gold ranking, the option letter).
      prefix: HELMET's system template, formatted; prepended to the generated text before scoring.
      unit_ids: re-ranking: the passage id of each unit (judgements are restricted to the passages shown).
      truncate_suffix: LongQA: the context is cut (never dropped) and this text appended when it is.
      keep_first_gold: RAG: when the gold units alone overflow, `fit='drop'` keeps only the first of them.
      info: identifiers kept in the results (`id`, `question`).
    """

    template: str
    fields: dict
    units: list
    joiner: str
    answer: object
    reference: str
    prefix: str
    gold: tuple = ()
    unit_ids: tuple = ()
    truncate_suffix: str | None = None
    keep_first_gold: bool = False
    info: dict = dataclasses.field(default_factory=dict)

    def render(self, context: str) -> str:
        """The prompt text with `context` in place of the units."""
        return self.template.format(**self.fields, context=context)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A fitted prompt: its `text`, its `tokens` (start token first), `kept` (indices of the units shown, in prompt
    order; None when the context was truncated instead) and `cut_tokens` (context tokens truncated, 0 if none)."""

    text: str
    tokens: list
    kept: tuple | None
    cut_tokens: int = 0


def resolve_dataset(name: str) -> Dataset:
    """The `Dataset` named `name` (or HELMET's name for it, see `ALIASES`). Raises ValueError naming the choices for
    an unknown name and what is missing for a HELMET dataset this module does not run."""
    key = ALIASES.get(name, name)
    if key in DATASETS:
        return DATASETS[key]
    if key in UNSUPPORTED:
        raise ValueError(f"HELMET dataset {name!r} is not supported: {UNSUPPORTED[key]}")
    raise ValueError(f"unknown HELMET dataset {name!r}; choices: {sorted(DATASETS)}, groups: {sorted(GROUPS)} "
                     f"(HELMET's names {sorted(ALIASES)} are accepted too)")


def resolve_datasets(names) -> list[Dataset]:
    """`Dataset`s for a list of dataset or group names (or a comma-separated string), each once, in order."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError(f"datasets must name at least one dataset or group, got {names!r}; choices: "
                         f"{sorted(DATASETS)}, groups: {sorted(GROUPS)}")
    out = []
    for name in names:
        for dataset in ([DATASETS[n] for n in GROUPS[name]] if name in GROUPS else [resolve_dataset(name)]):
            if dataset not in out:
                out.append(dataset)
    return out


def _length_index(length: int) -> int:
    """Index into `HELMET_LENGTHS` of the smallest HELMET length >= `length`."""
    check_int("length", length, 1)
    for i, helmet_length in enumerate(HELMET_LENGTHS):
        if length <= helmet_length:
            return i
    raise ValueError(f"length={length} exceeds HELMET's largest length {HELMET_LENGTHS[-1]} (no data files for it)")


def data_file(dataset: Dataset, data_dir: str, length: int, relative: str | None = None) -> str:
    """The path of `dataset`'s test file for `length` (or of `relative`) under `data_dir`, or under `data_dir/data`
    (the tarball's own top directory). FileNotFoundError names the path and the expected file name."""
    relative = relative or dataset.test_files[_length_index(length)]
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"HELMET data directory {data_dir!r} does not exist (give the 'data' directory of "
                                f"HELMET's data release)")
    for root in (data_dir, os.path.join(data_dir, "data")):
        path = os.path.join(root, relative)
        if os.path.exists(path):
            return path
    hint = {"icl": "ICL data: export the Hugging Face dataset to train.jsonl and test.jsonl (HARNESS.md, HELMET)",
            "infbench_mc": "InfiniteBench's own file (xinrongzhang2022/InfiniteBench on the Hugging Face hub)",
            "infbench_qa": "InfiniteBench's own file (xinrongzhang2022/InfiniteBench on the Hugging Face hub)"}.get(
        dataset.kind, "from HELMET's data release (princeton-nlp/HELMET, data.tar.gz)")
    raise FileNotFoundError(f"HELMET dataset {dataset.name!r} at length {length}: missing "
                            f"{os.path.join(data_dir, relative)} (expected file name {os.path.basename(relative)!r}: "
                            f"{hint})")


def _iter_jsonl(path: str):
    """(line index, object) of each non-blank line of a jsonl file; ValueError names the file and line."""
    with open(path, encoding="utf-8") as f:
        index = 0
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not a JSON object: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number} is not a JSON object: {line[:80]!r}")
            yield index, row
            index += 1


def _read_jsonl(path: str, keep: Callable[[int, dict], bool] | None = None) -> list[dict]:
    return [row for i, row in _iter_jsonl(path) if keep is None or keep(i, row)]


def _hf_permutation(n: int, seed: int) -> list[int]:
    """The row order of Hugging Face `Dataset.shuffle(seed=seed)` over `n` rows (numpy `default_rng` PCG64)."""
    return np.random.default_rng(seed).permutation(n).tolist()


def _sha_seed(text) -> int:
    return int(hashlib.sha256(str(text).encode("utf-8")).hexdigest(), 16) % 2**31


def _shuffled_unique(rows: list[dict], seed: int, key: str, count: int) -> list[dict]:
    """`rows` shuffled as Hugging Face's `shuffle(seed)`, duplicates of `key` dropped, the first `count` (HELMET's
    demonstration choice)."""
    out, seen = [], set()
    for i in _hf_permutation(len(rows), seed):
        value = rows[i][key]
        if value in seen:
            continue
        seen.add(value)
        out.append(rows[i])
        if len(out) == count:
            break
    return out


def _first_rows_of_permutation(path: str, n: int | None, seed: int) -> list[dict]:
    """HELMET's `data.shuffle(seed).select(range(min(n, len)))` (all rows in file order when `n` is None)."""
    if n is None:
        return _read_jsonl(path)
    total = sum(1 for _ in _iter_jsonl(path))
    order = _hf_permutation(total, seed)[:n]
    rank = {row_index: position for position, row_index in enumerate(order)}
    rows = [None] * len(order)
    for i, row in _iter_jsonl(path):
        if i in rank:
            rows[rank[i]] = row
    return rows


def _field(row: dict, name: str, path: str):
    if name not in row:
        raise ValueError(f"{path}: a row lacks the field {name!r} (it has {sorted(row)})")
    return row[name]


_TEXT_UNIT = re.compile(r"(?<=\n)|(?<=[.!?] )|(?<=\", )")


def _text_units(context: str, needles: list[str]) -> tuple[list[str], tuple]:
    """A haystack split after newlines, sentence ends and JSON separators (`''.join(units) == context`), and the
    indices of the units holding one of `needles`."""
    units = [u for u in _TEXT_UNIT.split(context) if u]
    needles = [n for n in needles if n]
    gold = tuple(i for i, u in enumerate(units) if any(n in u for n in needles))
    return units, gold


def _load_json_kv(dataset, path, n, seed):
    rows = _first_rows_of_permutation(path, n, seed)
    examples = []
    for row in rows:
        demos = _field(row, "demos", path)[:dataset.shots]
        demo_text = "\n\n".join(_JSON_KV_DEMO.format(key=k, value=" " + v) for k, v in demos)
        demo_text += "\n\n" if dataset.shots > 0 else ""
        question, answer = str(_field(row, "question", path)), _field(row, "answer", path)
        context = str(_field(row, "context", path))
        units, gold = _text_units(context, [question] + _answer_list(answer))
        if "{" in context and context.rstrip().endswith("}"):  # keep the lines that open and close the object
            gold = tuple(sorted({*gold, next(i for i, u in enumerate(units) if "{" in u), len(units) - 1}))
        examples.append(Example(_JSON_KV_USER + "\nCorresponding value:", {"demos": demo_text, "question": question},
                                units, "", answer, _answer_list(answer)[0], "Corresponding value:", gold,
                                info={"id": row.get("id"), "question": question}))
    return examples


def _load_ruler(dataset, path, n, seed):
    multi = dict(dataset.options)["multi"]
    user, system = (_RULER_MULTI_USER, _RULER_MULTI_SYSTEM) if multi else (_RULER_USER, _RULER_SYSTEM)
    examples = []
    for row in _first_rows_of_permutation(path, n, seed):
        answer = _answer_list(row["answer"] if "answer" in row else _field(row, "outputs", path))
        fields = {k: v for k, v in row.items() if k != "context"}
        try:
            prefix = system.format(**fields)
        except KeyError as e:
            raise ValueError(f"{path}: a row lacks the field {e.args[0]!r} of HELMET's RULER template") from None
        units, gold = _text_units(str(_field(row, "context", path)), answer)
        examples.append(Example(user + "\n" + system, fields, units, "", answer, ", ".join(answer), prefix, gold,
                                info={"id": row.get("index"), "question": row.get("query")}))
    return examples


def _passage_gold(ctxs, answers) -> tuple:
    """Indices of the passages holding an answer: KILT's `has_answer` flags when present, else a normalised
    substring match of an answer in the title or text."""
    if any("has_answer" in c for c in ctxs):
        return tuple(i for i, c in enumerate(ctxs) if c.get("has_answer"))
    normalized = [normalize_answer(a) for a in _answer_list(answers)]
    normalized = [a for a in normalized if a]
    return tuple(i for i, c in enumerate(ctxs)
                 if any(a in normalize_answer(f"{c.get('title', '')} {c.get('text', '')}") for a in normalized))


def _format_passages(template, ctxs, path):
    try:
        return [template.format(**c) for c in ctxs]
    except KeyError as e:
        raise ValueError(f"{path}: a passage lacks the field {e.args[0]!r} (passages need {template!r})") from None


def _load_rag(dataset, path, demo_path, n, seed):
    threshold = dict(dataset.options)["popularity_threshold"]

    def popular(row):  # HELMET keeps popqa rows with log10(s_pop) < 3
        return threshold is None or math.log10(_field(row, "s_pop", path)) < threshold

    first = next(_iter_jsonl(path), (0, {}))[1]
    key = "id" if "id" in first else "question"
    keys = sorted({_field(row, key, path) for _, row in _iter_jsonl(path) if popular(row)})
    chosen = set(keys if n is None else random.Random(seed).sample(keys, min(n, len(keys))))
    rows = _read_jsonl(path, lambda i, row: popular(row) and row[key] in chosen)
    demo_rows = [row for row in _read_jsonl(demo_path) if popular(row)] if dataset.shots > 0 else []
    examples = []
    for row in rows:
        demo_text = ""
        if dataset.shots > 0:
            # popqa has one split: HELMET leaves the question itself out of its demonstrations
            pool = [d for d in demo_rows if d.get(key) != row[key]] if dataset.name == "popqa" else demo_rows
            demos = _shuffled_unique(pool, _sha_seed(row[key]), key, dataset.shots)
            demo_text = "\n\n".join(
                _RAG_DEMO.format(documents="\n\n".join(_format_passages(_RAG_PASSAGE, d["ctxs"], demo_path)),
                                 question=d["question"], answer=_answer_list(d["answers"])[0]) for d in demos) + "\n\n"
        ctxs, answers = _field(row, "ctxs", path), _field(row, "answers", path)
        fields = {"demos": demo_text, "question": _field(row, "question", path)}
        examples.append(Example(_RAG_USER + "\nAnswer:", fields,
                                _format_passages(_RAG_PASSAGE, ctxs, path), "\n\n", answers, _answer_list(answers)[0],
                                "Answer:", _passage_gold(ctxs, answers), keep_first_gold=True,
                                info={"id": row.get("id"), "question": row["question"]}))
    return examples


def _load_rerank(dataset, path, demo_path, n, seed):
    first = next(_iter_jsonl(path), (0, {}))[1]
    key = "qid" if "qid" in first else "query"
    keys = sorted({_field(row, key, path) for _, row in _iter_jsonl(path)})
    chosen = set(keys if n is None else random.Random(seed).sample(keys, min(n, len(keys))))
    rows = _read_jsonl(path, lambda i, row: row[key] in chosen)
    demos = _read_jsonl(demo_path) if dataset.shots > 0 else []
    filtered = len(demos) > 2 * len(rows)
    if filtered:  # HELMET drops the test queries from a large demonstration pool once
        test_qids = {row.get("qid") for row in rows}
        demos = [d for d in demos if d.get("qid") not in test_qids]
    examples = []
    for row in rows:
        ctxs = _field(row, "ctxs", path)
        template = _RERANK_PASSAGE if "title" in ctxs[0] else _RERANK_PASSAGE_NO_TITLE
        demo_text = ""
        if dataset.shots > 0:
            pool = demos if filtered else [d for d in demos if d.get("qid") != row.get("qid")]
            for d in _shuffled_unique(pool, abs(_sha_seed(_field(row, "qid", path))), "qid", dataset.shots):
                ranking = " > ".join(str(c["id"]) for c in sorted(d["ctxs"], key=lambda c: c["label"], reverse=True))
                demo_text += ("\n\n".join(_format_passages(template, d["ctxs"], demo_path))
                              + f"\n\nQuery: {d['query']}\nRanking: {ranking}" + "\n\n")
        qrels = {str(c["id"]): int(c["label"]) for c in ctxs}
        gold_ranking = " > ".join(str(c["id"]) for c in sorted(ctxs, key=lambda c: c["label"], reverse=True))
        fields = {"demos": demo_text, "question": _field(row, "query", path)}
        examples.append(Example(_RERANK_USER + "\nRanking:", fields,
                                _format_passages(template, ctxs, path), "\n\n", qrels, gold_ranking, "Ranking:",
                                unit_ids=tuple(str(c["id"]) for c in ctxs),
                                info={"id": row.get("qid"), "question": row["query"]}))
    return examples


def balance_labels(rows: list[dict], count: int, seed: int, label_field: str) -> list[dict]:
    """HELMET's label-balanced sample of `count` rows (data.py `balance_labels`): rounds of one row per label
    (labels in order of first appearance, rows drawn with `random.Random(seed)`, with replacement once a label runs
    out), each round shuffled, concatenated, cut to `count`. Step for step as `load_icl`'s `balance_labels` in
    princeton-nlp/HELMET data.py (commit fdd6333, read 2026-12-03), which also balances the test rows this way."""
    rand = random.Random(seed)
    by_label = {}
    for row in rows:
        by_label.setdefault(row[label_field], []).append(row)
    rounds = math.ceil(count / len(by_label))
    grouped = [[] for _ in range(rounds)]
    for samples in by_label.values():
        indices = rand.sample(range(len(samples)), rounds % len(samples))
        while len(indices) < rounds:
            indices += rand.sample(range(len(samples)), min(rounds - len(indices), len(samples)))
        for i, index in enumerate(indices):
            grouped[i].append(samples[index])
    for group in grouped:
        rand.shuffle(group)
    return [row for group in grouped for row in group][:count]


def _load_icl(dataset, directory, length, n, seed):
    options = dict(dataset.options)
    label_field, num_labels = options["label_field"], options["num_labels"]
    shots = dataset.shots[_length_index(length)]
    paths = {}
    for split in ("train", "test"):
        paths[split] = os.path.join(directory, f"{split}.jsonl")
        if not os.path.exists(paths[split]):
            raise FileNotFoundError(f"HELMET dataset {dataset.name!r}: missing {paths[split]} (expected file name "
                                    f"'{split}.jsonl' with fields 'text' and {label_field!r}: the Hugging Face "
                                    f"dataset exported as in HARNESS.md, HELMET)")
    train, test = _read_jsonl(paths["train"]), _read_jsonl(paths["test"])
    for split, rows in (("train", train), ("test", test)):
        if not rows:
            raise ValueError(f"{paths[split]} holds no rows")
        for row in rows:
            label = _field(row, label_field, paths[split])
            _field(row, "text", paths[split])
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
                raise ValueError(f"{paths[split]}: {label_field}={label!r} is not a label id in [0, {num_labels}) "
                                 f"(export the dataset's integer labels)")
    if n is not None and len(test) > n:
        test = balance_labels([test[i] for i in _hf_permutation(len(test), seed)], n, seed, label_field)
    examples = []
    for row in test:
        local_seed = (int(hashlib.sha256(row["text"].encode("utf-8")).hexdigest(), 16) + seed) % 2**31
        demos = balance_labels(train, shots, local_seed, label_field)
        mapping = list(range(num_labels))
        random.Random(local_seed).shuffle(mapping)
        units = [_ICL_ITEM.format(text=d["text"], label=str(mapping[int(d[label_field])])) for d in demos]
        answer = str(mapping[int(row[label_field])])
        examples.append(Example(_ICL_USER + "\nlabel:", {"question": row["text"]}, units, "\n\n", answer, answer,
                                "label:", info={"question": row["text"]}))
    return examples


def _load_infbench(dataset, path, n, seed):
    choice = dataset.kind == "infbench_mc"
    rows = []
    for _, row in _iter_jsonl(path):
        for name in ("id", "context", "input", "answer") + (("options",) if choice else ()):
            _field(row, name, path)
        processed = {"id": row["id"], "context": row["context"], "question": row["input"],
                     "answer": _answer_list(row["answer"])}
        if choice:
            options = row["options"]
            if len(options) != 4 or processed["answer"][0] not in options:
                raise ValueError(f"{path}: row id={row['id']!r} needs 4 options holding its answer "
                                 f"{processed['answer'][0]!r}, got options={options!r}")
            letter = chr(ord("A") + options.index(processed["answer"][0]))
            processed.update(options="A. {}\nB. {}\nC. {}\nD. {}".format(*options),
                             answer=[letter, f"{letter}. {processed['answer'][0]}"])
        rows.append(processed)
    if choice:
        demo_template = "[story text]\nQuestion: {question}\nOptions:\n{options}\nAnswer: {answer[0]}"
    else:
        demo_template = "[story text]\nQuestion: {question}\nAnswer: {answer[0]}"
    demos = {}
    if dataset.shots > 0:
        for row in rows:
            pool = [r for r in rows if r["id"] != row["id"]]
            chosen = [pool[i] for i in _hf_permutation(len(pool), seed)[:dataset.shots]]
            demos[row["id"]] = ("For example:\n\n" + "\n\n".join(demo_template.format(**d) for d in chosen)
                                + "\n\nNow, read the following story:\n\n")
    if n is not None:
        rows = [rows[i] for i in _hf_permutation(len(rows), seed)[:n]]
    user = _INFBENCH_MC_USER if choice else _INFBENCH_QA_USER
    examples = []
    for row in rows:
        fields = {"demo": demos.get(row["id"], ""), "question": row["question"]}
        if choice:
            fields["options"] = row["options"]
        examples.append(Example(user + "\n\nAnswer:", fields, [row["context"]], "", row["answer"], row["answer"][0],
                                "Answer:", truncate_suffix=TRUNCATION_SUFFIX,
                                info={"id": row["id"], "question": row["question"]}))
    return examples


def load_examples(dataset, data_dir: str, length: int, *, n: int | None = None, seed: int = DEFAULT_SEED) -> list:
    """HELMET's test examples of `dataset` (a name or `Dataset`) for a target `length`, before fitting.

    Args:
      dataset: a name from `DATASETS` (or HELMET's name for it) or a `Dataset`.
      data_dir: the HELMET data directory (see the module docstring for the files each dataset reads).
      length: the target input length in tokens, 1 <= length <= 131072; picks the file (and the ICL shot count) of
        the smallest HELMET length >= `length`.
      n: HELMET's `max_test_samples` (questions for RAG and re-ranking, rows otherwise); None: all rows.
      seed: HELMET's seed (42), for the sample and the demonstrations.

    Returns:
      a list of `Example`.
    """
    if not isinstance(dataset, Dataset):
        dataset = resolve_dataset(dataset)
    if n is not None:
        check_int("n", n, 1)
    if dataset.kind == "icl":
        train = data_file(dataset, data_dir, length, os.path.join(dataset.test_files[0], "train.jsonl"))
        return _load_icl(dataset, os.path.dirname(train), length, n, seed)
    path = data_file(dataset, data_dir, length)
    if dataset.kind == "json_kv":
        return _load_json_kv(dataset, path, n, seed)
    if dataset.kind == "ruler":
        return _load_ruler(dataset, path, n, seed)
    if dataset.kind in ("infbench_mc", "infbench_qa"):
        return _load_infbench(dataset, path, n, seed)
    demo_path = data_file(dataset, data_dir, length, dataset.demo_file) if dataset.shots > 0 else None
    if dataset.kind == "rag":
        return _load_rag(dataset, path, demo_path, n, seed)
    return _load_rerank(dataset, path, demo_path, n, seed)


# ----------------------------------------------------------------------------------------------------------------
# Fitting a prompt to its token budget


def _start_id(tokenizer) -> int:
    start = getattr(tokenizer, "start_id", None)
    if start is None:
        bos = getattr(tokenizer, "bos_id", None)
        start = bos if bos is not None and bos >= 0 else tokenizer.eos_id
    return start


def _arrange(others: list[int], m: int, gold: list[int], n_units: int) -> list[int]:
    """The first `m` of `others` in order with each of `gold` (sorted) put back at its relative depth: unit g of
    `n_units` at index round(g / (n_units - 1) * (size - 1)). With every unit kept this is the original order."""
    order = list(others[:m])
    size = m + len(gold)
    last = -1
    for k, g in enumerate(gold):
        depth = g / (n_units - 1) if n_units > 1 else 0.0
        target = min(max(round(depth * (size - 1)), last + 1), m + k)
        order.insert(target, g)
        last = target
    return order


def _largest_fitting(fits: Callable[[int], bool], hi: int, guess: int) -> int | None:
    """The largest m in [0, hi] with fits(m) (fits true up to some m, false after): gallops from `guess` (up while
    it fits, else down), then bisects; None if not fits(0). A close guess costs a few calls."""
    guess = min(max(guess, 0), hi)
    if fits(guess):
        lo, step = guess, 1
        while lo < hi:
            probe = min(lo + step, hi)
            if not fits(probe):
                high = probe
                break
            lo, step = probe, 2 * step
        else:
            return lo
    else:
        high, step = guess, 1
        while True:
            if high == 0:
                return None
            probe = max(high - step, 0)
            if fits(probe):
                lo = probe
                break
            high, step = probe, 2 * step
    while high - lo > 1:  # fits(lo), not fits(high)
        mid = (lo + high) // 2
        if fits(mid):
            lo = mid
        else:
            high = mid
    return lo


def _drop_to_fit(example: Example, encode, tokenizer, budget: int, gold: list[int], full=None) -> Prompt | None:
    """The prompt with the most leading non-gold units that fits (`_arrange`), or None. `full`: the prompt with
    every unit as `(text, tokens)`, when known."""
    n_units = len(example.units)
    gold_set = set(gold)
    others = [i for i in range(n_units) if i not in gold_set]
    cache = {}
    if full is not None and len(gold) == len(example.gold):
        cache[len(others)] = (*full, tuple(range(n_units)))

    def build(m):
        if m not in cache:
            order = _arrange(others, m, gold, n_units)
            text = example.render(example.joiner.join(example.units[i] for i in order))
            cache[m] = (text, encode(text), tuple(order))
        return cache[m]

    # Guess from the units' own token counts, then search with exact counts.
    pieces = [example.units[i] for i in others]
    if hasattr(tokenizer, "encode_batch"):
        counts = [len(t) for t in tokenizer.encode_batch(pieces)] if pieces else []
    else:
        counts = [len(tokenizer.encode(piece)) for piece in pieces]
    excess = len(build(len(others))[1]) - budget
    guess, removed = len(others), 0
    while guess > 0 and removed < excess:
        guess -= 1
        removed += counts[guess]
    m = _largest_fitting(lambda k: len(build(k)[1]) <= budget, len(others), guess)
    if m is None:
        return None
    text, tokens, order = build(m)
    return Prompt(text, tokens, order)


def _truncate_to_fit(example: Example, encode, tokenizer, budget: int) -> Prompt | None:
    """HELMET's rule: cut the context's last tokens (appending `truncate_suffix` if any) until the prompt fits."""
    context = example.joiner.join(example.units)
    context_tokens = tokenizer.encode(context)
    suffix = example.truncate_suffix or ""
    cut = len(encode(example.render(context))) - budget + (len(tokenizer.encode(suffix)) if suffix else 0)
    while True:
        keep = len(context_tokens) - cut
        if keep < 0:
            return None
        text = example.render(tokenizer.decode(context_tokens[:keep]) + suffix)
        tokens = encode(text)
        if len(tokens) <= budget:
            return Prompt(text, tokens, None, cut)
        cut += len(tokens) - budget


def build_prompt(example: Example, tokenizer, budget: int, fit: str = "drop") -> Prompt:
    """`example`'s prompt with at most `budget` tokens (the start token included).

    Args:
      example: an `Example` (`load_examples`).
      tokenizer: the run's tokenizer (`encode`, `encode_batch`, `decode`, `start_id` or `bos_id` / `eos_id`).
      budget: the most prompt tokens, HELMET's `input_length - generation_length`.
      fit: 'drop' (remove whole context units, never the gold ones, see the module docstring) or 'truncate'
        (HELMET's rule: cut the context's last tokens). LongQA examples are always truncated.

    Returns:
      a `Prompt`; the whole context when it fits.

    Raises:
      TooShort (a ValueError) when no fitting leaves room: the template, demonstrations and gold units alone exceed
      `budget`.
    """
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got fit={fit!r}")
    check_int("budget", budget, 1)
    start = _start_id(tokenizer)

    def encode(text):
        return [start] + list(tokenizer.encode(text))

    text = example.render(example.joiner.join(example.units))
    tokens = encode(text)
    if len(tokens) <= budget:
        return Prompt(text, tokens, tuple(range(len(example.units))))
    if fit == "truncate" or example.truncate_suffix is not None:
        prompt = _truncate_to_fit(example, encode, tokenizer, budget)
    else:
        gold = sorted(example.gold)
        prompt = _drop_to_fit(example, encode, tokenizer, budget, gold, full=(text, tokens))
        if prompt is None and len(gold) > 1 and example.keep_first_gold:
            prompt = _drop_to_fit(example, encode, tokenizer, budget, gold[:1])
    if prompt is None:
        if fit == "truncate" or example.truncate_suffix is not None:
            what = f"with the whole context cut ({len(encode(example.render('')))} tokens without it)"
        else:
            bare = example.render(example.joiner.join(example.units[i] for i in sorted(example.gold)[:1]))
            what = (f"with every droppable passage / demonstration removed ({len(encode(bare))} tokens with at most "
                    f"one gold unit)")
        raise TooShort(f"a prompt needs more than the budget of {budget} tokens even {what}")
    return prompt


# ----------------------------------------------------------------------------------------------------------------
# Scoring


def score_output(dataset, example: Example, output: str, kept: tuple | None = None) -> tuple[float, object]:
    """The example's score in [0, 1] for a generated `output` (the new text only), and the parsed answer.

    HELMET's post-processing: the system template (`example.prefix`) is prepended, then per kind:
    json_kv SubEM of the text or of `parse_output(text, 'corresponding value:')`; RULER `ruler_recall` of the text;
    RAG SubEM of the text or of `parse_output(text)`; ICL exact match of `parse_output(text, 'label:')`; re-ranking
    NDCG@10 of `parse_rankings(text)` against the judgements of the passages in `kept` (all when None);
    InfiniteBench multiple choice exact match of the text or of `parse_output(text)`, or the option written out
    ('B. text') anywhere in the text; InfiniteBench QA ROUGE-L F1 of the text or of `parse_output(text)`.
    """
    if not isinstance(dataset, Dataset):
        dataset = resolve_dataset(dataset)
    text = example.prefix + output
    kind, answer = dataset.kind, example.answer
    if kind == "json_kv":
        parsed = parse_output(text, "corresponding value:")
        return max(substring_exact_match(text, answer), substring_exact_match(parsed, answer)), parsed
    if kind == "ruler":
        return ruler_recall(text, answer), text
    if kind == "rag":
        parsed = parse_output(text)
        return max(substring_exact_match(text, answer), substring_exact_match(parsed, answer)), parsed
    if kind == "icl":
        parsed = parse_output(text, "label:")
        return exact_match(parsed, answer), parsed
    if kind == "rerank":
        parsed = parse_rankings(text)
        shown = set(example.unit_ids[i] for i in kept) if kept is not None else set(answer)
        return ndcg_at_k(parsed, {doc: rel for doc, rel in answer.items() if doc in shown}, 10), parsed
    if kind == "infbench_mc":
        parsed = parse_output(text)
        score = max(exact_match(text, answer), exact_match(parsed, answer))
        return (1.0 if answer[1].lower() in text.lower() else score), parsed
    if kind == "infbench_qa":
        parsed = parse_output(text)
        return max(rouge_l_f1(text, answer), rouge_l_f1(parsed, answer)), parsed
    raise ValueError(f"dataset {dataset.name!r} has an unknown kind {kind!r}")


# ----------------------------------------------------------------------------------------------------------------
# The suite


def _check_lengths(lengths):
    if isinstance(lengths, (str, numbers.Number)) or not lengths:
        raise ValueError(f"lengths must be a non-empty list of integers >= 1, got lengths={lengths!r}")
    for length in lengths:
        _length_index(length)
    check_distinct("lengths", lengths)  # a length's rows would count twice in the group means


def check_data(datasets, data_dir: str, lengths) -> None:
    """Raises before any decoding: FileNotFoundError naming each missing file (path and expected name) of
    `datasets` (names or `Dataset`s) at `lengths`, ValueError for a length that leaves no room for a prompt,
    ImportError when a metric's package is missing."""
    specs = [d if isinstance(d, Dataset) else resolve_dataset(d) for d in datasets]
    _check_lengths(lengths)
    for spec in specs:
        for length in lengths:
            if spec.generation_length >= length:
                raise ValueError(f"length={length} leaves no room for a prompt: {spec.name} generates up to "
                                 f"{spec.generation_length} tokens")
            if spec.kind == "icl":
                for split in ("train", "test"):
                    data_file(spec, data_dir, length, os.path.join(spec.test_files[0], f"{split}.jsonl"))
                continue
            data_file(spec, data_dir, length)
            if spec.demo_file and spec.shots:
                data_file(spec, data_dir, length, spec.demo_file)
        if spec.kind == "infbench_qa":
            rouge_l_f1("a", ["a"])  # ImportError naming rouge_score before any decoding


def evaluate(model, tokenizer, data_dir: str, *, datasets=DEFAULT_GROUPS, lengths=DEFAULT_LENGTHS,
             n: int | None = None, seed: int = DEFAULT_SEED, fit: str = "drop", batch_size: int = 8,
             decode: Callable | None = None, log: Callable[[str], None] | None = None) -> dict:
    """HELMET scores of `model` on `datasets` at each target input length.

    Args:
      model: a focal_jax `Llama` or `GPT2` (any attention kind); a GPT-2's `n_positions` bounds the lengths.
      tokenizer: its tokenizer (`focal_jax.data.Tokenizer`).
      data_dir: the HELMET data directory (module docstring).
      datasets: dataset or group names (list or comma-separated string); see `DATASETS` and `GROUPS`.
      lengths: target input lengths in tokens (prompt + generation), each in [1, 131072].
      n: examples per dataset and length (HELMET's `max_test_samples`); None: HELMET's (100, ICL 500).
      seed: HELMET's seed.
      fit: 'drop' or 'truncate' (`build_prompt`).
      batch_size: prompts decoded together.
      decode: `decode(model, prompts, *, max_new_tokens, eos_id, stop, batch_size) -> new token lists`;
        None: `focal_jax.eval.decode.greedy_decode`. Called once per batch of `batch_size` prompts, sorted by
        length (`focal_jax.eval.recall.decode_in_batches`).
      log: called with one progress line per (dataset, length), e.g. `print`, and one per decoded batch when a cell
        has several; None is silent.

    Returns:
      `{'rows': [...], 'groups': [...]}`. One row per (dataset, length), datasets in order: `{'dataset', 'group',
      'length', 'metric', 'score' (the mean, in [0, 1]), 'n', 'prompt_tokens' (mean), 'units_kept' (mean fraction
      of context units shown, 1.0 when nothing was dropped), 'truncated' (prompts whose context was cut), 'file',
      'examples': [{'id', 'question', 'prompt_tokens', 'output', 'parsed', 'score'}]}`; a length at which some prompt
      cannot fit gives `score` None, `n` 0 and the reason under 'skipped'. One group row per (group, length):
      `{'group', 'length', 'score' (mean over the group's scored datasets, None if none), 'datasets'}`.

    Raises:
      ValueError / FileNotFoundError naming the bad value or the missing file (all files are checked before any
      decoding).
    """
    specs = resolve_datasets(datasets)
    _check_lengths(lengths)
    if n is not None:
        check_int("n", n, 1)
    if fit not in FITS:
        raise ValueError(f"fit must be one of {FITS}, got fit={fit!r}")
    check_int("batch_size", batch_size, 1)
    n_positions = getattr(getattr(model, "config", None), "n_positions", None)
    if n_positions is not None and max(lengths) > n_positions:
        raise ValueError(f"length={max(lengths)} exceeds the model's n_positions={n_positions} (GPT-2's learned "
                         f"positions; prompt and generation together must fit)")
    check_data(specs, data_dir, lengths)
    decode = decode or greedy_decode
    eos = getattr(tokenizer, "eos_id", None)
    eos = eos if eos is not None and eos >= 0 else None
    rows = []
    for spec in specs:
        if spec.stop_newline:
            def stop(new):
                return "\n" in tokenizer.decode(new)
        else:
            stop = None
        for length in lengths:
            start = time.perf_counter()
            relative = spec.test_files[_length_index(length)]
            examples = load_examples(spec, data_dir, length, n=n or spec.max_samples, seed=seed)
            budget = length - spec.generation_length
            row = {"dataset": spec.name, "group": spec.group, "length": int(length), "metric": spec.metric,
                   "file": relative}
            try:
                prompts = [build_prompt(ex, tokenizer, budget, fit) for ex in examples]
            except TooShort as e:
                reason = f"length={length} (budget {budget} prompt tokens): {e}"
                rows.append({**row, "score": None, "n": 0, "prompt_tokens": None, "skipped": reason})
                if log is not None:
                    log(f"helmet: {spec.name} at {length} tokens: skipped ({reason})")
                continue
            new_tokens = decode_in_batches(decode, model, [p.tokens for p in prompts], batch_size=batch_size, log=log,
                                           label=f"helmet: {spec.name} at {length} tokens",
                                           max_new_tokens=spec.generation_length, eos_id=eos, stop=stop)
            scored = []
            for ex, prompt, tokens in zip(examples, prompts, new_tokens):
                output = tokenizer.decode(tokens)
                value, parsed = score_output(spec, ex, output, prompt.kept)
                scored.append({**ex.info, "prompt_tokens": len(prompt.tokens), "output": output, "parsed": parsed,
                               "score": float(value)})
            kept = [len(p.kept) / len(ex.units) if p.kept is not None else 1.0 for ex, p in zip(examples, prompts)]
            row.update(score=float(np.mean([s["score"] for s in scored])) if scored else None, n=len(scored),
                       prompt_tokens=float(np.mean([len(p.tokens) for p in prompts])) if prompts else None,
                       units_kept=float(np.mean(kept)) if kept else None,
                       truncated=sum(p.cut_tokens > 0 for p in prompts), examples=scored)
            rows.append(row)
            if log is not None:
                score = "-" if row["score"] is None else f"{row['score']:.3f}"
                prompt_tokens = "-" if row["prompt_tokens"] is None else f"{row['prompt_tokens']:.0f}"
                units = "" if row["units_kept"] is None else f", {100 * row['units_kept']:.0f}% of context units kept"
                log(f"helmet: {spec.name} at {length} tokens ({relative}; mean prompt {prompt_tokens}{units}): "
                    f"{spec.metric} {score} of {row['n']} ({time.perf_counter() - start:.1f}s)")
    return {"rows": rows, "groups": group_scores(rows)}


def group_scores(rows: list[dict]) -> list[dict]:
    """Per (group, length): the mean score of the group's datasets that have one (HELMET's group average), groups
    in order of first appearance; `score` None when none has one."""
    groups = list(dict.fromkeys(r["group"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    out = []
    for group in groups:
        for length in lengths:
            cell = [r for r in rows if r["group"] == group and r["length"] == length and r["score"] is not None]
            out.append({"group": group, "length": length,
                        "score": float(np.mean([r["score"] for r in cell])) if cell else None,
                        "datasets": [r["dataset"] for r in cell]})
    return out


def format_table(result: dict) -> str:
    """A markdown table of `evaluate`'s result: one line per dataset, then one per group mean (in bold), one score
    column per length ('-' for a skipped or missing cell)."""
    rows, groups = result["rows"], result["groups"]
    lengths = sorted({r["length"] for r in rows})
    lines = ["| dataset | metric | " + " | ".join(str(n) for n in lengths) + " |", "|---" * (len(lengths) + 2) + "|"]
    score = {(r["dataset"], r["length"]): r["score"] for r in rows}
    metric = {r["dataset"]: r["metric"] for r in rows}
    for name in dict.fromkeys(r["dataset"] for r in rows):
        cells = [f"{score[name, n]:.3f}" if score.get((name, n)) is not None else "-" for n in lengths]
        lines.append(f"| {name} | {metric[name]} | " + " | ".join(cells) + " |")
    group_score = {(g["group"], g["length"]): g["score"] for g in groups}
    for group in dict.fromkeys(g["group"] for g in groups):
        cells = [f"{group_score[group, n]:.3f}" if group_score.get((group, n)) is not None else "-" for n in lengths]
        lines.append(f"| **{group}** | mean | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_helmet(result: dict, png: str, *, title: str | None = None) -> str:
    """Score against target length (log2 x axis), one line per group (its datasets' mean; cells without a score
    left out), into `png`; returns `png`."""
    groups = [g for g in result["groups"] if g["score"] is not None]
    if not groups:
        raise ValueError("plot_helmet needs at least one group score, got none")
    series = {}
    for group in dict.fromkeys(g["group"] for g in groups):
        datasets = sorted({d for g in groups if g["group"] == group for d in g["datasets"]})
        series[f"{group} ({', '.join(datasets)})"] = [(g["length"], g["score"]) for g in groups if g["group"] == group]
    return plot_by_length(series, png, title=title or "HELMET", xlabel="input length (tokens)", ylabel="score")


def main(argv=None) -> dict:
    """Command line (see the module docstring): evaluates a run directory's model on HELMET data, prints progress
    and a table, writes the results as JSON (`--out`, default WORKDIR/helmet.json) and a plot of score against
    length per group (`--png`, default the JSON path with .png). Returns `evaluate`'s result."""
    parser = argparse.ArgumentParser(prog="python -m focal_jax.eval.helmet", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="focal_jax run directory (checkpoint, tokenizer)")
    parser.add_argument("--step", type=int, default=None, help="a saved checkpoint step (default: the latest)")
    parser.add_argument("--data", required=True, help="HELMET data directory (the 'data' directory of its release)")
    parser.add_argument("--datasets", default=",".join(DEFAULT_GROUPS),
                        help=f"comma-separated datasets or groups; datasets: {','.join(DATASETS)}; "
                             f"groups: {','.join(GROUPS)}")
    parser.add_argument("--lengths", type=length_list, default=list(DEFAULT_LENGTHS),
                        help="comma-separated input lengths in tokens (prompt + generation)")
    parser.add_argument("--n", type=positive_int, default=None,
                        help="examples per dataset and length (default HELMET's)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--fit", choices=FITS, default="drop",
                        help="drop whole passages / demonstrations (default) or truncate the context (HELMET)")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--topk", type=positive_int, default=None,
                        help="hard top-k routing for a Focus model (1 to its number of groups)")
    parser.add_argument("--rope-ntk-factor", type=rope_ntk_factor, default=None,
                        help="dynamic NTK scaling (>= 1) of RoPE past the trained length (models with RoPE only; the "
                             "Focal paper's 64K evaluation)")
    parser.add_argument("--tokenizer", default=None,
                        help="SentencePiece model or tokenizer.json (default: the workdir's own copy)")
    parser.add_argument("--mesh", type=mesh_shape, default=None, help=MESH_HELP)
    parser.add_argument("--out", default=None, help="results JSON (default: WORKDIR/helmet.json)")
    parser.add_argument("--png", default=None, help="plot (default: the JSON path with .png)")
    args = parser.parse_args(argv)

    workdir = os.path.abspath(os.path.expanduser(args.workdir))
    data_dir = os.path.abspath(os.path.expanduser(args.data))
    out = os.path.abspath(os.path.expanduser(args.out or os.path.join(workdir, "helmet.json")))
    png = os.path.abspath(os.path.expanduser(args.png or os.path.splitext(out)[0] + ".png"))
    for flag, path in (("--out", out), ("--png", png)):  # checked now, not after the evaluation
        if problem := output_file_error(flag, path, make_folder=True):
            parser.error(problem)
    mesh = evaluation_mesh(parser, args.mesh, rows=("--batch-size", args.batch_size))
    try:
        specs = resolve_datasets(args.datasets)
        _check_lengths(args.lengths)
        if args.n is not None:
            check_int("n", args.n, 1)
        check_data(specs, data_dir, args.lengths)
        model, tokenizer, step = load_for_decoding(workdir, step=args.step, tokenizer=args.tokenizer, topk=args.topk,
                                                   rope_ntk_factor=args.rope_ntk_factor, name="helmet",
                                                   lengths=args.lengths, mesh=mesh)
        with on_mesh(mesh):
            result = evaluate(model, tokenizer, data_dir, datasets=[s.name for s in specs], lengths=args.lengths,
                              n=args.n, seed=args.seed, fit=args.fit, batch_size=args.batch_size,
                              log=lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError, ImportError) as e:
        parser.error(str(e))
    print(format_table(result))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    record = {"workdir": workdir, "step": step, "data": data_dir, "seed": args.seed, "fit": args.fit,
              "topk": args.topk, "rope_ntk_factor": args.rope_ntk_factor, "n": args.n, "mesh": args.mesh, **result}
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    label = f"{os.path.basename(workdir)} (step {step}{f', top-{args.topk}' if args.topk else ''})"
    written = [out]
    if any(g["score"] is not None for g in result["groups"]):
        written.append(plot_helmet(result, png, title=f"HELMET: {label}"))
    else:
        print(f"helmet: no group has a score (see the reasons above): no plot{remove_stale_plot(png)}")
    print(f"helmet: wrote {' and '.join(written)}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
