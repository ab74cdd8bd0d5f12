"""Samples/s of the pre-training loader (read + shuffle + span corruption + DataLoader workers).

    python benchmarks/loader_throughput.py                      # shards built from the bundled C4
    python benchmarks/loader_throughput.py --data-dir data/c4   # a dataset from `python -m data_prep.shard`
    python benchmarks/loader_throughput.py --workers 0 1 2 4 8 --seconds 20

Without --data-dir it tokenises the bundled C4 train file with the T5 SentencePiece model and writes
shards with `data_prep.shard_format` (the rows repeated --replicate times over several shards, so the
random reads span more files than one small shard). It then pulls micro-batches as one rank of a
training job does and prints samples/s next to what the GPU consumes: a batch of 128 per 0.12 s
step is ~1067 samples/s per GPU (the speed target), so a ratio above 1 means the loader keeps up.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.shard_format import (  # noqa: E402
    FORMAT_NAME,
    FORMAT_VERSION,
    encode_shard,
    load_manifest,
    sha256_file,
    shard_name,
    write_shard_atomic,
)
from training.data import EpochPermutation, PretrainBatches, SpanCorruption  # noqa: E402

GPU_SAMPLES_PER_S = 128 / 0.12  # batch 128 per 0.12 s step, per GPU


def build_bundled_c4_dataset(out: Path, replicate: int, rows_per_shard: int) -> Path:
    """Tokenise assets/c4 train into rows of 568 tokens and write shards + manifest."""
    import sentencepiece as spm

    spiece = REPO / "assets" / "t5" / "spiece.model"
    sp = spm.SentencePieceProcessor(model_file=str(spiece))
    stream: list[int] = []
    with gzip.open(REPO / "assets" / "c4" / "en" / "c4-train.00000-of-01024.json.gz", "rt") as f:
        for line in f:
            stream.extend(sp.encode(json.loads(line)["text"]) + [1])
    n = len(stream) // 568
    rows = np.tile(np.array(stream[: n * 568], dtype=np.uint16).reshape(n, 568), (replicate, 1))
    (out / "train").mkdir(parents=True, exist_ok=True)
    entries = []
    for index, start in enumerate(range(0, len(rows), rows_per_shard)):
        shard = rows[start : start + rows_per_shard]
        rel = f"train/{shard_name(index)}"
        digest = write_shard_atomic(out / rel, encode_shard(shard, index, rows_per_block=1024))
        entries.append({"path": rel, "rows": len(shard), "tokens": int(shard.size), "sha256": digest})
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "row_length": 568,
        "dtype": "uint16",
        "tokenizer": {
            "sha256": sha256_file(spiece),
            "vocab_size": 32100,
            "eos_id": 1,
            "pad_id": 0,
            "path": str(spiece),
        },
        "splits": {"train": {"shards": entries, "rows": len(rows), "tokens": int(rows.size)}},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"built {out}: {len(rows)} rows of 568 tokens in {len(entries)} shards ({n} distinct rows)")
    return out


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


def measure(
    data_dir: Path, workers: int, micro_batch: int, grad_acc: int, seconds: float, pin_memory: bool
) -> float:
    loader = PretrainBatches(
        data_dir,
        "train",
        rank=0,
        world_size=1,
        micro_batch_size=micro_batch,
        grad_acc=grad_acc,
        seed=0,
        num_workers=workers,
        prefetch_factor=4,
        pin_memory=pin_memory,
        expected_tokenizer_sha256=load_manifest(data_dir)["tokenizer"]["sha256"],
    )
    it = iter(loader)
    for _ in range(max(2, 2 * workers)):  # worker start-up and first shard maps are not throughput
        next(it)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        batch = next(it)
        count += len(batch["input_ids"])
    return count / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", type=Path, help="prepared dataset (default: build one from bundled C4)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--grad-acc", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per worker count")
    parser.add_argument(
        "--replicate", type=int, default=20, help="copies of the bundled rows (no --data-dir)"
    )
    parser.add_argument("--rows-per-shard", type=int, default=2048)
    parser.add_argument("--pin-memory", action="store_true", help="pin batches (needs CUDA)")
    parser.add_argument("--keep", type=Path, help="write the built dataset here and keep it")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir
        if data_dir is None:
            data_dir = build_bundled_c4_dataset(args.keep or Path(tmp), args.replicate, args.rows_per_shard)
        probe = PretrainBatches(
            data_dir,
            "train",
            rank=0,
            world_size=1,
            micro_batch_size=1,
            grad_acc=1,
            seed=0,
            num_workers=0,
            expected_tokenizer_sha256=load_manifest(data_dir)["tokenizer"]["sha256"],
        )
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
