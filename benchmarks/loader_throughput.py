"""Samples/s of the pre-training loader (read + shuffle + span corruption + DataLoader workers).

    python benchmarks/loader_throughput.py                      # shards built from the bundled C4
    python benchmarks/loader_throughput.py --data-dir data/c4   # a dataset from `python -m data_prep.shard`
    python benchmarks/loader_throughput.py --workers 0 1 2 4 8 --seconds 20

Without --data-dir it shards --replicate copies of the bundled C4 train file with `data_prep.shard`
(the T5 SentencePiece model, 568-token rows), so that the random reads span several shards. It then
pulls micro-batches as one rank of a training job does and prints samples/s next to what one GPU
consumes at batch 128 and 0.12 s a step (~1067 samples/s, faster than T5 base trains on an H100):
a ratio above 1 means the loader keeps up.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.shard import ShardConfig, run_sharding  # noqa: E402
from data_prep.shard_format import load_manifest  # noqa: E402
from training.data import EpochPermutation, PretrainBatches, SpanCorruption  # noqa: E402

BUNDLED_C4 = REPO / "assets" / "c4" / "en" / "c4-train.00000-of-01024.json.gz"
GPU_SAMPLES_PER_S = 128 / 0.12  # batch 128 per 0.12 s step, per GPU


def build_bundled_c4_dataset(out: Path, replicate: int, rows_per_shard: int) -> Path:
    """Shard `replicate` copies of the bundled C4 train file with `data_prep.shard` into out/shards."""
    text = out / "text"
    text.mkdir(parents=True, exist_ok=True)
    for i in range(replicate):
        link = text / f"c4_copy{i:03d}.json.gz"
        if not link.exists():
            link.symlink_to(BUNDLED_C4)
    manifest = run_sharding(ShardConfig(input=str(text / "*.json.gz"), output=str(out / "shards"), progress=False,
                                        rows_per_shard=rows_per_shard, workers=min(replicate, os.cpu_count() or 1)))
    rows = manifest["splits"]["train"]["rows"]
    print(f"built {out / 'shards'}: {rows} rows of {manifest['row_length']} tokens ({replicate} copies of the text)")
    return out / "shards"


def component_costs(loader: PretrainBatches, batch: int = 128, repeats: int = 20) -> dict[str, float]:
    """Microseconds per sample of each stage, in this process, after the shard indexes are parsed."""
    n = loader.rows_per_epoch
    perm = EpochPermutation(n, seed=0, epoch=0)
    corruption = SpanCorruption()
    loader.store.read(loader.store.shard_starts[:-1])  # parse every shard's index once (first touch)
    t_perm = t_read = t_corrupt = 0.0
    for i in range(repeats):
        positions = (np.arange(batch) + i * batch) % n
        t0 = time.perf_counter()
        rows_ids = perm(positions)
        t1 = time.perf_counter()
        rows = loader.store.read(rows_ids)
        t2 = time.perf_counter()
        corruption.corrupt(rows, positions, seed=0)
        t3 = time.perf_counter()
        t_perm, t_read, t_corrupt = t_perm + t1 - t0, t_read + t2 - t1, t_corrupt + t3 - t2
    per = 1e6 / (batch * repeats)
    return {"permute_us": t_perm * per, "read_us": t_read * per, "corrupt_us": t_corrupt * per}


def open_loader(data_dir: Path, **options) -> PretrainBatches:
    """The train split's loader as rank 0 of 1 sees it, seed 0."""
    sha = load_manifest(data_dir)["tokenizer"]["sha256"]
    return PretrainBatches(data_dir, "train", rank=0, world_size=1, seed=0, expected_tokenizer_sha256=sha, **options)


def measure(data_dir: Path, workers: int, micro_batch: int, grad_acc: int, seconds: float, pin_memory: bool) -> float:
    loader = open_loader(data_dir, micro_batch_size=micro_batch, grad_acc=grad_acc, num_workers=workers,
                         prefetch_factor=4, pin_memory=pin_memory)  # fmt: skip
    it = iter(loader)
    for _ in range(max(2, 2 * workers)):  # worker start-up and first shard maps are not throughput
        next(it)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = next(it)
        count += len(batch["input_ids"])
    return count / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, help="prepared dataset (default: build one from bundled C4)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--grad-acc", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per worker count")
    parser.add_argument("--replicate", type=int, default=20, help="copies of the bundled text (no --data-dir)")
    parser.add_argument("--rows-per-shard", type=int, default=2048)
    parser.add_argument("--pin-memory", action="store_true", help="pin batches (needs CUDA)")
    parser.add_argument("--keep", type=Path, help="write the built dataset here and keep it")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = build_bundled_c4_dataset(args.keep or Path(tmp), args.replicate, args.rows_per_shard)
        probe = open_loader(data_dir, micro_batch_size=1, grad_acc=1, num_workers=0)
        costs = component_costs(probe)
        print(f"cpu cores: {os.cpu_count()}; rows in split: {probe.rows_per_epoch}")
        print("per sample, one process: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
        print(f"GPU consumption target: {GPU_SAMPLES_PER_S:.0f} samples/s (batch 128 per 0.12 s step)")
        print(f"micro-batch {args.micro_batch}, grad_acc {args.grad_acc}, pin_memory {args.pin_memory}")
        print(f"{'workers':>8} {'samples/s':>10} {'x GPU need':>10}")
        for workers in args.workers:
            rate = measure(data_dir, workers, args.micro_batch, args.grad_acc, args.seconds, args.pin_memory)
            print(f"{workers:>8} {rate:>10.0f} {rate / GPU_SAMPLES_PER_S:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
