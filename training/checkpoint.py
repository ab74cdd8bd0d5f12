"""Crash-safe DeepSpeed checkpoints with per-rank state, content checksums, rotation and verified
resume (the model weights of a checkpoint: training/checkpoint_weights.py).

Layout (one directory per checkpoint, DeepSpeed's own files directly inside it; the run directory's
`checkpoints/` is training/run_dir.py's):

    <output_dir>/checkpoints/
        step_00005000/
            mp_rank_00_model_states.pt                      # DeepSpeed: module (+ optimizer at ZeRO 0)
            zero_pp_rank_{r}_mp_rank_00_optim_states.pt     # DeepSpeed, ZeRO >= 1: rank r's optimizer shard
            rank_state_{r}.pt                               # ours: rank r's data cursor, RNG states, ...
            meta.json                                       # ours, written last: step, world size, run
                                                            # config, files with sizes and sha256 checksums
        step_00010000/ ...
        .tmp-step_00015000/                                 # a save in progress (or interrupted)
        step_00020000.damaged/                              # a damaged checkpoint set aside when its step
                                                            # was saved again (kept for inspection)
        latest                                              # "step_00010000", written after the rename
        zero_to_fp32.py                                     # DeepSpeed's recovery script (ZeRO >= 1)

A save writes everything into `.tmp-step_N/` (DeepSpeed with save_dir=checkpoints/, tag=".tmp-step_N";
DeepSpeed stores no path inside its files), the ranks hash the files (training/checkpoint_checksums.py),
rank 0 writes meta.json, renames the directory to `step_N` (atomic on POSIX) and only then rewrites
`latest`. A kill at any moment leaves either a complete step_N or a `.tmp-` directory that resume
ignores; a full disk removes the `.tmp-` directory and raises `CheckpointDiskFullError`.

Resume takes the newest step_* whose files are all present with the recorded sizes and contents (the
ranks share the hashing); `latest` is only cross-checked. Broken and damaged checkpoints are reported
by file and kept on disk, never deleted; when checkpoints exist but none is intact, resuming is
refused rather than restarting from scratch. Rotation never deletes the newest checkpoint written
before the run's latest non-finite (skipped) updates.

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

from training.checkpoint_checksums import (
    META_NAME,
    blocks,
    checksum_record,
    hash_blocks,
    share,
    verify_checkpoint,
)
from training.checkpoint_space import gigabytes, ran_out_of_space, state_bytes
from training.cli_errors import ExpectedError
from training.run_dir import RunDir, step_dirname

logger = logging.getLogger(__name__)

LATEST_NAME = "latest"
TMP_PREFIX = ".tmp-"
META_VERSION = 2  # 2: content checksums, the run config and the skipped-step count
DAMAGED_SUFFIX = ".damaged"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(ExpectedError, RuntimeError):
    """A checkpoint cannot be written or loaded; the message names the file and says what to do."""


class CheckpointDiskFullError(CheckpointError):
    """The device ran out of space (or quota) while a checkpoint was written; the partial checkpoint
    is removed and the earlier ones are untouched."""


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
    """Saves, rotates, verifies and loads the checkpoints of a run directory (its `checkpoints/`).

    Every rank constructs one and calls `save` / `find_resumable` / `load` (DeepSpeed and the
    checksums need all ranks); rank 0 alone does the renames, `latest` and the deletions. `barrier`
    synchronises the ranks (the default uses torch.distributed when it is initialised, else does
    nothing), which lets tests drive ranks by hand; without a process group of `world_size` ranks,
    each process hashes and verifies everything itself. `run_config` (a plain dict) is recorded in
    every checkpoint's meta.json, so that a resume can tell what changed (training/resume_policy.py).
    """

    def __init__(
        self,
        run_dir: RunDir | str | Path,
        *,
        keep_last: int,
        rank: int,
        world_size: int,
        barrier: Callable[[], None] | None = None,
        run_config: dict[str, Any] | None = None,
        threads: int | None = None,
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
        self.run_config = run_config
        self.threads = threads
        self.damaged: dict[str, str] = {}  # checkpoint name -> what is wrong, as found by find_resumable
        self.protected: set[str] = set()  # checkpoint names rotation keeps (fine-tuning's best one)
        self._verified: set[Path] = set()

    # -------------------------------------------------------------------------------------------
    # Collectives (a no-op without a process group of this world size)
    # -------------------------------------------------------------------------------------------

    def _distributed(self) -> bool:
        return (
            self.world_size > 1
            and torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() == self.world_size
        )

    def _leads(self) -> bool:
        """Whether this process decides for all (rank 0, or any process without a process group)."""
        return self.rank == 0 or not self._distributed()

    def _share(self) -> tuple[int, int]:
        """(index, count) of this process's share of the hashing."""
        return (self.rank, self.world_size) if self._distributed() else (0, 1)

    def _from_rank0(self, obj: Any) -> Any:
        if not self._distributed():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def _gathered(self, obj: Any) -> list[Any]:
        if not self._distributed():
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    # -------------------------------------------------------------------------------------------
    # Save
    # -------------------------------------------------------------------------------------------

    def save(self, engine: Any, step: int, rank_state: dict) -> Path:
        """Write a complete checkpoint for `step` (every rank calls this) and return its directory.
        `rank_state["skipped_steps"]` (rank 0's), when present, is recorded for rotation."""
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

        try:
            # DeepSpeed puts its files in save_dir/tag = tmp; all ranks must call it (ZeRO shards, barriers).
            # An (empty) universal_checkpoint_info lets DeepSpeed's ds_to_universal convert the checkpoint
            # for another ZeRO stage or world size (training/checkpoint_universal.py).
            engine.save_checkpoint(str(self.root), tag=tmp_name, save_latest=False,
                                   client_state={"universal_checkpoint_info": {}})
            tmp.mkdir(parents=True, exist_ok=True)
            rank_file = tmp / rank_state_name(self.rank)
            torch.save(rank_state, rank_file)
            _fsync_path(rank_file)
        except (OSError, RuntimeError) as exc:
            self._raise_if_out_of_space(exc, tmp, name, engine)
            raise
        self.barrier()  # every rank's files are on disk

        files = None
        if self.rank == 0:
            files = checkpoint_files(tmp)
            for rel in files:
                _fsync_path(tmp / rel)
            missing = [rank_state_name(r) for r in range(self.world_size) if rank_state_name(r) not in files]
            if missing:
                raise CheckpointError(
                    f"checkpoint {tmp}: {missing} are not visible from rank 0 after the barrier; the output "
                    "directory must be on a filesystem shared by all ranks"
                )
        files = self._from_rank0(files)
        t_hash = time.time()
        digests: dict[tuple[str, int], str] = {}
        for part in self._gathered(hash_blocks(tmp, share(blocks(files), *self._share()), self.threads)):
            digests.update(part)
        t_hash = time.time() - t_hash

        if self.rank == 0:
            unreadable = [f"{n} at byte {o}: {d}" for (n, o), d in digests.items() if d.startswith("error: ")]
            if unreadable:
                raise CheckpointError(f"checkpoint {tmp}: cannot read back {unreadable[0]}")
            meta = {
                "version": META_VERSION,
                "step": step,
                "world_size": self.world_size,
                "zero_stage": _engine_zero_stage(engine),
                "time": time.time(),
                "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "skipped_steps": rank_state.get("skipped_steps"),
                "files": files,
                "checksums": checksum_record(files, digests),
                "run_config": self.run_config,
            }
            try:
                write_atomic(tmp / META_NAME, json.dumps(meta, indent=1) + "\n")
            except OSError as exc:
                self._raise_if_out_of_space(exc, tmp, name, engine)
                raise

            if final.exists():  # saving the same step again: after a resume that skipped it, or a retry
                self._replace_existing(final)
            os.replace(tmp, final)
            _fsync_path(self.root)
            # `latest` goes LAST: a crash before this line leaves it naming the previous checkpoint,
            # and find_resumable still finds the new one by scanning.
            try:
                write_atomic(self.root / LATEST_NAME, name + "\n")
            except OSError as exc:  # the checkpoint is complete; resume finds it by scanning
                logger.warning("%s is saved but `latest` could not be updated (%s)", final, exc)
            self._rotate(keep=final)
            logger.info("saved checkpoint %s (%s, %.1f s, of which %.1f s checksums)", final,
                        gigabytes(sum(files.values())), time.time() - t0, t_hash)
        self.damaged.pop(name, None)
        self._verified.add(final)
        self.barrier()
        return final

    def _replace_existing(self, final: Path) -> None:
        """Make room for a new `final`: an intact earlier save of the step is deleted, a damaged one
        (as find_resumable found it, or incomplete) is kept beside it for inspection."""
        why = self.damaged.get(final.name) or "; ".join(self.problems(final))
        if why:
            aside = final.with_name(final.name + DAMAGED_SUFFIX)
            n = 1
            while aside.exists():
                n += 1
                aside = final.with_name(f"{final.name}{DAMAGED_SUFFIX}{n}")
            os.replace(final, aside)
            logger.warning("kept the damaged %s as %s (%s); delete it once it is no longer needed", final.name,
                           aside.name, why)
            return
        replaced = self.root / f".old-{final.name}-{int(time.time())}"
        os.replace(final, replaced)
        shutil.rmtree(replaced, ignore_errors=True)

    def _raise_if_out_of_space(self, exc: BaseException, tmp: Path, name: str, engine: Any) -> None:
        """Remove the partial checkpoint and raise CheckpointDiskFullError if `exc` is a full device."""
        previous = self._newest_complete()
        if previous is not None:
            needed, basis = sum(self.read_meta(previous)["files"].values()), f"the size of {previous.name}"
        else:
            needed = state_bytes(engine, _engine_zero_stage(engine), self.world_size)
            basis = "the size of the model and optimizer state"
        root = self.root if self.root.exists() else self.root.parent
        if not ran_out_of_space(exc, shutil.disk_usage(root).free, needed):
            return
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free
        resume = f"resumes from {previous.name}" if previous is not None else "starts from step 0"
        raise CheckpointDiskFullError(
            f"no space left on the device of {self.root} for checkpoint {name}: it needs about {gigabytes(needed)} "
            f"({basis}) and {gigabytes(free)} are free. The partial checkpoint was removed and the earlier "
            f"checkpoints are untouched. Free space (or lower checkpoint.keep_last) and start the same command "
            f"again: it {resume}"
        ) from exc

    def _rotate(self, keep: Path) -> None:
        """Delete the oldest intact checkpoints beyond keep_last, except the newest one written before
        the run's latest non-finite updates; broken and damaged ones are left alone."""
        complete = sorted(self._intact_by_size(), key=self._step_of)
        excess = complete[: max(0, len(complete) - self.keep_last)]
        guard = self._newest_before_nonfinite(complete)
        for path in excess:
            if path == keep or path.name in self.protected:
                continue
            if path == guard:
                logger.info("keeping %s beyond checkpoint.keep_last=%d: it is the newest checkpoint written before "
                            "the run's latest non-finite (skipped) updates", path.name, self.keep_last)
                continue
            logger.info("deleting old checkpoint %s (checkpoint.keep_last=%d)", path, self.keep_last)
            trash = path.with_name(f".del-{path.name}")
            os.replace(path, trash)  # a half-deleted dir must never look like a checkpoint
            shutil.rmtree(trash, ignore_errors=True)

    def _newest_before_nonfinite(self, complete: list[Path]) -> Path | None:
        """The newest of `complete` (oldest first) whose run had skipped fewer updates than the newest's."""
        if not complete:
            return None
        skipped = [self.read_meta(p).get("skipped_steps") for p in complete]
        if skipped[-1] is None:
            return None
        earlier = [p for p, s in zip(complete, skipped) if s is not None and s < skipped[-1]]
        return earlier[-1] if earlier else None

    # -------------------------------------------------------------------------------------------
    # Find and verify
    # -------------------------------------------------------------------------------------------

    @staticmethod
    def _step_of(path: Path) -> int:
        match = _STEP_DIR.match(path.name)
        return int(match.group(1)) if match else -1

    def _step_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]

    def _intact_by_size(self) -> list[Path]:
        return [p for p in self._step_dirs() if not self.problems(p) and p.name not in self.damaged]

    def _newest_complete(self) -> Path | None:
        return max(self._intact_by_size(), key=self._step_of, default=None)

    def problems(self, path: Path) -> list[str]:
        """What is wrong with the checkpoint at `path` that shows without reading its contents: meta.json,
        the files it lists and their sizes (empty list = complete; `verify` checks the contents)."""
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

    def verify(self, path: Path) -> list[str]:
        """What is wrong with the checkpoint at `path`, its contents included (every rank calls this;
        the ranks share the hashing). Empty list = intact."""
        path = Path(path)
        found = self._from_rank0(self.problems(path) if self._leads() else None)
        if found:
            return found
        mine, has_checksums = verify_checkpoint(path, index=self._share()[0], count=self._share()[1],
                                                threads=self.threads)
        found = [line for part in self._gathered(mine) for line in part]
        if not found:
            if not has_checksums and self._leads():
                logger.warning("checkpoint %s records no checksums (an older version wrote it): its contents are "
                               "not verified", path)
            self._verified.add(path)
        return found

    def read_meta(self, path: Path) -> dict[str, Any]:
        return json.loads((Path(path) / META_NAME).read_text())

    @staticmethod
    def is_universal(meta: dict[str, Any]) -> bool:
        """A checkpoint's meta (`read_meta`) says it was written by training/checkpoint_universal.py:
        loadable on any ZeRO stage and world size."""
        return bool(meta.get("universal"))

    def find_resumable(self) -> Path | None:
        """Newest intact checkpoint, or None when there is none at all. Partial ones (an interrupted
        save) and damaged ones (a file missing, of the wrong size or with other contents) are reported
        with what is wrong and skipped, never deleted; when checkpoints exist but every one is damaged,
        CheckpointError (starting over would silently drop the run).

        Call it on every rank: rank 0 lists the candidates, the ranks share the hashing of each, and
        all of them get the same answer even if their views of a shared filesystem differ for a
        moment. (With NCCL, set the CUDA device first.)
        """
        log = logger.warning if self._leads() else logger.debug
        candidates = self._from_rank0(self._candidates(log) if self._leads() else None)
        chosen = None
        for name, has_meta, found in candidates:
            path = self.root / name
            if not found:
                found = self.verify(path)
            if not found:
                chosen = path
                break
            if has_meta:
                self.damaged[name] = "; ".join(found)
                log("skipping damaged checkpoint %s: %s", path, "; ".join(found))
            else:
                log("skipping incomplete checkpoint %s: %s", path, "; ".join(found))
        if self._leads():
            self._check_latest(chosen, log)
        if chosen is None and self.damaged:
            raise CheckpointError(
                f"no intact checkpoint under {self.root}: {', '.join(sorted(self.damaged))} are damaged (see the "
                "warnings above). Move them out of checkpoints/ to start the run over, or restore them from a copy"
            )
        return chosen

    def _candidates(self, log) -> list[tuple[str, bool, list[str]]]:
        """(name, whether meta.json exists, what the structural check finds) of every step directory,
        newest first."""
        if not self.root.is_dir():
            return []
        for p in sorted(self.root.iterdir()):
            if p.is_dir() and p.name.startswith(TMP_PREFIX):
                log("ignoring partial checkpoint %s (an interrupted save); delete it to free space", p)
        return [(p.name, (p / META_NAME).is_file(), self.problems(p))
                for p in sorted(self._step_dirs(), key=self._step_of, reverse=True)]

    def _check_latest(self, chosen: Path | None, log) -> None:
        latest_file = self.root / LATEST_NAME
        if not latest_file.is_file():
            return
        latest_name = latest_file.read_text().strip()
        if (chosen is not None and latest_name == chosen.name) or latest_name in self.damaged:
            return  # a damaged checkpoint's warning is said once, when it is skipped
        target = self.root / latest_name
        if not target.is_dir():
            why = "does not exist"
        elif self.problems(target):
            why = "is incomplete"
        else:
            why = "is older (a save finished its rename but not `latest`)"
        log("`latest` names %s, which %s; resuming from %s instead", latest_name, why,
            chosen.name if chosen else "scratch")

    # -------------------------------------------------------------------------------------------
    # Load
    # -------------------------------------------------------------------------------------------

    def load(self, engine: Any, path: Path) -> tuple[int, dict]:
        """Restore DeepSpeed state (module, optimizer, lr scheduler) from `path`; return (step, rank_state).
        The checkpoint is verified first unless this manager has just done so (find_resumable).

        When the checkpoint was written with a different world size and this rank has no file of its
        own, rank 0's state is returned (the data cursor is global, so that is right for it; per-rank
        RNG streams then restart from rank 0's). ZeRO >= 1 checkpoints change world size only once
        converted to DeepSpeed's universal format (training/checkpoint_universal.py).
        """
        path = Path(path)
        found = self.problems(path) if path in self._verified else self.verify(path)
        if found:
            raise CheckpointError(f"cannot load checkpoint {path}: {'; '.join(found)}")
        meta = self.read_meta(path)
        saved_world, saved_stage = int(meta["world_size"]), int(meta.get("zero_stage", 0))
        if saved_world != self.world_size and saved_stage >= 1 and not self.is_universal(meta):
            raise CheckpointError(
                f"checkpoint {path} was written by {saved_world} ranks with ZeRO stage {saved_stage}, and "
                f"this run has {self.world_size}: DeepSpeed cannot re-partition ZeRO optimizer state "
                "directly. Resume with the same number of ranks, or convert it first: "
                "python -m training.checkpoint_universal RUN_DIR NEW_RUN_DIR"
            )

        own = path / rank_state_name(self.rank)
        rank_file = own if saved_world == self.world_size or (own.is_file() and self.rank < saved_world) else None
        if saved_world != self.world_size:
            logger.warning("checkpoint %s was written by %d ranks, this run has %d: rank %d %s", path, saved_world,
                           self.world_size, self.rank, "resumes from its own rank state" if rank_file else
                           "has no state file and takes rank 0's (the data cursor is global, so it is correct; RNG "
                           "streams restart from rank 0's)")
        rank_file = rank_file or path / rank_state_name(0)
        # Our own file (data cursor, RNG states incl. numpy/python tuples): trusted, so weights_only=False.
        # Read before DeepSpeed's files, so that a file that cannot be read changes nothing in the engine.
        try:
            rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
        except Exception as exc:  # whatever unpickling a damaged file raises
            raise CheckpointError(f"cannot load checkpoint {path}: {rank_file.name} cannot be read "
                                  f"({type(exc).__name__}: {exc}); move {path.name} out of checkpoints/ to resume "
                                  "from the one before") from exc

        load_path, _ = engine.load_checkpoint(
            str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed could not load checkpoint {path}")
        step = int(meta["step"])
        logger.info("resumed from %s at step %d", path, step)
        return step, rank_state
