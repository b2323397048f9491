"""Synthetic long-context tasks with known answers, for training and for scoring recall.

Every task returns `Example(prompt, answer)`: the prompt ends right before the answer (no trailing space) and the
answer is a string of digits (words, after a space, for `frequent_words`), so `prompt + answer` is a training
document and a model's continuation of `prompt` is scored with `score`. Each task has a length knob (`n_pairs`,
`n_sentences` or `n_words`) so contexts can grow.

- `associative_recall` (multi-query associative recall): `n_pairs` key=value pairs, then `n_queries` queries of
  distinct keys; the first `n_queries - 1` are answered in the prompt, the last one is the example's answer.
- `needle` (needle in a haystack): `n_sentences` filler sentences with `n_keys` needles
  "The magic number for KEY is VALUE." at random places; one key is queried, the other needles are distractors.
- `json_kv`: a JSON object of `n_pairs` random hex keys to random digit-string values; one key is queried.
- `frequent_words`: `n_words` words drawn from `n_vocab` words of a fixed list with Zipf weights (1 / rank); the answer
  is the most frequent word, or the `top` most frequent ones, most frequent first, comma-separated.

>>> ex = make_examples('associative_recall', 1, seed=0, n_pairs=3, n_queries=2)[0]
>>> ex.prompt.count('='), ex.answer.isdigit()
(5, True)
"""

import dataclasses
import inspect
import json

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
    """One task instance: the model reads `prompt` and should continue it with `answer` (digits, or for
    `frequent_words` a space and comma-separated words)."""

    prompt: str
    answer: str


_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
_HEX = np.array(list("0123456789abcdef"))
_FILLER = (
    "The grass is green and the sky is blue.",
    "The sun rose slowly over the quiet hills.",
    "A small boat drifted along the river.",
    "The market was busy on a warm afternoon.",
    "Rain fell softly on the roof all night.",
    "The old library smelled of paper and dust.",
    "Children played in the park until dusk.",
    "A cold wind blew across the empty field.",
    "The train left the station on time.",
    "Birds sang in the trees near the house.",
    "The road wound through the dark forest.",
    "A cup of tea cooled on the kitchen table.",
    "The city lights glowed in the distance.",
    "Snow covered the mountains in the north.",
    "The baker opened his shop before dawn.",
    "Waves broke gently against the shore.",
)
# frequent_words draws from these; none is a prefix of another, so `score`'s prefix match cannot confuse two.
_WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "bread", "chair", "green", "light", "music", "ocean", "paper",
    "queen", "sugar", "table", "water", "horse", "glass", "night", "plant", "house", "money", "smile", "train",
    "bird", "door", "fish", "king", "lamp", "moon", "rain", "wolf",
)


def _random_strings(rng, n, length, alphabet):
    """`n` distinct random strings of `length` characters from `alphabet` (a numpy array of characters)."""
    if n > len(alphabet) ** length:
        raise ValueError(f"cannot draw {n} distinct strings of length {length} from {len(alphabet)} characters")
    out = {}
    while len(out) < n:
        word = "".join(rng.choice(alphabet, length))
        out[word] = None
    return list(out)


def _values(rng, n, digits):
    """`n` random digit strings of exactly `digits` digits (leading zeros allowed)."""
    return ["".join(map(str, rng.integers(0, 10, digits))) for _ in range(n)]


def associative_recall(rng, *, n_pairs: int = 16, n_queries: int = 4, key_len: int = 3,
                       value_digits: int = 4) -> Example:
    """'Pairs: abc=1234, ...\\nQueries: xyz=5678, abc=' -> '1234' (answered queries, then the asked one)."""
    if not 1 <= n_queries <= n_pairs:
        raise ValueError(f"associative_recall needs 1 <= n_queries <= n_pairs, got n_queries={n_queries}, "
                         f"n_pairs={n_pairs}")
    keys = _random_strings(rng, n_pairs, key_len, _LETTERS)
    values = _values(rng, n_pairs, value_digits)
    asked = rng.choice(n_pairs, n_queries, replace=False)
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, values))
    answered = "".join(f"{keys[i]}={values[i]}, " for i in asked[:-1])
    return Example(f"Pairs: {pairs}.\nQueries: {answered}{keys[asked[-1]]}=", values[asked[-1]])


def needle(rng, *, n_sentences: int = 40, n_keys: int = 1, key_len: int = 5, value_digits: int = 4) -> Example:
    """Filler sentences with `n_keys` needles 'The magic number for KEY is VALUE.'; asks one KEY -> its VALUE."""
    if n_keys < 1:
        raise ValueError(f"needle needs n_keys >= 1, got n_keys={n_keys}")
    keys = _random_strings(rng, n_keys, key_len, _LETTERS)
    values = _values(rng, n_keys, value_digits)
    sentences = [_FILLER[i] for i in rng.integers(0, len(_FILLER), n_sentences)]
    for key, value in zip(keys, values):
        sentences.insert(int(rng.integers(0, len(sentences) + 1)), f"The magic number for {key} is {value}.")
    asked = int(rng.integers(0, n_keys))
    question = f"\nWhat is the magic number for {keys[asked]}? Answer:"
    return Example(" ".join(sentences) + question, values[asked])


