"""One place where figures leave the training job: console line, metrics.jsonl and W&B.

Only rank 0 writes. Every record is one JSON object per line in the run directory's metrics.jsonl
with a `kind` ("train", "eval", "event") and a `step`. Training records carry at least `step`,
`objective` (`data.objective`), `loss`, `lr`, `grad_l2`, `tokens_per_s` (real input + target
tokens, padding excluded), `mfu` (FLOPs of the real lengths, training/model/flops.py) and `eta_s`
(the estimated seconds left, see `RemainingTime`); evaluation records `step`, `objective`,
`eval_loss`, `eval_accuracy` (T5 span corruption's) and, for ul2 / prefix_lm, `eval_loss/NAME`
and `eval_accuracy/NAME` per denoiser; event records an `event`: start, resume, first_step
(`seconds` to launch this process's first step, torch.compile included, and `compile_cache`: what
AOTAutograd's cache did), checkpoint, nonfinite_stop, exit. W&B runs offline unless `logging.wandb=online`, so no account is needed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from training.run_dir import RunDir

logger = logging.getLogger("t5ds")
T = TypeVar("T")

# Warnings of the libraries that say nothing a user of t5ds can act on, filtered one by one by their
# exact text (every other warning still shows):
# - torch 2.13 deprecates the collectives DeepSpeed's ZeRO 1-3 call (all_gather_into_tensor,
#   reduce_scatter_tensor), once per process and call site;
# - DeepSpeed calls every optimizer it does not ship "untested" under ZeRO; t5ds's optimizers are
#   tested with ZeRO 1-3 (tests/test_optim_zero.py) and the DeepSpeed configs allow them.
_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
_UNTESTED_OPTIMIZER = "You are using ZeRO with an untested optimizer"


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


def quiet_library_noise() -> None:
    """Filter the library messages above (idempotent; call in every process of a run)."""
    warnings.filterwarnings("ignore", message=_DEPRECATED_COLLECTIVES, category=FutureWarning)
    deepspeed_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropMessages) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_DropMessages(_UNTESTED_OPTIMIZER))


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Rank 0 logs INFO to stderr; other ranks only warnings and errors. The libraries' chatter stays
    at warnings (rouge-score's absl logs "Using default tokenizer." at INFO), minus `quiet_library_noise`."""
    logging.basicConfig(
        level=level if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "urllib3", "filelock", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_library_noise()


def _scalar(value: Any) -> Any:
    """A one-element tensor or numpy number as a Python number (what DeepSpeed's ZeRO optimizers return
    for the gradient norm, say); anything else as it is."""
    if type(value).__module__.split(".")[0] in ("torch", "numpy"):
        try:
            return value.item()
        except (AttributeError, ValueError, RuntimeError):  # more than one element
            return value
    return value


def _fmt(value: Any) -> str:
    value = _scalar(value)
    if isinstance(value, float):
        if value != 0.0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def format_duration(seconds: float) -> str:
    """H:MM:SS, with days in front past 24 hours (1d 02:03:04)."""
    total = int(round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    clock = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}" if days else clock


def train_line(record: dict, total_steps: int) -> str:
    """nanoT5's console line, plus tokens/s, MFU and the estimated time left."""
    parts = [f"[train] Step {record['step']} out of {total_steps}"]
    if record.get("objective"):
        parts.append(f"Objective --> {record['objective']}")
    names = [("loss", "Loss"), ("grad_l2", "Grad_l2"), ("weights_l2", "Weights_l2"), ("lr", "Lr"),
             ("seconds_per_step", "Seconds_per_step"), ("tokens_per_s", "Tokens_per_s"), ("mfu", "MFU")]
    for key, label in names:
        if record.get(key) is not None:
            parts.append(f"{label} --> {_fmt(record[key])}")
    if record.get("eta_s") is not None:
        parts.append(f"ETA --> {format_duration(record['eta_s'])}")
    return " | ".join(parts)


class RemainingTime:
    """The wall-clock time left in a run, from the average time per step since `start`.

    Start it once the first step of the process is done, so that start-up and torch.compile stay out
    of the average; periodic evaluations and checkpoints stay in, as they recur until the end."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start: tuple[float, int] | None = None

    def start(self, step: int) -> None:
        self._start = (self._clock(), step)

    def seconds(self, step: int, total_steps: int) -> float | None:
        """Seconds until `total_steps`, or None before two points are known."""
        if self._start is None or step <= self._start[1]:
            return None
        started_at, first = self._start
        per_step = (self._clock() - started_at) / (step - first)
        return max(0, total_steps - step) * per_step


def progress(items: Iterable[T], *, total: int, desc: str, rank: int, every_s: float = 60.0,
             clock: Callable[[], float] = time.monotonic, terminal: bool | None = None) -> Iterator[T]:
    """`items`, with their progress shown on rank 0: a tqdm bar where stderr is a terminal, else a log
    line (done/total and the estimated time left) at most every `every_s` seconds, so that a short loop
    logs nothing and a long one a line a minute."""
    if rank != 0:
        yield from items
        return
    if sys.stderr.isatty() if terminal is None else terminal:
        from tqdm import tqdm  # here: only a terminal shows a bar

        yield from tqdm(items, total=total, desc=desc, leave=False, dynamic_ncols=True)
        return
    started = last = clock()
    for done, item in enumerate(items, 1):
        yield item
        now = clock()
        if now - last >= every_s and done < total:
            last = now
            left = (now - started) / done * (total - done)
            logger.info("%s: %d/%d, ETA %s", desc, done, total, format_duration(left))


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
        record = {k: _scalar(v) for k, v in record.items()}
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


def compile_cache_text(outcomes: dict[str, int]) -> str:
    """"hit 1, miss 2": what the compile cache did, as a `first_step` event's "compile_cache" holds it."""
    return ", ".join(f"{k} {n}" for k, n in outcomes.items())


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
