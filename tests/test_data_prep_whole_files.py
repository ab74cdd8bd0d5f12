"""Workers that read whole files (enough line-per-document files per worker) give the shards and
manifest of an in-process run byte for byte, with a file without a final newline, a plain file, an
empty file and a broken gzip among them, and resume byte-identically after a kill."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.chunk_encoding import UnitTask, iter_chunks
from data_prep.shard import KILL_AFTER_SHARD_ENV, ShardConfig, load_progress, run_sharding
from data_prep.shard_config import DataError, resolve_split_sources
from data_prep.shard_format import load_manifest

OPTS = {"rows_per_shard": 16, "rows_per_block": 4, "chunk_docs": 37, "progress": False}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, c4_train_path: Path, c4_validation_path: Path) -> str:
    """The bundled C4 train file as 8 files (C4 names) and its validation file as it is."""
    root = tmp_path_factory.mktemp("corpus")
    lines = gzip.decompress(c4_train_path.read_bytes()).splitlines(keepends=True)
    pieces = [b"".join(lines[i * len(lines) // 7 : (i + 1) * len(lines) // 7]) for i in range(7)]
    for i, data in enumerate(pieces[:4] + [b""] + pieces[4:]):
        name = root / f"c4-train.{i:05d}-of-00008.json"
        if i == 2:
            name.write_bytes(data.rstrip(b"\n"))  # no final newline; plain
        elif i == 6:
            name.with_suffix(".json.gz").write_bytes(gzip.compress(data)[:-4000])  # broken gzip stream
        else:
            name.with_suffix(".json.gz").write_bytes(gzip.compress(data))
    (root / c4_validation_path.name).symlink_to(c4_validation_path)
    return str(root / "c4-*.json*")


def shard(out: Path, corpus: str, workers: int) -> dict:
    return run_sharding(ShardConfig(input=corpus, output=str(out), workers=workers, **OPTS))


def dataset_bytes(data_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.rglob("*"))
            if p.is_file() and p.name not in ("manifest.json", "progress.json")}


def without_run(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "run"}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, corpus: str) -> Path:
    out = tmp_path_factory.mktemp("w0") / "ds"
    shard(out, corpus, workers=0)
    return out


def test_whole_files_only_with_enough_files_per_worker(tmp_path: Path, corpus: str):
    cfg = ShardConfig(input=corpus, output=str(tmp_path), workers=2, **OPTS)
    train = resolve_split_sources(cfg)["train"]
    assert [type(t) for t in iter_chunks(train, (0, 0), 37, workers=2)] == [UnitTask] * 8
    assert {type(t) for t in iter_chunks(train, (0, 0), 37, workers=3)} != {UnitTask}
    assert {type(t) for t in iter_chunks(train, (0, 0), 37, workers=0)} != {UnitTask}


def test_workers_reading_whole_files_match_in_process_run(tmp_path: Path, corpus: str, in_process: Path):
    manifest = shard(tmp_path / "w2", corpus, workers=2)
    assert manifest["splits"]["train"]["skipped"] == {"corrupt_gzip": 1}
    assert dataset_bytes(tmp_path / "w2") == dataset_bytes(in_process)  # no spill file is left either
    assert without_run(manifest) == without_run(load_manifest(in_process))


def test_resume_after_kill_with_whole_files(tmp_path: Path, corpus: str, in_process: Path, repo_root: Path):
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "data_prep.shard", "--input", corpus, "--output", str(out), "--workers", "2",
           "--rows-per-shard", "16", "--rows-per-block", "4", "--chunk-docs", "37", "--no-progress", "-q"]
    env = dict(os.environ, PYTHONPATH=str(repo_root), **{KILL_AFTER_SHARD_ENV: "11"})
    killed = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True)
    assert killed.returncode == 75, killed.stderr
    position = load_progress(out)["splits"]["train"]["position"]
    assert position[0] > 0 and position[1] > 0, "the kill should fall inside a later file"
    env.pop(KILL_AFTER_SHARD_ENV)
    resumed = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert dataset_bytes(out) == dataset_bytes(in_process)
    assert without_run(load_manifest(out)) == without_run(load_manifest(in_process))


def test_strict_stops_at_the_broken_file_and_keeps_finished_shards(tmp_path: Path, corpus: str, in_process: Path):
    out = tmp_path / "strict"
    with pytest.raises(DataError, match=r"c4-train\.00006-of-00008\.json\.gz:\d+: corrupt_gzip:.*--strict"):
        run_sharding(ShardConfig(input=corpus, output=str(out), workers=2, strict=True, **OPTS))
    kept = sorted((out / "train").glob("shard-*.tar"))
    assert kept and all(p.read_bytes() == (in_process / "train" / p.name).read_bytes() for p in kept)
    assert not (out / ".train-unit-tokens").exists()
