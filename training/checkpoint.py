"""Crash-safe DeepSpeed checkpoints with per-rank state, rotation and validated resume, and the
model weights of a checkpoint (`checkpoint_state_dict`, `load_run_model`).

Layout (one directory per checkpoint, DeepSpeed's own files directly inside it; the run directory's
`checkpoints/` is training/run_dir.py's):

    <output_dir>/checkpoints/
        step_00005000/
            mp_rank_00_model_states.pt                      # DeepSpeed: module (+ optimizer at ZeRO 0)
            zero_pp_rank_{r}_mp_rank_00_optim_states.pt     # DeepSpeed, ZeRO >= 1: rank r's optimizer shard
            rank_state_{r}.pt                               # ours: rank r's data cursor, RNG states, ...
            meta.json                                       # ours, written last: step, world size, files + sizes
        step_00010000/ ...
        .tmp-step_00015000/                                 # a save in progress (or interrupted)
        latest                                              # "step_00010000", written after the rename
        zero_to_fp32.py                                     # DeepSpeed's recovery script (ZeRO >= 1)

A save writes everything into `.tmp-step_N/` (DeepSpeed with save_dir=checkpoints/, tag=".tmp-step_N"),
then rank 0 writes meta.json, renames the directory to `step_N` (atomic on POSIX) and only then
rewrites `latest` (tmp file + rename). DeepSpeed names its files relative to the tag directory and
stores no path inside them, so after the rename `engine.load_checkpoint(checkpoints/, tag="step_N")`
reads them. A kill at any moment leaves either a complete step_N or a `.tmp-` directory that resume
ignores. Resume scans step_* directories newest first and takes the first whose meta.json lists files
that are all present with the recorded sizes; `latest` is only cross-checked, never trusted alone.
Broken or partial checkpoints are reported and kept on disk (for inspection), never deleted.

The output_dir must be on a filesystem that every rank sees (as DeepSpeed itself assumes).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from training.model import T5ForConditionalGeneration
from training.run_dir import RunDir, step_dirname

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"
META_NAME = "meta.json"
TMP_PREFIX = ".tmp-"
META_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def rank_state_name(rank: int) -> str:
    return f"rank_state_{rank}.pt"


def _default_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _fsync_path(path: Path) -> None:
    """Flush a file or directory to stable storage (best effort: some filesystems refuse on dirs)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file, an fsync and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def checkpoint_files(directory: Path) -> dict[str, int]:
    """Relative path -> size in bytes of every regular file under `directory` (meta.json excluded)."""
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != META_NAME:
            files[p.relative_to(directory).as_posix()] = p.stat().st_size
    return files


def _engine_zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


