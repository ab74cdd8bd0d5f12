"""Pre-training objectives: raw rows -> encoder inputs and decoder targets, chosen by `data.objective`.

An objective has `name`, `row_length` (raw tokens a shard row holds), `input_length` and
`target_length` (the columns of its batches), `lowest_special_id` (raw token ids must stay below
it: the sentinels), `evaluation_sets()` (the held-out sets it reports, by name) and

    make(rows int[B, row_length], sample_indices, seed, stream) -> {"input_ids", "labels", ...}

where every sample's randomness comes from its own generator keyed by (seed, global sample index,
stream) (`span_corruption.sample_generator`), never from the batch, rank or worker. `OBJECTIVES`
maps `data.objective` to its builder:

- span_corruption: T5's (`SpanCorruption`), the default; batches {input_ids, labels}, bit for bit
  `SpanCorruption.corrupt`'s.
- ul2: UL2's mixture of denoisers (`denoisers.py`); batches add attention_mask (inputs are padded)
  and denoiser (the index of each sample's denoiser).
- prefix_lm: the S-denoiser alone, same batches as ul2.

Row length. Shards do not depend on the objective: every objective reads rows of the raw length
T5's formula gives for `data.input_length` (568 for 512, what `data_prep.shard --input-length`
writes). A corpus of another row length is refused by `row_store.open_split`, which names the
input_length that fits it. A UL2 denoiser reads the longest start of the row whose inputs fit in
input_length (all 568 tokens, or fewer for the R-denoisers whose mode token takes room).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from data_prep.shard_format import t5_span_lengths
from training.config import ConfigError
from training.data.denoisers import DenoiserMixture, resolve
from training.data.span_corruption import SpanCorruption, noise_counts


class SpanCorruptionObjective:
    """T5 span corruption (`SpanCorruption`) behind the objective interface."""

    name = "span_corruption"

    def __init__(self, corruption: SpanCorruption) -> None:
        self.span_corruption = corruption
        self.row_length = corruption.tokens_length
        self.input_length = corruption.input_length
        self.target_length = corruption.targets_length
        self.lowest_special_id = corruption.lowest_sentinel_id

    def make(self, rows: np.ndarray, sample_indices, seed: int, stream: int) -> dict[str, np.ndarray]:
        inputs, labels = self.span_corruption.corrupt(rows, sample_indices, seed, stream)
        return {"input_ids": inputs, "labels": labels}

    def evaluation_sets(self) -> dict[str, SpanCorruptionObjective]:
        return {"": self}


class DenoisingObjective:
    """A weighted mixture of denoisers (ul2, prefix_lm) behind the objective interface."""

    def __init__(self, name: str, mixture: DenoiserMixture, row_length: int, span_corruption: SpanCorruption) -> None:
        self.name, self.mixture, self.row_length = name, mixture, row_length
        self.input_length, self.target_length = mixture.input_length, mixture.target_length
        self.denoiser_names = tuple(s.name for s in mixture.specs)
        spans = [s.span_counts(s.raw_length)[1] for s in mixture.specs if s.kind == "span"]
        self.lowest_special_id = min(mixture.sentinel_start_id - max(spans, default=0) + 1,
                                     span_corruption.lowest_sentinel_id)
        self.span_corruption = span_corruption

    def make(self, rows: np.ndarray, sample_indices, seed: int, stream: int) -> dict[str, np.ndarray]:
        return self.mixture.make(rows, sample_indices, seed, stream)

    def evaluation_sets(self) -> dict[str, object]:
        """"" = T5 span corruption (the held-out loss every objective is compared on), then each denoiser
        alone on the same rows, at the mixture's shapes (no extra compiled graph per denoiser)."""
        sets: dict[str, object] = {"": SpanCorruptionObjective(self.span_corruption)}
        for index, name in enumerate(self.denoiser_names):
            sets[name] = DenoisingObjective(self.name, self.mixture.only(index), self.row_length,
                                            self.span_corruption)
        return sets


