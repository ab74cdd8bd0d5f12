"""T5 span corruption against a numpy transcription of T5's TF reference, plus structural invariants."""

import gzip
import json

import numpy as np
import pytest
import sentencepiece as spm

from training.data.span_corruption import (
    LABEL_PAD_ID,
    NOISE_STREAM_TRAIN,
    NOISE_STREAM_VALIDATION,
    SpanCorruption,
    expand_sentinels,
    noise_counts,
    sample_generator,
)


def reference_random_spans_noise_mask(length, noise_density, mean_noise_span_length, shuffle):
    """t5.data.preprocessors.random_spans_noise_mask (random_roll=False), TF ops replaced by numpy.

    `shuffle(x)` stands in for seqio.stateless_shuffle; it is called for the noise segmentation first,
    then for the non-noise one, as in the reference.
    """
    orig_length = length
    length = max(length, 2)
    num_noise_tokens = int(np.round(float(length) * noise_density))
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = int(np.round(float(num_noise_tokens) / mean_noise_span_length))
    num_noise_spans = max(num_noise_spans, 1)
    num_nonnoise_tokens = length - num_noise_tokens

    def _random_segmentation(num_items, num_segments):
        first_in_segment = np.pad(
            shuffle((np.arange(num_items - 1) < num_segments - 1).astype(np.int64)), [[1, 0]]
        )
        segment_id = np.cumsum(first_in_segment)
        # tf.math.segment_sum(ones_like(segment_id), segment_id)
        return np.bincount(segment_id, minlength=num_segments)

    noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans)
    nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans)
    interleaved_span_lengths = np.reshape(
        np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [num_noise_spans * 2]
    )
    span_starts = np.cumsum(interleaved_span_lengths)[:-1]
    span_start_indicator = np.zeros(length, dtype=np.int64)
    np.add.at(span_start_indicator, span_starts, 1)  # tf.math.unsorted_segment_sum
    span_num = np.cumsum(span_start_indicator)
    is_noise = np.equal(span_num % 2, 1)
    return is_noise[:orig_length]


def reference_span_corruption(tokens, mask, sentinel_id, eos_id=1):
    """T5's noise_span_to_unique_sentinel (inputs) / nonnoise_span_to_unique_sentinel (targets) + EOS."""

    def noise_span_to_unique_sentinel(tokens, noise_mask):
        prev_token_is_noise = np.pad(noise_mask[:-1], [[1, 0]])
        first_noise_tokens = np.logical_and(noise_mask, np.logical_not(prev_token_is_noise))
        subsequent_noise_tokens = np.logical_and(noise_mask, prev_token_is_noise)
        sentinel = sentinel_id + 1 - np.cumsum(first_noise_tokens.astype(np.int64))
        tokens = np.where(first_noise_tokens, sentinel, tokens)
        return tokens[np.logical_not(subsequent_noise_tokens)]

    inputs = noise_span_to_unique_sentinel(tokens, mask)
    targets = noise_span_to_unique_sentinel(tokens, np.logical_not(mask))
    return np.append(inputs, eos_id), np.append(targets, eos_id)


@pytest.fixture(scope="module")
def c4_rows(spiece_path, c4_train_path):
    """Real C4 token rows of 568 tokens (documents joined with EOS), as the shards hold them."""
    sp = spm.SentencePieceProcessor(model_file=str(spiece_path))
    stream = []
    with gzip.open(c4_train_path, "rt") as f:
        for line, _ in zip(f, range(60)):
            stream.extend(sp.encode(json.loads(line)["text"]) + [1])
    n = len(stream) // 568
    return np.array(stream[: n * 568], dtype=np.uint16).reshape(n, 568)


@pytest.mark.parametrize("length", [1, 2, 3, 7, 20, 100, 568, 1000])
@pytest.mark.parametrize("density,mean_span", [(0.15, 3.0), (0.3, 2.0), (0.4, 1.0)])
def test_mask_equals_t5_reference_with_the_same_draws(length, density, mean_span):
    corruption = SpanCorruption(noise_density=density, mean_noise_span_length=mean_span)
    for index in range(5):
        mask = corruption.noise_mask(length, sample_generator(7, index))
        rng = sample_generator(7, index)
        reference = reference_random_spans_noise_mask(length, density, mean_span, rng.permutation)
        np.testing.assert_array_equal(mask, reference)


def test_mask_structure_exact_counts():
    corruption = SpanCorruption()
    masks = corruption.noise_masks(568, [sample_generator(3, i) for i in range(200)])
    assert masks.shape == (200, 568)
    num_noise, num_spans = noise_counts(568, 0.15, 3.0)
    assert (num_noise, num_spans) == (85, 28)
    assert (masks.sum(axis=1) == 85).all()
    starts = masks & ~np.pad(masks[:, :-1], [[0, 0], [1, 0]])
    assert (starts.sum(axis=1) == 28).all()  # exactly 28 non-empty noise spans
    assert not masks[:, 0].any()  # the row starts with non-noise
    assert masks[:, -1].all()  # ... and, T5's interleaving, ends with noise
    # Segmentation is random: span lengths vary and average the mean span length.
    lengths = np.diff(np.flatnonzero(np.diff(np.pad(masks[0].astype(int), 1))))[::2]
    assert lengths.sum() == 85 and len(set(lengths.tolist())) > 1
    assert len({m.tobytes() for m in masks}) == 200


