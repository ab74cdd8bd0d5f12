r"""Fine-tune and evaluate one checkpoint on several GLUE-style tasks in T5's text-to-text form, and
print the table of their validation results.

    python -m training.glue --checkpoint runs/base --tasks rte=/data/glue/rte,sst2=/data/glue/sst2 \
        --out runs/glue_base [--launcher "deepspeed --num_gpus 8"] [key=value ...]

Each task runs `training/finetune.py --config training/configs/glue_<task>.yaml init=CHECKPOINT
data.dir=DIR output_dir=OUT/<task> [key=value ...]` in turn (the key=value overrides apply to
every task). A task directory holds the task's train and validation splits as files
(`train.jsonl`, `validation.parquet`, ...) or a `save_to_disk` DatasetDict, in Hugging Face's
glue / super_glue layout. The table (the selected checkpoint's validation scores) is printed and
written to OUT/glue_results.json. A task whose run directory exists resumes, or re-evaluates a
finished run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.invocation import command_name
from training.cli_errors import ExpectedError, run_main
from training.metrics import read_metrics
from training.run_dir import RunDir

CONFIGS = Path(__file__).resolve().parent / "configs"
FINETUNE = Path(__file__).resolve().parent / "finetune.py"
RESULTS_NAME = "glue_results.json"


def known_tasks() -> list[str]:
    return sorted(p.stem.removeprefix("glue_") for p in CONFIGS.glob("glue_*.yaml"))


def parse_tasks(text: str) -> dict[str, Path]:
    """`rte=DIR,sst2=DIR` -> {task: directory}; ExpectedError for an unknown task or a missing directory."""
    tasks: dict[str, Path] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, directory = item.partition("=")
        if not sep or not directory:
            raise ExpectedError(f"--tasks {item!r}: write TASK=DIR, e.g. rte=/data/glue/rte")
        if name not in known_tasks():
            raise ExpectedError(f"--tasks: unknown task {name!r}; the recipe has {', '.join(known_tasks())}")
        if not Path(directory).is_dir():
            raise ExpectedError(f"--tasks {name}={directory}: no such directory (the task's train and validation files)")
        tasks[name] = Path(directory)
    if not tasks:
        raise ExpectedError("--tasks names no task: e.g. --tasks rte=/data/glue/rte,sst2=/data/glue/sst2")
    return tasks


def selected_result(run: Path) -> dict:
    """The validation record a finished run ends with: the best one on eval.best_metric (the first
    of equal ones, as the run selects), else the newest."""
    cfg = RunDir(run).read_config()
    metric, mode, split = cfg["eval"]["best_metric"], cfg["eval"]["best_mode"], cfg["task"]["validation_split"]
    records = [r for r in read_metrics(RunDir(run).metrics_file, "eval") if r.get("split") == split]
    if not records:
        raise ExpectedError(f"{run} holds no {split} evaluation: its fine-tuning did not finish")
    if metric is None:
        return records[-1]
    sign = 1 if mode == "max" else -1
    best = max(sign * r[metric] for r in records)
    return next(r for r in records if sign * r[metric] == best)


def format_table(rows: list[dict]) -> str:
    header = ("task", "metric", "score", "examples", "step")
    lines = [[r["task"], m, f"{r[m]:.2f}", str(r["n_examples"]), str(r["step"])] for r in rows for m in r["metrics"]]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [list(header), *lines])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=command_name(), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="the model to fine-tune: one of our runs, a Hugging Face T5 directory, or `random`")
    p.add_argument("--tasks", required=True, help=f"TASK=DIR,... with TASK in {', '.join(known_tasks())}")
    p.add_argument("--out", required=True, help="directory of the runs (OUT/<task>) and of glue_results.json")
    p.add_argument("--launcher", default=sys.executable,
                   help='command that runs training/finetune.py, e.g. "deepspeed --num_gpus 8" (default: this python)')
    p.add_argument("overrides", nargs="*", metavar="key=value", help="run-config overrides for every task")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tasks = parse_tasks(args.tasks)
    out = Path(args.out)
    rows = []
    for name, directory in tasks.items():
        run = out / name
        command = [*shlex.split(args.launcher), str(FINETUNE), "--config", str(CONFIGS / f"glue_{name}.yaml"),
                   f"init={args.checkpoint}", f"data.dir={directory}", f"output_dir={run}", *args.overrides]
        print(f"[glue] {name}: {shlex.join(command)}", flush=True)
        code = subprocess.call(command)
        if code != 0:
            print(f"[glue] {name} stopped with exit code {code}; start the same command again to go on "
                  f"(finished tasks re-evaluate)", file=sys.stderr)
            return code
        record = selected_result(run)
        metrics = RunDir(run).read_config()["task"]["metrics"]
        rows.append({"task": name, "metrics": metrics, **{m: record[m] for m in metrics},
                     "n_examples": record["n_examples"], "step": record["step"], "run": str(run)})
    table = format_table(rows)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_NAME).write_text(json.dumps({"checkpoint": args.checkpoint, "results": rows}, indent=2) + "\n")
    print(f"wrote {out / RESULTS_NAME}")
    return 0


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