class CheckpointManager:
    """Saves, rotates, validates and loads the checkpoints of a run directory (its `checkpoints/`).

    Every rank constructs one and calls `save` / `load` (DeepSpeed needs all ranks); rank 0 alone
    does the renames, `latest` and the deletions. `barrier` synchronises the ranks (the default uses
    torch.distributed when it is initialised, else does nothing), which lets tests drive ranks by hand.
    """

    def __init__(
        self,
        run_dir: RunDir | str | Path,
        *,
        keep_last: int,
        rank: int,
        world_size: int,
        barrier: Callable[[], None] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1 (checkpoint.keep_last)")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        self.root = RunDir(run_dir).checkpoints
        self.keep_last = keep_last
        self.rank = rank
        self.world_size = world_size
        self.barrier = barrier if barrier is not None else _default_barrier

    # -------------------------------------------------------------------------------------------
    # Save
    # -------------------------------------------------------------------------------------------

    def save(self, engine: Any, step: int, rank_state: dict) -> Path:
        """Write a complete checkpoint for `step` (every rank calls this) and return its directory."""
        name = step_dirname(step)
        tmp_name = TMP_PREFIX + name
        tmp, final = self.root / tmp_name, self.root / name
        t0 = time.time()

        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # an interrupted save of this same step: nothing in it is trustworthy
                logger.warning("removing leftover partial checkpoint %s before saving step %d", tmp, step)
                shutil.rmtree(tmp)
        self.barrier()

        # DeepSpeed puts its files in save_dir/tag = tmp; all ranks must call it (ZeRO shards, barriers).
        # An (empty) universal_checkpoint_info lets DeepSpeed's ds_to_universal convert the checkpoint
        # for another ZeRO stage or world size (training/checkpoint_universal.py).
        engine.save_checkpoint(str(self.root), tag=tmp_name, save_latest=False,
                               client_state={"universal_checkpoint_info": {}})
        tmp.mkdir(parents=True, exist_ok=True)
        rank_file = tmp / rank_state_name(self.rank)
        torch.save(rank_state, rank_file)
        _fsync_path(rank_file)
        self.barrier()  # every rank's files are on disk

        if self.rank == 0:
            files = checkpoint_files(tmp)
            for rel in files:
                _fsync_path(tmp / rel)
            missing = [rank_state_name(r) for r in range(self.world_size) if rank_state_name(r) not in files]
            if missing:
                raise RuntimeError(
                    f"checkpoint {tmp}: {missing} are not visible from rank 0 after the barrier; the output "
                    "directory must be on a filesystem shared by all ranks"
                )
            meta = {
                "version": META_VERSION,
                "step": step,
                "world_size": self.world_size,
                "zero_stage": _engine_zero_stage(engine),
                "time": time.time(),
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": files,
            }
            write_atomic(tmp / META_NAME, json.dumps(meta, indent=1) + "\n")

            replaced = None
            if final.exists():  # saving the same step again (e.g. right after a resume)
                replaced = self.root / f".old-{name}-{int(time.time())}"
                os.replace(final, replaced)
            os.replace(tmp, final)
            _fsync_path(self.root)
            if replaced is not None:
                shutil.rmtree(replaced, ignore_errors=True)
            # `latest` goes LAST: a crash before this line leaves it naming the previous checkpoint,
            # and find_resumable still finds the new one by scanning.
            write_atomic(self.root / LATEST_NAME, name + "\n")
            self._rotate(keep=final)
            size_gb = sum(files.values()) / 1e9
            logger.info("saved checkpoint %s (%.2f GB, %.1f s)", final, size_gb, time.time() - t0)
        self.barrier()
        return final

    def _rotate(self, keep: Path) -> None:
        """Delete the oldest COMPLETE checkpoints beyond keep_last; broken ones are left alone."""
        complete = [p for p in self._step_dirs() if not self.problems(p)]
        complete.sort(key=self._step_of)
        excess = complete[: max(0, len(complete) - self.keep_last)]
        for path in excess:
            if path == keep:
                continue
            logger.info("deleting old checkpoint %s (checkpoint.keep_last=%d)", path, self.keep_last)
            trash = path.with_name(f".del-{path.name}")
            os.replace(path, trash)  # a half-deleted dir must never look like a checkpoint
            shutil.rmtree(trash, ignore_errors=True)

    # -------------------------------------------------------------------------------------------
    # Find and validate
    # -------------------------------------------------------------------------------------------

    @staticmethod
    def _step_of(path: Path) -> int:
        match = _STEP_DIR.match(path.name)
        return int(match.group(1)) if match else -1

    def _step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]

    def problems(self, path: Path) -> list[str]:
        """What is wrong with the checkpoint at `path` (empty list = complete and loadable)."""
        path = Path(path)
        if not path.is_dir():
            return [f"{path} is not a directory"]
        meta_path = path / META_NAME
        if not meta_path.is_file():
            return [f"{META_NAME} is missing (the save did not finish)"]
        try:
            meta = json.loads(meta_path.read_text())
            files = meta["files"]
            step, world_size = int(meta["step"]), int(meta["world_size"])
        except (ValueError, KeyError, TypeError) as e:
            return [f"{META_NAME} is unreadable ({type(e).__name__}: {e})"]
        found = []
        if step != self._step_of(path):
            found.append(f"{META_NAME} says step {step} but the directory is {path.name}")
        for rel, size in files.items():
            p = path / rel
            if not p.is_file():
                found.append(f"{rel} is missing")
            elif p.stat().st_size != size:
                found.append(f"{rel} has {p.stat().st_size} bytes, {META_NAME} recorded {size}")
        for r in range(world_size):
            if rank_state_name(r) not in files:
                found.append(f"{META_NAME} lists no {rank_state_name(r)} for world size {world_size}")
        return found

    def read_meta(self, path: Path) -> dict[str, Any]:
        return json.loads((Path(path) / META_NAME).read_text())

    @staticmethod
    def is_universal(meta: dict[str, Any]) -> bool:
        """A checkpoint's meta (`read_meta`) says it was written by training/checkpoint_universal.py:
        loadable on any ZeRO stage and world size."""
        return bool(meta.get("universal"))

    def find_resumable(self) -> Path | None:
        """Newest complete checkpoint, or None. Broken/partial ones are logged and skipped, not deleted.

        Call it on every rank: when torch.distributed is initialised with this world size, rank 0's
        answer is broadcast so that all ranks load the same checkpoint even if their views of a
        shared filesystem differ for a moment. (With NCCL, set the CUDA device first.)
        """
        chosen = self._scan() if self.rank == 0 or not self._distributed() else None
        if self._distributed():
            box = [str(chosen) if chosen is not None else None]
            torch.distributed.broadcast_object_list(box, src=0)
            chosen = Path(box[0]) if box[0] is not None else None
        return chosen

    def _distributed(self) -> bool:
        return (
            self.world_size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() == self.world_size
        )

    def _scan(self) -> Path | None:
        log = logger.warning
        if not self.root.is_dir():
            return None
        for p in sorted(self.root.iterdir()):
            if p.is_dir() and p.name.startswith(TMP_PREFIX):
                log("ignoring partial checkpoint %s (an interrupted save); delete it to free space", p)

        latest_name = None
        latest_file = self.root / LATEST_NAME
        if latest_file.is_file():
            latest_name = latest_file.read_text().strip()

        chosen = None
        for path in sorted(self._step_dirs(), key=self._step_of, reverse=True):
            found = self.problems(path)
            if not found:
                chosen = path
                break
            log("skipping incomplete checkpoint %s: %s", path, "; ".join(found))

        if latest_name is not None and (chosen is None or latest_name != chosen.name):
            target = self.root / latest_name
            if not target.is_dir():
                why = "does not exist"
            elif self.problems(target):
                why = "is incomplete"
            else:
                why = "is older (a save finished its rename but not `latest`)"
            log(
                "`latest` names %s, which %s; resuming from %s instead",
                latest_name,
                why,
                chosen.name if chosen else "scratch",
            )
        return chosen

    # -------------------------------------------------------------------------------------------
    # Load
    # -------------------------------------------------------------------------------------------

    def load(self, engine: Any, path: Path) -> tuple[int, dict]:
        """Restore DeepSpeed state (module, optimizer, lr scheduler) from `path`; return (step, rank_state).

        When the checkpoint was written with a different world size and this rank has no file of its
        own, rank 0's state is returned (the data cursor is global, so that is right for it; per-rank
        RNG streams then restart from rank 0's). ZeRO >= 1 checkpoints change world size only once
        converted to DeepSpeed's universal format (training/checkpoint_universal.py).
        """
        path = Path(path)
        found = self.problems(path)
        if found:
            raise RuntimeError(f"cannot load checkpoint {path}: {'; '.join(found)}")
        meta = self.read_meta(path)
        saved_world, saved_stage = int(meta["world_size"]), int(meta.get("zero_stage", 0))
        if saved_world != self.world_size and saved_stage >= 1 and not self.is_universal(meta):
            raise RuntimeError(
                f"checkpoint {path} was written by {saved_world} ranks with ZeRO stage {saved_stage}, and "
                f"this run has {self.world_size}: DeepSpeed cannot re-partition ZeRO optimizer state "
                "directly. Resume with the same number of ranks, or convert it first: "
                "python -m training.checkpoint_universal RUN_DIR NEW_RUN_DIR"
            )

        load_path, _ = engine.load_checkpoint(
            str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {path}")

        own = path / rank_state_name(self.rank)
        if saved_world == self.world_size:
            rank_file = own
        elif own.is_file() and self.rank < saved_world:
            rank_file = own
            logger.warning(
                "checkpoint %s was written by %d ranks, this run has %d: rank %d resumes from its own "
                "rank state",
                path,
                saved_world,
                self.world_size,
                self.rank,
            )
        else:
            rank_file = path / rank_state_name(0)
            logger.warning(
                "checkpoint %s was written by %d ranks, this run has %d: rank %d has no state file and "
                "takes rank 0's (the data cursor is global, so it is correct; RNG streams restart from "
                "rank 0's)",
                path,
                saved_world,
                self.world_size,
                self.rank,
            )
        # Our own file (data cursor, RNG states incl. numpy/python tuples): trusted, so weights_only=False.
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        step = int(meta["step"])
        logger.info("resumed from %s at step %d", path, step)
        return step, rank_state


# -----------------------------------------------------------------------------------------------
# The model weights of a checkpoint
# -----------------------------------------------------------------------------------------------


def newest_checkpoint(run_dir: RunDir | str | Path) -> Path | None:
    """The newest complete checkpoint of a run, as one process sees it (export, conversion, starting
    another run from this one); None if there is none."""
    manager = CheckpointManager(run_dir, keep_last=1, rank=0, world_size=1, barrier=lambda: None)
    return manager.find_resumable()


def checkpoint_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """fp32 model weights of one checkpoint directory (checkpoints/step_N), whatever the ZeRO stage.

    ZeRO 0-2 store the full module (fp32 master weights: the engine keeps fp32 parameters and
    computes in bf16 through autocast); ZeRO 3 stores only partitions, which DeepSpeed's
    zero_to_fp32 reassembles.
    """
    model_file = checkpoint / "mp_rank_00_model_states.pt"  # ZeRO 0-2
    zero3_file = checkpoint / "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO 3
    if not model_file.is_file() and not zero3_file.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a DeepSpeed checkpoint directory (no {model_file.name} "
                                f"or {zero3_file.name})")
    states = torch.load(model_file if model_file.is_file() else zero3_file, map_location="cpu", weights_only=False)
    module = states.get("module")
    zero_stage = int(states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    if zero_stage == 3 or not module:
        # deepspeed imports here: it takes seconds, and only ZeRO 3 checkpoints need it.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    return {k: v.float() for k, v in module.items()}


def load_run_model(run_dir: RunDir | str | Path, checkpoint: str | Path | None = None):
    """(the model of a run at its newest complete checkpoint, or at `checkpoint`, on the CPU in fp32 and
    in eval mode; the checkpoint directory)."""
    run_dir = RunDir(run_dir)
    if checkpoint is None:
        checkpoint = newest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"no complete checkpoint under {run_dir.checkpoints}: train longer "
                                    "(checkpoint.every_steps) or pass --checkpoint")
    model = T5ForConditionalGeneration(run_dir.read_model_config())
    state = checkpoint_state_dict(Path(checkpoint))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{checkpoint} does not match the run's model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    logger.info("loaded %s", checkpoint)
    return model.eval(), Path(checkpoint)
