"""SIGTERM / SIGUSR1 handling: checkpoint at the next step boundary and exit for a requeue.

A signal may reach only one rank (SLURM's `--signal` goes to the batch shell, which forwards it;
`scancel --signal` may hit one task). The handler only sets a flag; the training loop asks
`StopRequest.agreed()` at every step boundary, an all-reduce that makes every rank see the flag in
the same step, so all ranks checkpoint the same step together and then exit with
`EXIT_REQUEUE`. The SLURM scripts requeue the job on that code.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable

from training.distributed import any_rank

logger = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again" -- what a preempted job is.
EXIT_REQUEUE = 75
# The run stopped itself because too many updates in a row had a non-finite loss or gradient.
EXIT_NONFINITE = 3


class StopRequest:
    """Records that a stop signal arrived; the loop polls it at step boundaries."""

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)):
        self.received: int | None = None
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self.received = signum
        # No logging here: the logging module is not re-entrant inside a signal handler.

    def agreed(self) -> bool:
        """True on every rank once any rank has received a stop signal (a collective call)."""
        stop = any_rank(self.received is not None)
        if stop and self.received is not None:
            logger.warning("received %s: checkpointing and exiting with code %d for a requeue",
                           signal.Signals(self.received).name, EXIT_REQUEUE)
        return stop

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
