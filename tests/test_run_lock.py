"""One trainer per run directory (training/run_dir.py's trainer lock): a second start refuses at once
naming the holder, a lock left by a killed trainer does not block the next start."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from training.run_dir import RunDir, RunDirInUse

REPO = Path(__file__).resolve().parents[1]

HOLD = """
import sys, time
from training.run_dir import RunDir
RunDir(sys.argv[1]).lock_for_training()
print("locked", flush=True)
time.sleep(600)
"""


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "T5DS_DEBUG"):
        env.pop(name, None)
    return env


@pytest.fixture
def holder(tmp_path):
    """Another process holding the trainer lock of tmp_path/run."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_a_second_trainer_is_refused_with_the_holders_host_and_pid(tmp_path, holder):
    run = RunDir(tmp_path / "run")
    before = _snapshot(run.path)
    with pytest.raises(RunDirInUse) as refused:
        run.lock_for_training()
    message = str(refused.value)
    assert str(run.path) in message and f"pid {holder.pid}" in message and socket.gethostname() in message
    assert _snapshot(run.path) == before  # nothing written
    assert json.loads(before["trainer.lock"]) | {"since": None} == {"host": socket.gethostname(),
                                                                     "pid": holder.pid, "since": None}


def test_a_lock_left_by_a_killed_trainer_does_not_block(tmp_path, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    run = RunDir(tmp_path / "run")
    assert run.lock_file.is_file()  # the stale file stays
    run.lock_for_training()
    try:
        assert json.loads(run.lock_file.read_text())["pid"] == os.getpid()
    finally:
        run.unlock()


def test_pretrain_on_a_directory_in_use_exits_2_with_one_line(tmp_path, holder):
    run = tmp_path / "run"
    before = _snapshot(run)
    proc = subprocess.run([sys.executable, "training/pretrain.py", "--config", "training/configs/tiny_demo.yaml",
                           f"output_dir={run}", "data.dir=/nonexistent"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    expected = RunDirInUse(run, json.loads(before["trainer.lock"]))  # the holder's host, pid and start
    assert errors == [f"error: {expected}"] and f"pid {holder.pid}" in errors[0]
    assert "Traceback" not in proc.stderr
    assert _snapshot(run) == before


@pytest.mark.slow
def test_two_ranks_on_a_directory_in_use_print_one_line(tmp_path, holder):
    """Rank 0 meets the lock, rank 1 does not: both stop at the end of set-up, one line is printed."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    if not deepspeed.is_file():
        pytest.skip(f"no `deepspeed` command next to {sys.executable}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([str(deepspeed), "--num_gpus", "2", "--master_port", str(port), "training/pretrain.py",
                           "--config", "training/configs/tiny_demo.yaml", f"output_dir={tmp_path / 'run'}",
                           "data.dir=/nonexistent"], cwd=REPO, env={**_env(), "DS_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is in use by another trainer" in errors[0], output[-3000:]
    assert "Traceback" not in output
