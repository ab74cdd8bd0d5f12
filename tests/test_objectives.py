"""The pre-training objectives on real C4 rows: each UL2 denoiser against the paper's definition
(lengths, spans, sentinel layout, mode token), the raw row rebuilt from inputs + targets, the
mixture's proportions, per-sample determinism, FLOPs of real lengths and the one-line refusals."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.test_span_corruption import c4_rows  # noqa: F401  (a fixture: real C4 rows of 568 tokens)
from training.config import UL2_DENOISERS, ConfigError, DataConfig, Denoiser
from training.config_loader import load_run_config
from training.data.objectives import build_objective
from training.data.span_corruption import SpanCorruption, expand_sentinels, sample_generator
from training.model.config import T5Config
from training.model.flops import model_flops_per_step, samples_flops_per_step

MODE_IDS = {"[NLU]": (784, 567, 9138, 908), "[NLG]": (784, 18207, 517, 908), "[S2S]": (784, 134, 357, 134, 908)}


@pytest.fixture(scope="module")
def ul2(spiece_path):
    return build_objective(DataConfig(objective="ul2", tokenizer=str(spiece_path)))


def real(array: np.ndarray) -> np.ndarray:
    return array[array != -100]


def test_ul2_shapes_and_mode_tokens_of_the_t5_vocabulary(ul2):
    assert (ul2.row_length, ul2.input_length, ul2.target_length) == (568, 512, 384)
    specs = ul2.mixture.specs
    assert [s.name for s in specs] == [d.name for d in UL2_DENOISERS]
    assert [s.mode_ids for s in specs] == [MODE_IDS[d.mode_token] for d in UL2_DENOISERS]
    # The R-denoiser mu=3 r=0.15 reads 564 of the 568 tokens so that its 4 mode pieces fit in 512 inputs;
    # the X-denoiser mu=3 r=0.5 has the longest targets: 284 noise tokens + 95 sentinels + EOS.
    assert (specs[0].raw_length, specs[0].max_input, specs[0].max_target) == (564, 512, 114)
    assert (specs[2].raw_length, specs[2].max_input, specs[2].max_target) == (568, 384, 380)
    assert ul2.lowest_special_id == 32099 - 95 + 1


@pytest.mark.parametrize("index", range(len(UL2_DENOISERS)))
def test_each_denoiser_follows_the_paper_and_rebuilds_the_row(ul2, c4_rows, index):  # noqa: F811
    spec = ul2.mixture.specs[index]
    alone = ul2.evaluation_sets()[spec.name]
    batch = alone.make(c4_rows, np.arange(len(c4_rows)) + 1000, seed=3, stream=0)
    assert (batch["denoiser"] == index).all()
    mode, shares = list(spec.mode_ids), []
    for b, row in enumerate(c4_rows.astype(np.int64)):
        inputs = batch["input_ids"][b][batch["attention_mask"][b] == 1]
        assert (batch["input_ids"][b][batch["attention_mask"][b] == 0] == 0).all()  # pad id where masked
        targets = real(batch["labels"][b])
        assert inputs[: len(mode)].tolist() == mode and inputs[-1] == 1 and targets[-1] == 1
        raw = row[: spec.raw_length]
        if spec.kind == "prefix":
            prefix, suffix = inputs[len(mode) : -1], targets[:-1]
            assert len(prefix) >= round((1 - 2 * spec.rate) * (len(raw) - 1)) and len(suffix) >= 1
            np.testing.assert_array_equal(np.concatenate([prefix, suffix]), raw)
            shares.append(len(suffix) / len(raw))
            continue
        noise, spans = spec.span_counts(len(raw))
        assert noise == round(len(raw) * spec.rate) and spans == max(1, round(noise / spec.mean_span))
        sentinels = 32099 - np.arange(spans)
        np.testing.assert_array_equal(inputs[(inputs >= 32000)], sentinels)  # one per span, counting down
        np.testing.assert_array_equal(targets[(targets >= 32000)], sentinels)
        assert targets[0] == 32099  # the target starts with the first span's sentinel
        assert len(inputs) == len(mode) + len(raw) - noise + spans + 1 == spec.max_input
        assert len(targets) == noise + spans + 1 == spec.max_target
        np.testing.assert_array_equal(
            expand_sentinels(inputs[len(mode) :], targets, 32099, 32099 - spans + 1), raw)
    if shares:  # the split point is uniform: the mean target share is the rate
        assert np.mean(shares) == pytest.approx(spec.rate, abs=0.04)


def test_proportions_over_many_samples(ul2, c4_rows):  # noqa: F811
    chosen = np.array([ul2.mixture.choose(sample_generator(11, g, 0)) for g in range(30000)])
    expected = np.array([d.weight for d in UL2_DENOISERS]) / sum(d.weight for d in UL2_DENOISERS)
    observed = np.bincount(chosen, minlength=len(expected)) / len(chosen)
    assert np.abs(observed - expected).max() < 4 * np.sqrt(expected * (1 - expected) / len(chosen)).max()
    batch = ul2.make(c4_rows[:16], np.arange(16), seed=11, stream=0)
    np.testing.assert_array_equal(batch["denoiser"], chosen[:16])  # the first draw of each sample's generator


def test_a_sample_depends_only_on_seed_index_and_stream(ul2, c4_rows):  # noqa: F811
    rows, indices = c4_rows[:12], np.arange(40, 52)
    a = ul2.make(rows, indices, seed=5, stream=0)
    b = ul2.make(rows[::-1], indices[::-1], seed=5, stream=0)  # another batch order
    one = ul2.make(rows[4:5], indices[4:5], seed=5, stream=0)  # another batch size
    for key in a:
        np.testing.assert_array_equal(a[key], b[key][::-1])
        np.testing.assert_array_equal(a[key][4:5], one[key])
    other = ul2.make(rows, indices, seed=5, stream=1)
    assert not np.array_equal(a["input_ids"], other["input_ids"])


def test_padding_fraction_of_ul2_on_c4(ul2, c4_rows):  # noqa: F811
    """The share of padded positions in UL2 batches (inputs 512 + targets 384) on real C4 rows: the
    figure docs/objectives.md quotes."""
    batch = ul2.make(np.resize(c4_rows, (2000, 568)), np.arange(2000), seed=0, stream=0)
    used = batch["attention_mask"].sum() + (batch["labels"] != -100).sum()
    padding = 1 - used / (2000 * (512 + 384))
    assert 0.32 < padding < 0.36, padding  # 0.34


def test_prefix_lm_and_span_corruption_objectives(spiece_path, c4_rows):  # noqa: F811
    prefix = build_objective(DataConfig(objective="prefix_lm", tokenizer=str(spiece_path)))
    assert [s.kind for s in prefix.mixture.specs] == ["prefix"] and prefix.mixture.specs[0].mode_ids == ()
    batch = prefix.make(c4_rows[:4], np.arange(4), seed=0, stream=0)
    for b in range(4):  # no mode token: the inputs are the row's start, the targets its end
        inputs = batch["input_ids"][b][batch["attention_mask"][b] == 1][:-1]
        np.testing.assert_array_equal(np.concatenate([inputs, real(batch["labels"][b])[:-1]]),
                                      c4_rows[b, : len(inputs) + len(real(batch["labels"][b])) - 1])
    span = build_objective(DataConfig())
    inputs, labels = SpanCorruption().corrupt(c4_rows[:4], np.arange(4), seed=2)
    got = span.make(c4_rows[:4], np.arange(4), seed=2, stream=0)
    assert set(got) == {"input_ids", "labels"}
    np.testing.assert_array_equal(got["input_ids"], inputs) and np.testing.assert_array_equal(got["labels"], labels)
    assert list(span.evaluation_sets()) == [""] and list(prefix.evaluation_sets()) == ["", "prefix_r0.25"]


def test_flops_count_the_real_lengths():
    config = T5Config.from_preset("base")
    assert samples_flops_per_step(config, [512] * 128, [114] * 128) == pytest.approx(
        model_flops_per_step(config, 128, 512, 114), rel=1e-12)
    mixed = samples_flops_per_step(config, [512, 300, 300], [114, 200, 200])
    assert mixed == pytest.approx(model_flops_per_step(config, 1, 512, 114) + model_flops_per_step(config, 2, 300, 200))


@pytest.mark.parametrize("overrides,message", [
    (["data.objective=ul2", "data.denoisers=[{kind: span, weight: 0}, {kind: prefix, weight: 0}]"],
     r"weights \[0.0, 0.0\] sum to 0: give at least one denoiser a positive weight"),
    (["data.objective=ul2", "data.denoisers=[{kind: span, weight: -1}]"], "weight=-1.0 must be >= 0"),
    (["data.denoisers=[{kind: span}]"], "data.denoisers applies to data.objective=ul2 or prefix_lm"),
    (["data.objective=prefix_lm", "data.denoisers=[{kind: span}]"], "prefix_lm takes only denoisers of kind prefix"),
    (["data.objective=ul2", "data.denoisers=[{kind: prefix, rate: 0.6}]"], r"must be in \(0, 0.5\]"),
    (["data.objective=ul2", "data.denoisers=[{kind: span}, {kind: span}]"], "repeat: give each a distinct name"),
    (["data.objective=mlm"], "data.objective='mlm' is not valid; use one of: span_corruption, ul2, prefix_lm"),
])
def test_bad_objective_configs_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_run_config("training/configs/t5_base_c4.yaml", overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("denoiser,message", [
    (Denoiser(mode_token="⟦NLU⟧"), "mode token '⟦NLU⟧' is not in the vocabulary of .*spiece.model .*unknown piece"),
    (Denoiser(rate=0.3, mean_span=1.5), "masks 113 spans but the vocabulary has 100 sentinels: raise its mean_span"),
    (Denoiser(rate=0.5, spans=300), "cannot fit rows of 568 tokens into inputs of 512: .*re-shard with a larger"),
])
def test_denoisers_that_cannot_run_are_one_line_errors(spiece_path, denoiser, message):
    data = dataclasses.replace(DataConfig(tokenizer=str(spiece_path)), objective="ul2", denoisers=(denoiser,))
    with pytest.raises(ConfigError, match=message) as err:
        build_objective(data)
    assert "\n" not in str(err.value)


def test_the_shipped_ul2_config_is_the_default_mixture():
    cfg = load_run_config("training/configs/ul2_base_c4.yaml", [])
    assert cfg.data.objective == "ul2" and cfg.data.denoisers == UL2_DENOISERS
    assert cfg.data.objective_denoisers == load_run_config("training/configs/t5_base_c4.yaml", [
        "data.objective=ul2"]).data.objective_denoisers
    assert cfg.model.preset == "base" and cfg.data.input_length == 512
