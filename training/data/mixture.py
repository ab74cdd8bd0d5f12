"""Global sample index -> raw row: one corpus's epoch line, or a weighted interleave of several corpora.

One corpus (`data.dir`): sample g is position g % N of epoch g // N, whose order is the permutation
`EpochPermutation(N, seed, epoch)` of the corpus's N rows (training/data/pretrain_loader.py).

A mixture (`data.sources`: K corpora with positive weights w_k) splits the same sample line between
the corpora in two pure functions of the global sample index g:

1. Which corpus. The weights are made integers with the same ratios (0.7 and 0.3 -> 7 and 3; 3 and 1
   stay) of sum W, the period. One period is laid out by smooth weighted round-robin (nginx's SWRR):
   at each slot every corpus earns its weight, the richest (lowest k on a tie) takes the slot and
   pays W. A period holds exactly w_k slots of corpus k, spread evenly: any W consecutive samples
   hold exactly w_k samples of corpus k, and any window of L samples holds L * w_k / W of them
   within less than 2 (tests/test_mixture.py counts both). Sample g lies in period g // W at slot
   g % W; the slot's corpus k is `source[g % W]`, and n = (g // W) * w_k + `ordinal[g % W]` is how
   many samples of corpus k come before it.
2. Which row of that corpus. Corpus k has its own epoch line: its n-th sample is position n % N_k of
   its epoch n // N_k, permuted by `EpochPermutation(N_k, seed, epoch, stream=k)`. Each corpus wraps
   into its next epoch on its own schedule (a small corpus with a large weight is repeated more).

So the sample at g depends only on (seed, g, weights, corpus sizes): the loader's cursor (the global
sample index) is the whole resume state, on any number of GPUs, as for one corpus. The cursor also
records the corpora's sizes and integer weights, and a resume with others is refused. A mixture of
one corpus gives that corpus's line exactly (stream 0 is the single-corpus permutation).

Corpora of one mixture must share the tokenizer (manifest sha256, vocabulary, EOS) and the row
layout (row length, dtype); `check_compatible` refuses others before any row is read.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from data_prep.shard_format import load_manifest
from training.cli_errors import ExpectedError
from training.data.permutation import EpochPermutation
from training.data.row_store import RowStore

# A period is laid out once, in two int64 tables of up to this many entries (1.6 MB, under a second to build).
MAX_PERIOD = 100_000


class MixtureError(ExpectedError, ValueError):
    """The corpora of `data.sources` cannot make one mixture, or do not match the saved cursor's."""


@dataclass(frozen=True)
class WeightedCorpus:
    """One corpus of a mixture: a directory written by data_prep.shard and its sampling weight."""

    name: str
    dir: str
    weight: float


