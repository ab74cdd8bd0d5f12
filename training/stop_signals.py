"""Stopping a run cleanly: checkpoint at the next step boundary and exit 75 for a requeue.

What asks a run to stop:
- SIGTERM, SIGUSR1 or SIGINT to a rank (`kill`, `timeout`, a container stop, SLURM's `--signal`,
  Ctrl-C). A second SIGINT stops at once, without a checkpoint (KeyboardInterrupt).
- The rank's launcher going away. Each rank started by a launcher (`deepspeed` and the
  deepspeed.launcher.launch process under it, `torchrun`, `python -m training.launch`) watches
  those processes: when one of them dies (SIGTERM or SIGKILL to `deepspeed`, a closed terminal)
  the rank stops as if signalled, instead of training on unsupervised. The direct parent is also
  covered by the kernel (PR_SET_PDEATHSIG sends this process SIGTERM when it dies).

A signal may reach only one rank (SLURM's `--signal` goes to the batch shell, which forwards it;
`scancel --signal` may hit one task). The handlers only set a flag; the training loop asks
`StopRequest.agreed()` at every step boundary, an all-reduce that makes every rank see the flag in
the same step, so all ranks checkpoint the same step together and then exit with `EXIT_REQUEUE`.
The SLURM scripts requeue the job on that code.

DataLoader workers ignore these signals (`ignore_stop_signals`, their worker_init_fn): a signal to
the whole process group reaches the rank, which stops at the step boundary and shuts its loader
down, instead of the workers dying under it before it has checkpointed.

This module imports no torch (the collective is imported when it is needed): the entry points
install the handlers before their heavy imports, so a signal during start-up is honoured too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again" -- what a preempted job is.
EXIT_REQUEUE = 75
# The run stopped itself because too many updates in a row had a non-finite loss or gradient.
EXIT_NONFINITE = 3

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

# How the launchers this module knows show up in a process's command line: `python -m MODULE` or a
# console script named SCRIPT.
LAUNCHER_MODULES = ("deepspeed.launcher.runner", "deepspeed.launcher.launch", "torch.distributed.run",
                    "training.launch")
LAUNCHER_SCRIPTS = ("deepspeed", "torchrun")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ignore_stop_signals(worker_id: int | None = None) -> None:  # noqa: ARG001 (worker_init_fn signature)
    """A DataLoader worker_init_fn: the worker ignores the stop signals, so that only its rank decides
    when the loader ends (torch's own worker handler dies on a SIGTERM from anyone). A SIGTERM from
    the rank itself, which is how torch and multiprocessing end a worker that outstays its loader,
    still ends it, and so does the rank's death (torch's watchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # SIGTERM is blocked in every thread and taken by one that knows who sent it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_exit_on_sigterm_from, args=(os.getppid(),), name="t5ds-sigterm", daemon=True).start()


def _exit_on_sigterm_from(parent: int) -> None:
    while True:
        if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
            os._exit(0)  # what torch's worker handler does for its parent's SIGTERM


def launcher_name(cmdline: list[str]) -> str | None:
    """The launcher a command line runs (a LAUNCHER_MODULES or LAUNCHER_SCRIPTS entry), or None."""
    args = list(cmdline[1:])  # after the interpreter
    while args and args[0].startswith("-") and args[0] != "-m":
        option = args.pop(0)
        if option in ("-X", "-W") and args:  # interpreter options that take a value
            args.pop(0)
    if len(args) >= 2 and args[0] == "-m":
        return args[1] if args[1] in LAUNCHER_MODULES else None
    for candidate in (args[:1] + list(cmdline[:1])):  # `python /venv/bin/deepspeed ...` or the script itself
        if os.path.basename(candidate) in LAUNCHER_SCRIPTS:
            return os.path.basename(candidate)
    return None


@dataclass(frozen=True)
class WatchedProcess:
    pid: int
    create_time: float  # tells the process from a later one that reuses its pid
    name: str


def launcher_chain(pid: int | None = None) -> list[WatchedProcess]:
    """The launcher processes above process `pid` (default: this one), nearest first: its parent if
    that is a launcher, then that one's parent if it is one too, and so on."""
    import psutil  # a DeepSpeed dependency; imported here, as only a started rank needs it

    chain = []
    try:
        process = psutil.Process(pid).parent()
        while process is not None:
            name = launcher_name(process.cmdline())
            if name is None:
                break
            chain.append(WatchedProcess(process.pid, process.create_time(), name))
            process = process.parent()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        pass
    return chain


def _alive(watched: WatchedProcess) -> bool:
    import psutil

    try:
        process = psutil.Process(watched.pid)
        return process.create_time() == watched.create_time and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _set_parent_death_signal(sig: int) -> bool:
    """PR_SET_PDEATHSIG: the kernel sends `sig` to this process when its parent thread ends (Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class StopRequest:
    """Records that a stop was asked for (a signal, or a launcher gone); the loop polls it at step
    boundaries. Get the process's one instance with `stop_request()`."""

    def __init__(self, signals=STOP_SIGNALS, *, watch_launcher: bool = True, poll_s: float = 1.0) -> None:
        self.received: int | None = None  # the signal, or SIGTERM when the launcher is gone
        self.reason: str | None = None  # what asked for the stop, for the log line
        self._previous = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._done = threading.Event()
        self.watched: list[WatchedProcess] = []
        self._pdeathsig = False
        if watch_launcher:
            self.watch(launcher_chain(), poll_s=poll_s)

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without a checkpoint
        self.received = signum
        self.reason = f"received {signal.Signals(signum).name}"
        # No logging here: the logging module is not re-entrant inside a signal handler.

    def launcher_gone(self, watched: WatchedProcess) -> None:
        """Ask for a stop because the launcher process `watched` has ended."""
        if self.received is None:
            self.received = signal.SIGTERM
            self.reason = f"the launcher ({watched.name}, pid {watched.pid}) has ended"

    def watch(self, processes: list[WatchedProcess], *, poll_s: float = 1.0) -> None:
        """Stop when any of `processes` ends (checked every `poll_s` seconds by a daemon thread);
        the nearest, when it is this process's parent, also through PR_SET_PDEATHSIG."""
        if not processes:
            return
        self.watched = list(processes)
        if processes[0].pid == os.getppid():
            self._pdeathsig = _set_parent_death_signal(signal.SIGTERM)
        threading.Thread(target=self._watch_loop, args=(poll_s,), name="t5ds-launcher-watch", daemon=True).start()

    def _watch_loop(self, poll_s: float) -> None:
        while not self._done.wait(poll_s):
            for watched in self.watched:
                if not _alive(watched):
                    self.launcher_gone(watched)
                    return

    def agreed(self) -> bool:
        """True on every rank once any rank was asked to stop (a collective call)."""
        from training.distributed import any_rank  # torch: imported by the time a loop runs

        stop = any_rank(self.received is not None)
        if stop and self.received is not None:
            again = " (Ctrl-C again stops at once, without one)" if self.received == signal.SIGINT else ""
            logger.warning("%s: checkpointing and exiting with code %d for a requeue%s", self.reason, EXIT_REQUEUE,
                           again)
        return stop

    def restore(self) -> None:
        """Put the previous signal handlers back and stop watching (idempotent)."""
        global _installed
        self._done.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._pdeathsig:
            _set_parent_death_signal(0)
            self._pdeathsig = False
        if _installed is self:
            _installed = None


_installed: StopRequest | None = None


def stop_request() -> StopRequest:
    """This process's StopRequest, installed on the first call (signal handlers, launcher watch)."""
    global _installed
    if _installed is None:
        _installed = StopRequest()
    return _installed
