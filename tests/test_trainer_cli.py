"""The command line of training/pretrain.py and training/finetune.py: `--help` and a bad run config
are answered before torch and DeepSpeed are imported, from any working directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from training.trainer_args import parse_trainer_args

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINTS = ["training/pretrain.py", "training/finetune.py"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "T5DS_DEBUG", "RANK")}
    return subprocess.run([sys.executable, "-X", "importtime", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _imported(proc: subprocess.CompletedProcess) -> set[str]:
    """Top-level packages the process imported (from -X importtime's report on stderr)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_is_answered_without_importing_torch_from_any_directory(script, tmp_path):
    proc = _run([str(REPO / script), "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ") and "exit codes: 0 done; 75 stopped" in proc.stdout
    imported = _imported(proc)
    assert "training" in imported and not imported & {"torch", "deepspeed", "numpy"}
    # the usage examples keep their line continuations instead of running into one line
    continued = [line for line in proc.stdout.splitlines() if line.rstrip().endswith(" \\")]
    assert continued and all("--deepspeed_config" not in line for line in continued)


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_a_bad_override_is_one_line_before_torch_is_imported(script, tmp_path):
    proc = _run([str(REPO / script), "optim.base_lrr=1e-2"], cwd=tmp_path)  # default config, found from tmp_path
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "unknown key optim.base_lrr" in errors[0]
    assert not _imported(proc) & {"torch", "deepspeed"}


def test_overrides_may_come_between_the_options():
    args = parse_trainer_args(["--config", "a.yaml", "seed=1", "--deepspeed_config", "ds.json", "optim.base_lr=1"],
                              doc="", default_config="d.yaml")
    assert (args.config, args.deepspeed_config, args.overrides) == ("a.yaml", "ds.json", ["seed=1", "optim.base_lr=1"])
