"""The run directory: what a pre-training or fine-tuning run writes, and where.

    <output_dir>/
        config.yaml         the resolved run config (defaults <- YAML <- overrides); load_run_config reads it
        ds_config.json      the resolved DeepSpeed config the engine started with
        model_config.json   the model's exact T5Config; its presence marks one of our runs
        metrics.jsonl       training, evaluation and event records (training/metrics.py)
        checkpoints/        step_NNNNNNNN/ checkpoints and `latest` (training/checkpoint.py)
        sni_eval/           fine-tuning only: step_NNNNNNNN/ with each SNI evaluation's predictions
                            and metrics (training/sni/evaluate.py)
        eval/               text-to-text fine-tuning: <split>/step_NNNNNNNN/ with each evaluation's
                            predictions and metrics (training/text2text/evaluate.py)
        wandb/              Weights & Biases' offline files, when logging.wandb is not disabled
        trainer.lock        held (a POSIX lock) by the trainer using the directory; host and pid inside

`RunDir` is the one place that names these files: pretrain.py and finetune.py write a run through
it, and export.py, checkpoint.py, checkpoint_universal.py, evaluate_sni.py, metrics.py and
plot_metrics.py find what they read through it. A run resumes by being started again on the same
directory.

One trainer at a time: rank 0 of a run takes `trainer.lock` (`RunDir.lock_for_training`) before it
writes anything, and holds it until the process ends; a second trainer on the directory stops at
once with the holder's host and pid. The lock is a POSIX record lock (fcntl), which the kernel drops
when its process dies however it dies, so a crashed trainer never blocks the next start (the file
stays, naming the last holder). POSIX locks rather than flock because byte-range locks are what
network and cluster filesystems lock across clients (NFS's lock protocol, Lustre with `-o flock`,
CephFS), where flock is at times emulated or kept local to one node. On a filesystem without
locks the run goes on with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from training.cli_errors import ExpectedError
from training.config_loader import dump_yaml

if TYPE_CHECKING:
    from training.model.config import T5Config

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.yaml"
DS_CONFIG_NAME = "ds_config.json"
MODEL_CONFIG_NAME = "model_config.json"
METRICS_NAME = "metrics.jsonl"
CHECKPOINTS_DIRNAME = "checkpoints"
SNI_EVAL_DIRNAME = "sni_eval"
EVAL_DIRNAME = "eval"
LOCK_NAME = "trainer.lock"
COMPILE_CACHE_DIRNAME = "compile_cache"
# errno values of a filesystem that does not do POSIX locks
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

# What a run directory holds that another run of the same model needs (the universal-checkpoint
# conversion copies them into the new run directory).
DEFINITION_NAMES = (CONFIG_NAME, MODEL_CONFIG_NAME)


def step_dirname(step: int) -> str:
    """Directory name of what belongs to optimizer step `step` (a checkpoint, an SNI evaluation):
    step_00005000."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:08d}"


