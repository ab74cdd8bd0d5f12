"""The model weights of a run's checkpoint, whatever the ZeRO stage it was written at: for export,
evaluation and starting one run from another (`init_from`). Contents are verified against the
checkpoint's checksums before they are used (training/checkpoint.py writes them)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from training.checkpoint import CheckpointError, CheckpointManager
from training.checkpoint_checksums import META_NAME, RANK_STATE_FILE, verify_checkpoint
from training.model import T5ForConditionalGeneration
from training.run_dir import RunDir

logger = logging.getLogger(__name__)


def newest_checkpoint(run_dir: RunDir | str | Path) -> Path | None:
    """The newest intact checkpoint of a run (contents verified), as one process sees it (export,
    conversion, starting another run from this one); None if there is none."""
    manager = CheckpointManager(run_dir, keep_last=1, rank=0, world_size=1, barrier=lambda: None)
    return manager.find_resumable()


def _weight_files(meta: dict[str, Any]) -> list[str]:
    """The files `checkpoint_state_dict` reads: the module file under ZeRO 0-2, all of DeepSpeed's
    files under ZeRO 3 (zero_to_fp32 reassembles the weights from the optimizer's partitions)."""
    if "mp_rank_00_model_states.pt" in meta["files"] and int(meta.get("zero_stage", 0)) < 3:
        return ["mp_rank_00_model_states.pt"]
    return [n for n in meta["files"] if not RANK_STATE_FILE.match(n)]


def checkpoint_state_dict(checkpoint: Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """fp32 model weights of one checkpoint directory (checkpoints/step_N), whatever the ZeRO stage;
    the files read are verified against the checkpoint's checksums first (CheckpointError if damaged).

    ZeRO 0-2 store the full module (fp32 master weights: the engine keeps fp32 parameters and
    computes in bf16 through autocast); ZeRO 3 stores only partitions, which DeepSpeed's
    zero_to_fp32 reassembles.
    """
    checkpoint = Path(checkpoint)
    model_file = checkpoint / "mp_rank_00_model_states.pt"  # ZeRO 0-2
    zero3_file = checkpoint / "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO 3
    if not model_file.is_file() and not zero3_file.is_file():
        raise FileNotFoundError(f"{checkpoint} is not a DeepSpeed checkpoint directory (no {model_file.name} "
                                f"or {zero3_file.name})")
    if verify and (checkpoint / META_NAME).is_file():
        found, has_checksums = verify_checkpoint(checkpoint, _weight_files(json.loads((checkpoint / META_NAME)
                                                                                      .read_text())))
        if found:
            raise CheckpointError(f"checkpoint {checkpoint} is damaged: {'; '.join(found)}")
        if not has_checksums:
            logger.warning("checkpoint %s records no checksums (an older version wrote it): its weights are not "
                           "verified", checkpoint)
    states = torch.load(model_file if model_file.is_file() else zero3_file, map_location="cpu", weights_only=False)
    module = states.get("module")
    zero_stage = int(states.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    if zero_stage == 3 or not module:
        # deepspeed imports here: it takes seconds, and only ZeRO 3 checkpoints need it.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    return {k: v.float() for k, v in module.items()}


def load_run_model(run_dir: RunDir | str | Path, checkpoint: str | Path | None = None):
    """(the model of a run at its newest intact checkpoint, or at `checkpoint`, on the CPU in fp32 and
    in eval mode; the checkpoint directory). The checkpoint's contents are verified first."""
    run_dir = RunDir(run_dir)
    verified = checkpoint is None
    if checkpoint is None:
        checkpoint = newest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"no complete checkpoint under {run_dir.checkpoints}: train longer "
                                    "(checkpoint.every_steps) or pass --checkpoint")
    model = T5ForConditionalGeneration(run_dir.read_model_config())
    state = checkpoint_state_dict(Path(checkpoint), verify=not verified)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{checkpoint} does not match the run's model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    logger.info("loaded %s", checkpoint)
    return model.eval(), Path(checkpoint)
