"""Sharding throughput next to the raw SentencePiece encode rate on the same text, in one run.

    python -m data_prep.benchmark                       # bundled C4 sample, 1 and 2 workers
    python -m data_prep.benchmark --input 'data/wiki/*.jsonl.gz' --workers 1,2,4,8
    python -m data_prep.benchmark --workers 1,2,4,8,15 --copies 80 --per-worker --repeats 1

Raw rate: `sp.encode(list_of_texts, num_threads=1)` over all documents (one thread, text already in
memory). Sharding rate: wall time of `run_sharding` (pool start, reading + gunzip, JSON parsing,
encoding, packing, writing shards) for each worker count, on the same files. The goal is a per-worker
rate >= 0.8 x the raw rate and near-linear scaling while workers < cores (the main process packs,
and reads too with fewer than 4 files per worker, so it needs a share of a core: `main cores` is its
CPU time, threads included, per wall second). --per-worker reads W x --copies copies with W workers,
so every run lasts about as long and the pool's start-up stays a small share of it; the copies are
links to the same files (SentencePiece keeps no cache: a repeated document costs what a new one does).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import sentencepiece as spm

from data_prep.chunk_encoding import encode_chunk, init_worker
from data_prep.shard import ShardConfig, run_sharding
from data_prep.sources import payload_to_text, resolve_source
from data_prep.tokenizer import DEFAULT_SPIECE, load_tokenizer

BUNDLED = str(Path(__file__).resolve().parents[1] / "assets" / "c4" / "en" / "c4-*.json.gz")


def read_texts(files: list[str], text_field: str) -> list[str]:
    texts = []
    for path in files:
        source = resolve_source(path, kind="files", text_field=text_field)
        for record in source.iter_unit(0):
            text, _, _ = payload_to_text(source.unit_format(0), record.payload, text_field)
            if text is not None:
                texts.append(text)
    return texts


def _cpu_seconds(children: bool = True) -> float:
    """CPU time (user + system) of this process (all its threads) and its finished children (the pool's workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + (kids.ru_utime + kids.ru_stime if children else 0.0)


def raw_encode(sp, texts: list[str]) -> tuple[float, float, int]:
    """(wall s, CPU s, tokens) of one single-thread sp.encode(list_of_texts)."""
    t0, c0 = time.perf_counter(), _cpu_seconds()
    ids = sp.encode(texts, num_threads=1)
    return time.perf_counter() - t0, _cpu_seconds() - c0, sum(len(x) for x in ids)


def pool_startup(workers: int, tokenizer: str) -> float:
    """Wall seconds to start `workers` spawn processes that load the tokenizer and answer once."""
    if workers == 0:
        return 0.0
    t0 = time.perf_counter()
    with ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=init_worker,
        initargs=(tokenizer, "text", "<u2", os.getpid()),
    ) as pool:
        list(pool.map(encode_chunk, ["json"] * workers, [[b'{"text": "warm up"}']] * workers))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_prep.benchmark", description=__doc__.split("\n")[0])
    p.add_argument("--input", default=BUNDLED, help="file glob (default: the bundled C4 sample)")
    p.add_argument("--tokenizer", default=str(DEFAULT_SPIECE), help="SentencePiece .model")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--copies", type=int, default=8, help="read the input files this many times (longer run)")
    p.add_argument("--per-worker", action="store_true", help="W workers read W x --copies copies")
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement; the best is reported")
    p.add_argument("--text-field", default="text")
    args = p.parse_args(argv)
    load_tokenizer(args.tokenizer)  # fail early on a bad path

    files = list(resolve_source(args.input, kind="files", text_field=args.text_field).files)
    with tempfile.TemporaryDirectory(prefix="shard-bench-") as tmp:
        texts = read_texts(files, args.text_field)
        sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
        print(f"machine: {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, "
              f"load average {os.getloadavg()[0]:.1f} at start")  # fmt: skip
        per = " per worker" if args.per_worker else ""
        print(f"input: {args.input} ({len(files)} files x {args.copies} copies{per}, {len(texts)} docs per copy)")
        print(
            "raw = sp.encode(list_of_texts, num_threads=1) on one copy, measured right before each run; "
            "rates in M tokens/s; cpu = tokens per CPU second (main + workers), robust to other load"
        )
        print(
            "startup = wall s to start the pool (spawn, imports, tokenizer load), measured separately; "
            "steady = per-worker rate over (wall - startup), what a long run approaches"
        )
        header = ["workers", "wall s", "raw", "shard", "shard/worker", "per-worker/raw", "startup s"]
        header += ["steady/raw", "raw cpu", "shard cpu", "main cores"]
        print(" ".join(f"{h:>14}" for h in header))
        for workers in [int(w) for w in args.workers.split(",")]:
            # The same files `copies` times (symlinks), named so that no C4 train/validation split applies.
            inputs = Path(tmp) / f"in-{workers}"
            inputs.mkdir()
            for c in range(args.copies * (max(workers, 1) if args.per_worker else 1)):
                for i, f in enumerate(files):
                    suffix = "".join(Path(f).suffixes[-2:]) if f.endswith(".gz") else Path(f).suffix
                    os.symlink(os.path.abspath(f), inputs / f"copy{c:05d}-{i:05d}{suffix}")
            best = None
            for r in range(args.repeats):
                startup = pool_startup(workers, args.tokenizer)
                raw_wall, raw_cpu, raw_tokens = raw_encode(sp, texts)
                out = Path(tmp) / f"out-{workers}-{r}"
                cfg = ShardConfig(
                    input=str(inputs / "*"), output=str(out), tokenizer=args.tokenizer,
                    text_field=args.text_field, workers=workers, progress=False,
                )  # fmt: skip
                t0, c0, m0 = time.perf_counter(), _cpu_seconds(), _cpu_seconds(children=False)
                manifest = run_sharding(cfg)
                wall, cpu, main_cpu = time.perf_counter() - t0, _cpu_seconds() - c0, _cpu_seconds(False) - m0
                split = manifest["splits"]["train"]
                tokens = split["tokens"] + split["dropped_tail_tokens"]
                row = (wall, raw_tokens / raw_wall, tokens / wall, raw_tokens / raw_cpu, tokens / cpu, startup, tokens,
                       main_cpu / wall)  # fmt: skip
                if best is None or row[0] < best[0]:
                    best = row
                shutil.rmtree(out)
            wall, raw, rate, raw_cpu, cpu, startup, tokens, main_cores = best
            per_worker = rate / max(workers, 1)
            steady = tokens / max(wall - startup, 1e-9) / max(workers, 1)
            cells = [f"{workers}", f"{wall:.2f}", f"{raw / 1e6:.3f}", f"{rate / 1e6:.3f}", f"{per_worker / 1e6:.3f}",
                     f"{per_worker / raw:.2f}", f"{startup:.2f}", f"{steady / raw:.2f}",
                     f"{raw_cpu / 1e6:.3f}", f"{cpu / 1e6:.3f}", f"{main_cores:.2f}"]  # fmt: skip
            print(" ".join(f"{c:>14}" for c in cells))
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
