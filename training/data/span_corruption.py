"""T5 span corruption, exactly as `t5.data.preprocessors.span_corruption` defines it.

For a raw row of `tokens_length` token ids (568 for inputs 512, density 0.15, mean span 3.0):

    num_noise_tokens    = round(tokens_length * noise_density), clamped to [1, tokens_length - 1]
    num_noise_spans     = max(1, round(num_noise_tokens / mean_noise_span_length))
    num_nonnoise_tokens = tokens_length - num_noise_tokens

The noise tokens are split into `num_noise_spans` non-empty spans and the non-noise tokens into
as many non-empty spans, both by T5's `_random_segmentation` (shuffle a vector holding
`num_segments - 1` ones among `num_items - 1` slots; a one marks where a new segment starts), then
interleaved starting with non-noise: [keep_0, noise_0, keep_1, noise_1, ..., keep_m-1, noise_m-1].

    inputs  = keep_0 <s_0> keep_1 <s_1> ... keep_m-1 <s_m-1> EOS
    targets = <s_0> noise_0 <s_1> noise_1 ... <s_m-1> noise_m-1 EOS

with sentinel <s_k> = sentinel_start_id - k (`<extra_id_0>` = 32099 counting down in the T5
vocabulary). For 568 raw tokens that is 483 + 28 + 1 = 512 inputs and 85 + 28 + 1 = 114 targets,
with no padding. Rows of another length are padded to the configured lengths (inputs with
`pad_id`, labels with -100).

Randomness comes only from (seed, sample_index): each sample draws from its own counter-based
Philox generator keyed by those two numbers, so a sample gets the same noise whatever the rank,
DataLoader worker, batch composition or restart. The random draws are a short per-sample loop
(~30 us/sample); building the corrupted rows is vectorised over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data_prep.shard_format import t5_span_lengths

# Separates the noise streams of different uses of the same (seed, index) key (Philox counter word).
NOISE_STREAM_TRAIN = 0
NOISE_STREAM_VALIDATION = 1

LABEL_PAD_ID = -100  # ignored by torch.nn.functional.cross_entropy(ignore_index=-100)


def noise_counts(tokens_length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(num_noise_tokens, num_noise_spans) for a row of `tokens_length` tokens, as T5 computes them."""
    length = max(tokens_length, 2)
    num_noise_tokens = int(round(length * noise_density))
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = max(int(round(num_noise_tokens / mean_noise_span_length)), 1)
    num_nonnoise_tokens = length - num_noise_tokens
    if num_noise_spans > num_nonnoise_tokens:
        raise ValueError(
            f"{num_noise_spans} noise spans need as many non-noise tokens, but a row of {tokens_length} "
            f"tokens at noise_density={noise_density} has only {num_nonnoise_tokens}: lower noise_density "
            "or raise mean_noise_span_length."
        )
    return num_noise_tokens, num_noise_spans


