"""Seconds per checkpoint for the content checksums of training/checkpoint.py, on files of the size of a
T5 v1.1 checkpoint under ZeRO 0.

    python benchmarks/checkpoint_checksums.py [--preset base] [--dir /tmp] [--threads 1 2 4]

Builds a checkpoint directory like the trainer's: `mp_rank_00_model_states.pt` with the fp32 weights
and AdamW's two moments (3 x 4 bytes per parameter, counted from the preset on the meta device) and a
small `rank_state_0.pt`, filled with random bytes (hashing does not depend on what the bytes are).
It then measures, for each thread count, what a save adds (hashing the files just written, from the
page cache) and what a resume adds (verifying them after they are evicted from the page cache, i.e.
read from the disk; and again with them cached). Each rank of a multi-GPU run hashes 1/world of the
blocks, so these are the one-rank figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training.checkpoint_checksums import (  # noqa: E402
    META_NAME,
    blocks,
    checksum_record,
    default_threads,
    hash_blocks,
    verify_checkpoint,
)
from training.model import T5Config, T5ForConditionalGeneration  # noqa: E402

_CHUNK = 64 << 20


def parameter_count(preset: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in T5ForConditionalGeneration(T5Config.from_preset(preset)).parameters())


def write_random_file(path: Path, size: int, rng: np.random.Generator) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(_CHUNK, left)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n
        f.flush()
        os.fsync(f.fileno())


def evict(directory: Path) -> None:
    """Drop the directory's files from the page cache (they are on disk: written with fsync)."""
    for p in directory.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base", help="T5 v1.1 size whose ZeRO 0 checkpoint to imitate")
    parser.add_argument("--dir", default=None, help="where to write it (default: the system's temp dir)")
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, default_threads()}))
    args = parser.parse_args(argv)

    params = parameter_count(args.preset)
    files = {"mp_rank_00_model_states.pt": 12 * params, "rank_state_0.pt": 20_000}
    root = Path(tempfile.mkdtemp(prefix="ckpt_checksums_", dir=args.dir))
    try:
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for name, size in files.items():
            write_random_file(root / name, size, rng)
        write_s = time.perf_counter() - t0
        total = sum(files.values())
        print(f"T5 v1.1 {args.preset}: {params / 1e6:.1f}M parameters; ZeRO 0 checkpoint {total / 1e9:.2f} GB "
              f"(fp32 weights + 2 AdamW moments) in {root}; writing it took {write_s:.1f} s "
              f"({os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f})")
        units = blocks(files)
        for threads in args.threads:
            t0 = time.perf_counter()
            record = checksum_record(files, hash_blocks(root, units, threads))
            save_s = time.perf_counter() - t0
            (root / META_NAME).write_text(json.dumps({"files": files, "checksums": record}))
            evict(root)
            t0 = time.perf_counter()
            found, _ = verify_checkpoint(root, threads=threads)
            cold_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            found_warm, _ = verify_checkpoint(root, threads=threads)
            warm_s = time.perf_counter() - t0
            assert not found and not found_warm, found + found_warm
            print(f"threads {threads}: save (files cached) {save_s:.2f} s = {total / save_s / 1e9:.2f} GB/s; "
                  f"verify from disk {cold_s:.2f} s = {total / cold_s / 1e9:.2f} GB/s; "
                  f"verify cached {warm_s:.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
