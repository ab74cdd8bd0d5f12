"""A stand-in for training/pretrain.py that honours its launch contract, for fast tests of the SLURM scripts.

    python tests/fake_trainer.py --config CFG.yaml [--deepspeed_config DS.json] [key=value ...]

What it shares with the real trainer (see tests/test_slurm.py):
- rank / world size from RANK, WORLD_SIZE, LOCAL_RANK (else SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID);
  with more than one rank it joins a torch.distributed gloo group through MASTER_ADDR / MASTER_PORT, so
  wrong rank variables fail here as they would in the real trainer;
- SIGTERM / SIGUSR1 on any rank: every rank checkpoints at the next step boundary (the stop flag is
  all-reduced) and the process exits 75;
- started on an output_dir that holds a complete checkpoint, it resumes from the newest one;
- writes <output_dir>/metrics.jsonl (kind train / eval / event) and <output_dir>/checkpoints/;
- exit code 0 when done, non-zero on failure.

Its "model" is one number: loss <- 0.97 * loss + 0.01 * sin(step + seed), so an interrupted and resumed
run must end on exactly the loss of an uninterrupted one. Config keys it reads: output_dir, seed,
optim.total_steps, checkpoint.every_steps, logging.every_steps, plus its own:
  fake.step_seconds   sleep per step (default 0.05), so a test can signal mid-run
  fake.fail_at_step   exit with fake.exit_code (default 1) when this step is reached
  fake.hold_at_step   after this step, wait for a stop signal (up to fake.hold_seconds, default 60) before
                      going on: a test that signals at this step cannot lose the race to the run's end
Every rank also appends the launch variables it saw to <output_dir>/ranks.jsonl.
"""

from __future__ import annotations

import signal

# First thing: a stop signal that arrives while Python still imports must not kill the process.
_received: list[int] = []
for _sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(_sig, lambda signum, frame: _received.append(signum))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402

EXIT_REQUEUE = 75


def env_int(*names: str, default: int) -> int:
    for name in names:
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return default


def load_config(path: str, overrides: list[str]) -> dict:
    cfg = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} is not key=value")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    return cfg


def get(cfg: dict, key: str, default=None):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def next_loss(loss: float, step: int, seed: int) -> float:
    return 0.97 * loss + 0.01 * math.sin(step + seed)


class Group:
    """The few collectives the loop needs; a gloo process group when world_size > 1."""

    def __init__(self, rank: int, world_size: int):
        self.world_size = world_size
        self.dist = None
        if world_size > 1:
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size)
            self.dist, self.torch = dist, torch

    def any(self, flag: bool) -> bool:
        if self.dist is None:
            return flag
        t = self.torch.tensor([int(flag)])
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()


def newest_complete(ckpt_dir: Path) -> Path | None:
    done = sorted(p.parent for p in ckpt_dir.glob("step_*/COMPLETE"))
    return done[-1] if done else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--deepspeed_config", default=None)
    parser.add_argument("--local_rank", type=int, default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.deepspeed_config is not None and not Path(args.deepspeed_config).is_file():
        print(f"fake_trainer: --deepspeed_config {args.deepspeed_config} not found", file=sys.stderr)
        return 2
    cfg = load_config(args.config, args.overrides)

    rank = env_int("RANK", "SLURM_PROCID", default=0)
    world_size = env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    out = Path(get(cfg, "output_dir", "runs/fake"))
    ckpt_dir = out / "checkpoints"
    seed = int(get(cfg, "seed", 0))
    total_steps = int(get(cfg, "optim.total_steps", 20))
    ckpt_every = int(get(cfg, "checkpoint.every_steps", 0))
    log_every = int(get(cfg, "logging.every_steps", 1))
    step_seconds = float(get(cfg, "fake.step_seconds", 0.05))
    fail_at = get(cfg, "fake.fail_at_step")
    fail_code = int(get(cfg, "fake.exit_code", 1))
    hold_at = get(cfg, "fake.hold_at_step")
    hold_seconds = float(get(cfg, "fake.hold_seconds", 60))

    out.mkdir(parents=True, exist_ok=True)
    seen = {
        k: os.environ.get(k)
        for k in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "SLURM_PROCID",
            "SLURM_RESTART_COUNT",
            "DS_ACCELERATOR",
        )
    }
    with open(out / "ranks.jsonl", "a") as f:
        f.write(
            json.dumps(
                {
                    "rank": rank,
                    "world_size": world_size,
                    "local_rank": local_rank,
                    "host": socket.gethostname(),
                    "deepspeed_config": args.deepspeed_config,
                    "argv": sys.argv[1:],
                    "env": seen,
                }
            )
            + "\n"
        )
    group = Group(rank, world_size)
    metrics = open(out / "metrics.jsonl", "a") if rank == 0 else None

    def log(kind: str, record: dict) -> None:
        if metrics is not None:
            metrics.write(json.dumps({"kind": kind, "time": time.time(), **record}) + "\n")
            metrics.flush()

    def save(step: int, loss: float) -> None:
        d = ckpt_dir / f"step_{step:08d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank_{rank}.json").write_text(
            json.dumps({"step": step, "loss": loss, "world_size": world_size})
        )
        group.barrier()  # every rank's file is on disk before the checkpoint counts as complete
        if rank == 0:
            (d / "COMPLETE").write_text("")
        group.barrier()
        log("event", {"step": step, "event": "checkpoint", "path": str(d)})

    step, loss = 0, 10.0
    resume = newest_complete(ckpt_dir)
    if resume is not None:
        state = json.loads((resume / "rank_0.json").read_text())
        step, loss = state["step"], state["loss"]
    log("event", {"step": step, "event": "resume" if resume else "start", "world_size": world_size})

    exit_code = 0
    while step < total_steps:
        time.sleep(step_seconds)
        loss = next_loss(loss, step, seed)
        step += 1
        if fail_at is not None and step >= int(fail_at):
            print(f"fake_trainer: failing on purpose at step {step} (fake.fail_at_step)", file=sys.stderr)
            return fail_code  # no clean shutdown, like a crash
        if step % log_every == 0 or step == total_steps:
            log("train", {"step": step, "loss": loss})
        if hold_at is not None and step == int(hold_at):
            deadline = time.monotonic() + hold_seconds
            while not _received and time.monotonic() < deadline:
                time.sleep(0.05)
        if group.any(bool(_received)):
            save(step, loss)
            exit_code = EXIT_REQUEUE
            break
        if ckpt_every and step % ckpt_every == 0 and step < total_steps:
            save(step, loss)
    if exit_code == 0:
        log("eval", {"step": step, "eval_loss": loss})
        save(step, loss)
        if rank == 0:
            print(f"held-out loss {loss:.6f} after {step} steps; run directory {out}", flush=True)
    log("event", {"step": step, "event": "exit", "exit_code": exit_code})
    group.close()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
