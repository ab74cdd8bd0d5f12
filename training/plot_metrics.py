"""Plot every metric one or more runs logged in metrics.jsonl, one panel per metric.

    python -m training.plot_metrics RUN [RUN ...] [--out FILE] [--log-y]

Every numeric field of the training and evaluation records is drawn against the optimizer step:
losses (training and held-out in one panel), held-out accuracy, the SNI Rouge-L (overall and per
category in one panel) and exact match, learning rate, gradient and weight norms, step time and
loader wait, throughput, MFU, memory, and any other field a run logs. Without --out the image is
RUN/metrics.png (several runs: metrics_compared.png in the first run's directory); the suffix of
--out picks the format (png, pdf, svg).

A resumed run may have logged a step twice (the steps between its last checkpoint and the
interruption are trained again); the later record wins, which is the one the final model saw.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from data_prep.invocation import command_name
from training.cli_errors import run_main
from training.metrics import read_metrics
from training.run_dir import RunDir

# Record fields that place a record rather than measure something.
_NOT_METRICS = {"kind", "time", "step"}


@dataclass(frozen=True)
class Panel:
    """One plot: the (kind, field) series it draws, its title and y-axis label."""

    title: str
    ylabel: str
    fields: tuple[tuple[str, str], ...]  # (kind, field); a field ending in "/" takes every field under it


def _panels(finetune: bool) -> list[Panel]:
    """The known metrics, in display order, labelled for a pre-training or a fine-tuning run."""
    loss = ("SNI training loss", "cross-entropy (nats/target token)") if finetune else \
        ("span-corruption loss", "cross-entropy (nats/target token)")
    return [
        Panel(*loss, (("train", "loss"), ("eval", "eval_loss"))),
        Panel("held-out token accuracy", "fraction of target tokens", (("eval", "eval_accuracy"),)),
        Panel("held-out target tokens", "tokens", (("eval", "eval_tokens"),)),
        Panel("SNI Rouge-L", "Rouge-L (0-100)", (("eval", "rougeL"), ("eval", "rougeL/"))),
        Panel("SNI exact match", "exact match (%)", (("eval", "exact_match"),)),
        Panel("SNI instances evaluated", "instances", (("eval", "n_instances"),)),
        Panel("evaluation time", "seconds", (("eval", "eval_seconds"),)),
        Panel("learning rate", "learning rate", (("train", "lr"),)),
        Panel("gradient norm", "L2 norm before clipping", (("train", "grad_l2"),)),
        Panel("weight norm", "L2 norm", (("train", "weights_l2"),)),
        Panel("throughput", "tokens/s (all ranks)", (("train", "tokens_per_s"),)),
        Panel("model FLOPs utilisation", "MFU (fraction of peak)", (("train", "mfu"),)),
        Panel("step time", "seconds per step", (("train", "seconds_per_step"), ("train", "data_wait_s"))),
        Panel("peak GPU memory", "GiB (most of any rank)", (("train", "peak_mem_gib"),)),
        Panel("skipped updates", "non-finite steps (cumulative)", (("train", "skipped_steps"),)),
        Panel("elapsed time", "training seconds", (("train", "elapsed_s"),)),
        Panel("epoch", "epochs", (("train", "epoch"),)),
    ]


_LEGEND = {("train", "loss"): "train", ("eval", "eval_loss"): "held-out", ("eval", "rougeL"): "all tasks",
           ("train", "seconds_per_step"): "step", ("train", "data_wait_s"): "loader wait"}

Series = dict[tuple[str, str], tuple[list[int], list[float]]]


def run_series(run_dir: str | Path) -> Series:
    """{(kind, field): (steps, values)} for every numeric field of the run's train and eval records
    that has at least one finite value; a step logged twice keeps its later value."""
    path = RunDir(run_dir).metrics_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass a run directory (output_dir) of training/pretrain.py "
                                "or training/finetune.py")
    by_step: dict[tuple[str, str], dict[int, float]] = {}
    for record in read_metrics(path):
        kind = record.get("kind")
        if kind not in ("train", "eval") or not isinstance(record.get("step"), int):
            continue
        for field, value in record.items():
            if field in _NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            by_step.setdefault((kind, field), {})[record["step"]] = float(value)
    series = {}
    for key, values in by_step.items():
        if any(math.isfinite(v) for v in values.values()):
            steps = sorted(values)
            series[key] = (steps, [values[s] for s in steps])
    return series


def is_finetune_run(run_dir: str | Path, series: Series) -> bool:
    """A fine-tuning run's config names its `init`; without config.yaml, its Rouge-L records tell."""
    run = RunDir(run_dir)
    if run.config_file.is_file():
        return "init" in run.read_config()
    return ("eval", "rougeL") in series


def _panel_fields(panel: Panel, available: set[tuple[str, str]]) -> list[tuple[str, str]]:
    fields = []
    for kind, field in panel.fields:
        if field.endswith("/"):
            fields += sorted(k for k in available if k[0] == kind and k[1].startswith(field))
        elif (kind, field) in available:
            fields.append((kind, field))
    return fields


def build_figure(runs: list[str | Path], log_y: bool = False):
    """The figure: one panel per metric any of `runs` logged. Each line's gid is "RUN_NAME|kind|field"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    loaded = [(Path(run).name or str(run), run_series(run), run) for run in runs]
    if not any(series for _, series, _ in loaded):
        raise ValueError(f"nothing to plot: no training or evaluation record in {', '.join(map(str, runs))} yet")
    finetune = is_finetune_run(loaded[0][2], loaded[0][1])
    available = {key for _, series, _ in loaded for key in series}
    panels = _panels(finetune)
    known = {f for panel in panels for f in panel.fields}
    for kind, field in sorted(available):  # fields no panel names get their own, labelled by name
        if (kind, field) not in known and not any(field.startswith(f[1]) and f[1].endswith("/") for f in known):
            panels.append(Panel(f"{field} ({kind})", field, ((kind, field),)))
    drawn = [(panel, _panel_fields(panel, available)) for panel in panels]
    drawn = [(panel, fields) for panel, fields in drawn if fields]

    columns = min(3, len(drawn))
    rows = -(-len(drawn) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.4 * rows), squeeze=False)
    for ax, (panel, fields) in zip(axes.flat, drawn):
        lines = 0
        for name, series, _ in loaded:
            for key in fields:
                if key not in series:
                    continue
                label = _LEGEND.get(key, key[1].rsplit("/", 1)[-1])  # rougeL/title_generation: the category
                if len(loaded) > 1:
                    label = f"{name} {label}"
                style = dict(marker="o", markersize=3) if key[0] == "eval" else dict(linewidth=1)
                ax.plot(*series[key], label=label, gid=f"{name}|{key[0]}|{key[1]}", **style)
                lines += 1
        ax.set_title(panel.title)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(panel.ylabel)
        if log_y and ("train", "loss") in panel.fields:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if lines > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(drawn):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def default_output(runs: list[str]) -> Path:
    return Path(runs[0]) / ("metrics.png" if len(runs) == 1 else "metrics_compared.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default=None,
                        help="image to write (png, pdf, svg; default: RUN/metrics.png, or "
                             "FIRST_RUN/metrics_compared.png for several runs)")
    parser.add_argument("--log-y", action="store_true", help="logarithmic loss axis")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (a dependency of t5ds; missing only after a --no-deps install)
    except ImportError:
        print("plotting needs matplotlib, a dependency of t5ds: pip install matplotlib", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_output(args.runs)
    try:
        fig = build_figure(args.runs, log_y=args.log_y)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