def sentencepiece_mode_ids(tokenizer_path: str) -> Callable[[str], tuple[int, ...]]:
    """Mode token text -> its ids in the SentencePiece model at `tokenizer_path`: the one piece of
    that name when the vocabulary has it, else the pieces the text encodes to, none of which may be
    the unknown piece (UL2 with T5's vocabulary: "[NLU]" -> "▁[", "N", "LU", "]")."""
    import sentencepiece  # here: only the denoising objectives need it

    processor = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_path))

    def ids(text: str) -> tuple[int, ...]:
        piece = processor.piece_to_id(text)
        if piece != processor.unk_id():
            return (piece,)
        encoded = tuple(processor.encode(text))
        if not encoded or processor.unk_id() in encoded:
            raise ConfigError(f"mode token {text!r} is not in the vocabulary of {tokenizer_path} (it encodes to the "
                              "unknown piece): pick a mode token its pieces cover, or train a tokenizer that reserves it")
        return encoded

    return ids


def _span_corruption(data, sentinel_start_id: int, num_sentinels: int, eos_id: int, pad_id: int) -> SpanCorruption:
    """T5 span corruption at `data`'s lengths; ConfigError where a row needs more noise spans than the
    tokenizer has sentinels (span k gets <extra_id_k>; past the last one it would take ids of ordinary
    pieces)."""
    _, spans = noise_counts(t5_span_lengths(data.input_length, data.noise_density, data.mean_noise_span_length)[0],
                            data.noise_density, data.mean_noise_span_length)
    if spans > num_sentinels:
        raise ConfigError(
            f"data.input_length={data.input_length} makes {spans} noise spans a row, but tokenizer {data.tokenizer} "
            f"has {num_sentinels} sentinels: lower data.input_length or raise data.mean_noise_span_length, or use "
            f"a tokenizer with more (data_prep.tokenizer train --extra-ids {spans})"
        )
    return SpanCorruption(input_length=data.input_length, noise_density=data.noise_density,
                          mean_noise_span_length=data.mean_noise_span_length, sentinel_start_id=sentinel_start_id,
                          eos_id=eos_id, pad_id=pad_id)


def _denoising(data, mode_ids: Callable[[str], tuple[int, ...]], sentinel_start_id: int, num_sentinels: int,
               eos_id: int, pad_id: int) -> DenoisingObjective:
    row_length = t5_span_lengths(data.input_length, data.noise_density, data.mean_noise_span_length)[0]
    denoisers = data.objective_denoisers
    specs = []
    for denoiser in denoisers:
        ids = mode_ids(denoiser.mode_token) if denoiser.mode_token else ()
        try:
            specs.append(resolve(denoiser, ids, row_length, data.input_length, num_sentinels))
        except ValueError as err:
            raise ConfigError(f"data.denoisers: {err}") from None
    mixture = DenoiserMixture(specs, [d.weight for d in denoisers], input_length=data.input_length,
                              sentinel_start_id=sentinel_start_id, eos_id=eos_id, pad_id=pad_id)
    return DenoisingObjective(data.objective, mixture, row_length,
                              _span_corruption(data, sentinel_start_id, num_sentinels, eos_id, pad_id))


def _span_corruption_objective(data, mode_ids, sentinel_start_id: int, num_sentinels: int, eos_id: int,
                               pad_id: int) -> SpanCorruptionObjective:
    return SpanCorruptionObjective(_span_corruption(data, sentinel_start_id, num_sentinels, eos_id, pad_id))


# data.objective -> builder(data, mode_ids, sentinel_start_id, num_sentinels, eos_id, pad_id)
OBJECTIVES = {"span_corruption": _span_corruption_objective, "ul2": _denoising, "prefix_lm": _denoising}


def build_objective(data, *, mode_ids: Callable[[str], tuple[int, ...]] | None = None,
                    sentinel_start_id: int = 32099, num_sentinels: int = 100, eos_id: int = 1,
                    pad_id: int = 0) -> SpanCorruptionObjective | DenoisingObjective:
    """The objective `data` (a training.config.DataConfig) names. `mode_ids` turns a mode token into ids
    (default: `sentencepiece_mode_ids(data.tokenizer)`); `sentinel_start_id` is the id of <extra_id_0>,
    with `num_sentinels` sentinels counting down from it. ConfigError when a denoiser cannot run, or
    when the tokenizer has too few sentinels for a row's noise spans."""
    if data.objective not in OBJECTIVES:
        raise ConfigError(f"data.objective={data.objective!r} is not valid; use one of: {', '.join(OBJECTIVES)}")
    if mode_ids is None and any(d.mode_token for d in data.objective_denoisers):
        mode_ids = sentencepiece_mode_ids(data.tokenizer)
    return OBJECTIVES[data.objective](data, mode_ids, sentinel_start_id, num_sentinels, eos_id, pad_id)
