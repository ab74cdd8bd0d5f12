"""Weak scaling of the engine over GPUs and ZeRO stages (same batch per GPU at every GPU count).

Runs `training/pretrain.py` (real shards, a shipped run config, the shipped ds_configs) for a fixed
number of steps on each GPU count and ZeRO stage and prints, per run: seconds/step, tokens/s,
tokens/s per GPU, scaling efficiency (tokens/s per GPU against the 1-GPU run of the same stage),
MFU, peak GPU memory (the largest over the ranks) and the loss at the last step; then, per GPU count, how far the
last losses of the stages are apart (same global batch, same seed: they must agree).

    python benchmarks/scaling.py --data DIR [--gpus 1,2,4] [--configs zero0,zero1,zero2,zero3]
        [--per-gpu-batch 128] [--steps 20] [--parallel] [--out runs/scaling] [--json FILE]
        [--baseline-json FILE] [key=value ...]

--parallel runs several small runs at once on disjoint GPUs (four 1-GPU runs on a 4-GPU machine,
then two 2-GPU runs): each run has its GPUs to itself, but the runs share the host's CPUs and
disk, which the loader-wait column shows. Without it the runs go one after the other.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_step import add_run_arguments, run_command, start_run, summarise  # noqa: E402


def plan_waves(gpu_counts: list[int], configs: list[str], total_gpus: int, parallel: bool) -> list[list[dict]]:
    """Runs grouped into waves that run at the same time, each run with its own GPU ids."""
    waves = []
    for n in gpu_counts:
        if n > total_gpus:
            raise SystemExit(f"--gpus asks for {n} GPUs but {total_gpus} are available")
        per_wave = total_gpus // n if parallel else 1
        runs = [{"gpus": n, "config": c} for c in configs]
        for start in range(0, len(runs), per_wave):
            wave = runs[start : start + per_wave]
            for slot, run in enumerate(wave):
                run["gpu_ids"] = list(range(slot * n, (slot + 1) * n))
            waves.append(wave)
    return waves


def add_scaling(rows: list[dict], baselines: list[dict] = ()) -> None:
    """Scaling efficiency: tokens/s per GPU against the 1-GPU run of the same config (from `rows`,
    else from `baselines`: rows of another invocation, read with --baseline-json)."""
    base = {}
    for r in [*baselines, *rows]:  # this invocation's own 1-GPU runs win
        if r["gpus"] == 1 and "tokens_per_gpu" in r:
            base[r["config"]] = r["tokens_per_gpu"]
    for r in rows:
        if "tokens_per_gpu" in r and r["config"] in base:
            r["scaling_eff"] = r["tokens_per_gpu"] / base[r["config"]]


def loss_spread(rows: list[dict]) -> dict[int, float]:
    """Per GPU count: (max - min) / min of the last losses across configs."""
    out = {}
    for n in sorted({r["gpus"] for r in rows}):
        losses = [r["last_loss"] for r in rows if r["gpus"] == n and "last_loss" in r]
        if len(losses) > 1:
            out[n] = (max(losses) - min(losses)) / min(losses)
    return out


def format_row(r: dict) -> str:
    head = f"{r['config']:<8}{r['gpus']:>5}{r['global_batch']:>7}"
    if "error" in r:
        return f"{head}  {r['error']}"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    eff = f"{100 * r['scaling_eff']:.1f}%" if "scaling_eff" in r else "-"
    return (f"{head}{r['s_per_step']:>9.4f}{r['tokens_per_s']:>11.0f}{r['tokens_per_gpu']:>11.0f}{eff:>8}{mfu:>7}"
            f"{r['peak_gib']:>9.1f}{r['data_wait_ms']:>8.2f}{r['last_loss']:>10.4f}{r['wall_s']:>7.0f}")


HEADER = (f"{'config':<8}{'gpus':>5}{'batch':>7}{'s/step':>9}{'tokens/s':>11}{'tok/s/GPU':>11}{'scaling':>8}"
          f"{'MFU':>7}{'peak GiB':>9}{'wait ms':>8}{'last loss':>10}{'wall s':>7}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser)
    parser.add_argument("--configs", default="zero0,zero1,zero2,zero3", help="ds_configs/<name>.json, comma list")
    parser.add_argument("--gpus", default="1,2,4", help="GPU counts, comma list")
    parser.add_argument("--per-gpu-batch", type=int, default=128, help="sequences per GPU per step (grad_acc 1)")
    parser.add_argument("--total-gpus", type=int, default=None, help="GPUs on this machine (default: all CUDA ones)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--parallel", action="store_true", help="run small runs side by side on disjoint GPUs")
    parser.add_argument("--out", default="runs/scaling")
    parser.add_argument("--json", default="", help="append one JSON line per run to this file")
    parser.add_argument("--baseline-json", default="",
                        help="1-GPU rows of another invocation (its --json file) for the scaling column")
    args, overrides = parser.parse_known_args()
    total_gpus = args.total_gpus
    if total_gpus is None:
        import torch

        total_gpus = torch.cuda.device_count()
        if total_gpus == 0:
            raise SystemExit("no CUDA GPU: pass --total-gpus N to run N CPU processes per slot (tests only)")
    gpu_counts = [int(g) for g in args.gpus.split(",")]
    configs = args.configs.split(",")
    Path(args.out).mkdir(parents=True, exist_ok=True)

    baselines = []
    if args.baseline_json:
        baselines = [json.loads(line) for line in Path(args.baseline_json).read_text().splitlines() if line.strip()]
    rows = []
    print(HEADER, flush=True)
    for wave in plan_waves(gpu_counts, configs, total_gpus, args.parallel):
        started = []
        for run in wave:
            n, name = run["gpus"], run["config"]
            tag = f"{name}_{n}gpu"
            out, log_path = Path(args.out) / tag, Path(args.out) / f"{tag}.log"
            global_batch = args.per_gpu_batch * n
            cmd = run_command(f"ds_configs/{name}.json", args,
                              [f"optim.batch_size={global_batch}", "optim.grad_acc=1", *overrides], out, n)
            started.append((run, out, log_path, global_batch, time.time(),
                            start_run(cmd, log_path, run["gpu_ids"])))
        for run, out, log_path, global_batch, t0, proc in started:
            proc.wait()
            row = {"config": run["config"], "gpus": run["gpus"], "global_batch": global_batch,
                   **summarise(out, proc.returncode, log_path, time.time() - t0)}
            if "tokens_per_s" in row:
                row["tokens_per_gpu"] = row["tokens_per_s"] / run["gpus"]
            rows.append(row)
        add_scaling(rows, baselines)
        for row in rows[-len(wave):]:
            print(format_row(row), flush=True)
            if args.json:  # row by row: a run cut short by a time limit keeps what finished
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")

    print("\nsame rows, scaling efficiency filled in (tokens/s per GPU against 1 GPU, same config):")
    print(HEADER)
    for row in rows:
        print(format_row(row))
    for n, spread in loss_spread(rows).items():
        print(f"{n} GPU(s): last losses of {', '.join(configs)} within {100 * spread:.2f}% of each other")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
