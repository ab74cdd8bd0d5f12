"""The SNI metric equals an independent computation of the official formula."""

import logging
import string

import pytest
from nltk.stem.porter import PorterStemmer
from rouge_score import tokenize as rouge_tokenize

from training.sni.rouge import (
    Reference,
    category_key,
    compute_metrics,
    normalize_answer,
    score_instance,
    sni_metrics,
)

_STEMMER = PorterStemmer()


def independent_rouge_l(prediction: str, reference: str) -> float:
    """F-measure of the longest common subsequence of rouge-score's stemmed default tokens."""
    p = rouge_tokenize.tokenize(prediction, _STEMMER)
    r = rouge_tokenize.tokenize(reference, _STEMMER)
    if not p or not r:
        return 0.0
    table = [[0] * (len(p) + 1) for _ in range(len(r) + 1)]
    for i in range(len(r)):
        for j in range(len(p)):
            table[i + 1][j + 1] = table[i][j] + 1 if r[i] == p[j] else max(table[i][j + 1], table[i + 1][j])
    lcs = table[-1][-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


def independent_em(prediction: str, reference: str) -> float:
    def norm(s):
        s = "".join(c for c in s.lower() if c not in string.punctuation)
        return " ".join(s.split())

    return float(norm(prediction) == norm(reference))


# (prediction, references, task, category): multi-reference instances, an empty prediction, stemming,
# punctuation and case differences, an article difference (kept by the official normalisation).
CASES = [
    ("box", ["box"], "task_a", "Word Analogy"),
    ("boxes", ["bag", "box"], "task_a", "Word Analogy"),
    ("", ["bottle"], "task_a", "Word Analogy"),
    ("The cats are running quickly.", ["the cat runs quickly", "a dog"], "task_b", "Title Generation"),
    (
        "a neural coherence model",
        ["A Neural Local Coherence Model", "coherence"],
        "task_b",
        "Title Generation",
    ),
    ("E", ["E"], "task_c", "Textual Entailment"),
    ("C.", ["c"], "task_c", "Textual Entailment"),
    ("the answer", ["answer"], "task_c", "Textual Entailment"),
    ("!!!", ["?"], "task_c", "Textual Entailment"),
    ("Paris is in France", ["France", "Paris, France", "It is Paris"], "task_b", "Title Generation"),
]


def test_instance_scores_match_independent_formula():
    for pred, refs, _, _ in CASES:
        rouge, em = score_instance(pred, refs)
        assert rouge == pytest.approx(max(independent_rouge_l(pred, r) for r in refs), abs=1e-12)
        assert em == max(independent_em(pred, r) for r in refs)
    assert score_instance("", ["bottle"]) == (0.0, 0.0)
    assert score_instance("the answer", ["answer"])[1] == 0.0  # articles are not removed
    assert score_instance("boxes", ["bag", "box"])[0] == 1.0  # Porter stemming, max over references
    with pytest.raises(ValueError, match="non-empty list"):
        score_instance("x", "x")


def test_aggregates_match_independent_formula():
    preds = [c[0] for c in CASES]
    refs = [c[1] for c in CASES]
    expected_rouge = (
        100 * sum(max(independent_rouge_l(p, r) for r in rs) for p, rs in zip(preds, refs)) / len(CASES)
    )
    expected_em = 100 * sum(max(independent_em(p, r) for r in rs) for p, rs in zip(preds, refs)) / len(CASES)
    got = compute_metrics(preds, refs)
    assert got["rougeL"] == round(expected_rouge, 4) and got["exact_match"] == round(expected_em, 4)

    expected = [Reference(f"id{i}", c[2], c[3], tuple(c[1])) for i, c in enumerate(CASES)]
    missing = Reference("id_missing", "task_a", "Word Analogy", ("jar",))
    predictions = {f"id{i}": c[0] for i, c in enumerate(CASES)}
    m = sni_metrics(predictions, expected + [missing])
    assert m["rougeL"] == round(expected_rouge, 4) and m["exact_match"] == round(expected_em, 4)
    assert m["n_instances"] == len(CASES) and m["n_tasks"] == 3
    assert m["n_missing"] == 1 and m["missing_ids"] == ["id_missing"] and m["n_absent_from_data"] == 0
    # the official script scores a missing prediction as ""
    assert m["rougeL_missing_as_empty"] == round(expected_rouge * len(CASES) / (len(CASES) + 1), 4)
    for task in ("task_a", "task_b", "task_c"):
        idx = [i for i, c in enumerate(CASES) if c[2] == task]
        want = 100 * sum(max(independent_rouge_l(preds[i], r) for r in refs[i]) for i in idx) / len(idx)
        assert m["per_task"][task]["rougeL"] == round(want, 4) and m["per_task"][task]["n"] == len(idx)
    assert set(m["per_category"]) == {"word_analogy", "title_generation", "textual_entailment"}
    assert m["per_category"]["textual_entailment"] == m["per_task"]["task_c"]


def test_normalisation_and_errors():
    assert normalize_answer("  The  Cat's   hat!! ") == "the cats hat"
    assert category_key("Title  Generation") == "title_generation"
    with pytest.raises(ValueError, match="no reference"):
        sni_metrics({"unknown": "x"}, [Reference("a", "t", "c", ("x",))])
    with pytest.raises(ValueError, match="predictions but"):
        compute_metrics(["a"], [])


def test_references_absent_from_the_data_are_counted_and_other_missing_ones_warned_about(caplog):
    """A partial copy of SNI lacks some instances of the official references: those are missing by
    construction (counted, no warning); a prediction missing for an instance that was evaluated is
    warned about. Both count as empty in the *_missing_as_empty figures."""
    expected = [Reference(f"id{i}", c[2], c[3], tuple(c[1])) for i, c in enumerate(CASES)]
    absent = Reference("id_absent", "task_a", "Word Analogy", ("jar",))
    predictions = {f"id{i}": c[0] for i, c in enumerate(CASES)}
    with caplog.at_level(logging.INFO, logger="training.sni.rouge"):
        m = sni_metrics(predictions, expected + [absent], absent_from_data=["id_absent"])
    assert m["n_missing"] == m["n_absent_from_data"] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    caplog.clear()
    lost = dict(predictions)
    del lost["id0"]
    with caplog.at_level(logging.INFO, logger="training.sni.rouge"):
        m2 = sni_metrics(lost, expected + [absent], absent_from_data=["id_absent"])
    assert m2["n_missing"] == 2 and m2["n_absent_from_data"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["no prediction for 1 evaluated instances; they count as empty in *_missing_as_empty"]
    assert m2["rougeL_missing_as_empty"] < m["rougeL_missing_as_empty"]