def json_kv(rng, *, n_pairs: int = 16, key_len: int = 8, value_digits: int = 6) -> Example:
    """'{"3f9a0c1e": "482193", ...}\\nKey: "3f9a0c1e"\\nValue:' -> '482193'."""
    keys = _random_strings(rng, n_pairs, key_len, _HEX)
    values = _values(rng, n_pairs, value_digits)
    asked = int(rng.integers(0, n_pairs))
    return Example(f'{json.dumps(dict(zip(keys, values)))}\nKey: "{keys[asked]}"\nValue:', values[asked])


def frequent_words(rng, *, n_words: int = 64, n_vocab: int = 8, top: int = 1) -> Example:
    """'Words: moon rain moon wolf ...\nThe most frequent word is:' -> ' moon'; with `top` = k > 1 the prompt asks
    for 'the k most frequent words, most frequent first' -> ' moon, rain, wolf'.

    The `n_vocab` words are picked from a fixed list of 32; the text draws `n_words` of them with Zipf weights
    (1 / rank), again until the `top + 1` highest counts all differ, so the answer is unique.
    """
    if not 1 <= top < n_vocab <= len(_WORDS):
        raise ValueError(f"frequent_words needs 1 <= top < n_vocab <= {len(_WORDS)}, got top={top}, "
                         f"n_vocab={n_vocab}")
    if n_words < top * (top + 1) // 2:
        raise ValueError(f"frequent_words needs n_words >= top * (top + 1) / 2 = {top * (top + 1) // 2} for "
                         f"{top + 1} distinct counts, got n_words={n_words}")
    vocab = [_WORDS[i] for i in rng.choice(len(_WORDS), n_vocab, replace=False)]
    weights = 1.0 / np.arange(1, n_vocab + 1)
    for _ in range(1000):
        drawn = rng.choice(n_vocab, n_words, p=weights / weights.sum())
        counts = np.bincount(drawn, minlength=n_vocab)
        ranked = np.argsort(-counts, kind="stable")
        if np.all(np.diff(counts[ranked[:top + 1]]) < 0):
            break
    else:
        raise ValueError(f"frequent_words drew no text with {top + 1} distinct top counts in 1000 tries "
                         f"(n_words={n_words}, n_vocab={n_vocab}, top={top}); use more n_words")
    question = ("The most frequent word is:" if top == 1
                else f"The {top} most frequent words, most frequent first, are:")
    text = " ".join(vocab[i] for i in drawn)
    return Example(f"Words: {text}.\n{question}", " " + ", ".join(vocab[i] for i in ranked[:top]))


TASKS = {"associative_recall": associative_recall, "needle": needle, "json_kv": json_kv,
         "frequent_words": frequent_words}


def task_options(task: str) -> dict[str, int]:
    """The keyword arguments `task` accepts and their defaults; raises naming the valid tasks if unknown."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; valid tasks: {sorted(TASKS)}")
    params = inspect.signature(TASKS[task]).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def make_examples(task: str, n: int, seed: int, **kwargs) -> list[Example]:
    """`n` examples of `task` -> list[Example], deterministic given `seed`.

    `kwargs` are the task's knobs (see `task_options(task)`), e.g. `n_pairs` / `n_sentences` for the length.
    """
    options = task_options(task)
    unknown = sorted(set(kwargs) - set(options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {task!r}; valid options: {sorted(options)}")
    for name, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"task option {name} must be an integer >= 1, got {name}={value!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an integer >= 0, got n={n!r}")
    rng = np.random.default_rng(seed)
    return [TASKS[task](rng, **kwargs) for _ in range(n)]


def score(predictions: list[str], examples: list[Example]) -> float:
    """Exact-match accuracy in [0, 1]: a prediction counts if, whitespace-stripped, it starts with the answer
    (whitespace-stripped too: the leading space of a `frequent_words` answer is not required) and the answer is not
    followed by a letter or digit.

    `predictions[i]` is the model's continuation of `examples[i].prompt`; text after the answer is ignored (the
    model need not stop), so a `frequent_words` prediction 'moon, rain' is right when the answer is ' moon', but
    '12345' is wrong when the answer is '1234'.

    >>> score(['1234 and more', ' 99', '12345'], [Example('a=', '1234'), Example('b=', '12'), Example('c=', '1234')])
    0.3333333333333333
    """
    if len(predictions) != len(examples):
        raise ValueError(f"got {len(predictions)} predictions for {len(examples)} examples")
    if not examples:
        raise ValueError("score needs at least one example, got none")
    hits = [_matches(p.strip(), ex.answer.strip()) for p, ex in zip(predictions, examples)]
    return sum(hits) / len(hits)


def _matches(prediction: str, answer: str) -> bool:
    return prediction.startswith(answer) and not prediction[len(answer):len(answer) + 1].isalnum()