def sample_generator(seed: int, sample_index: int, stream: int = NOISE_STREAM_TRAIN) -> np.random.Generator:
    """The random generator of one sample: Philox keyed by (seed, sample_index), stream in the counter."""
    if seed < 0 or sample_index < 0:
        raise ValueError(f"seed and sample_index must be >= 0, got {seed}, {sample_index}")
    key = np.array([seed % 2**64, sample_index % 2**64], dtype=np.uint64)
    counter = np.array([0, 0, 0, stream], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


def segment_starts(rng: np.random.Generator, num_items: int, num_segments: int) -> np.ndarray:
    """Start offsets (sorted, first is 0) of T5's `_random_segmentation` of `num_items` into `num_segments`.

    T5 shuffles `arange(num_items - 1) < num_segments - 1` and prepends a 0; a 1 at slot i means a
    new segment starts at item i + 1. `rng.permutation(n) < k` is that shuffled vector (permuting an
    array equals indexing it with a permutation of its indices drawn from the same state).
    """
    first_in_segment = rng.permutation(num_items - 1) < (num_segments - 1)
    return np.concatenate([[0], np.flatnonzero(first_in_segment) + 1])


@dataclass(frozen=True)
class SpanCorruption:
    """T5 span-corruption settings and the fixed output lengths they imply."""

    input_length: int = 512  # encoder tokens per sample, EOS included
    noise_density: float = 0.15  # share of raw tokens masked
    mean_noise_span_length: float = 3.0  # mean length of one masked span, in tokens
    sentinel_start_id: int = 32099  # id of <extra_id_0>; span k gets sentinel_start_id - k
    eos_id: int = 1
    pad_id: int = 0  # pads input_ids when a row is shorter than tokens_length
    tokens_length: int = field(init=False)  # raw tokens per row (568 for 512); derived
    targets_length: int = field(init=False)  # decoder targets per sample, EOS included (114 for 512)

    def __post_init__(self) -> None:
        # t5_span_lengths validates the three numbers with messages that say what is allowed.
        tokens_length, targets_length = t5_span_lengths(
            self.input_length, self.noise_density, self.mean_noise_span_length
        )
        object.__setattr__(self, "tokens_length", tokens_length)
        object.__setattr__(self, "targets_length", targets_length)
        _, spans = noise_counts(tokens_length, self.noise_density, self.mean_noise_span_length)
        if self.sentinel_start_id - spans + 1 <= max(self.eos_id, self.pad_id):
            raise ValueError(
                f"sentinel_start_id={self.sentinel_start_id} leaves no room for {spans} sentinels above "
                "the special ids; use the id of <extra_id_0> (32099 for T5)."
            )

    @property
    def lowest_sentinel_id(self) -> int:
        """Smallest sentinel id a full-length row uses; raw token ids must stay below it."""
        _, spans = noise_counts(self.tokens_length, self.noise_density, self.mean_noise_span_length)
        return self.sentinel_start_id - spans + 1

    def noise_mask(self, length: int, rng: np.random.Generator) -> np.ndarray:
        """T5's `random_spans_noise_mask` for one row: bool[length], True = noise."""
        return self.noise_masks(length, [rng])[0]

    def noise_masks(self, length: int, rngs: list[np.random.Generator]) -> np.ndarray:
        """Noise masks bool[len(rngs), length] for rows of `length` tokens, one generator per row."""
        num_noise, num_spans = noise_counts(length, self.noise_density, self.mean_noise_span_length)
        padded_length = max(length, 2)  # T5 computes the mask on at least 2 tokens, then truncates
        num_nonnoise = padded_length - num_noise
        batch = len(rngs)
        noise_starts = np.empty((batch, num_spans), dtype=np.int64)
        nonnoise_starts = np.empty((batch, num_spans), dtype=np.int64)
        for i, rng in enumerate(rngs):  # draw order fixed: noise segmentation, then non-noise
            noise_starts[i] = segment_starts(rng, num_noise, num_spans)
            nonnoise_starts[i] = segment_starts(rng, num_nonnoise, num_spans)
        noise_lengths = np.diff(noise_starts, axis=1, append=num_noise)
        nonnoise_lengths = np.diff(nonnoise_starts, axis=1, append=num_nonnoise)
        interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=2).reshape(batch, 2 * num_spans)
        span_starts = np.cumsum(interleaved, axis=1)[:, :-1]  # distinct: every span is non-empty
        indicator = np.zeros((batch, padded_length), dtype=np.int64)
        np.put_along_axis(indicator, span_starts, 1, axis=1)
        span_num = np.cumsum(indicator, axis=1)
        return (span_num % 2 == 1)[:, :length]

    def corrupt(
        self,
        rows: np.ndarray,
        sample_indices: np.ndarray | list[int],
        seed: int,
        stream: int = NOISE_STREAM_TRAIN,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Span-corrupt rows int[B, L] (L <= tokens_length) -> (inputs int64[B, input_length], labels
        int64[B, targets_length]). Row b's noise is keyed by (seed, sample_indices[b], stream)."""
        rows = np.asarray(rows)
        if rows.ndim != 2:
            raise ValueError(f"rows must be 2-D (batch, row_length), got shape {rows.shape}")
        batch, length = rows.shape
        if len(sample_indices) != batch:
            raise ValueError(f"{len(sample_indices)} sample indices for {batch} rows")
        if length > self.tokens_length:
            raise ValueError(
                f"rows of {length} tokens are longer than the {self.tokens_length} that input_length="
                f"{self.input_length} takes; re-shard with row_length {self.tokens_length}."
            )
        rngs = [sample_generator(seed, int(i), stream) for i in sample_indices]
        mask = self.noise_masks(length, rngs)
        rows = rows.astype(np.int64)

        previous = np.zeros_like(mask)
        previous[:, 1:] = mask[:, :-1]
        noise_start = mask & ~previous  # first token of each noise span
        nonnoise_start = ~mask & (previous | (np.arange(length) == 0))  # first token of each kept span

        # Inputs: kept tokens, each noise span replaced by its sentinel. Every row of the batch has the
        # same number of kept tokens and spans, so boolean selection reshapes to a rectangle.
        sentinels = self.sentinel_start_id - (np.cumsum(noise_start, axis=1) - 1)
        values = np.where(noise_start, sentinels, rows)
        inputs = values[~mask | noise_start].reshape(batch, -1)
        # Targets: the noise tokens, each span preceded by the sentinel of the kept span before it.
        sentinels = self.sentinel_start_id - (np.cumsum(nonnoise_start, axis=1) - 1)
        values = np.where(nonnoise_start, sentinels, rows)
        targets = values[mask | nonnoise_start].reshape(batch, -1)

        eos = np.full((batch, 1), self.eos_id, dtype=np.int64)
        inputs = np.concatenate([inputs, eos], axis=1)
        targets = np.concatenate([targets, eos], axis=1)
        if inputs.shape[1] > self.input_length or targets.shape[1] > self.targets_length:
            raise ValueError(
                f"rows of {length} tokens corrupt to {inputs.shape[1]} inputs / {targets.shape[1]} targets, "
                f"more than {self.input_length} / {self.targets_length}"
            )
        inputs = _pad_right(inputs, self.input_length, self.pad_id)
        labels = _pad_right(targets, self.targets_length, LABEL_PAD_ID)
        return inputs, labels


def _pad_right(array: np.ndarray, length: int, value: int) -> np.ndarray:
    if array.shape[1] == length:
        return array
    out = np.full((array.shape[0], length), value, dtype=array.dtype)
    out[:, : array.shape[1]] = array
    return out


def expand_sentinels(
    inputs: np.ndarray, labels: np.ndarray, sentinel_start_id: int, lowest_sentinel_id: int, eos_id: int = 1
) -> np.ndarray:
    """Invert span corruption for one sample: put each target span back in place of its sentinel.

    Returns the raw row. Used by tests and by anyone checking a pipeline end to end.
    """
    inputs = np.asarray(inputs)
    labels = np.asarray(labels)
    labels = labels[labels != LABEL_PAD_ID]
    if inputs.size == 0 or labels.size == 0 or labels[-1] != eos_id:
        raise ValueError("labels must end with EOS (before any -100 padding)")
    # Inputs end with EOS then pad ids; EOS may also occur inside the row (between documents).
    last_eos = int(np.flatnonzero(inputs == eos_id)[-1]) if (inputs == eos_id).any() else -1
    if last_eos < 0:
        raise ValueError("inputs hold no EOS")
    spans: dict[int, list[int]] = {}
    current: int | None = None
    for token in labels[:-1].tolist():
        if lowest_sentinel_id <= token <= sentinel_start_id:
            current = token
            spans[current] = []
        elif current is None:
            raise ValueError("targets do not start with a sentinel")
        else:
            spans[current].append(token)
    row: list[int] = []
    for token in inputs[:last_eos].tolist():
        row.extend(spans.pop(token, []) if lowest_sentinel_id <= token <= sentinel_start_id else [token])
    if spans:
        raise ValueError(f"target sentinels {sorted(spans)} have no sentinel in the inputs")
    return np.array(row, dtype=np.int64)