def integer_weights(weights: Sequence[float]) -> tuple[int, ...]:
    """The smallest positive integers in the ratios of `weights` (decimal values taken as written)."""
    if not weights or any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise MixtureError(f"data.sources: the weights {list(weights)} must all be finite and > 0")
    exact = [Fraction(str(w)) for w in weights]  # str: 0.7 is 7/10, not the nearest binary fraction
    scale = math.lcm(*(f.denominator for f in exact))
    ints = [int(f * scale) for f in exact]
    common = math.gcd(*ints)
    ints = [i // common for i in ints]
    if sum(ints) > MAX_PERIOD:
        raise MixtureError(
            f"data.sources: the weights {list(weights)} repeat only every {sum(ints)} samples (at most {MAX_PERIOD}): "
            "round them to fewer decimals, e.g. integers or percentages"
        )
    return tuple(ints)


class InterleaveSchedule:
    """Global sample index -> (corpus, how many samples of that corpus precede it); see the docstring."""

    def __init__(self, weights: Sequence[int]) -> None:
        self.weights = tuple(int(w) for w in weights)
        self.period = sum(self.weights)
        source = np.empty(self.period, dtype=np.int64)
        ordinal = np.empty(self.period, dtype=np.int64)
        credit = [0] * len(self.weights)
        taken = [0] * len(self.weights)
        for slot in range(self.period):
            for k, w in enumerate(self.weights):
                credit[k] += w
            k = max(range(len(credit)), key=credit.__getitem__)  # the first of the richest
            credit[k] -= self.period
            source[slot], ordinal[slot] = k, taken[k]
            taken[k] += 1
        self.source, self.ordinal = source, ordinal
        self._weight_of = np.asarray(self.weights, dtype=np.int64)

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(corpus of each sample, its index on that corpus's own sample line)."""
        periods, slots = np.divmod(np.asarray(samples, dtype=np.int64), self.period)
        source = self.source[slots]
        return source, periods * self._weight_of[source] + self.ordinal[slots]


class _EpochLine:
    """One corpus's sample n -> row perm_{n // N}(n % N); keeps the permutation of the newest epoch."""

    def __init__(self, rows: int, seed: int, stream: int) -> None:
        self.rows, self.seed, self.stream = rows, seed, stream
        self._permutations: dict[int, EpochPermutation] = {}

    def row_ids(self, samples: np.ndarray) -> np.ndarray:
        epochs, positions = np.divmod(samples, self.rows)
        row_ids = np.empty_like(samples)
        for epoch in np.unique(epochs).tolist():
            if epoch not in self._permutations:
                self._permutations = {epoch: EpochPermutation(self.rows, self.seed, epoch, stream=self.stream)}
            here = epochs == epoch
            row_ids[here] = self._permutations[epoch](positions[here])
        return row_ids


class SampleRows:
    """The raw rows of global samples, from one store or a weighted mixture of stores. Picklable."""

    def __init__(self, stores: Sequence[RowStore], seed: int, weights: Sequence[int] = (1,)) -> None:
        if len(weights) != len(stores):
            raise ValueError(f"{len(stores)} stores need {len(stores)} weights, got {len(weights)}")
        self.stores = tuple(stores)
        self.schedule = InterleaveSchedule(weights)
        self._lines = [_EpochLine(len(store), seed, stream=k) for k, store in enumerate(self.stores)]

    def read(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows [len, row_length], row id within its corpus, corpus index) of global samples `samples`."""
        samples = np.asarray(samples, dtype=np.int64)
        sources, ordinals = self.schedule.locate(samples)
        if len(self.stores) == 1:
            row_ids = self._lines[0].row_ids(ordinals)
            return self.stores[0].read(row_ids), row_ids, sources
        row_ids = np.empty_like(samples)
        rows = None
        for k in np.unique(sources).tolist():
            here = sources == k
            row_ids[here] = self._lines[k].row_ids(ordinals[here])
            part = self.stores[k].read(row_ids[here])
            if rows is None:
                rows = np.empty((len(samples), part.shape[1]), dtype=part.dtype)
            rows[here] = part
        return rows, row_ids, sources

    def describe(self, names: Sequence[str], run_samples: int) -> list[dict]:
        """Per corpus: name, share of the samples, rows, and epochs of it that `run_samples` samples take."""
        return [
            {
                "name": name,
                "share": w / self.schedule.period,
                "rows": len(store),
                "epochs": run_samples * w / self.schedule.period / len(store),
            }
            for name, store, w in zip(names, self.stores, self.schedule.weights)
        ]


@contextlib.contextmanager
def mixture_errors(corpora: Sequence[WeightedCorpus] | None, k: int) -> Iterator[None]:
    """Name corpus k of a mixture (its place in data.sources and its name) in the errors of the block."""
    try:
        yield
    except ExpectedError:
        raise
    except (ValueError, FileNotFoundError) as exc:
        if corpora is None:
            raise
        raise MixtureError(f"data.sources[{k}] ({corpora[k].name}): {exc}") from exc


_TOKENIZER_KEYS = ("sha256", "vocab_size", "eos_id")


def check_compatible(corpora: Sequence[WeightedCorpus]) -> None:
    """Refuse corpora whose manifests differ from the first's in tokenizer or row layout: one line
    naming both directories and what to do."""
    manifests = []
    for k, corpus in enumerate(corpora):
        with mixture_errors(corpora, k):
            manifests.append(load_manifest(corpus.dir))
    first = manifests[0]
    for corpus, other in zip(corpora[1:], manifests[1:]):
        for key in _TOKENIZER_KEYS:
            a, b = first.get("tokenizer", {}).get(key), other.get("tokenizer", {}).get(key)
            if a != b:
                raise MixtureError(
                    f"data.sources: {corpora[0].dir} and {corpus.dir} were tokenised differently (tokenizer "
                    f"{key} {a} vs {b}): a mixture needs one tokenizer; re-shard one with the other's tokenizer"
                )
        for key in ("row_length", "dtype"):
            a, b = first.get(key), other.get(key)
            if a != b:
                raise MixtureError(
                    f"data.sources: {corpora[0].dir} and {corpus.dir} have different row layouts ({key} {a} vs "
                    f"{b}): a mixture needs one layout; re-shard one of them with the other's {key}"
                )


def check_same_mixture(saved: list[dict] | None, current: list[dict] | None) -> None:
    """Refuse a resume whose corpora (rows, integer weights) differ from the saved cursor's: the sample
    line, and so the position the cursor names, depends on them."""

    def what(sources: list[dict] | None) -> str:
        if sources is None:
            return "one corpus (data.dir)"
        return "a mixture of " + ", ".join(f"{s['name']} ({s['rows']} rows, weight {s['weight']})" for s in sources)

    def key(sources: list[dict] | None) -> list[tuple[int, int]] | None:
        return None if sources is None else [(int(s["rows"]), int(s["weight"])) for s in sources]

    if key(saved) != key(current):
        raise MixtureError(
            f"the data cursor was saved on {what(saved)}, this run reads {what(current)}: resume with the "
            "corpora and weights of the checkpoint, or start a new output_dir"
        )


def corpora_of(data: str | os.PathLike | Sequence[WeightedCorpus]) -> list[WeightedCorpus] | None:
    """The corpora of a mixture, or None for one directory."""
    if isinstance(data, (str, os.PathLike)):
        return None
    corpora = list(data)
    if not corpora:
        raise ValueError("a mixture needs at least one corpus")
    return corpora
