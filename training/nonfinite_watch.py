"""Counting the training steps whose update was skipped for a non-finite loss or gradient.

A non-finite step is caught in one of two places: by our optimizer's guard (training/optim), or,
under DeepSpeed's fp16/bf16 wrappers, by DeepSpeed before our optimizer runs (`engine.skipped_steps`).
`adamwscale`'s guard is deferred: the outcome of a step is read on the host at the next step, so
that the step never waits for the GPU, and the watch learns of a skip one step late. Reading with
`wait=True` (before a checkpoint) settles the last step too.
"""

from __future__ import annotations

from typing import Any


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
