"""Export a training run's newest complete checkpoint to a Hugging Face T5 directory.

    python -m training.export RUN_DIR OUT_DIR [--checkpoint RUN_DIR/checkpoints/step_00001000]
        [--dtype bfloat16] [--max-shard-size 5GB] [--tokenizer PATH]

OUT_DIR gets what transformers' save_pretrained writes: config.json, generation_config.json, the
weights as safetensors (model.safetensors, or shards of at most --max-shard-size with
model.safetensors.index.json), and the tokenizer files. transformers loads it with
`from_pretrained`; docs/model.md says what each transformers version does with T5 v1.1's untied head.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from data_prep.invocation import command_name
from training.cli_errors import run_main


def _shard_size(text: str) -> int | str:
    """A byte count ("2000000000") or a size with a unit ("5GB", "500MB"), as save_pretrained takes."""
    from huggingface_hub import split_torch_state_dict_into_shards

    size: int | str = int(text) if text.isdigit() else text
    try:
        split_torch_state_dict_into_shards({}, max_shard_size=size)  # parses the size, as the export will
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err}") from None
    return size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run's output_dir")
    parser.add_argument("out_dir", help="directory to write the Hugging Face model into (new or empty)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: newest complete)")
    parser.add_argument("--tokenizer", default=None,
                        help="SentencePiece model or tokenizer directory (default: the run's data.tokenizer)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the exported weights (default: float32, as trained)")
    parser.add_argument("--max-shard-size", type=_shard_size, default=None,
                        help="largest weight file, e.g. 5GB or 500MB (default: transformers 5's save_pretrained "
                             "default, 50GB)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is not empty" if out.is_dir() else "is a file"
        print(f"error: {out} exists and {what}: choose a new directory (nothing was written)", file=sys.stderr)
        return 2
    # Here, not at the top: --help and argument errors do not wait for torch and the model.
    from training.checkpoint_weights import load_run_model
    from training.model.hf_compat import DEFAULT_MAX_SHARD_SIZE, save_hf_directory
    from training.run_dir import RunDir

    try:
        tokenizer = args.tokenizer
        if tokenizer is None:  # pre-training and fine-tuning configs both keep it at data.tokenizer
            tokenizer = RunDir(args.run_dir).read_config()["data"]["tokenizer"]
        if not Path(tokenizer).exists():
            raise FileNotFoundError(f"tokenizer {tokenizer} not found: pass --tokenizer PATH (a SentencePiece "
                                    "model, e.g. assets/t5/spiece.model, or a tokenizer directory)")
        model, checkpoint = load_run_model(args.run_dir, args.checkpoint)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    save_hf_directory(model, out, tokenizer_path=tokenizer, dtype=args.dtype,
                      max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    print(f"exported {checkpoint} to {out} ({args.dtype})")
    return 0


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
