"""Length-grouped UL2 micro-batches (data.target_buckets, training/data/length_groups.py) on real C4
rows: a grouped step holds the ungrouped step's samples, sorted and trimmed to their buckets; the
padding it saves; the same summed gradient on a tiny model; the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_pretrain_loader import dataset  # noqa: F401  (a fixture: 120 C4 rows of 568 tokens)
from tests.test_span_corruption import c4_rows  # noqa: F401  (a fixture: real C4 rows of 568 tokens)
from training.config import ConfigError, DataConfig
from training.config_loader import load_run_config
from training.data.length_groups import check_buckets, group_step
from training.data.objectives import build_objective
from training.data.pretrain_loader import PretrainBatches
from training.model.config import T5Config
from training.model.t5 import T5ForConditionalGeneration
from training.pretrain import LogWindow

BUCKETS = (128, 256)


@pytest.fixture(scope="module")
def ul2(spiece_path):
    return build_objective(DataConfig(objective="ul2", tokenizer=str(spiece_path)))


def target_lengths(batch) -> np.ndarray:
    return np.asarray((batch["labels"] != -100).sum(1))


def steps(loader, grad_acc: int, count: int) -> list[list[dict]]:
    batches = iter(loader)
    return [[next(batches) for _ in range(grad_acc)] for _ in range(count)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_grouped_step_holds_the_ungrouped_samples_sorted_and_trimmed(dataset, ul2, num_workers):  # noqa: F811
    grad_acc, micro = 4, 6
    kwargs = dict(rank=0, world_size=1, micro_batch_size=micro, grad_acc=grad_acc, seed=5, objective=ul2,
                  include_indices=True, expected_tokenizer_sha256=dataset["sha"])
    plain = PretrainBatches(dataset["dir"], "train", num_workers=0, **kwargs)
    grouped = PretrainBatches(dataset["dir"], "train", num_workers=num_workers, target_buckets=BUCKETS, **kwargs)
    widths = set()
    for want, got in zip(steps(plain, grad_acc, 8), steps(grouped, grad_acc, 8)):
        by_sample = {}
        for batch in want:
            for b, g in enumerate(batch["sample_index"].tolist()):
                by_sample[g] = {name: tensor[b] for name, tensor in batch.items()}
        got_samples = [g for batch in got for g in batch["sample_index"].tolist()]
        assert sorted(got_samples) == sorted(by_sample)
        lengths = np.concatenate([target_lengths(batch) for batch in got])
        assert (np.diff(lengths) >= 0).all()  # sorted across the step, so within every micro-batch
        for batch in got:
            width = batch["labels"].shape[1]
            assert width == min(b for b in (*BUCKETS, ul2.target_length) if b >= target_lengths(batch).max())
            assert batch["input_ids"].shape == (micro, ul2.input_length)
            widths.add(width)
            for b, g in enumerate(batch["sample_index"].tolist()):
                ref = by_sample[g]
                assert int(batch["denoiser"][b]) == int(ref["denoiser"])
                assert torch.equal(batch["input_ids"][b], ref["input_ids"])
                assert torch.equal(batch["attention_mask"][b], ref["attention_mask"])
                assert torch.equal(batch["labels"][b], ref["labels"][:width])
                assert (ref["labels"][width:] == -100).all()
        ties = lengths[1:] == lengths[:-1]  # stable: equal lengths keep their order on the sample line
        assert (np.diff(got_samples)[ties] > 0).all()
    assert grouped.cursor.samples_consumed == plain.cursor.samples_consumed == 8 * grad_acc * micro
    assert len(widths) > 1


@pytest.mark.parametrize("grad_acc,bound", [(2, 0.37), (4, 0.32)])
def test_padding_fraction_of_grouped_ul2_on_c4(ul2, c4_rows, grad_acc, bound):  # noqa: F811
    """Label padding of UL2 with steps of 128 samples per rank (micro-batches of 128 / grad_acc) over 32
    steps: 0.56 ungrouped, 0.35 grouped by two, 0.30 by four (docs/objectives.md quotes them)."""
    samples = 32 * 128
    batch = ul2.make(np.resize(c4_rows, (samples, 568)), np.arange(samples), seed=0, stream=0)
    real = int((batch["labels"] != -100).sum())
    ungrouped = 1 - real / batch["labels"].size
    buckets = check_buckets(BUCKETS, ul2.target_length)
    positions = sum(micro["labels"].size for s in range(0, samples, 128)
                    for micro in group_step({k: v[s:s + 128] for k, v in batch.items()}, grad_acc, buckets))
    grouped = 1 - real / positions
    assert 0.54 < ungrouped < 0.58 and bound - 0.05 < grouped < bound, (ungrouped, grouped)


def test_a_grouped_step_gives_the_ungrouped_gradient(ul2, c4_rows):  # noqa: F811
    """The summed gradient of a step, its micro-batches scaled as train_step does (LogWindow.count), is
    the same with and without grouping: every micro-batch divides by micro-batch x target_length."""
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math", dropout_rate=0.0))
    grad_acc, micro = 4, 4
    step = ul2.make(c4_rows[: grad_acc * micro], np.arange(grad_acc * micro), seed=1, stream=0)
    plain = [{k: v[m * micro:(m + 1) * micro] for k, v in step.items()} for m in range(grad_acc)]
    grouped = group_step(step, grad_acc, check_buckets((64, 128), ul2.target_length))
    assert len({micro["labels"].shape[1] for micro in grouped}) > 1

    def summed_gradient(micro_batches):
        model.zero_grad()
        window = LogWindow(torch.device("cpu"), ul2.target_length)
        for arrays in micro_batches:
            batch = {k: torch.from_numpy(v) for k, v in arrays.items()}
            scale = window.count(batch, model.config)
            out = model(input_ids=batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"],
                        return_logits=False)
            (out.loss * scale).backward()
        return [p.grad.clone() for p in model.parameters()], window

    want, plain_window = summed_gradient(plain)
    got, grouped_window = summed_gradient(grouped)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert (grouped_window.tokens, grouped_window.flops, grouped_window.target_positions) == \
        (plain_window.tokens, plain_window.flops, plain_window.target_positions)


@pytest.mark.parametrize("overrides,message", [
    (["data.target_buckets=[128]"], "data.target_buckets applies to data.objective=ul2 or prefix_lm"),
    (["data.objective=ul2", "data.target_buckets=[256, 128]"], r"\[256, 128\] must be ascending multiples of 8"),
    (["data.objective=ul2", "data.target_buckets=[100]"], "must be ascending multiples of 8, e.g. "),
])
def test_bad_target_buckets_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_run_config("training/configs/t5_base_c4.yaml", overrides)
    assert "\n" not in str(err.value)


def test_buckets_past_the_target_length_are_refused(ul2):
    assert check_buckets((128, 256), 384) == (128, 256, 384)
    with pytest.raises(ConfigError, match=r"\[128, 384\] must all be below the objective's target length 384"):
        check_buckets((128, 384), ul2.target_length)
