"""Best-checkpoint selection and early stopping on a validation metric.

The fine-tuning loop feeds every validation result to `BestSelection.observe`; an improvement is
saved as a checkpoint that rotation keeps (`protected`), and `patience` evaluations in a row without
one end the run. The state travels in each checkpoint's rank state, so a resumed run goes on with
the same best value, best step and count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class BestSelection:
    metric: str | None = None  # None: no selection, the run keeps its last weights
    mode: str = "max"
    patience: int = 0  # 0 = never stop early
    best: float | None = None
    best_step: int | None = None
    best_record: dict | None = None  # the evaluation record of the best step
    evals_without_improvement: int = 0
    finished: bool = False  # the run ended (its last checkpoint holds the selected weights)

    @property
    def active(self) -> bool:
        return self.metric is not None

    def observe(self, value: float, step: int, record: dict | None = None) -> bool:
        """Count one validation result; True when it improves on the best so far (ties do not)."""
        better = self.best is None or (value > self.best if self.mode == "max" else value < self.best)
        if better:
            self.best, self.best_step, self.best_record, self.evals_without_improvement = value, step, record, 0
        else:
            self.evals_without_improvement += 1
        return better

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_without_improvement >= self.patience

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the progress of a checkpoint's selection on the same metric and mode (another
        metric or mode starts the selection over; patience is this run's)."""
        if state and (state["metric"], state["mode"]) == (self.metric, self.mode):
            self.best, self.best_step, self.best_record = state["best"], state["best_step"], state["best_record"]
            self.evals_without_improvement, self.finished = state["evals_without_improvement"], state["finished"]
