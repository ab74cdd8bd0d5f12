r"""Convert a run's checkpoint to DeepSpeed's universal format, to resume it with another ZeRO stage or
another number of GPUs (ZeRO 1-3 optimizer state is partitioned by world size and cannot be loaded
elsewhere as it is).

    python -m training.checkpoint_universal RUN_DIR NEW_RUN_DIR [--checkpoint RUN_DIR/checkpoints/step_N]
    deepspeed --num_gpus 2 training/pretrain.py --config ... --deepspeed_config ds_configs/zero3.json \
        output_dir=NEW_RUN_DIR

The source checkpoint's checksums are verified first. NEW_RUN_DIR gets `checkpoints/step_N` in
universal layout (one fp32 weight + Adam moments file per parameter, written by DeepSpeed's
ds_to_universal), the per-rank data cursors and RNG states, and a meta.json with the new files'
checksums, marked `"universal": true`; the trainer sees that mark and loads it with DeepSpeed's
`checkpoint.load_universal`. The source run is not modified.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from data_prep.invocation import command_name
from training.cli_errors import expected_errors, run_main
from training.run_dir import RunDir

# torch and the checkpoint code are imported where they are used: `--help` and a bad argument are
# answered without the seconds their import takes.

logger = logging.getLogger(__name__)


def _make_loadable_by_zero3(universal_dir: Path) -> None:
    """ds_to_universal (DeepSpeed 0.19) writes what ZeRO 1/2 engines read; a ZeRO 3 engine also looks for
    its module-state file under the stage-3 name and for the optimizer's step and hyper-parameters
    under `optimizer_state_dict` in zero/optimizer_state.pt. Add both (same content, no new data)."""
    import torch

    os.link(universal_dir / "mp_rank_00_model_states.pt", universal_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    state_path = universal_dir / "zero" / "optimizer_state.pt"
    optim_sd = torch.load(state_path, weights_only=False)
    if "optimizer_state_dict" not in optim_sd:
        step_file = next((universal_dir / "zero").glob("*/step.pt"), None)
        step = torch.load(step_file, weights_only=False) if step_file is not None else 0
        optim_sd["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim_sd["param_groups"]}
        torch.save(optim_sd, state_path)


def convert_to_universal(run_dir: str | Path, new_run_dir: str | Path, checkpoint: str | Path | None = None) -> Path:
    """Write `checkpoint` (default: the run's newest complete one) as a universal checkpoint into
    `new_run_dir`/checkpoints/ and return its directory; the new run directory also gets the run's
    config and model config."""
    from training.checkpoint import (
        LATEST_NAME,
        META_NAME,
        TMP_PREFIX,
        CheckpointManager,
        checkpoint_files,
        rank_state_name,
        write_atomic,
    )
    from training.checkpoint_checksums import blocks, checksum_record, hash_blocks

    run_dir, new_run_dir = RunDir(run_dir), RunDir(new_run_dir)
    source = CheckpointManager(run_dir, keep_last=1, rank=0, world_size=1, barrier=lambda: None)
    src = Path(checkpoint) if checkpoint else source.find_resumable()  # find_resumable verifies
    if src is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir.checkpoints}")
    problems = source.verify(src) if checkpoint else []
    if problems:
        raise RuntimeError(f"cannot convert {src}: {'; '.join(problems)}")
    meta = source.read_meta(src)
    if source.is_universal(meta):
        raise ValueError(f"{src} is already a universal checkpoint: resume from it directly")
    dest_root = new_run_dir.checkpoints
    if dest_root.exists() and any(dest_root.iterdir()):
        raise FileExistsError(f"{dest_root} is not empty: choose a new run directory (nothing was written)")
    dest_root.mkdir(parents=True, exist_ok=True)
    tmp, final = dest_root / (TMP_PREFIX + src.name), dest_root / src.name

    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
         "--output_folder", str(tmp), "--num_extract_workers", "1", "--num_merge_workers", "1"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {src}:\n{proc.stderr[-3000:]}")
    for r in range(int(meta["world_size"])):
        shutil.copy2(src / rank_state_name(r), tmp / rank_state_name(r))
    _make_loadable_by_zero3(tmp)
    files = checkpoint_files(tmp)
    universal_meta = {**meta, "universal": True, "converted_from": str(src.resolve()), "files": files,
                      "checksums": checksum_record(files, hash_blocks(tmp, blocks(files)))}
    write_atomic(tmp / META_NAME, json.dumps(universal_meta, indent=1) + "\n")
    tmp.replace(final)
    write_atomic(dest_root / LATEST_NAME, final.name + "\n")
    run_dir.copy_definition_to(new_run_dir)
    logger.info("wrote universal checkpoint %s from %s", final, src)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run whose checkpoint to convert")
    parser.add_argument("new_run_dir", help="run directory to resume in (with any ZeRO stage / GPU count)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: newest complete)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # A checkpoint that cannot be converted (missing, damaged, already universal) is the user's to fix.
    with expected_errors("", ValueError, RuntimeError):
        final = convert_to_universal(args.run_dir, args.new_run_dir, args.checkpoint)
    print(f"universal checkpoint: {final}; resume with output_dir={args.new_run_dir} on any ZeRO stage / GPU count")
    return 0


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
