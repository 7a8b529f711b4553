"""A generated sentiment task that works offline: learnable, but not trivial.

Each example reviews one or two things ("the soundtrack was not very good, but the plot felt
wonderful"). The label needs composition, not just word counting:

* an adjective carries a polarity; a negation ("not", "never", "hardly") flips it;
* with "but", the clause after it decides; with "and" or "although", the first clause does;
* a few percent of labels are flipped (``label_noise``), so accuracy saturates below 100%.

A bag-of-words model cannot solve the negation and "but" rules; a pretrained encoder with
LoRA can. Generation is deterministic given the seed.
"""

from __future__ import annotations

import random

from .types import TaskData, TextExamples

POSITIVE = ["good", "great", "wonderful", "excellent", "delightful", "charming", "brilliant", "moving",
            "enjoyable", "superb", "pleasant", "clever", "beautiful", "gripping", "fresh", "funny"]
NEGATIVE = ["bad", "awful", "terrible", "boring", "dull", "clumsy", "tedious", "bland", "weak",
            "poor", "annoying", "messy", "forgettable", "lifeless", "stale", "painful"]
NOUNS = ["movie", "plot", "acting", "soundtrack", "ending", "script", "cast", "dialogue", "pacing",
         "cinematography", "story", "direction", "humor", "finale", "score", "performance"]
VERBS = ["was", "is", "seemed", "felt", "turned out", "looked"]
INTENSIFIERS = ["", "", "very ", "really ", "quite ", "rather ", "truly "]
NEGATIONS = ["not ", "never ", "hardly ", "not at all "]
OPENERS = ["", "", "honestly, ", "overall, ", "i think ", "to be fair, "]


def _clause(rng: random.Random) -> tuple[str, int]:
    polarity = rng.random() < 0.5
    adj = rng.choice(POSITIVE if polarity else NEGATIVE)
    negated = rng.random() < 0.35
    det = rng.choice(["the", "this", "that"])
    text = f"{det} {rng.choice(NOUNS)} {rng.choice(VERBS)} {rng.choice(NEGATIONS) if negated else ''}{rng.choice(INTENSIFIERS)}{adj}"
    return " ".join(text.split()), int(polarity != negated)


def _example(rng: random.Random) -> tuple[str, int]:
    first, label_first = _clause(rng)
    if rng.random() < 0.45:
        return rng.choice(OPENERS) + first, label_first
    second, label_second = _clause(rng)
    joiner = rng.choice(["but", "and", "although"])
    if joiner == "but":
        return f"{rng.choice(OPENERS)}{first}, but {second}", label_second
    if joiner == "and":
        # "and" joins agreeing clauses: make the second agree with the first.
        while label_second != label_first:
            second, label_second = _clause(rng)
        return f"{rng.choice(OPENERS)}{first} and {second}", label_first
    return f"{rng.choice(OPENERS)}{first}, although {second}", label_first


def make_examples(n: int, seed: int, label_noise: float = 0.05) -> TextExamples:
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        text, label = _example(rng)
        if rng.random() < label_noise:
            label = 1 - label
        texts.append(text)
        labels.append(label)
    return TextExamples(text_a=texts, labels=labels)


def load_synthetic(train_size: int, eval_size: int, seed: int) -> TaskData:
    """The generated task. Train and evaluation sets use disjoint random streams."""
    return TaskData(
        name="synthetic",
        num_labels=2,
        train=make_examples(train_size, seed=10_000 + seed),
        eval_splits={"validation": make_examples(eval_size, seed=20_000 + seed, label_noise=0.0)},
        label_names=["negative", "positive"],
    )
