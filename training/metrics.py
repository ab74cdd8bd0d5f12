"""One place where figures leave the training job: console line, metrics.jsonl and W&B.

Only rank 0 writes. Every record is one JSON object per line in the run directory's metrics.jsonl
with a `kind` ("train", "eval", "event") and a `step`. Training records carry at least `step`,
`loss`, `lr`, `grad_l2`, `tokens_per_s`; evaluation records `step`, `eval_loss`,
`eval_accuracy`; event records an `event`: start, resume, first_step (`seconds` to launch this
process's first step, torch.compile included, and `compile_cache`: what AOTAutograd's cache did),
checkpoint, nonfinite_stop, exit. W&B runs offline unless `logging.wandb=online`, so no account is needed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from training.run_dir import RunDir

logger = logging.getLogger("t5ds")


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Rank 0 logs INFO to stderr; other ranks only warnings and errors."""
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0.0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def train_line(record: dict, total_steps: int) -> str:
    """nanoT5's console line, plus tokens/s and MFU."""
    parts = [f"[train] Step {record['step']} out of {total_steps}"]
    names = [("loss", "Loss"), ("grad_l2", "Grad_l2"), ("weights_l2", "Weights_l2"), ("lr", "Lr"),
             ("seconds_per_step", "Seconds_per_step"), ("tokens_per_s", "Tokens_per_s"), ("mfu", "MFU")]
    for key, label in names:
        if record.get(key) is not None:
            parts.append(f"{label} --> {_fmt(record[key])}")
    return " | ".join(parts)


class MetricsLogger:
    """Appends records to metrics.jsonl (rank 0) and mirrors them to W&B when enabled."""

    def __init__(self, run_dir: RunDir | str | Path, *, rank: int, wandb_mode: str = "disabled",
                 wandb_project: str = "t5ds", run_name: str | None = None, config: dict | None = None):
        run_dir = RunDir(run_dir)
        self.rank = rank
        self.path = run_dir.metrics_file
        self._wandb = None
        if rank != 0:
            return
        run_dir.create()
        if wandb_mode != "disabled":
            self._wandb = self._start_wandb(run_dir.path, wandb_mode, wandb_project, run_name, config)

    @staticmethod
    def _start_wandb(output_dir, mode, project, run_name, config):
        try:
            import wandb  # here: only runs that log to W&B need it, and it is slow to import
        except ImportError:
            logger.warning("wandb is not installed; logging to metrics.jsonl only")
            return None
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            return wandb.init(project=project, name=run_name, mode=mode, dir=str(output_dir), config=config,
                              resume="allow")
        except Exception as err:  # a W&B outage must never stop training
            logger.warning("W&B could not start (%s); logging to metrics.jsonl only", err)
            return None

    def log(self, kind: str, record: dict) -> None:
        if self.rank != 0:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        line = json.dumps({"kind": kind, "time": round(time.time(), 3), **clean})
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if self._wandb is not None:
            step = record.get("step")
            self._wandb.log({f"{kind}/{k}": v for k, v in record.items() if isinstance(v, (int, float))},
                            step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict]:
    """All records of metrics.jsonl (of one kind if given); a torn last line is ignored."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or record.get("kind") == kind:
                records.append(record)
    return records
