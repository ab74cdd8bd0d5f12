r"""Evaluate a checkpoint on Super-Natural-Instructions (Tk-Instruct protocol: greedy, Rouge-L).

    python -m training.evaluate_sni CHECKPOINT --data /work/shared/data/sni --out DIR \
        [--max-instances-per-task N] [--batch-size B] [--tasks task1159_... task641_...]

CHECKPOINT: a Hugging Face model directory (config.json + model.safetensors / pytorch_model.bin), or
a plain state-dict file (.safetensors / .bin / .pt, e.g. a nanoT5 checkpoint) or a directory holding
one without config.json, together with `--preset base` (or small / large / ...), or one of our run
directories (training/pretrain.py, training/finetune.py: its newest complete checkpoint).
--data: the compact SNI directory (test.jsonl.gz [+ test_references.jsonl.gz]) or a
natural-instructions checkout root. Writes DIR/predictions.jsonl and DIR/metrics.json.

Several GPUs: `torchrun --nproc_per_node 8 -m training.evaluate_sni ...` splits generation over the
ranks (each loads the full model) and gathers the predictions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from data_prep.invocation import command_name
from data_prep.tokenizer import DEFAULT_SPIECE
from training.cli_errors import ExpectedError, ReportedByAnotherRank, expected_errors, run_main
from training.run_dir import RunDir

if TYPE_CHECKING:
    import torch

# torch, the model and the SNI code are imported where they are used: `--help` and a bad argument
# are answered without the seconds their import takes.

logger = logging.getLogger(__name__)

DTYPES = ("bf16", "fp16", "fp32")  # --dtype: torch.bfloat16, torch.float16, torch.float32


def load_model_for_eval(
    path: str | os.PathLike,
    preset: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
):
    """Our T5ForConditionalGeneration in eval mode on `device`, from
    - an HF directory with config.json (weights: safetensors or bin, sharded or not), or
    - a plain state-dict file, or a directory holding one without config.json, plus `preset`, or
    - one of our run directories (training/pretrain.py, training/finetune.py): its newest complete
      checkpoint."""
    import torch

    from training.checkpoint_weights import load_run_model
    from training.model.hf_compat import load_pretrained

    dtype = torch.float32 if dtype is None else dtype
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if RunDir(path).is_run():  # one of our runs (pre-training or fine-tuning)
        model, _ = load_run_model(path)
        return model.to(device=device, dtype=dtype).eval()
    if path.is_dir() and not (path / "config.json").exists() and preset is None:
        raise ValueError(
            f"{path} has no config.json: pass --preset (e.g. base) for a plain state dict, or point to "
            "a Hugging Face model directory"
        )
    model = load_pretrained(path, preset=preset, dropout_rate=0.0)
    return model.to(device=device, dtype=dtype).eval()


def _dist_setup() -> tuple[int, int, torch.device]:
    """Rank, world size and device from a torchrun-style environment (1 process without one)."""
    import torch
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if world_size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world_size, device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=command_name(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="HF model directory, a run directory of ours, or a state-dict file/directory "
                   "with --preset")
    p.add_argument(
        "--data", required=True, help="compact SNI directory/file or natural-instructions checkout"
    )
    p.add_argument("--out", required=True, help="output directory (predictions.jsonl, metrics.json)")
    p.add_argument(
        "--preset", default=None, help="T5 preset for a plain state dict: tiny/small/base/large/xl/xxl"
    )
    p.add_argument(
        "--max-instances-per-task", type=int, default=None, help="seeded subset per task (default: all)"
    )
    p.add_argument("--tasks", nargs="+", default=None, help="only these test tasks (default: all 119)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="instances per generate call per rank (larger is faster on a GPU)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="generation length (Tk-Instruct: 128)")
    p.add_argument(
        "--num-beams", type=int, default=1, help="1 = greedy (Tk-Instruct); k > 1 = beam search with k beams"
    )
    p.add_argument(
        "--length-penalty", type=float, default=1.0, help="beam search: score / length**penalty (HF's 1.0)"
    )
    p.add_argument("--max-source-length", type=int, default=1024, help="prompt length in tokens (1024)")
    p.add_argument("--spiece", default=str(DEFAULT_SPIECE), help="T5 SentencePiece model")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="model dtype for generation")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the per-task subset (with --max-instances-per-task)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return evaluate(args)
    except ExpectedError as exc:
        # Every rank meets the same error (same arguments, same files): rank 0 reports it.
        if int(os.environ.get("RANK", "0")) != 0:
            raise ReportedByAnotherRank(str(exc)) from exc
        raise


def evaluate(args: argparse.Namespace) -> int:
    import torch

    from training.distributed import shutdown_distributed
    from training.sni.encoding import SNITokenizer, TemplateConfig
    from training.sni.evaluate import build_eval_set, evaluate_sni

    out = Path(args.out)
    if (out / "metrics.json").exists():
        raise ExpectedError(f"{out}/metrics.json exists: choose another --out (nothing was overwritten)")
    rank, world_size, device = _dist_setup()
    tokenizer = SNITokenizer(args.spiece)
    with expected_errors(f"--data {args.data}", ValueError, FileNotFoundError):
        eval_set = build_eval_set(
            args.data,
            tokenizer,
            tasks=args.tasks,
            max_instances_per_task=args.max_instances_per_task,
            seed=args.seed,
            template=TemplateConfig(max_source_length=args.max_source_length),
        )
    with expected_errors(f"checkpoint {args.checkpoint}", ValueError):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        model = load_model_for_eval(args.checkpoint, args.preset, device, dtype)
    metrics = evaluate_sni(
        model,
        eval_set,
        tokenizer,
        out_dir=out,
        batch_size=args.batch_size,
        rank=rank,
        world_size=world_size,
        max_new_tokens=args.max_new_tokens,
        device=device,
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
    )
    if rank == 0:
        summary = {k: metrics[k] for k in ("rougeL", "exact_match", "n_instances", "n_tasks", "n_missing")}
        summary["rougeL_missing_as_empty"] = metrics["rougeL_missing_as_empty"]
        summary["per_category_rougeL"] = {k: v["rougeL"] for k, v in metrics["per_category"].items()}
        print(json.dumps(summary, indent=2))
        print(f"wrote {out / 'predictions.jsonl'} and {out / 'metrics.json'}")
    if world_size > 1:
        shutdown_distributed()
    return 0


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
