"""Sharding on several nodes: `data_prep.shard --part K/N` per node, then `data_prep.join`, gives the
files of one run over the whole input byte for byte; the join refuses, in one line with exit 2 and
without touching what is written, missing, unfinished or mismatched parts and a second join."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.join import main as join_main
from data_prep.shard import KILL_AFTER_SHARD_ENV
from data_prep.shard import main as shard_main
from data_prep.verify import verify_dataset

OPTS = ["--rows-per-shard", "16", "--rows-per-block", "4", "--no-progress", "-q"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, c4_train_path: Path, c4_validation_path: Path) -> str:
    """The bundled C4 sample as 4 train and 2 validation files (C4 names), so that 3 parts each get some."""
    root = tmp_path_factory.mktemp("corpus")
    for path, name, pieces in ((c4_train_path, "train", 4), (c4_validation_path, "validation", 2)):
        lines = gzip.decompress(path.read_bytes()).splitlines(keepends=True)
        for i in range(pieces):
            part = lines[i * len(lines) // pieces : (i + 1) * len(lines) // pieces]
            (root / f"c4-{name}.{i:05d}-of-{pieces:05d}.json.gz").write_bytes(gzip.compress(b"".join(part)))
    return str(root / "c4-*.json.gz")


def files(data_dir: Path) -> dict[str, bytes]:
    """Every file of the dataset proper: the shards, and the manifest without its `run` record."""
    out = {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.glob("*/shard-*.tar"))
           if not p.parent.name.startswith("part-")}
    manifest = json.loads((data_dir / "manifest.json").read_text())
    run = manifest.pop("run")
    out["manifest.json"] = json.dumps(manifest).encode()
    return out | {"run": run}


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def shard_part(corpus: str, out: Path, k: int, n: int = 3, *extra: str) -> int:
    return shard_main(["--input", corpus, "--output", str(out), "--workers", "0", "--part", f"{k}/{n}", *OPTS, *extra])


def refused(capsys, call, *args) -> str:
    capsys.readouterr()
    assert call(*args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def one_run(tmp_path_factory, corpus: str) -> Path:
    out = tmp_path_factory.mktemp("one") / "ds"
    assert shard_main(["--input", corpus, "--output", str(out), "--workers", "2", *OPTS]) == 0
    return out


def test_three_parts_joined_equal_one_run(tmp_path: Path, corpus: str, one_run: Path, capsys):
    out = tmp_path / "ds"
    for k in (3, 1, 2):  # array tasks finish in any order
        assert shard_part(corpus, out, k) == 0
    part_files = snapshot(out)
    assert join_main([str(out)]) == 0
    joined, single = files(out), files(one_run)
    assert joined.pop("run")["joined_parts"] == 3 and single.pop("run")["workers"] == 2
    assert joined == single and len(joined) > 20
    assert verify_dataset(out)[0] == []
    assert {k: v for k, v in snapshot(out).items() if k.startswith("part-")} == part_files  # parts only read
    manifest = json.loads((out / "manifest.json").read_text())
    assert [len(json.loads((out / f"part-{k}-of-3/manifest.json").read_text())["source"]["train"]["files"])
            for k in (1, 2, 3)] == [1, 1, 2] and len(manifest["source"]["train"]["files"]) == 4

    before = snapshot(out)
    assert "already joined" in refused(capsys, join_main, [str(out)])
    assert snapshot(out) == before


def test_parts_without_files_join_too(tmp_path: Path, c4_train_path: Path):
    """The bundled sample as it is (one train, one validation file) in 3 parts: two parts get no files."""
    corpus = str(c4_train_path.parent / "c4-*.json.gz")
    out = tmp_path / "ds"
    for k in (1, 2, 3):
        assert shard_part(corpus, out, k) == 0
    assert json.loads((out / "part-1-of-3/manifest.json").read_text())["splits"]["train"]["shards"] == []
    assert join_main([str(out)]) == 0
    single = tmp_path / "one"
    assert shard_main(["--input", corpus, "--output", str(single), "--workers", "0", *OPTS]) == 0
    joined, expected = files(out), files(single)
    joined.pop("run"), expected.pop("run")
    assert joined == expected


def test_join_refuses_missing_unfinished_and_mismatched_parts(tmp_path: Path, corpus: str, repo_root: Path, capsys):
    out = tmp_path / "ds"
    assert "no part directories" in refused(capsys, join_main, [str(out)])
    for k in (1, 3):
        assert shard_part(corpus, out, k) == 0
    before = snapshot(out)
    assert "lacks part(s) 2 of 3" in refused(capsys, join_main, [str(out)])
    assert snapshot(out) == before

    # Part 2 killed after its first shard: started, no manifest yet.
    cmd = [sys.executable, "-m", "data_prep.shard", "--input", corpus, "--output", str(out), "--workers", "0",
           "--part", "2/3", *OPTS]
    env = dict(os.environ, PYTHONPATH=str(repo_root), **{KILL_AFTER_SHARD_ENV: "0"})
    assert subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True).returncode == 75
    before = snapshot(out)
    assert "part-2-of-3 is still being written or was stopped" in refused(capsys, join_main, [str(out)])
    assert snapshot(out) == before and not (out / "manifest.json").exists()

    # Part 2 from other settings: refused, naming the difference.
    moved = tmp_path / "part2-killed"
    shutil.move(out / "part-2-of-3", moved)
    assert shard_part(corpus, out, 2, 3, "--input-length", "256") == 0
    assert "other settings" in (msg := refused(capsys, join_main, [str(out)])) and "row_length" in msg
    shutil.rmtree(out / "part-2-of-3")

    # Part 2 from another file list with as many files (one of them shorter).
    other = tmp_path / "other"
    shutil.copytree(Path(corpus).parent, other)
    first = sorted(other.glob("c4-train.*"))[0]
    first.write_bytes(gzip.compress(gzip.decompress(first.read_bytes())[:5000].rsplit(b"\n", 1)[0] + b"\n"))
    assert shard_part(str(other / "c4-*.json.gz"), out, 2) == 0
    assert "different train file lists" in refused(capsys, join_main, [str(out)])
    shutil.rmtree(out / "part-2-of-3")

    # Parts of another N beside them.
    assert shard_part(corpus, out, 1, 2) == 0
    assert "parts of 2 and of 3 parts" in refused(capsys, join_main, [str(out)])
    shutil.rmtree(out / "part-1-of-2")

    # The killed part 2, run again, resumes; then the join succeeds.
    shutil.move(moved, out / "part-2-of-3")
    assert shard_part(corpus, out, 2) == 0
    assert join_main([str(out)]) == 0 and verify_dataset(out)[0] == []


def test_join_refuses_parts_with_other_tokenizers(tmp_path: Path, corpus: str, spiece_path: Path, capsys):
    """A tokenizer with other ids than the first part's (the T5 vocabulary without its sentinels)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(spiece_path.read_bytes())
    model.pieces[100].piece = "\u2581t5ds-other-piece"
    other = tmp_path / "other.model"
    other.write_bytes(model.SerializeToString())
    spm.SentencePieceProcessor(model_file=str(other))  # a valid model
    out = tmp_path / "ds"
    assert shard_part(corpus, out, 1, 2) == 0
    assert shard_part(corpus, out, 2, 2, "--tokenizer", str(other)) == 0
    before = snapshot(out)
    assert "tokenizer.sha256" in refused(capsys, join_main, [str(out)])
    assert snapshot(out) == before


