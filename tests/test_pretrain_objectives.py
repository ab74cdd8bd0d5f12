"""`training/pretrain.py` with UL2 (data.objective=ul2) on CPU, on the shards span corruption uses:
per-denoiser held-out loss, the objective in metrics and on the progress line, exact resume
(5 + resume + 5 == 10 steps) and 2 ranks resumed on 1, also with length-grouped micro-batches
(data.target_buckets), whose losses are the ungrouped run's."""

from __future__ import annotations

import pytest

from tests.test_pretrain import (  # noqa: F401  (shards is a fixture)
    STEPS,
    assert_weights_close,
    copy_run_until,
    final_weights,
    losses,
    shards,
    train,
)
from training.config import UL2_DENOISERS
from training.metrics import read_metrics

UL2 = "data.objective=ul2"


@pytest.fixture(scope="module")
def ul2_run(shards, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("runs") / "ul2"
    proc = train(out, shards, UL2)
    return out, proc


def test_ul2_run_names_the_objective_and_reports_each_denoiser(ul2_run):
    run, proc = ul2_run
    records = read_metrics(run / "metrics.jsonl", "train")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {r["objective"] for r in records} == {"ul2"}
    # Padding is not counted: fewer tokens per step than the 8 x (64 + 56) positions of a batch.
    assert all(0 < r["tokens_per_s"] * r["seconds_per_step"] < 8 * (64 + 56) for r in records)
    assert "Objective --> ul2" in proc.stderr
    (final,) = read_metrics(run / "metrics.jsonl", "eval")
    assert final["objective"] == "ul2" and final["eval_loss"] > 0
    for denoiser in UL2_DENOISERS:
        assert final[f"eval_loss/{denoiser.name}"] > 0 and 0 <= final[f"eval_accuracy/{denoiser.name}"] <= 1
        assert f"{denoiser.name} --> " in proc.stderr


def test_ul2_resume_continues_exactly(ul2_run, shards, tmp_path):  # noqa: F811
    reference, _ = ul2_run
    resumed = tmp_path / "resumed"
    copy_run_until(reference, resumed, 5)
    train(resumed, shards, UL2)
    ref, got = losses(reference), losses(resumed)
    assert all(got[step] == ref[step] for step in range(6, STEPS + 1)), (ref, got)
    assert_weights_close(final_weights(resumed), final_weights(reference), rtol=1e-6)


def test_ul2_two_ranks_match_one_and_resume_on_one(ul2_run, shards, tmp_path):  # noqa: F811
    reference, _ = ul2_run
    two = tmp_path / "two_ranks"
    train(two, shards, UL2, nproc=2)
    ref, got = losses(reference), losses(two)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    resumed = tmp_path / "resumed_on_one"
    copy_run_until(two, resumed, 5)
    train(resumed, shards, UL2, nproc=1)
    got_resumed = losses(resumed)
    for step in range(6, STEPS + 1):
        assert got_resumed[step] == pytest.approx(got[step], rel=1e-4), step
    assert_weights_close(final_weights(resumed), final_weights(two), rtol=1e-4)



# Length-grouped micro-batches (training/data/length_groups.py): targets of 48 at input_length 64.
GROUPED = [UL2, "optim.grad_acc=2", "data.target_buckets=[16, 32]"]


@pytest.fixture(scope="module")
def grouped_run(shards, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("runs") / "ul2_grouped"
    train(out, shards, *GROUPED)
    return out


def test_grouped_ul2_trains_as_ungrouped_and_resumes_exactly(ul2_run, grouped_run, shards, tmp_path):  # noqa: F811
    """The same samples per step and the ungrouped denominator: the losses of the one-micro-batch run."""
    ref, got = losses(ul2_run[0]), losses(grouped_run)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    resumed = tmp_path / "resumed"
    copy_run_until(grouped_run, resumed, 5)
    train(resumed, shards, *GROUPED)
    got_resumed = losses(resumed)
    assert all(got_resumed[step] == got[step] for step in range(6, STEPS + 1)), (got, got_resumed)
    assert_weights_close(final_weights(resumed), final_weights(grouped_run), rtol=1e-6)


def test_grouped_ul2_on_two_ranks_matches_one_and_resumes_on_one(grouped_run, shards, tmp_path):  # noqa: F811
    two = tmp_path / "two_ranks"
    train(two, shards, *GROUPED, nproc=2)
    ref, got = losses(grouped_run), losses(two)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    resumed = tmp_path / "resumed_on_one"
    copy_run_until(two, resumed, 5)
    train(resumed, shards, *GROUPED, nproc=1)
    got_resumed = losses(resumed)
    for step in range(6, STEPS + 1):
        assert got_resumed[step] == pytest.approx(got[step], rel=1e-4), step
    assert_weights_close(final_weights(resumed), final_weights(two), rtol=1e-4)
