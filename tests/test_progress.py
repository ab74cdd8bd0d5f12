"""What a run tells its user while it runs (training/metrics.py): the estimated time left on the
training line, progress of long loops (a log line with the time left where stderr is no terminal),
the library messages filtered by their exact text and no others, and records whose figures arrive as
tensors. Clocks are stand-ins: nothing here is timed."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

from training.metrics import (
    MetricsLogger,
    RemainingTime,
    format_duration,
    progress,
    quiet_library_noise,
    train_line,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_remaining_time_averages_the_steps_since_the_first_one():
    clock = Clock()
    remaining = RemainingTime(clock)
    assert remaining.seconds(10, 100) is None  # not started
    remaining.start(1)  # the first step (start-up, compilation) is done now
    assert remaining.seconds(1, 100) is None
    clock.now += 20.0  # 10 more steps, an evaluation among them
    assert remaining.seconds(11, 101) == pytest.approx(90 * 2.0)
    clock.now += 2.0
    assert remaining.seconds(12, 101) == pytest.approx(89 * 22.0 / 11)
    assert remaining.seconds(101, 101) == 0.0
    assert remaining.seconds(150, 101) == 0.0  # a shrunken horizon (time budget) is never negative


def test_the_training_line_ends_with_the_time_left():
    record = {"step": 11, "loss": 2.5, "lr": 0.01, "eta_s": 3725.4}
    assert train_line(record, 101).endswith("| Lr --> 0.0100 | ETA --> 1:02:05")
    assert "ETA" not in train_line({**record, "eta_s": None}, 101)
    assert format_duration(59) == "0:00:59"
    assert format_duration(90061) == "1d 01:01:01"


def test_progress_logs_a_line_a_minute_with_the_time_left_where_there_is_no_terminal(caplog):
    clock = Clock()

    def ticking(n, seconds_each):
        for i in range(n):
            clock.now += seconds_each
            yield i

    with caplog.at_level(logging.INFO, logger="t5ds"):
        items = list(progress(ticking(10, 25.0), total=10, desc="SNI generation", rank=0, clock=clock,
                              terminal=False))  # fmt: skip
    assert items == list(range(10))
    lines = [r.getMessage() for r in caplog.records]
    # every 60 s at most, never after the last item: after items 3 (75 s), 6 (150 s), 9 (225 s)
    assert lines == ["SNI generation: 3/10, ETA 0:02:55", "SNI generation: 6/10, ETA 0:01:40",
                     "SNI generation: 9/10, ETA 0:00:25"]  # fmt: skip

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="t5ds"):
        assert list(progress(ticking(10, 1.0), total=10, desc="short", rank=0, clock=clock, terminal=False)) == list(range(10))
        assert list(progress(ticking(10, 25.0), total=10, desc="rank 1", rank=1, clock=clock, terminal=False)) == list(range(10))
    assert caplog.records == []  # a short loop says nothing; other ranks never do


def test_progress_draws_a_bar_on_a_terminal(capsys):
    assert list(progress(range(5), total=5, desc="bar", rank=0, terminal=True)) == list(range(5))
    assert "bar" in capsys.readouterr().err


def test_library_noise_is_filtered_by_its_exact_text_and_nothing_else():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_library_noise()
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Please use ... instead.", FutureWarning,
                          stacklevel=1)  # fmt: skip
        warnings.warn("`torch.distributed.all_gather_coalesced` will be deprecated.", FutureWarning, stacklevel=1)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [
        "`torch.distributed.all_gather_coalesced` will be deprecated.",
        "`torch.distributed.all_gather_into_tensor` is deprecated.",
    ]

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    deepspeed_logger = logging.getLogger("DeepSpeed")
    deepspeed_logger.addHandler(handler)
    try:
        quiet_library_noise()  # twice: one filter
        deepspeed_logger.warning("**** You are using ZeRO with an untested optimizer, proceed with caution *****")
        deepspeed_logger.warning("Unable to find hostfile, will proceed with training with local resources only.")
    finally:
        deepspeed_logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "Unable to find hostfile, will proceed with training with local resources only."
    ]
    assert len(deepspeed_logger.filters) == 1


def test_records_with_tensor_figures_are_written_as_numbers(tmp_path):
    """DeepSpeed's ZeRO optimizers return the gradient norm as a 0-dim tensor."""
    metrics = MetricsLogger(tmp_path, rank=0)
    metrics.log("train", {"step": 3, "grad_l2": torch.tensor(1.5), "loss": 2.0, "eta_s": None})
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["grad_l2"] == 1.5 and record["eta_s"] is None
    assert "Grad_l2 --> 1.5000" in train_line({"step": 3, "grad_l2": torch.tensor(1.5)}, 10)
