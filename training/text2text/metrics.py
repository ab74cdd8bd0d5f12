"""Text-to-text metrics by name, each x100 and, except BLEU, the mean over examples of the best score
over an example's references:

* `exact_match`, `f1`: the official SQuAD v1.1 script's `exact_match_score` and `f1_score` (answers
  normalised: lowercase, punctuation and the articles a/an/the removed, whitespace collapsed; F1 over
  the tokens' multiset).
* `accuracy`: the generated text equals a reference exactly (surrounding whitespace ignored): the
  label accuracy of T5's classification tasks, where the label is a word.
* `rouge1`, `rouge2`, `rougeL`: the `rouge-score` package's F-measure with its default tokenizer and
  the Porter stemmer (as SNI's Rouge-L).
* `bleu`: `sacrebleu.corpus_bleu` (its default 13a tokenisation, corpus level, as T5 reports BLEU);
  sacrebleu is the reference implementation translation papers report, so its figures compare.
* `mcc`, `class_f1`: corpus-level classification scores over the task's label words (GLUE reports
  CoLA's Matthews correlation and MRPC's and QQP's F1): each generated text is its label, or a class
  of its own when it is none of them. `mcc` is the multi-class Matthews correlation (Gorodkin's R_K,
  what scikit-learn's `matthews_corrcoef` computes; 0 where a marginal is constant); `class_f1` the F1
  of the positive class, the second label word (HF's GLUE class 1). Computed here: two formulas over
  a confusion matrix do not justify scikit-learn as a dependency.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Callable, Mapping, Sequence

ROUGE = ("rouge1", "rouge2", "rougeL")
CLASS_METRICS = ("mcc", "class_f1")
METRICS = ("exact_match", "f1", "accuracy", *ROUGE, "bleu", *CLASS_METRICS)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def squad_normalize(text: str) -> str:
    """SQuAD v1.1's normalize_answer: lowercase, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact_match(prediction: str, reference: str) -> float:
    return float(squad_normalize(prediction) == squad_normalize(reference))


def squad_f1(prediction: str, reference: str) -> float:
    """SQuAD v1.1's f1_score: token-multiset precision and recall of the normalised texts."""
    pred, ref = squad_normalize(prediction).split(), squad_normalize(reference).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def label_accuracy(prediction: str, reference: str) -> float:
    return float(prediction.strip() == reference.strip())


def check_metric_names(names: Sequence[str], labels: Sequence[str] = ()) -> None:
    """ValueError naming the valid metrics when `names` is empty or holds an unknown one, or a class
    metric without the two or more label words it scores over (two for `class_f1`)."""
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        what = f"unknown metric {unknown[0]!r}" if unknown else "no metric named"
        raise ValueError(f"{what}: task.metrics takes a list of {', '.join(METRICS)}")
    if "mcc" in names and len(labels) < 2:
        raise ValueError("task.metrics mcc scores generated labels: set task.label_words to the task's labels")
    if "class_f1" in names and len(labels) != 2:
        raise ValueError("task.metrics class_f1 is the F1 of a binary task's positive class (the second label "
                         f"word): set task.label_words to two labels, not {list(labels)}")


def matthews_correlation(truth: Sequence[str], predicted: Sequence[str]) -> float:
    """Multi-class Matthews correlation of two label sequences: (c*s - sum_k p_k t_k) / sqrt((s^2 -
    sum_k p_k^2) (s^2 - sum_k t_k^2)) over their confusion matrix (c correct, s all, t_k and p_k the
    true and predicted counts of class k); 0 where either count vector is one class."""
    true_counts, pred_counts = collections.Counter(truth), collections.Counter(predicted)
    s, c = len(truth), sum(t == p for t, p in zip(truth, predicted))
    classes = true_counts.keys() | pred_counts.keys()
    cov_tp = c * s - sum(pred_counts[k] * true_counts[k] for k in classes)
    cov_pp = s * s - sum(n * n for n in pred_counts.values())
    cov_tt = s * s - sum(n * n for n in true_counts.values())
    return 0.0 if cov_pp == 0 or cov_tt == 0 else cov_tp / (cov_pp * cov_tt) ** 0.5


def positive_class_f1(truth: Sequence[str], predicted: Sequence[str], positive: str) -> float:
    """F1 of the class `positive`: 2 TP / (2 TP + FP + FN); 0 where it is neither true nor predicted."""
    tp = sum(t == p == positive for t, p in zip(truth, predicted))
    wrong = sum((t == positive) != (p == positive) for t, p in zip(truth, predicted))
    return 2 * tp / (2 * tp + wrong) if tp or wrong else 0.0


def _per_example(names: Sequence[str]) -> dict[str, Callable[[str, str], float]]:
    scorers: dict[str, Callable[[str, str], float]] = {}
    functions = {"exact_match": squad_exact_match, "f1": squad_f1, "accuracy": label_accuracy}
    scorers.update({n: functions[n] for n in names if n in functions})
    rouge = [n for n in names if n in ROUGE]
    if rouge:
        from rouge_score import rouge_scorer, tokenizers  # here: the run config imports this module

        # RougeScorer(rouge, use_stemmer=True), with its default tokenizer passed in (no log line per call)
        scorer = rouge_scorer.RougeScorer(rouge, tokenizer=tokenizers.DefaultTokenizer(use_stemmer=True))
        for n in rouge:
            scorers[n] = lambda p, r, n=n: scorer.score(target=r, prediction=p)[n].fmeasure
    return scorers


def score_examples(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]],
                   names: Sequence[str], labels: Sequence[str] = ()) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(corpus metrics x100, per-example scores x100 by id) of `predictions` against `references`
    (both keyed by example id; every reference id must have a prediction). `labels`: the task's label
    words, for the class metrics (each example's first reference is its class)."""
    check_metric_names(names, labels)
    ids = list(references)
    lost = [i for i in ids if i not in predictions]
    if lost:
        raise ValueError(f"{len(lost)} examples have no prediction, e.g. {lost[:3]}")
    per_example: dict[str, dict[str, float]] = {i: {} for i in ids}
    corpus: dict[str, float] = {}
    for name, fn in _per_example(names).items():
        for i in ids:
            per_example[i][name] = round(100.0 * max(fn(predictions[i], r) for r in references[i]), 4)
        corpus[name] = round(sum(per_example[i][name] for i in ids) / len(ids), 4)
    if "bleu" in names:
        import sacrebleu  # here: only BLEU needs it

        width = max(len(references[i]) for i in ids)
        streams = [[references[i][k] if k < len(references[i]) else None for i in ids] for k in range(width)]
        corpus["bleu"] = round(sacrebleu.corpus_bleu([predictions[i] for i in ids], streams).score, 4)
    if set(names) & set(CLASS_METRICS):  # each example's class: its first reference, its prediction
        truth, predicted = [references[i][0].strip() for i in ids], [predictions[i].strip() for i in ids]
        if "mcc" in names:
            corpus["mcc"] = round(100.0 * matthews_correlation(truth, predicted), 4)
        if "class_f1" in names:
            corpus["class_f1"] = round(100.0 * positive_class_f1(truth, predicted, labels[1]), 4)
    return {n: corpus[n] for n in names}, per_example
