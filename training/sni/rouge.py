"""The official SNI metrics: Rouge-L and exact match, max over references, mean over instances, x100.

Reproduces `eval/automatic/evaluation.py` of allenai/natural-instructions and Tk-Instruct's
`src/compute_metrics.py` (the two define the same functions):

* `rouge`: `rouge_scorer.RougeScorer(['rougeL'], use_stemmer=True)` (rouge-score's default
  tokenizer: lowercase, non [a-z0-9] -> space, Porter stemmer on tokens longer than 3 characters),
  `scorer.score(prediction=prediction, target=ground_truth)["rougeL"].fmeasure`. The "xlingual" track
  instead tokenises with the GPT-2 tokenizer (`tokenize(s)` with "Ġ" stripped) and no stemmer; the
  default-split test set is entirely on the default (English) track.
* `exact_match`: `normalize_answer(prediction) == normalize_answer(ground_truth)` where
  normalize_answer lowercases, removes `string.punctuation` and collapses whitespace. Unlike SQuAD's,
  it does NOT remove articles ("adapted ... without removing the articles").
* `metric_max_over_ground_truths`: max over the instance's references.
* `compute_metrics`: `100.0 * sum / len(references)`, rounded to 4 decimals.
* `compute_grouped_metrics` per task (`task_id`) and per category, whose key is
  `"_".join(task_category.lower().split())`.
* A reference without a prediction is scored as the empty prediction ("No prediction for N
  instances. Use empty string as prediction.").
"""

from __future__ import annotations

import logging
import string
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from rouge_score import rouge_scorer, tokenizers

logger = logging.getLogger(__name__)

