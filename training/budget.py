"""Wall-clock budgets (cramming's `budget`) and the learning-rate horizon fitted to them.

Without a budget the schedule runs over `optim.total_steps`. With `budget.hours` set, the run
measures its own seconds per step and keeps re-estimating how many optimizer steps fit in the time
left; the cosine/linear schedules use that estimate as their horizon, so the learning rate reaches
its final value when the budget runs out. Rank 0's clock decides and is broadcast, so every rank
uses the same learning rate and stops at the same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.distributed import control_group

# Re-estimate the horizon only after this many steps of the current process, so compile and
# loader warm-up do not make the first estimate pessimistic.
_MIN_STEPS_FOR_ESTIMATE = 5


@dataclass
class Horizon:
    """The step count the learning-rate schedule treats as the end of training."""

    total_steps: int


class TimeBudget:
    """Tracks wall-clock time spent by the run, across restarts (elapsed time is checkpointed)."""

    def __init__(self, hours: float | None, *, elapsed_before_s: float = 0.0):
        self.limit_s = None if hours is None else hours * 3600.0
        self.elapsed_before_s = elapsed_before_s
        self._start = time.monotonic()
        self._first_step: int | None = None
        self._first_step_time: float | None = None

    def elapsed_s(self) -> float:
        return self.elapsed_before_s + (time.monotonic() - self._start)

    def mark_step(self, step: int) -> None:
        """Call after each optimizer step; the first call starts the step-time measurement."""
        if self._first_step is None:
            self._first_step, self._first_step_time = step, time.monotonic()

    def _local_view(self, step: int, max_steps: int) -> tuple[float, float]:
        """(spent flag, fitted total steps) as this rank sees them."""
        if self.limit_s is None:
            return 0.0, float(max_steps)
        remaining = self.limit_s - self.elapsed_s()
        if remaining <= 0:
            return 1.0, float(step)
        steps_done = 0 if self._first_step is None else step - self._first_step
        if steps_done < _MIN_STEPS_FOR_ESTIMATE:
            return 0.0, float(max_steps)
        seconds_per_step = (time.monotonic() - self._first_step_time) / steps_done
        return 0.0, float(min(max_steps, step + max(1, int(remaining / seconds_per_step))))

    def check(self, step: int, max_steps: int, horizon: Horizon) -> bool:
        """Update `horizon` from rank 0's estimate; True (on every rank) when the budget is spent."""
        view = torch.tensor(self._local_view(step, max_steps), dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(view, src=0, group=control_group())
        spent, total = view.tolist()
        horizon.total_steps = max(int(total), step + 1) if not spent else max(step, 1)
        return bool(spent)
