"""training/stop_signals.py: stop requests from signals and from a launcher that has gone, and
DataLoader workers that outlive a signal to their process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from training.stop_signals import StopRequest, ignore_stop_signals, launcher_name

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cmdline, name", [
    (["/venv/bin/python3", "/venv/bin/deepspeed", "--num_gpus", "2", "training/pretrain.py"], "deepspeed"),
    (["/venv/bin/python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30="], "deepspeed.launcher.launch"),
    (["python", "-m", "deepspeed.launcher.runner", "train.py"], "deepspeed.launcher.runner"),
    (["python", "-X", "importtime", "-m", "torch.distributed.run", "train.py"], "torch.distributed.run"),
    (["/usr/bin/python3", "/venv/bin/torchrun", "--nproc_per_node", "2"], "torchrun"),
    (["python", "-m", "training.launch", "training/pretrain.py"], "training.launch"),
    (["/venv/bin/deepspeed", "training/pretrain.py"], "deepspeed"),
    (["python", "-u", "training/pretrain.py", "--local_rank=0"], None),
    (["/usr/bin/slurmstepd"], None),
    (["bash", "-c", "exec python training/pretrain.py"], None),
])
def test_launchers_are_told_by_their_command_line(cmdline, name):
    assert launcher_name(cmdline) == name


def test_a_second_ctrl_c_stops_at_once():
    stop = StopRequest(watch_launcher=False)
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGINT and stop.reason == "received SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()


# A stand-in launcher: a script whose file name is a launcher's (`deepspeed`, `torchrun`); it runs the
# rest of its command line and waits for it.
FAKE_LAUNCHER = "import subprocess, sys\nsys.exit(subprocess.call(sys.argv[1:]))\n"
# A rank: it reports the launchers it watches, then what stopped it.
RANK = textwrap.dedent("""
    import time
    from training.stop_signals import stop_request
    stop = stop_request()
    print("watching", " ".join(w.name for w in stop.watched), flush=True)
    deadline = time.monotonic() + 60
    while stop.received is None and time.monotonic() < deadline:
        time.sleep(0.05)
    print("stopped:", stop.reason, flush=True)
""")


@pytest.fixture
def launched_rank(tmp_path):
    """deepspeed (fake) -> torchrun (fake) -> a rank; yields (deepspeed proc, torchrun pid, stdout)."""
    for name in ("deepspeed", "torchrun"):
        (tmp_path / name).write_text(FAKE_LAUNCHER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    top = subprocess.Popen([sys.executable, str(tmp_path / "deepspeed"), sys.executable, str(tmp_path / "torchrun"),
                            sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True,
                           start_new_session=True)
    assert top.stdout.readline().split() == ["watching", "torchrun", "deepspeed"]
    import psutil

    middle = psutil.Process(top.pid).children()[0]
    yield top, middle.pid, top.stdout
    os.killpg(top.pid, signal.SIGKILL)
    top.wait()


def test_a_rank_stops_when_its_launchers_launcher_is_killed(launched_rank):
    top, _, out = launched_rank
    top.kill()  # SIGKILL to `deepspeed`: its child (the torchrun stand-in) lives on
    assert out.readline().strip() == f"stopped: the launcher (deepspeed, pid {top.pid}) has ended"


def test_a_rank_stops_when_its_parent_launcher_is_killed(launched_rank):
    _, middle, out = launched_rank
    os.kill(middle, signal.SIGKILL)  # the kernel sends the rank SIGTERM (PR_SET_PDEATHSIG)
    assert out.readline().strip() in ("stopped: received SIGTERM",
                                      f"stopped: the launcher (torchrun, pid {middle}) has ended")


class _Pids(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.tensor(os.getpid())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_loader_worker_outlives_stop_signals_from_others_and_ends_with_its_loader():
    it = iter(DataLoader(_Pids(), batch_size=None, num_workers=1, worker_init_fn=ignore_stop_signals))
    worker = int(next(it))
    assert worker != os.getpid()
    for sig in ("TERM", "INT", "USR1"):  # from another process, as a signal to the process group comes
        subprocess.run(["kill", f"-{sig}", str(worker)], check=True)
    time.sleep(0.5)
    assert _alive(worker) and int(next(it)) == worker
    del it  # the loader shuts its worker down
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_a_process_exits_with_a_loader_still_open():
    """multiprocessing ends a daemonic worker left at exit with SIGTERM and waits for it: a worker that
    ignored every SIGTERM would hang the exit forever."""
    script = textwrap.dedent("""
        import os, torch
        from torch.utils.data import DataLoader, IterableDataset
        from training.stop_signals import ignore_stop_signals

        class Pids(IterableDataset):
            def __iter__(self):
                while True:
                    yield torch.tensor(os.getpid())

        loader = iter(DataLoader(Pids(), batch_size=None, num_workers=1, worker_init_fn=ignore_stop_signals))
        cycle = [loader]
        cycle.append(cycle)  # kept alive past the end of the module, as a generator's frame keeps its loader
        print(int(next(loader)), flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    worker = int(proc.stdout.split()[0])
    assert not _alive(worker)
