"""Export a training run's newest complete checkpoint to a Hugging Face T5 directory.

    python -m training.export RUN_DIR OUT_DIR [--checkpoint RUN_DIR/checkpoints/step_00001000]

OUT_DIR gets config.json, model.safetensors and the tokenizer files; transformers loads it with
`from_pretrained` (T5 v1.1's head is not tied to the embedding: see docs/model.md for loading it
with transformers 5).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from data_prep.invocation import command_name
from training.checkpoint import load_run_model
from training.model.hf_compat import save_hf_directory
from training.run_dir import RunDir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run's output_dir")
    parser.add_argument("out_dir", help="directory to write the Hugging Face model into")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: newest complete)")
    parser.add_argument("--tokenizer", default=None, help="SentencePiece model (default: the run's data.tokenizer)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    model, checkpoint = load_run_model(args.run_dir, args.checkpoint)
    tokenizer = args.tokenizer
    if tokenizer is None:  # pre-training and fine-tuning configs both keep it at data.tokenizer
        tokenizer = RunDir(args.run_dir).read_config()["data"]["tokenizer"]
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        print(f"{out} exists and is not empty: choose a new directory (nothing was written)", file=sys.stderr)
        return 2
    save_hf_directory(model, out, tokenizer_path=tokenizer)
    print(f"exported {checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
