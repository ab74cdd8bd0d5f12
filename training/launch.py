r"""Start a training run on one node through DeepSpeed's launcher, so that stopping this one command
stops the run cleanly and its exit code is the run's.

    python -m training.launch [deepspeed options] training/pretrain.py [trainer arguments]
    python -m training.launch --num_gpus 8 training/pretrain.py --config training/configs/t5_base_c4.yaml \
        --deepspeed_config ds_configs/zero2.json output_dir=runs/base

It takes the `deepspeed` command's arguments and runs that command, plus:
- SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 to this command, alone or with its process group (`timeout`,
  `kill`, a container stop, a batch system), is passed to every rank, which checkpoints at its next
  step boundary and exits 75; this command then exits 75 too, however long the checkpoint takes.
  A second Ctrl-C stops the ranks at once, without a checkpoint. (Signalled itself, the `deepspeed`
  command dies at once with code 143, and its launch process SIGKILLs the ranks 30 s after it is
  signalled, checkpoint written or not.)
- A free rendezvous port when neither --master_port nor MASTER_PORT is given (DeepSpeed's default,
  29500, is taken as soon as another job on the machine uses it).
- No process of the run outlives it: what is still running in the run's session once DeepSpeed has
  exited gets SIGTERM, then SIGKILL 10 s later.
If this command itself is killed (SIGKILL), the ranks notice that their launcher is gone and stop as
if signalled (training/stop_signals.py). Over several nodes (a hostfile) it passes the signals to
DeepSpeed's runner, which handles them its own way; such runs are better started with srun (slurm/).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys

from data_prep.invocation import command_name
from training.cli_errors import run_main
from training.stop_signals import STOP_SIGNALS, launcher_name

logger = logging.getLogger("t5ds.launch")

POLL_S = 0.2
LEFTOVER_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def deepspeed_command(argv: list[str]) -> list[str]:
    """The `deepspeed` command line for `argv`, with a free --master_port unless one is given."""
    has_port = "MASTER_PORT" in os.environ or any(a == "--master_port" or a.startswith("--master_port=")
                                                   for a in argv)
    port = [] if has_port else [f"--master_port={free_port()}"]
    return [sys.executable, "-m", "deepspeed.launcher.runner", *port, *argv]


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` installed (Linux /proc; True where unknown)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


def ranks_of(root_pid: int) -> list:
    """The training processes under `root_pid`: the children of DeepSpeed's launch process."""
    import psutil  # a DeepSpeed dependency

    ranks = []
    try:
        for process in psutil.Process(root_pid).children(recursive=True):
            try:
                if launcher_name(process.cmdline()) == "deepspeed.launcher.launch":
                    ranks.extend(process.children())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
    except psutil.NoSuchProcess:
        pass
    return ranks


class SignalForwarder:
    """Passes the stop signals this process receives to every rank under `child`, as soon as the rank
    has installed its handlers (a signal that arrives while the ranks still start waits for them)."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None  # set once started: signals before that wait for it
        self.pending: list[int] = []  # signals received, in order
        self.delivered: dict[int, int] = {}  # rank pid -> how many of `pending` it got
        self.announced = 0  # how many of `pending` were logged
        self.remote: bool | None = None  # whether the runner started a remote launcher; None until known
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self.pending.append(signum)

    def forward(self) -> None:
        if not self.pending:
            return
        for sig in self.pending[self.announced:]:
            logger.warning("received %s: passing it to every rank, which checkpoints at its next step and exits 75%s",
                           signal.Signals(sig).name,
                           " (Ctrl-C again stops them at once, without one)" if sig == signal.SIGINT else "")
        self.announced = len(self.pending)
        if self._remote_launch():
            # Several nodes (pdsh, mpirun, ...): the ranks are elsewhere; DeepSpeed's runner forwards.
            for sig in self.pending[self.delivered.get(self.child.pid, 0):]:
                self.child.send_signal(sig)
            self.delivered[self.child.pid] = len(self.pending)
            return
        for rank in ranks_of(self.child.pid):
            done = self.delivered.get(rank.pid, 0)
            for sig in self.pending[done:]:
                if not _catches(rank.pid, sig):
                    break  # still starting: try again at the next poll
                try:
                    os.kill(rank.pid, sig)
                except ProcessLookupError:
                    break
                done += 1
            self.delivered[rank.pid] = done

    def _remote_launch(self) -> bool:
        """Whether DeepSpeed's runner started something other than its local launch process. Decided
        once, from the first child whose command line can be read: an exiting process shows an empty
        one, and taking that for a remote launcher would signal the runner itself."""
        import psutil

        if self.remote is None:
            try:
                for child in psutil.Process(self.child.pid).children():
                    cmdline = child.cmdline()
                    if cmdline:
                        self.remote = launcher_name(cmdline) != "deepspeed.launcher.launch"
                        break
            except psutil.Error:
                pass
        return bool(self.remote)

    def wait(self) -> int:
        """Wait for the child, forwarding signals meanwhile; its exit code (128 + N when killed by signal N)."""
        while True:
            try:
                code = self.child.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                self.forward()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return code if code >= 0 else 128 - code


def end_leftovers(session: int, grace_s: float = LEFTOVER_GRACE_S) -> list[int]:
    """SIGTERM, then after `grace_s` SIGKILL, to every process still in session `session`; their pids."""
    import psutil

    def members():
        found = []
        for process in psutil.process_iter():
            try:
                if process.pid != os.getpid() and os.getsid(process.pid) == session:
                    found.append(process)
            except (OSError, psutil.Error):
                continue
        return found

    left = members()
    for process in left:
        logger.warning("ending process %d, left running by the run", process.pid)
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    return [p.pid for p in left]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {command_name()} [deepspeed options] SCRIPT [script arguments]\n\n{__doc__}", end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    forwarder = SignalForwarder()
    # Its own session: a signal to this command's process group reaches this process only, which
    # passes it to the ranks (DeepSpeed's processes would otherwise end on it at once).
    forwarder.child = subprocess.Popen(deepspeed_command(argv), start_new_session=True)
    code = forwarder.wait()
    end_leftovers(forwarder.child.pid)
    return code


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
