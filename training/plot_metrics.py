"""Plot the loss curves of one or more runs from their metrics.jsonl.

    python -m training.plot_metrics runs/demo [runs/other ...] --out loss.png

A resumed run may have logged a step twice (the steps between its last checkpoint and the
interruption are trained again); the later record wins, which is the one the final model saw.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.invocation import command_name
from training.metrics import read_metrics
from training.run_dir import RunDir


def curves(run_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """{"train": (steps, losses), "eval": (steps, eval_losses)} with duplicates resolved."""
    path = RunDir(run_dir).metrics_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a run directory (output_dir) of training/pretrain.py")
    result = {}
    for kind, key in (("train", "loss"), ("eval", "eval_loss")):
        by_step = {r["step"]: r[key] for r in read_metrics(path, kind) if r.get(key) is not None}
        steps = sorted(by_step)
        result[kind] = (steps, [by_step[s] for s in steps])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default="loss.png", help="image to write (png, pdf, svg)")
    parser.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    args = parser.parse_args(argv)
    try:  # matplotlib is optional (the `dev` extra): only this command needs it
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plotting needs matplotlib: pip install matplotlib (or pip install -e '.[dev]')", file=sys.stderr)
        return 2
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in args.runs:
        c = curves(run)
        name = Path(run).name
        ax.plot(*c["train"], label=f"{name} train", linewidth=1)
        if c["eval"][0]:
            ax.plot(*c["eval"], "o-", label=f"{name} held-out", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("span-corruption loss (nats/token)")
    if args.log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