def test_corruption_matches_reference_and_reconstructs_c4(c4_rows):
    corruption = SpanCorruption()
    assert (corruption.tokens_length, corruption.targets_length) == (568, 114)
    indices = np.arange(1000, 1000 + len(c4_rows))
    inputs, labels = corruption.corrupt(c4_rows, indices, seed=11)
    assert inputs.shape == (len(c4_rows), 512) and labels.shape == (len(c4_rows), 114)
    assert inputs.dtype == np.int64 and labels.dtype == np.int64
    assert (labels != LABEL_PAD_ID).all()  # standard lengths: no padding at all
    assert (inputs[:, -1] == 1).all() and (labels[:, -1] == 1).all()  # EOS last, once
    assert ((inputs == 1).sum(axis=1) - (c4_rows == 1).sum(axis=1) <= 1).all()
    for b, row in enumerate(c4_rows):
        mask = reference_random_spans_noise_mask(
            568, 0.15, 3.0, sample_generator(11, int(indices[b])).permutation
        )
        ref_inputs, ref_targets = reference_span_corruption(row.astype(np.int64), mask, 32099)
        np.testing.assert_array_equal(inputs[b], ref_inputs)
        np.testing.assert_array_equal(labels[b], ref_targets)
        np.testing.assert_array_equal(expand_sentinels(inputs[b], labels[b], 32099, 32072), row)
        # Sentinels count down from <extra_id_0> = 32099 in both inputs and targets, one per span.
        in_sentinels = inputs[b][inputs[b] >= 32000]
        np.testing.assert_array_equal(in_sentinels, 32099 - np.arange(28))
        np.testing.assert_array_equal(labels[b][labels[b] >= 32000], 32099 - np.arange(28))
        assert labels[b][0] == 32099


def test_noise_depends_only_on_seed_and_index(c4_rows):
    corruption = SpanCorruption()
    rows = c4_rows[:8]
    a_in, a_lab = corruption.corrupt(rows, np.arange(8), seed=5)
    # Same samples in another order / batch composition: same result per sample.
    b_in, b_lab = corruption.corrupt(rows[::-1], np.arange(8)[::-1], seed=5)
    np.testing.assert_array_equal(a_in, b_in[::-1])
    np.testing.assert_array_equal(a_lab, b_lab[::-1])
    one_in, _ = corruption.corrupt(rows[3:4], [3], seed=5)
    np.testing.assert_array_equal(one_in[0], a_in[3])
    # Another index, seed or stream changes the noise of the same row.
    same_row = np.repeat(rows[:1], 4, axis=0)
    x, _ = corruption.corrupt(same_row, [0, 1, 2, 3], seed=5)
    assert len({r.tobytes() for r in x}) == 4
    y, _ = corruption.corrupt(same_row[:1], [0], seed=6)
    z, _ = corruption.corrupt(same_row[:1], [0], seed=5, stream=NOISE_STREAM_VALIDATION)
    assert not np.array_equal(x[0], y[0]) and not np.array_equal(x[0], z[0])
    assert NOISE_STREAM_TRAIN != NOISE_STREAM_VALIDATION


def test_short_rows_are_padded(c4_rows):
    corruption = SpanCorruption()
    rows = c4_rows[:4, :300]
    inputs, labels = corruption.corrupt(rows, np.arange(4), seed=0)
    assert inputs.shape == (4, 512) and labels.shape == (4, 114)
    num_noise, num_spans = noise_counts(300, 0.15, 3.0)
    n_in, n_tgt = 300 - num_noise + num_spans + 1, num_noise + num_spans + 1
    assert (inputs[:, n_in - 1] == 1).all() and (inputs[:, n_in:] == 0).all()
    assert (labels[:, n_tgt - 1] == 1).all() and (labels[:, n_tgt:] == LABEL_PAD_ID).all()
    for b in range(4):
        np.testing.assert_array_equal(expand_sentinels(inputs[b], labels[b], 32099, 32072), rows[b])


def test_other_input_length_and_sentinel_start():
    corruption = SpanCorruption(input_length=128, sentinel_start_id=1099)
    tokens_length, targets_length = corruption.tokens_length, corruption.targets_length
    rows = np.random.default_rng(0).integers(3, 1000, size=(3, tokens_length))
    inputs, labels = corruption.corrupt(rows, [0, 1, 2], seed=1)
    assert inputs.shape == (3, 128) and labels.shape == (3, targets_length)
    assert (inputs[:, -1] == 1).all() and (labels != LABEL_PAD_ID).all()
    assert labels[0, 0] == 1099
    for b in range(3):
        np.testing.assert_array_equal(
            expand_sentinels(inputs[b], labels[b], 1099, corruption.lowest_sentinel_id), rows[b]
        )


def test_bad_arguments_are_refused():
    corruption = SpanCorruption()
    with pytest.raises(ValueError, match="longer than the 568"):
        corruption.corrupt(np.zeros((1, 600), dtype=np.int64), [0], seed=0)
    with pytest.raises(ValueError, match="sample indices"):
        corruption.corrupt(np.zeros((2, 568), dtype=np.int64), [0], seed=0)
    with pytest.raises(ValueError, match="noise_density"):
        SpanCorruption(noise_density=1.5)
    with pytest.raises(ValueError, match="sentinel_start_id"):
        SpanCorruption(sentinel_start_id=20)
    # 7 tokens at density 0.5, span 1: 4 noise spans need 4 separating kept tokens, there are 3.
    with pytest.raises(ValueError, match="non-noise tokens"):
        SpanCorruption(noise_density=0.5, mean_noise_span_length=1.0).noise_mask(7, sample_generator(0, 0))
