"""Held-out loss of model or kernel variants over one short pre-training schedule, several seeds.

Runs `training/pretrain.py` (real shards, a shipped run config, one ds_config) once per variant and
seed, with evaluation on the shards' validation split every --eval-every steps, and prints one row
per run (held-out loss at each evaluation, held-out token accuracy and the mean train loss of the
last logging window at the end, s/step, peak GPU memory; for ul2 / prefix_lm a second line with
each denoiser's final held-out loss), then per variant the mean final held-out
loss over the seeds and its gap to the first variant, next to the spread between seeds. Within
one variant the seed sets the initial weights and the data order; across variants each seed is
the same, so a variant's gap is read against how far the seeds (and repeated runs) differ.

    python benchmarks/convergence.py --data DIR --variants "default=;quack=model.ffn_kernel=quack"
        [--seeds 0,1] [--steps 600] [--warmup 100] [--eval-every 150] [--configs zero0]
        [--out runs/convergence] [--json FILE] [--table-only] [key=value ...]   # overrides for every run

A variant is NAME=OVERRIDES, the overrides space-separated run-config keys (empty: the config as
shipped); variants are separated by ';'. Each run has its directory in --out, NAME_seedN. A run
whose metrics.jsonl already holds the last evaluation is not run again, so a comparison can be
split over several invocations with the same --out (each run's figures come from its own
metrics.jsonl); a run cut short starts over, its records moved aside. A directory holding a run of
another configuration (schedule, seed or overrides: its config.yaml says) stops the script before
anything runs there. --table-only prints the table of what --out holds without running anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_step import add_run_arguments, run_command, start_run, summarise  # noqa: E402
from training.config_loader import load_run_config  # noqa: E402
from training.metrics import read_metrics  # noqa: E402


def parse_variants(text: str) -> dict[str, list[str]]:
    """'a=;b=k=v k2=v2' -> {'a': [], 'b': ['k=v', 'k2=v2']}; names must be unique path-safe words."""
    variants: dict[str, list[str]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, sep, overrides = item.partition("=")
        name = name.strip()
        if not sep or not name.replace("_", "").replace("-", "").isalnum():
            raise SystemExit(f"--variants item {item!r}: write NAME=OVERRIDES, NAME in letters, digits, '-', '_' "
                             f"(an empty OVERRIDES runs the config as shipped)")
        if name in variants:
            raise SystemExit(f"--variants names {name!r} twice; give each variant its own name")
        if bad := [o for o in overrides.split() if "=" not in o]:
            raise SystemExit(f"--variants {name}: {bad} are not key=value run-config overrides")
        variants[name] = overrides.split()
    if not variants:
        raise SystemExit("--variants is empty; e.g. --variants 'default=;quack=model.ffn_kernel=quack'")
    return variants


def run_figures(metrics_path: Path) -> dict | None:
    """A run's held-out losses and end-of-run figures from its metrics.jsonl; None if it holds no
    evaluation. The train loss is the last train record's: the mean over the last logging window."""
    if not metrics_path.exists():
        return None
    evals = read_metrics(metrics_path, "eval")
    if not evals:
        return None
    by_step = {r["step"]: r for r in evals}  # a resumed run may log a step twice: the later wins
    train = read_metrics(metrics_path, "train")
    last = by_step[max(by_step)]
    return {
        "eval_steps": sorted(by_step),
        "eval_losses": [by_step[s]["eval_loss"] for s in sorted(by_step)],
        "final_eval_loss": last["eval_loss"],
        "final_eval_accuracy": last["eval_accuracy"],
        "denoiser_losses": {k[len("eval_loss/"):]: v for k, v in last.items() if k.startswith("eval_loss/")},
        "final_step": max(by_step),
        "train_loss_end": train[-1]["loss"] if train else None,
    }


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_kept_run(out: Path, config_path: str, overrides: list[str]) -> None:
    """Stop if `out` holds a run of another configuration than the one this invocation would run
    there (another schedule, seed or variant under the same name): its figures would be compared as
    if they were this one's. The run directory's config.yaml is the run's resolved config."""
    kept_path = out / "config.yaml"
    if not kept_path.exists():
        return
    expected = _flat(load_run_config(config_path, overrides).to_dict())
    kept = _flat(load_run_config(kept_path).to_dict())
    differ = sorted(k for k in expected.keys() | kept.keys() if expected.get(k) != kept.get(k))
    if differ:
        shown = ", ".join(f"{k}: {kept.get(k)!r} there, {expected.get(k)!r} here" for k in differ[:5])
        raise SystemExit(f"{out} holds a run of another configuration ({shown}). Give this comparison another "
                         f"--out, or another variant name; nothing was run or removed.")