class RunDir:
    """The files of one run directory (the run config's `output_dir`); nothing is created until
    `create` or a write."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunDir) and self.path == other.path

    def __hash__(self) -> int:
        return hash(self.path)

    # -------------------------------------------------------------------------------------------
    # Paths
    # -------------------------------------------------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_NAME

    @property
    def ds_config_file(self) -> Path:
        return self.path / DS_CONFIG_NAME

    @property
    def model_config_file(self) -> Path:
        return self.path / MODEL_CONFIG_NAME

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_NAME

    @property
    def lock_file(self) -> Path:
        return self.path / LOCK_NAME

    @property
    def checkpoints(self) -> Path:
        """The directory holding the run's checkpoints (training/checkpoint.py's layout inside it)."""
        return self.path / CHECKPOINTS_DIRNAME

    @property
    def compile_cache(self) -> Path:
        """torch.compile's cache of the run (`model.compile_cache=run`): every rank and restart reads it."""
        return self.path / COMPILE_CACHE_DIRNAME

    def sni_eval_dir(self, step: int) -> Path:
        """Where the SNI evaluation after optimizer step `step` writes predictions.jsonl and metrics.json."""
        return self.path / SNI_EVAL_DIRNAME / step_dirname(step)

    def eval_dir(self, split: str, step: int) -> Path:
        """Where the text-to-text evaluation of `split` after optimizer step `step` writes its files."""
        return self.path / EVAL_DIRNAME / split / step_dirname(step)

    def is_run(self) -> bool:
        """Whether the directory holds a run of training/pretrain.py or training/finetune.py (they write
        model_config.json before their first step)."""
        return self.model_config_file.is_file()

    # -------------------------------------------------------------------------------------------
    # Writing (rank 0 of a run)
    # -------------------------------------------------------------------------------------------

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def lock_for_training(self) -> None:
        """Create the directory and take its trainer lock for the life of this process (or until
        `unlock`); RunDirInUse when another process holds it. Nothing else is written."""
        if self._lock_fd is not None:
            return
        self.create()
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                raise RunDirInUse(self.path, holder) from None
            if exc.errno in _NO_LOCKS:
                logger.warning("the filesystem of %s does not support file locks (%s): nothing stops a second "
                               "trainer on this directory", self.path, os.strerror(exc.errno))
                return
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                   "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n").encode(), 0)
        os.fsync(fd)
        self._lock_fd = fd

    def unlock(self) -> None:
        """Release the trainer lock (the file stays, naming the last holder)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor drops the process's POSIX lock
            self._lock_fd = None

    def write_config(self, cfg: Any) -> None:
        """The resolved run config (a RunConfig or FinetuneConfig), as YAML that load_run_config reads."""
        dump_yaml(cfg, self.config_file)

    def write_ds_config(self, ds_config: dict[str, Any]) -> None:
        _write_text(self.ds_config_file, json.dumps(ds_config, indent=2))

    def write_model_config(self, model_config: T5Config) -> None:
        _write_text(self.model_config_file, json.dumps(asdict(model_config), indent=2, sort_keys=True))

    def copy_definition_to(self, other: RunDir) -> None:
        """Copy the run config and the model config (those present) into `other`, a new run directory
        that continues this run's model."""
        other.create()
        for name in DEFINITION_NAMES:
            if (self.path / name).is_file():
                shutil.copy2(self.path / name, other.path / name)

    # -------------------------------------------------------------------------------------------
    # Reading
    # -------------------------------------------------------------------------------------------

    def read_config(self) -> dict[str, Any]:
        """The resolved run config as a plain nested dict (pre-training and fine-tuning runs alike)."""
        if not self.config_file.is_file():
            raise FileNotFoundError(f"{self.config_file} not found: {self.path} is not a run directory written by "
                                    "training/pretrain.py or training/finetune.py")
        return yaml.safe_load(self.config_file.read_text())

    def read_model_config(self) -> T5Config:
        """The exact model configuration the run trains."""
        # training.model imports torch and the kernels: here, so that reading a run's config or
        # metrics (plot_metrics, the benchmark scripts) does not wait for them.
        from training.model.config import T5Config

        if not self.is_run():
            raise FileNotFoundError(f"{self.model_config_file} not found: {self.path} is not a run directory "
                                    "written by training/pretrain.py or training/finetune.py")
        return T5Config(**json.loads(self.model_config_file.read_text()))


class RunDirInUse(ExpectedError):
    """Another trainer holds the run directory's lock."""

    def __init__(self, path: Path, holder: dict[str, Any]) -> None:
        host, pid = holder.get("host", "an unknown host"), holder.get("pid", "unknown")
        since = f", since {holder['since']}" if holder.get("since") else ""
        super().__init__(
            f"{path} is in use by another trainer (host {host}, pid {pid}{since}): wait for it to end, stop it "
            f"(kill -TERM {pid} on {host} checkpoints and exits), or set output_dir to another directory")
        self.holder = holder


def _read_holder(fd: int) -> dict[str, Any]:
    """Host, pid and start of the lock's holder (it writes them right after taking the lock: a start
    in that instant waits for them up to a second)."""
    for _ in range(20):
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError):
            holder = {}
        if isinstance(holder, dict) and holder:
            return holder
        time.sleep(0.05)
    return {}


def _write_text(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so that a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
