"""Step time of the whole engine (real shards, loader, DeepSpeed, logging) per ZeRO config.

Runs `training/pretrain.py` once per DeepSpeed config for a fixed number of steps and prints, per
run: seconds/step (median of the logging windows after the first two, which hold compilation),
tokens/s, MFU, peak GPU memory, the time each step waited for the loader, the last loss, and how
long the first step took to launch (torch.compile included) with what the compile cache did. The
same global batch and seed everywhere, so the stages see the same data; their bf16 steps still
differ in rounding (each stage sums and casts the gradients its own way), so on a short run at
nanoT5's learning rate the last losses drift apart. Equality across stages is tested on CPU in fp32
(tests/test_optim_zero.py).

    python benchmarks/engine_step.py --data DIR [--configs zero0,zero1,zero2] [--steps 60]
        [--nproc 1] [--out runs/bench] [key=value ...]       # extra run-config overrides

Compare with the model alone: `python -m training.benchmark` (same model, synthetic tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.metrics import compile_cache_text, read_metrics  # noqa: E402


def add_run_arguments(parser: argparse.ArgumentParser, warmup_default: str = "min(10, steps-1)") -> None:
    """The options every engine benchmark shares: the shards, the run config, the warm-up
    (`warmup_default`: what the script uses when --warmup is not given, for its help)."""
    parser.add_argument("--data", required=True, help="a directory written by data_prep.shard")
    parser.add_argument("--config", default="training/configs/t5_base_c4.yaml", help="run config")
    parser.add_argument("--warmup", type=int, default=None, help=f"optim.warmup_steps (default: {warmup_default})")


def run_command(ds_config: str, args: argparse.Namespace, overrides: list[str], out: Path, nproc: int) -> list[str]:
    """The command line of one engine run: training/pretrain.py on `nproc` processes (GPUs)."""
    launcher = [sys.executable]
    if nproc > 1:
        # --standalone: a free rendezvous port per run, so several runs can share a machine
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [*launcher, str(REPO / "training/pretrain.py"), "--config", args.config, "--deepspeed_config", ds_config,
            f"output_dir={out}", f"data.dir={args.data}", f"optim.total_steps={args.steps}",
            f"optim.warmup_steps={args.warmup if args.warmup is not None else min(10, args.steps - 1)}",
            f"logging.every_steps={args.log_every}", "eval.every_steps=0", "eval.max_samples=256",
            "checkpoint.every_steps=0", "checkpoint.at_end=false", "logging.wandb=disabled", *overrides]


_RUNNING: list[subprocess.Popen] = []


def _kill_runs(signum, frame) -> None:
    """SIGTERM/SIGINT (e.g. `timeout`): kill every run's process group at once. A plain SIGTERM would
    reach the trainer's stop handler, which writes a checkpoint first (180 GB for XXL)."""
    for proc in _RUNNING:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def start_run(cmd: list[str], log_path: Path, gpus: list[int] | None = None) -> subprocess.Popen:
    """Start one run in the background, its output in `log_path`, on the GPUs `gpus` (None: all),
    in its own process group; this process kills those groups when it is terminated."""
    if not _RUNNING:
        signal.signal(signal.SIGTERM, _kill_runs)
        signal.signal(signal.SIGINT, _kill_runs)
    env = dict(os.environ)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _RUNNING.append(proc)
    return proc


def summarise(out: Path, returncode: int, log_path: Path, wall_s: float) -> dict:
    """Figures of a finished run from its metrics.jsonl: medians of the logging windows after the
    first two (which hold compilation)."""
    if returncode != 0 or not (out / "metrics.jsonl").exists():
        return {"error": f"exit {returncode} (see {log_path})", "wall_s": wall_s}
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        return {"error": f"no training record (see {log_path})", "wall_s": wall_s}
    steady = train[2:] or train
    first = [r for r in records if r.get("kind") == "event" and r.get("event") == "first_step"]
    return {
        "s_per_step": statistics.median(r["seconds_per_step"] for r in steady),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if steady[0].get("mfu") is not None else None,
        "peak_gib": max(r.get("peak_mem_gib") or 0.0 for r in train),
        "data_wait_ms": 1e3 * statistics.median(r["data_wait_s"] for r in steady),
        "first_loss": train[0]["loss"],
        "last_loss": train[-1]["loss"],
        "last_step": train[-1]["step"],
        "first_step_s": first[0]["seconds"] if first else None,
        "compile_cache": first[0].get("compile_cache", {}) if first else {},
        "wall_s": wall_s,
    }


def first_step(row: dict) -> str:
    """The first step's seconds and the compile cache's outcome ("44.2 (miss 1)"), "-" where no run
    logged it."""
    if row.get("first_step_s") is None:
        return "-"
    cache = compile_cache_text(row["compile_cache"]) or "not compiled"
    return f"{row['first_step_s']:.1f} ({cache})"


def run_one(ds_config: str, args: argparse.Namespace, overrides: list[str]) -> dict:
    out = Path(args.out) / Path(ds_config).stem
    log_path = Path(args.out) / f"{Path(ds_config).stem}.log"
    start = time.time()
    proc = start_run(run_command(ds_config, args, overrides, out, args.nproc), log_path)
    proc.wait()
    return {"config": Path(ds_config).stem, **summarise(out, proc.returncode, log_path, time.time() - start)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--configs", default="zero0,zero1,zero2", help="ds_configs/<name>.json, comma list")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    parser.add_argument("--out", default="runs/bench_engine")
    parser.add_argument("--json", default="", help="append one JSON line per run to this file")
    args, overrides = parser.parse_known_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"{'config':<14}{'s/step':>9}{'tokens/s':>11}{'MFU':>7}{'peak GiB':>10}{'wait ms':>9}"
          f"{'last loss':>11}{'1st step s':>20}{'wall s':>8}", flush=True)
    for name in args.configs.split(","):
        row = run_one(f"ds_configs/{name}.json", args, overrides)
        if "error" in row:
            print(f"{name:<14} {row['error']}", flush=True)
        else:
            mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
            print(f"{row['config']:<14}{row['s_per_step']:>9.4f}{row['tokens_per_s']:>11.0f}{mfu:>7}"
                  f"{row['peak_gib']:>10.1f}{row['data_wait_ms']:>9.2f}{row['last_loss']:>11.4f}"
                  f"{first_step(row):>20}{row['wall_s']:>8.0f}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