def summarise_variants(rows: list[dict]) -> list[dict]:
    """Per variant (in first-seen order): the mean final held-out loss over its seeds, the spread
    (max - min) between its seeds, and the mean gap to the first variant over the seeds both ran."""
    names = list(dict.fromkeys(r["variant"] for r in rows))
    final = {(r["variant"], r["seed"]): r["final_eval_loss"] for r in rows}
    out = []
    for name in names:
        losses = [final[(n, s)] for (n, s) in final if n == name]
        shared = [s for (n, s) in final if n == name and (names[0], s) in final]
        gaps = [final[(name, s)] - final[(names[0], s)] for s in shared]
        out.append({"variant": name, "seeds": len(losses), "mean_final_eval_loss": statistics.fmean(losses),
                    "seed_spread": max(losses) - min(losses),
                    "mean_gap_to_first": statistics.fmean(gaps) if gaps else None})
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'variant':<14}{'seed':>5}  {'held-out loss at ' + '/'.join(map(str, rows[0]['eval_steps'])):<44}"
          f"{'acc':>7}{'train':>8}{'s/step':>8}{'GiB':>6}", flush=True)
    for r in rows:
        losses = " / ".join(f"{x:.4f}" for x in r["eval_losses"])
        speed = f"{r['s_per_step']:.4f}" if r.get("s_per_step") else "-"
        gib = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
        train = f"{r['train_loss_end']:.3f}" if r["train_loss_end"] is not None else "-"
        print(f"{r['variant']:<14}{r['seed']:>5}  {losses:<44}{r['final_eval_accuracy']:>7.4f}{train:>8}{speed:>8}"
              f"{gib:>6}", flush=True)
        if r.get("denoiser_losses"):  # ul2 / prefix_lm runs: each denoiser's held-out loss at the end
            print("    " + ", ".join(f"{k} {v:.4f}" for k, v in r["denoiser_losses"].items()), flush=True)
    print()
    for s in summarise_variants(rows):
        gap = f"{s['mean_gap_to_first']:+.4f}" if s["mean_gap_to_first"] is not None else "-"
        print(f"{s['variant']:<14} final held-out loss {s['mean_final_eval_loss']:.4f} over {s['seeds']} seed(s), "
              f"spread between seeds {s['seed_spread']:.4f}, gap to {rows[0]['variant']} {gap}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, warmup_default="steps // 6, at least 1")
    parser.add_argument("--variants", required=True, help="NAME=OVERRIDES;NAME=OVERRIDES (see above)")
    parser.add_argument("--seeds", default="0,1", help="comma list of seeds")
    parser.add_argument("--steps", type=int, default=600, help="optim.total_steps: the whole cosine schedule")
    parser.add_argument("--eval-every", type=int, default=150, help="eval.every_steps (and the last step)")
    parser.add_argument("--eval-samples", type=int, default=2048, help="eval.max_samples")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--configs", default="zero0", help="one ds_configs/<name>.json")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    parser.add_argument("--out", default="runs/convergence")
    parser.add_argument("--json", default="", help="write one JSON line per run (all of --out's) to this file")
    parser.add_argument("--table-only", action="store_true", help="print what --out holds; run nothing")
    args, overrides = parser.parse_known_args()
    if args.warmup is None:
        args.warmup = max(1, args.steps // 6)
    if "," in args.configs:
        raise SystemExit("--configs takes one ds_config here: every variant and seed must run the same stage")
    if args.eval_every <= 0 or args.steps % args.eval_every:
        raise SystemExit(f"--eval-every {args.eval_every} must divide --steps {args.steps}, so that every run "
                         f"ends on an evaluation")
    variants = parse_variants(args.variants)
    seeds = [int(s) for s in args.seeds.split(",")]
    ds_config = f"ds_configs/{args.configs}.json"
    plan = []  # (variant, its overrides, seed, run directory, command)
    for name, variant_overrides in variants.items():
        for seed in seeds:
            out = Path(args.out) / f"{name}_seed{seed}"
            cmd = run_command(ds_config, args, [f"seed={seed}", f"eval.every_steps={args.eval_every}",
                                                f"eval.max_samples={args.eval_samples}", *overrides,
                                                *variant_overrides], out, args.nproc)
            check_kept_run(out, args.config, cmd[cmd.index("--deepspeed_config") + 2:])
            plan.append((name, variant_overrides, seed, out, cmd))
    rows = []
    for name, variant_overrides, seed, out, cmd in plan:
        metrics_path, log_path = out / "metrics.jsonl", Path(args.out) / f"{name}_seed{seed}.log"
        figures = run_figures(metrics_path)
        speed: dict = {}
        if figures is None or figures["final_step"] < args.steps:
            if args.table_only:
                continue
            out.mkdir(parents=True, exist_ok=True)
            if metrics_path.exists():  # a run cut short starts over (the schedule is the comparison), its records kept
                metrics_path.rename(out / f"metrics.cut_short.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            start = time.time()
            proc = start_run(cmd, log_path)
            proc.wait()
            speed = summarise(out, proc.returncode, log_path, time.time() - start)
            if "error" in speed:
                print(f"{name} seed {seed}: {speed['error']}", flush=True)
                continue
            figures = run_figures(metrics_path)
        if figures is None:
            print(f"{name} seed {seed}: no evaluation in {metrics_path}", flush=True)
            continue
        if not speed:  # a run kept from an earlier invocation: its speed from its metrics.jsonl
            speed = summarise(out, 0, log_path, 0.0)
        rows.append({"variant": name, "seed": seed, "overrides": variant_overrides, **figures,
                     "s_per_step": speed.get("s_per_step"), "peak_gib": speed.get("peak_gib")})
        print(f"done: {name} seed {seed}: held-out loss {figures['final_eval_loss']:.4f} at step "
              f"{figures['final_step']}", flush=True)
    if not rows:
        print("no finished runs", flush=True)
        return 1
    if args.json:
        Path(args.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
