"""Counting the training steps whose update was skipped for a non-finite loss or gradient.

A non-finite step is caught in one of two places: by our optimizer's guard (training/optim), or,
under DeepSpeed's fp16/bf16 wrappers, by DeepSpeed before our optimizer runs (`engine.skipped_steps`).
`adamwscale`'s guard is deferred: the outcome of a step is read on the host at the next step, so
that the step never waits for the GPU, and the watch learns of a skip one step late. Reading with
`wait=True` (before a checkpoint) settles the last step too.

`checkpoint_refusal` says whether the state after a step may be written as a checkpoint: a
checkpoint is never written from a step that was skipped, whose loss is not finite, or whose
weights are not finite, so that the newest checkpoint is always one to resume from.
"""

from __future__ import annotations

import math
from typing import Any


def checkpoint_refusal(skipped_in_a_row: int, last_step_loss: float, weights_l2: float) -> str | None:
    """Why the state after the newest step must not be written as a checkpoint, or None when it may be.

    Checked, with values that are the same on every rank: the newest step's update was applied (a
    non-finite loss or gradient on any rank makes the optimizer, or DeepSpeed, skip it: `skipped_in_a_row`
    read after `NonfiniteWatch.update(wait=True)`); the step's loss, averaged over the ranks, is finite;
    the L2 norm of all weights (the train record's weights_l2) is finite: it is not when a weight is
    NaN or infinite, or beyond ~1e19, where its square overflows float32.
    """
    reasons = []
    if skipped_in_a_row:
        reasons.append(f"its update was skipped for a non-finite loss or gradient ({skipped_in_a_row} in a row)")
    if not math.isfinite(last_step_loss):
        reasons.append(f"its loss is {last_step_loss}")
    if not math.isfinite(weights_l2):
        reasons.append(f"the weights' L2 norm is {weights_l2}")
    return "; ".join(reasons) or None


class NonfiniteWatch:
    """Skipped-step counters of a training run, read after every step without a device sync."""

    def __init__(self, optimizer: Any, engine: Any = None, *, skipped_before: int = 0) -> None:
        self.optimizer = optimizer  # a training.optim optimizer (has `skip_counters`)
        self.engine = engine  # the DeepSpeed engine, or None
        self.skipped = skipped_before  # skipped steps over the whole run (resumes included)
        self.in_a_row = 0  # skipped steps since the last step known to be applied
        self._seen = self._total(wait=False)
        self._settled_ahead = False  # the last read waited: the step after it is not known yet

    def _total(self, wait: bool) -> int:
        engine_skips = 0 if self.engine is None else int(self.engine.skipped_steps)
        return self.optimizer.skip_counters(wait=wait)[0] + engine_skips

    def update(self, wait: bool = False) -> int:
        """Read the counters after a step; returns how many skipped steps are newly known."""
        total = self._total(wait)
        new, self._seen = total - self._seen, total
        if new:
            self.skipped += new
            self.in_a_row += new
        elif not self._settled_ahead:  # the newest step read is an applied one
            self.in_a_row = 0
        self._settled_ahead = wait
        return new
