"""UL2's mixture of denoisers (Tay et al. 2022, "UL2: Unifying Language Learning Paradigms").

Every sample takes one raw row and draws, from its own generator keyed by (seed, global sample
index) (`span_corruption.sample_generator`), first its denoiser (weights normalised), then that
denoiser's noise. Nothing depends on the rank, worker, batch or restart, so a resume (also on
another GPU count) sees the same samples.

- span denoiser (R and X): T5 span corruption of the row's first `raw_length` tokens with the
  denoiser's rate and mean span (or fixed number of spans), exactly `SpanCorruption`'s mask:
  inputs = [mode] keep_0 <s_0> keep_1 <s_1> ... EOS, targets = <s_0> noise_0 <s_1> noise_1 ... EOS.
- prefix denoiser (S, prefix LM): the split point is uniform as in T5's `random_prefix_noise_mask`
  (prefix of round((1 - 2 rate)(L - 1)) .. L - 1 tokens, so the target's mean share is `rate`):
  inputs = [mode] prefix EOS, targets = suffix EOS.

`mode` is the mode token's pieces ([NLU], [NLG], [S2S] in UL2). A denoiser's raw length is the
longest prefix of the row (at most the row) whose inputs fit in `input_length`, so the encoder
length stays the span-corruption one; the 568-token rows of input_length 512 serve every
denoiser. Batches have fixed shapes (input_length x target_length, the longest target of any
denoiser rounded up to a multiple of 8): one compiled graph, no recompilation; inputs are padded
with `pad_id` under an attention mask, labels with -100.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from training.data.span_corruption import LABEL_PAD_ID, noise_counts, sample_generator, segment_starts

_ALIGN = 8  # target columns are a multiple of this (tensor-core friendly shapes)


@dataclass(frozen=True)
class DenoiserSpec:
    """One denoiser resolved against a row length, an input length and a vocabulary."""

    name: str
    kind: str  # span | prefix
    rate: float
    mean_span: float
    spans: int  # 0 = from mean_span
    mode_ids: tuple[int, ...]
    raw_length: int  # raw tokens of the row this denoiser reads
    max_input: int  # longest inputs it produces, EOS and mode included
    max_target: int  # longest targets, EOS included

    def span_counts(self, length: int) -> tuple[int, int]:
        """(noise tokens, noise spans) for `length` raw tokens."""
        if self.spans:
            num_noise = min(max(int(round(length * self.rate)), 1), length - 1)
            if self.spans > min(num_noise, length - num_noise):
                raise ValueError(f"{self.spans} spans do not fit {num_noise} noise tokens of a {length}-token row")
            return num_noise, self.spans
        return noise_counts(length, self.rate, self.mean_span)


def _span_lengths(kind: str, rate: float, mean_span: float, spans: int, length: int) -> tuple[int, int]:
    """(inputs, targets) without the mode token, for a row of `length` tokens."""
    if kind == "prefix":
        return length, length - _min_prefix(rate, length) + 1  # prefix up to length - 1, + EOS
    spec = DenoiserSpec("", kind, rate, mean_span, spans, (), length, 0, 0)
    noise, count = spec.span_counts(length)
    return length - noise + count + 1, noise + count + 1


def _min_prefix(rate: float, length: int) -> int:
    return min(length - 1, max(1, int(round((1 - 2 * rate) * (length - 1)))))


def resolve(denoiser, mode_ids: tuple[int, ...], row_length: int, input_length: int, num_sentinels: int) -> DenoiserSpec:
    """Fit `denoiser` (a training.config.Denoiser) to the row and input lengths; ValueError saying
    what to change when it cannot."""
    args = (denoiser.kind, denoiser.rate, denoiser.mean_span, denoiser.spans)
    room = input_length - len(mode_ids)
    for raw in range(row_length, 1, -1):  # the longest start of the row that fits
        try:
            inputs, targets = _span_lengths(*args, raw)
        except ValueError:  # more spans than tokens to separate them at this length
            continue
        if inputs <= room:
            break
    else:
        raise ValueError(f"denoiser {denoiser.name} cannot fit rows of {row_length} tokens into inputs of "
                         f"{input_length}: change its rate/mean_span/spans, or re-shard with a larger "
                         "--input-length and raise data.input_length")
    spec = DenoiserSpec(denoiser.name, *args, mode_ids, raw, inputs + len(mode_ids), targets)
    spans = spec.span_counts(raw)[1] if denoiser.kind == "span" else 0
    if spans > num_sentinels:
        raise ValueError(f"denoiser {denoiser.name} masks {spans} spans but the vocabulary has {num_sentinels} "
                         "sentinels: raise its mean_span or lower its rate")
    return spec


class DenoiserMixture:
    """Rows -> (inputs, labels, denoiser index) for a weighted list of `DenoiserSpec`s."""

    def __init__(self, specs: list[DenoiserSpec], weights: list[float], *, input_length: int,
                 sentinel_start_id: int, eos_id: int = 1, pad_id: int = 0) -> None:
        self.specs = tuple(specs)
        total = float(sum(weights))
        self.probabilities = np.array(weights, dtype=np.float64) / total
        self._cumulative = np.cumsum(self.probabilities)
        self.input_length = input_length
        longest = max(s.max_target for s in specs)
        self.target_length = -(-longest // _ALIGN) * _ALIGN
        self.sentinel_start_id, self.eos_id, self.pad_id = sentinel_start_id, eos_id, pad_id

    def only(self, index: int) -> DenoiserMixture:
        """The same shapes with denoiser `index` alone (for its held-out loss)."""
        weights = [1.0 if i == index else 0.0 for i in range(len(self.specs))]
        mixture = DenoiserMixture(list(self.specs), weights, input_length=self.input_length,
                                  sentinel_start_id=self.sentinel_start_id, eos_id=self.eos_id, pad_id=self.pad_id)
        mixture.target_length = self.target_length
        return mixture

    def choose(self, rng: np.random.Generator) -> int:
        """The first draw of a sample's generator: its denoiser."""
        return min(int(np.searchsorted(self._cumulative, rng.random(), side="right")), len(self.specs) - 1)

    def sample(self, row: np.ndarray, rng: np.random.Generator) -> tuple[int, np.ndarray, np.ndarray]:
        """(denoiser index, inputs, targets) of one row (EOS included, no padding)."""
        index = self.choose(rng)
        spec = self.specs[index]
        row = row[: spec.raw_length]
        length, mode, eos = len(row), np.array(spec.mode_ids, dtype=np.int64), np.array([self.eos_id])
        if spec.kind == "prefix":
            split = int(rng.integers(_min_prefix(spec.rate, length), length))
            return index, np.concatenate([mode, row[:split], eos]), np.concatenate([row[split:], eos])
        num_noise, num_spans = spec.span_counts(length)
        noise_starts = segment_starts(rng, num_noise, num_spans)  # the draw order of SpanCorruption
        keep_starts = segment_starts(rng, length - num_noise, num_spans)
        segments = np.empty(2 * num_spans, dtype=np.int64)  # keep_0, noise_0, keep_1, noise_1, ...
        segments[0::2] = np.diff(keep_starts, append=length - num_noise)
        segments[1::2] = np.diff(noise_starts, append=num_noise)
        starts = np.cumsum(segments) - segments
        noise = np.repeat(np.tile([False, True], num_spans), segments)
        sentinels = self.sentinel_start_id - np.arange(num_spans)
        # Inputs: kept tokens, each noise span replaced by its sentinel; targets: each sentinel, then its span.
        values, keep = row.copy(), ~noise
        values[starts[1::2]], keep[starts[1::2]] = sentinels, True
        inputs = values[keep]
        values, take = row.copy(), noise.copy()
        values[starts[0::2]], take[starts[0::2]] = sentinels, True
        return index, np.concatenate([mode, inputs, eos]), np.concatenate([values[take], eos])

    def make(self, rows: np.ndarray, sample_indices, seed: int, stream: int) -> dict[str, np.ndarray]:
        """Rows int[B, L] -> input_ids int64[B, input_length] (pad_id padded), attention_mask,
        labels int64[B, target_length] (-100 padded) and denoiser int64[B]."""
        batch = len(rows)
        out = {"input_ids": np.full((batch, self.input_length), self.pad_id, dtype=np.int64),
               "attention_mask": np.zeros((batch, self.input_length), dtype=np.int64),
               "labels": np.full((batch, self.target_length), LABEL_PAD_ID, dtype=np.int64),
               "denoiser": np.empty(batch, dtype=np.int64)}
        for b, (row, g) in enumerate(zip(np.asarray(rows, dtype=np.int64), sample_indices)):
            index, inputs, targets = self.sample(row, sample_generator(seed, int(g), stream))
            out["input_ids"][b, : len(inputs)] = inputs
            out["attention_mask"][b, : len(inputs)] = 1
            out["labels"][b, : len(targets)] = targets
            out["denoiser"][b] = index
        return out
