"""Stopping a run as users do, through its launcher: SIGTERM to the `deepspeed` command, to its whole
process group or to one rank, SIGKILL to `deepspeed`, and SIGTERM to the process group of
`python -m training.launch`. Each ends with a stop checkpoint of every rank on disk, exit code 75
where the started command survives to report it, and no process of the run left. The runs start
outside the repository with the script's absolute path and the default tokenizer.

CPU, gloo, the tiny model on the bundled C4 sample, one DataLoader worker per rank (which a signal to
the process group also reaches)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from training.metrics import read_metrics
from training.stop_signals import EXIT_REQUEUE

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
TRAINER = [str(REPO / "training" / "pretrain.py"), "--config", "training/configs/tiny_demo.yaml",
           "optim.total_steps=1000", "optim.warmup_steps=2", "optim.batch_size=8", "data.input_length=64",
           "logging.every_steps=1", "eval.every_steps=0", "checkpoint.every_steps=0", "data.num_workers=1"]
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DS_ACCELERATOR="cpu")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "T5DS_DEBUG"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "c4"
    subprocess.run([sys.executable, "-m", "data_prep.shard", "--input", "assets/c4/en/c4-*.json.gz",
                    "--tokenizer", "assets/t5/spiece.model", "--output", str(out), "--input-length", "64",
                    "--rows-per-shard", "1024", "--workers", "1", "--no-progress"], cwd=REPO, env=_env(),
                   check=True, capture_output=True)
    return out


class Run:
    """A training command started in its own session (its process group is the command's pid)."""

    def __init__(self, command: list[str], run_dir: Path, cwd: Path) -> None:
        if command[0] == str(DEEPSPEED) and not DEEPSPEED.is_file():
            pytest.skip(f"no `deepspeed` command next to {sys.executable}")
        self.run_dir = run_dir
        self.log = cwd / "output.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, cwd=cwd, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.sessions = {self.proc.pid}

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def ranks(self) -> list[psutil.Process]:
        """The training processes: children of DeepSpeed's launch process."""
        found = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            self.sessions.add(os.getsid(p.pid))
            if "deepspeed.launcher.launch" in p.cmdline():
                found += p.children()
        return sorted(found, key=lambda p: p.cmdline())  # --local_rank=0 first

    def wait_for_step(self, step: int, ranks: int) -> None:
        """Until every rank trains (metrics.jsonl shows `step`) and each has its loader worker."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            records = read_metrics(self.run_dir / "metrics.jsonl", "train") if (self.run_dir / "metrics.jsonl").is_file() \
                else []
            if records and records[-1]["step"] >= step:
                found = self.ranks()
                assert len(found) == ranks and all(r.children() for r in found), self.output()
                return
            time.sleep(0.2)
        raise AssertionError(f"no step {step} within {TIMEOUT_S} s\n{self.output()}")

    def wait(self) -> int:
        return self.proc.wait(timeout=TIMEOUT_S)

    def assert_nothing_left(self) -> None:
        """No process of the run's sessions is left (a loader worker may take a few seconds)."""
        deadline = time.monotonic() + 60
        while True:
            left = []
            for p in psutil.process_iter(["cmdline"]):
                try:
                    if os.getsid(p.pid) in self.sessions:
                        left.append(p)
                except OSError:
                    continue
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for p in left:
            p.kill()
        assert not left, [p.info["cmdline"] for p in left]

    def assert_stop_checkpoint(self, world_size: int) -> None:
        """A checkpoint of every rank, written by the stop, and the run's exit record says 75."""
        events = read_metrics(self.run_dir / "metrics.jsonl", "event")
        assert [e["exit_code"] for e in events if e["event"] == "exit"] == [EXIT_REQUEUE], self.output()
        saved = [e for e in events if e["event"] == "checkpoint"]
        assert len(saved) == 1 and saved[0]["step"] >= 2, self.output()
        checkpoint = self.run_dir / "checkpoints" / f"step_{saved[0]['step']:08d}"
        meta = json.loads((checkpoint / "meta.json").read_text())
        assert meta["world_size"] == world_size
        assert all((checkpoint / f"rank_state_{r}.pt").is_file() for r in range(world_size))


def _deepspeed(tmp_path: Path, shards: Path, nproc: int) -> Run:
    run_dir = tmp_path / "run"
    command = [str(DEEPSPEED), "--num_gpus", str(nproc), "--master_port", str(_free_port()), *TRAINER,
               f"output_dir={run_dir}", f"data.dir={shards}"]
    return Run(command, run_dir, cwd=tmp_path)


def test_sigterm_to_the_deepspeed_command(shards, tmp_path):
    """`deepspeed` itself dies of SIGTERM at once (143: DeepSpeed's runner has no handler on one node);
    the rank notices that its launcher is gone, checkpoints and exits, and so does the launch process."""
    run = _deepspeed(tmp_path, shards, 1)
    run.wait_for_step(2, ranks=1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == -signal.SIGTERM
    run.assert_nothing_left()
    run.assert_stop_checkpoint(world_size=1)
    assert f"the launcher (deepspeed, pid {run.proc.pid}) has ended" in run.output()


def test_sigkill_to_the_deepspeed_command(shards, tmp_path):
    run = _deepspeed(tmp_path, shards, 1)
    run.wait_for_step(2, ranks=1)
    run.proc.kill()
    run.wait()
    run.assert_nothing_left()
    run.assert_stop_checkpoint(world_size=1)


def test_sigterm_to_the_process_group_of_the_deepspeed_command(shards, tmp_path):
    """What `timeout` or a terminal's Ctrl-C does: every process of the group gets the signal, the
    DataLoader workers included, which must not die before their rank has checkpointed."""
    run = _deepspeed(tmp_path, shards, 1)
    run.wait_for_step(2, ranks=1)
    os.killpg(run.proc.pid, signal.SIGTERM)
    run.wait()
    run.assert_nothing_left()
    run.assert_stop_checkpoint(world_size=1)
    assert "killed by signal" not in run.output()


def test_sigterm_to_one_rank_of_two(shards, tmp_path):
    """One rank signalled: both checkpoint the same step, and `deepspeed` reports 75."""
    run = _deepspeed(tmp_path, shards, 2)
    run.wait_for_step(2, ranks=2)
    run.ranks()[1].send_signal(signal.SIGTERM)
    assert run.wait() == EXIT_REQUEUE, run.output()
    run.assert_nothing_left()
    run.assert_stop_checkpoint(world_size=2)


def test_sigterm_to_the_process_group_of_training_launch(shards, tmp_path):
    """Through `python -m training.launch` the command itself reports 75, with a port it picked."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "training.launch", "--num_gpus", "2", *TRAINER, f"output_dir={run_dir}",
               f"data.dir={shards}"]
    run = Run(command, run_dir, cwd=tmp_path)
    run.wait_for_step(2, ranks=2)
    os.killpg(run.proc.pid, signal.SIGTERM)
    assert run.wait() == EXIT_REQUEUE, run.output()
    run.assert_nothing_left()
    run.assert_stop_checkpoint(world_size=2)
    assert "--master_port=" in run.output()


def test_the_forwarder_decides_local_or_remote_once(tmp_path):
    """Once the runner's child is seen to be DeepSpeed's local launch process, the run stays local:
    a later child that is not a launcher (or one whose command line reads empty as it exits) must not
    make the forwarder send the signals to the runner itself."""
    from training.launch import SignalForwarder

    fake = tmp_path / "deepspeed" / "launcher"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "launch.py").write_text("import time\ntime.sleep(1)\n")
    runner = ("import subprocess, sys\n"
              "subprocess.run([sys.executable, '-m', 'deepspeed.launcher.launch'])\n"
              "subprocess.run(['sleep', '30'])\n")
    forwarder = SignalForwarder()
    try:
        forwarder.child = subprocess.Popen([sys.executable, "-c", runner], env=dict(_env(), PYTHONPATH=str(tmp_path)))
        deadline = time.monotonic() + 30
        while forwarder.remote is None and time.monotonic() < deadline:
            assert not forwarder._remote_launch()
            time.sleep(0.05)
        assert forwarder.remote is False
        while not any(c.name() == "sleep" for c in psutil.Process(forwarder.child.pid).children()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not forwarder._remote_launch()
    finally:
        for child in psutil.Process(forwarder.child.pid).children(recursive=True):
            child.kill()
        forwarder.child.kill()
        forwarder.child.wait()
        for sig, handler in forwarder._previous.items():
            signal.signal(sig, handler)
