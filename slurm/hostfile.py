#!/usr/bin/env python3
"""SLURM node lists -> host names -> a DeepSpeed hostfile.

    python slurm/hostfile.py                                   # inside a job: this allocation
    python slurm/hostfile.py --nodelist 'gpu[01-03,07]' --slots 8
    gpu01 slots=8
    gpu02 slots=8
    ...
    python slurm/hostfile.py --first                           # the first host (rank 0, MASTER_ADDR)

Host names come from `scontrol show hostnames` when SLURM's tools are present, else from the
pure-Python expansion below (SLURM's hostlist syntax: `gpu[01-03,07]`, `a[1-2],b3`, `node-[001-002]-ib`,
`rack[1-2]-n[1-2]`; zero padding follows the lower bound of each range). Slots per node: `--slots`, else
SLURM_GPUS_ON_NODE, else the job's tasks per node (SLURM_TASKS_PER_NODE, e.g. `8(x2),4`), else 1.

Standard library only: it runs before any environment is activated.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
import subprocess
import sys


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in node list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in node list {text!r}")
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unclosed '[' in node list {text!r}")
    parts.append(text[start:])
    return parts


def _expand_range_set(body: str, nodelist: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (width of each range = width of its lower bound)."""
    values = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in node list {nodelist!r}: expected N or N-M with digits")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in node list {nodelist!r}")
        width = len(lo)
        values.extend(f"{n:0{width}d}" for n in range(int(lo), int(hi) + 1))
    return values


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list into host names, in order, like `scontrol show hostnames`."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise ValueError("empty node list: run inside a SLURM job (SLURM_JOB_NODELIST) or pass --nodelist")
    hosts = []
    for item in _split_top_level(nodelist):
        if not item:
            raise ValueError(f"empty entry in node list {nodelist!r}")
        # Literal text and [range] groups alternate; several groups give their cartesian product.
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices = [_expand_range_set(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def expand_counts(spec: str) -> list[int]:
    """SLURM's per-node counts ('8(x2),4', as in SLURM_TASKS_PER_NODE) -> [8, 8, 4]."""
    counts = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"bad per-node count {item!r} in {spec!r}: expected N or N(xK)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def hostnames(nodelist: str, use_scontrol: bool = True) -> list[str]:
    """Host names of `nodelist`: SLURM's own expansion when `scontrol` exists, else expand_nodelist."""
    if use_scontrol and shutil.which("scontrol"):
        try:
            proc = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
            )
        except subprocess.TimeoutExpired:  # scontrol retries a missing slurm.conf for a minute
            proc = None
        if proc is not None and proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.split()
    return expand_nodelist(nodelist)


def slots_per_node(n_hosts: int, slots: int | None = None, env: dict[str, str] | None = None) -> list[int]:
    """Slots for each of `n_hosts` nodes: `slots`, else GPUs on the node, else tasks per node, else 1."""
    env = os.environ if env is None else env
    if slots is not None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        return [slots] * n_hosts
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        return [int(gpus)] * n_hosts
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE"):
        if env.get(name):
            counts = expand_counts(env[name])
            if len(counts) == n_hosts:
                return counts
    return [1] * n_hosts


def hostfile_lines(hosts: list[str], slots: int | list[int]) -> list[str]:
    """DeepSpeed hostfile lines, `host slots=N`."""
    per_node = [slots] * len(hosts) if isinstance(slots, int) else list(slots)
    if len(per_node) != len(hosts):
        raise ValueError(f"{len(per_node)} slot counts for {len(hosts)} hosts")
    return [f"{host} slots={n}" for host, n in zip(hosts, per_node)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nodelist",
        default=os.environ.get("SLURM_JOB_NODELIST", ""),
        help="SLURM node list (default: $SLURM_JOB_NODELIST)",
    )
    parser.add_argument("--slots", type=int, default=None, help="slots (GPUs) per node")
    parser.add_argument("--output", default="-", help="hostfile to write ('-': stdout)")
    parser.add_argument("--first", action="store_true", help="print only the first host name")
    parser.add_argument("--no-scontrol", action="store_true", help="always use the built-in expansion")
    args = parser.parse_args(argv)
    try:
        hosts = hostnames(args.nodelist, use_scontrol=not args.no_scontrol)
        if args.first:
            print(hosts[0])
            return 0
        lines = hostfile_lines(hosts, slots_per_node(len(hosts), args.slots))
    except ValueError as e:
        print(f"hostfile.py: {e}", file=sys.stderr)
        return 2
    text = "\n".join(lines) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