_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, collapse whitespace (articles are kept, as in the official code)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    return " ".join(s.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


class _GPTTokenizer:
    """The xlingual tokenizer of the official script: GPT-2 BPE tokens with the "Ġ" space mark removed."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer  # here: slow to import, and only the xlingual track needs it

        try:
            self._tok = AutoTokenizer.from_pretrained("gpt2")
        except Exception as e:  # offline, or no cached copy
            raise RuntimeError(
                "the xlingual track needs the GPT-2 tokenizer ('gpt2' from the Hugging Face hub); "
                "download it once (it is cached) or evaluate the default (English) track only"
            ) from e

    def tokenize(self, s: str) -> list[str]:
        return [t.lstrip("Ġ") for t in self._tok.tokenize(s)]


class RougeL:
    """Rouge-L F-measure as the official script computes it, one scorer per track (built once)."""

    def __init__(self) -> None:
        # RougeScorer(["rougeL"], use_stemmer=True) with its default tokenizer passed in: the same
        # scorer, without rouge-score's log line "Using default tokenizer." at every evaluation.
        self._default = rouge_scorer.RougeScorer(["rougeL"], tokenizer=tokenizers.DefaultTokenizer(use_stemmer=True))
        self._xlingual = None

    def __call__(self, prediction: str, reference: str, xlingual: bool = False) -> float:
        if xlingual:
            if self._xlingual is None:
                self._xlingual = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_GPTTokenizer())
            scorer = self._xlingual
        else:
            scorer = self._default
        return scorer.score(target=reference, prediction=prediction)["rougeL"].fmeasure


_ROUGE: RougeL | None = None


def rouge_l(prediction: str, reference: str, xlingual: bool = False) -> float:
    """Rouge-L F-measure in [0, 1] of one prediction against one reference."""
    global _ROUGE
    if _ROUGE is None:
        _ROUGE = RougeL()
    return _ROUGE(prediction, reference, xlingual)


def score_instance(prediction: str, references: Sequence[str], xlingual: bool = False) -> tuple[float, float]:
    """(Rouge-L, exact match) of one instance, each the max over its references, in [0, 1]."""
    if isinstance(references, str) or not references:
        raise ValueError(f"references must be a non-empty list of strings, got {references!r}")
    rouge = max(rouge_l(prediction, r, xlingual) for r in references)
    em = max(exact_match(prediction, r) for r in references)
    return rouge, em


def category_key(category: str) -> str:
    """The official per-category key: "Title Generation" -> "title_generation"."""
    return "_".join(category.lower().split())


def compute_metrics(
    predictions: Sequence[str], references: Sequence[Sequence[str]], xlingual: bool = False
) -> dict[str, float]:
    """{"exact_match", "rougeL"}: 100 * mean over instances, rounded to 4 decimals (official)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("compute_metrics needs at least one prediction")
    em = rouge = 0.0
    for pred, refs in zip(predictions, references):
        r, e = score_instance(pred, refs, xlingual)
        rouge += r
        em += e
    n = len(references)
    return {"exact_match": round(100.0 * em / n, 4), "rougeL": round(100.0 * rouge / n, 4)}


@dataclass(frozen=True)
class ScoredInstance:
    """One evaluated instance with its scores in [0, 1]."""

    id: str
    task: str
    category: str  # raw category name, e.g. "Title Generation"
    rougeL: float
    exact_match: float


def _aggregate(items: Sequence[ScoredInstance]) -> dict[str, float]:
    n = len(items)
    return {
        "rougeL": round(100.0 * sum(i.rougeL for i in items) / n, 4),
        "exact_match": round(100.0 * sum(i.exact_match for i in items) / n, 4),
        "n": n,
    }


def _grouped(items: Sequence[ScoredInstance], key) -> dict[str, dict[str, float]]:
    groups: dict[str, list[ScoredInstance]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return {g: _aggregate(v) for g, v in sorted(groups.items())}


@dataclass(frozen=True)
class Reference:
    """What the metric needs to know about an instance."""

    id: str
    task: str
    category: str
    references: tuple[str, ...]
    track: str = "default"


def sni_metrics(
    predictions: Mapping[str, str], expected: Sequence[Reference], absent_from_data: Collection[str] = ()
) -> dict:
    """Metrics of `predictions` (id -> text) over the `expected` instances.

    Returns {"rougeL", "exact_match", "n_instances", "n_tasks", "per_task", "per_category",
    "n_missing", "missing_ids", "n_absent_from_data", "rougeL_missing_as_empty",
    "exact_match_missing_as_empty"}. The headline numbers average over the expected instances that
    have a prediction; the `*_missing_as_empty` ones score the others as "" (what the official script
    does, so these equal its output when `expected` is the whole official reference file). A
    prediction for an id not in `expected` raises. `absent_from_data`: ids of official references
    whose instance the data does not hold (a partial copy of SNI): missing by construction, they are
    counted in `n_absent_from_data`; any other missing prediction is warned about.
    """
    by_id = {r.id: r for r in expected}
    if len(by_id) != len(expected):
        raise ValueError("expected references contain duplicate ids")
    unknown = sorted(set(predictions) - set(by_id))
    if unknown:
        raise ValueError(f"{len(unknown)} predictions have no reference, e.g. {unknown[:3]}")
    scored: list[ScoredInstance] = []
    missing: list[Reference] = []
    for ref in expected:
        if ref.id not in predictions:
            missing.append(ref)
            continue
        rouge, em = score_instance(predictions[ref.id], ref.references, ref.track == "xlingual")
        scored.append(ScoredInstance(ref.id, ref.task, ref.category, rouge, em))
    if not scored:
        raise ValueError("no prediction matches any expected reference")
    overall = _aggregate(scored)
    metrics: dict = {
        "rougeL": overall["rougeL"],
        "exact_match": overall["exact_match"],
        "n_instances": overall["n"],
        "n_tasks": len({s.task for s in scored}),
        "per_task": _grouped(scored, lambda s: s.task),
        "per_category": _grouped(scored, lambda s: category_key(s.category)),
        "n_missing": len(missing),
        "missing_ids": [m.id for m in missing],
    }
    absent = set(absent_from_data)
    metrics["n_absent_from_data"] = sum(m.id in absent for m in missing)
    unexpected = len(missing) - metrics["n_absent_from_data"]
    if unexpected:
        logger.warning(
            "no prediction for %d evaluated instances; they count as empty in *_missing_as_empty", unexpected
        )
    if missing:
        empty = [
            ScoredInstance(m.id, m.task, m.category, *score_instance("", m.references, m.track == "xlingual"))
            for m in missing
        ]
        with_empty = _aggregate(scored + empty)
    else:
        with_empty = overall
    metrics["rougeL_missing_as_empty"] = with_empty["rougeL"]
    metrics["exact_match_missing_as_empty"] = with_empty["exact_match"]
    return metrics
