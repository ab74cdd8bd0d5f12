"""Export a training run's newest complete checkpoint to a Hugging Face T5 directory.

    python -m training.export RUN_DIR OUT_DIR [--checkpoint RUN_DIR/checkpoints/step_00001000]

OUT_DIR gets config.json, model.safetensors and the tokenizer files; transformers loads it with
`from_pretrained` (see docs/model.md for T5 v1.1's untied head under transformers 5).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import yaml

logger = logging.getLogger(__name__)

MODEL_CONFIG_NAME = "model_config.json"


def write_model_config(run_dir: str | Path, model_config) -> None:
    """Record the exact model configuration in the run directory (pretrain/finetune call this)."""
    path = Path(run_dir) / MODEL_CONFIG_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(model_config), indent=2, sort_keys=True))
    tmp.replace(path)


def read_model_config(run_dir: str | Path):
    from training.model import T5Config

    path = Path(run_dir) / MODEL_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a run directory written by "
                                "training/pretrain.py or training/finetune.py")
    return T5Config(**json.loads(path.read_text()))


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
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    return {k: v.float() for k, v in module.items()}


def load_run_model(run_dir: str | Path, checkpoint: str | Path | None = None):
    """The model of a run at its newest complete checkpoint (or `checkpoint`), on the CPU in fp32."""
    from training.checkpoint import CheckpointManager
    from training.model import T5ForConditionalGeneration

    run_dir = Path(run_dir)
    if checkpoint is None:
        manager = CheckpointManager(run_dir, keep_last=1, rank=0, world_size=1, barrier=lambda: None)
        checkpoint = manager.find_resumable()
        if checkpoint is None:
            raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'}: train longer "
                                    "(checkpoint.every_steps) or pass --checkpoint")
    model = T5ForConditionalGeneration(read_model_config(run_dir))
    state = checkpoint_state_dict(Path(checkpoint))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{checkpoint} does not match the run's model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    logger.info("loaded %s", checkpoint)
    return model.eval(), Path(checkpoint)


def main(argv: list[str] | None = None) -> int:
    from training.model.hf_compat import save_hf_directory

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run's output_dir")
    parser.add_argument("out_dir", help="directory to write the Hugging Face model into")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: newest complete)")
    parser.add_argument("--tokenizer", default=None, help="SentencePiece model (default: the run's data.tokenizer)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    model, checkpoint = load_run_model(args.run_dir, args.checkpoint)
    tokenizer = args.tokenizer
    if tokenizer is None:  # pre-training and fine-tuning configs both keep it at data.tokenizer
        run_config = yaml.safe_load((Path(args.run_dir) / "config.yaml").read_text())
        tokenizer = run_config["data"]["tokenizer"]
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        print(f"{out} exists and is not empty: choose a new directory (nothing was written)", file=sys.stderr)
        return 2
    save_hf_directory(model, out, tokenizer_path=tokenizer)
    print(f"exported {checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
