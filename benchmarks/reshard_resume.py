"""A checkpoint written with one ZeRO stage and GPU count, resumed with another: does the loss go on
where it stopped?

1. run A trains `--steps` steps with `--source` (e.g. zero2 on 4 GPUs), checkpointing half-way;
2. the half-way checkpoint is converted to DeepSpeed's universal format into run B
   (`python -m training.checkpoint_universal`, our optimizer's moments included);
3. run B resumes it with `--target` (e.g. zero3 on 2 GPUs) at the same global batch and trains to
   `--steps`.
Prints the loss of every step of the second half in A and in B and their largest relative gap.

    python benchmarks/reshard_resume.py --data DIR [--source zero2:4] [--target zero3:2] [--steps 20]
        [--batch 128] [--out runs/reshard] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_step import add_run_arguments, run_command, start_run  # noqa: E402
from training.metrics import read_metrics  # noqa: E402


def parse_layout(text: str) -> tuple[str, int]:
    name, _, gpus = text.partition(":")
    if not gpus.isdigit() or not (REPO / "ds_configs" / f"{name}.json").is_file():
        raise SystemExit(f"{text!r}: expected <ds_configs name>:<GPU count>, e.g. zero2:4")
    return name, int(gpus)


def train(name: str, nproc: int, out: Path, args, overrides: list[str]) -> float:
    log_path = out.parent / f"{out.name}.log"
    cmd = run_command(f"ds_configs/{name}.json", args, overrides, out, nproc)
    start = time.time()
    proc = start_run(cmd, log_path, list(range(nproc)) if args.gpu_ids else None)
    if proc.wait() != 0:
        raise SystemExit(f"run {out} failed with exit {proc.returncode}: see {log_path}")
    return time.time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--source", default="zero2:4", help="ds config and GPU count of the first run")
    parser.add_argument("--target", default="zero3:2", help="ds config and GPU count of the resumed run")
    parser.add_argument("--steps", type=int, default=20, help="total steps; the checkpoint is at half")
    parser.add_argument("--batch", type=int, default=128, help="global batch (sequences), the same for both runs")
    parser.add_argument("--no-gpu-ids", dest="gpu_ids", action="store_false",
                        help="do not set CUDA_VISIBLE_DEVICES (CPU runs)")
    parser.add_argument("--out", default="runs/reshard")
    args, overrides = parser.parse_known_args()
    source, target = parse_layout(args.source), parse_layout(args.target)
    half = args.steps // 2
    if half < 1:
        raise SystemExit("--steps must be at least 2")
    args.log_every = 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run_a, run_b = out / f"{source[0]}_{source[1]}gpu", out / f"{target[0]}_{target[1]}gpu_resumed"
    common = [f"optim.batch_size={args.batch}", "optim.grad_acc=1", *overrides]

    wall_a = train(*source, run_a, args, [*common, f"checkpoint.every_steps={half}", "checkpoint.keep_last=2"])
    from training.checkpoint_universal import convert_to_universal

    start = time.time()
    convert_to_universal(run_a, run_b, run_a / "checkpoints" / f"step_{half:08d}")
    wall_convert = time.time() - start
    wall_b = train(*target, run_b, args, common)

    loss_a = {r["step"]: r["loss"] for r in read_metrics(run_a / "metrics.jsonl", "train")}
    loss_b = {r["step"]: r["loss"] for r in read_metrics(run_b / "metrics.jsonl", "train")}
    if min(loss_b) != half + 1:
        raise SystemExit(f"run B started at step {min(loss_b)}, not at {half + 1}: it did not resume")
    print(f"A: {source[0]} on {source[1]} GPU(s), {wall_a:.0f} s; universal conversion {wall_convert:.0f} s; "
          f"B: {target[0]} on {target[1]} GPU(s) from A's step {half}, {wall_b:.0f} s; global batch {args.batch}")
    print(f"loss at step {half} (A, before the checkpoint): {loss_a[half]:.4f}")
    print(f"{'step':>6}{'A loss':>10}{'B loss':>10}{'rel gap':>10}")
    gaps = []
    for step in range(half + 1, args.steps + 1):
        gap = abs(loss_b[step] - loss_a[step]) / loss_a[step]
        gaps.append(gap)
        print(f"{step:>6}{loss_a[step]:>10.4f}{loss_b[step]:>10.4f}{100 * gap:>9.3f}%")
    print(f"largest relative gap after the resume: {100 * max(gaps):.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
