"""`python -m data_prep.verify`: passes a clean directory, catches damaged shards and manifests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.shard import ShardConfig, run_sharding
from data_prep.shard_format import encode_shard, write_shard_atomic
from data_prep.verify import main as verify_main
from data_prep.verify import verify_dataset


@pytest.fixture(scope="module")
def clean_dir(tmp_path_factory, c4_validation_path: Path) -> Path:
    out = tmp_path_factory.mktemp("verify") / "ds"
    run_sharding(
        ShardConfig(
            input=str(c4_validation_path),
            output=str(out),
            rows_per_shard=40,
            rows_per_block=16,
            workers=0,
            progress=False,
        )
    )
    return out


@pytest.fixture
def ds(clean_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ds"
    shutil.copytree(clean_dir, copy)
    return copy


def test_clean_directory_passes(clean_dir: Path, repo_root: Path, capsys):
    assert verify_main([str(clean_dir)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "OK:" in out[0] and "tokenizer hash ok" in out[0]
    proc = subprocess.run(
        [sys.executable, "-m", "data_prep.verify", str(clean_dir)],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_flipped_byte_is_caught(ds: Path, capsys):
    shard = ds / "train" / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verify_main([str(ds)]) == 1
    out = capsys.readouterr().out
    assert f"{shard}: sha256" in out and out.count("PROBLEM") == 1


def test_truncated_shard_is_caught(ds: Path, capsys):
    shard = ds / "train" / "shard-000001.tar"
    shard.write_bytes(shard.read_bytes()[:5000])
    assert verify_main([str(ds)]) == 1
    out = capsys.readouterr().out
    assert f"{shard}: sha256" in out
    assert f"{shard}: cannot read" in out or "rows / " in out


def test_missing_shard_and_wrong_totals_are_caught(ds: Path):
    (ds / "train" / "shard-000000.tar").unlink()
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][1]["rows"] += 1
    (ds / "manifest.json").write_text(json.dumps(manifest))
    problems, _ = verify_dataset(ds)
    assert any("shard-000000.tar: missing" in p for p in problems)
    assert any("shard-000001.tar: 40 rows" in p for p in problems)
    assert any(p.startswith("split train: shards sum to") for p in problems)


def test_out_of_vocabulary_id_is_caught(ds: Path):
    manifest = json.loads((ds / "manifest.json").read_text())
    rows = np.full((40, manifest["row_length"]), 5, dtype=np.uint16)
    rows[3, 7] = 32100  # first id past the T5 vocabulary (pieces + sentinels)
    digest = write_shard_atomic(ds / "train" / "shard-000000.tar", encode_shard(rows, 0, 16))
    manifest["splits"]["train"]["shards"][0]["sha256"] = digest
    (ds / "manifest.json").write_text(json.dumps(manifest))
    problems, _ = verify_dataset(ds)
    assert problems == [
        f"{ds / 'train' / 'shard-000000.tar'}: block 000000-0000 holds id 32100 >= vocab_size 32100"
    ]


def test_tokenizer_hash_mismatch_is_caught(ds: Path, spiece_path: Path, tmp_path: Path):
    other = tmp_path / "other.model"
    other.write_bytes(spiece_path.read_bytes() + b"\0")
    problems, _ = verify_dataset(ds, tokenizer=str(other))
    assert len(problems) == 1 and "sha256" in problems[0] and "another tokenizer" in problems[0]
    assert verify_dataset(ds, tokenizer=str(spiece_path))[0] == []


def test_a_dataset_without_shards_fails(ds: Path, capsys):
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["splits"] = {"train": {**manifest["splits"]["train"], "shards": [], "rows": 0, "tokens": 0}}
    (ds / "manifest.json").write_text(json.dumps(manifest))
    problems, _ = verify_dataset(ds)
    assert any("train holds no shards" in p for p in problems), problems
    assert verify_main([str(ds)]) == 1
    assert "OK" not in capsys.readouterr().out