def test_part_flag_refusals(tmp_path: Path, corpus: str, capsys):
    assert "expected K/N" in refused(capsys, shard_part, corpus, tmp_path / "a", 4, 3)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "train.jsonl").write_text('{"text": "a document"}\n')
    msg = refused(capsys, shard_main, ["--input", str(hf_dir), "--output", str(tmp_path / "b"), "--part", "1/2",
                                       "--hf-validation-split", "none", *OPTS])
    assert "Hugging Face dataset" in msg


def test_slurm_array_script_shards_parts_then_joins(tmp_path: Path, corpus: str, one_run: Path, repo_root: Path):
    """slurm/shard_array.sbatch as SLURM runs it: array tasks 1..3 of 3, then the same script without
    an array task id joins (run by bash with SLURM's variables: no cluster needed)."""
    out = tmp_path / "ds"
    env = dict(os.environ, PYTHONPATH=str(repo_root), SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(repo_root),
               INPUT=corpus, OUTPUT=str(out), SHARD_ARGS=" ".join(["--workers", "0", *OPTS]))
    script = ["bash", str(repo_root / "slurm/shard_array.sbatch")]
    array = {"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_MAX": "3"}
    gap = subprocess.run(script, env={**env, **array, "SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "0"},
                         capture_output=True, text=True)
    assert gap.returncode == 2 and "--array=1-N" in gap.stderr and not out.exists()
    for k in (1, 2, 3):
        task = subprocess.run(script, env={**env, **array, "SLURM_ARRAY_TASK_ID": str(k)}, capture_output=True, text=True)
        assert task.returncode == 0, task.stderr
    join = subprocess.run(script, env=env, capture_output=True, text=True)
    assert join.returncode == 0, join.stderr
    joined, single = files(out), files(one_run)
    joined.pop("run"), single.pop("run")
    assert joined == single
