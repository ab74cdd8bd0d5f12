"""Sharding: round trip on the bundled C4 sample, determinism across worker counts, resume, sources."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.shard import (
    KILL_AFTER_SHARD_ENV,
    OptionsMismatch,
    ShardConfig,
    load_progress,
    run_sharding,
    save_progress,
)
from data_prep.shard_format import load_manifest, read_shard, split_shards
from data_prep.tokenizer import load_tokenizer, tokenize_documents
from data_prep.verify import verify_dataset

ROW = 568


def c4_texts(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def split_stream(data_dir: Path, split: str) -> np.ndarray:
    manifest = load_manifest(data_dir)
    shards = [read_shard(data_dir / e.path) for e in split_shards(manifest, split)]
    return np.concatenate(shards).reshape(-1)


def shard(tmp: Path, inp: str, **kw) -> dict:
    kw.setdefault("workers", 0)
    kw.setdefault("rows_per_shard", 32)
    kw.setdefault("rows_per_block", 8)
    return run_sharding(ShardConfig(input=inp, output=str(tmp), progress=False, **kw))


def shard_bytes(data_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(data_dir)): p.read_bytes() for p in sorted(data_dir.glob("*/shard-*.tar"))}


def without_run(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "run"}


@pytest.fixture(scope="module")
def c4_glob(c4_train_path: Path) -> str:
    return str(c4_train_path.parent / "c4-*.json.gz")


@pytest.fixture(scope="module")
def c4_sharded(tmp_path_factory, c4_glob: str) -> Path:
    out = tmp_path_factory.mktemp("c4") / "ds"
    shard(out, c4_glob, workers=1)
    return out


def test_round_trip_bundled_c4(c4_sharded: Path, c4_train_path: Path, c4_validation_path: Path, spiece_path):
    """Decoding the shards gives back the tokenised documents (each + EOS) in order, minus the tail."""
    manifest = load_manifest(c4_sharded)
    tok = load_tokenizer(spiece_path)
    assert manifest["row_length"] == ROW and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["vocab_size"] == 32100 and manifest["tokenizer"]["eos_id"] == 1
    for split, path in (("train", c4_train_path), ("validation", c4_validation_path)):
        texts = c4_texts(path)
        expected = np.concatenate([np.asarray(d) for d in tokenize_documents(texts, tok)])
        got = split_stream(c4_sharded, split)
        info = manifest["splits"][split]
        assert len(got) == info["tokens"] == len(expected) - info["dropped_tail_tokens"]
        assert 0 <= info["dropped_tail_tokens"] < ROW
        np.testing.assert_array_equal(got, expected[: len(got)])
        assert info["documents"] == len(texts) and info["skipped_total"] == 0
        assert len(info["shards"]) > 3, "use small rows_per_shard so several shards are written"
        assert all(set(e) == {"path", "rows", "tokens", "sha256"} for e in info["shards"])
        assert all(e["rows"] == 32 for e in info["shards"][:-1])
    assert verify_dataset(c4_sharded)[0] == []


def test_c4_layout_is_split_by_name(c4_sharded: Path):
    source = load_manifest(c4_sharded)["source"]
    assert [Path(f["path"]).name for f in source["train"]["files"]] == ["c4-train.00000-of-01024.json.gz"]
    assert [Path(f["path"]).name for f in source["validation"]["files"]] == [
        "c4-validation.00000-of-00008.json.gz"
    ]


def test_deterministic_across_worker_counts(tmp_path: Path, c4_glob: str, c4_sharded: Path):
    """0 (in-process), 1 and 2 workers give byte-identical shards and manifests (but for `run`)."""
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        manifest = shard(out, c4_glob, workers=workers, chunk_docs=37 + workers)
        assert shard_bytes(out) == shard_bytes(c4_sharded)
        assert without_run(manifest) == without_run(load_manifest(c4_sharded))


def test_resume_after_kill_matches_uninterrupted_run(
    tmp_path: Path, c4_glob: str, c4_sharded: Path, repo_root
):
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "data_prep.shard", "--input", c4_glob, "--output", str(out)]
    cmd += ["--rows-per-shard", "32", "--rows-per-block", "8", "--workers", "1", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(repo_root), **{KILL_AFTER_SHARD_ENV: "5"})
    killed = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True)
    assert killed.returncode == 75, killed.stderr
    # The run died after renaming shard 5 but before recording it: no manifest, progress lists 0..4.
    assert not (out / "manifest.json").exists()
    state = load_progress(out)
    assert len(state["splits"]["train"]["shards"]) == 5 and not state["splits"]["train"]["done"]
    on_disk = sorted(p.name for p in (out / "train").iterdir())
    assert "shard-000005.tar" in on_disk  # the orphan: complete-looking, but not recorded
    listed = {Path(e["path"]).name for e in state["splits"]["train"]["shards"]}
    assert set(on_disk) - listed == {"shard-000005.tar"}
    first_five = {n: (out / "train" / n).stat().st_mtime_ns for n in listed}

    env.pop(KILL_AFTER_SHARD_ENV)
    resumed = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming train after 5 finished shards" in resumed.stderr
    # Finished shards were kept, not rewritten; everything equals the uninterrupted run byte for byte.
    assert {n: (out / "train" / n).stat().st_mtime_ns for n in listed} == first_five
    assert shard_bytes(out) == shard_bytes(c4_sharded)
    manifest = load_manifest(out)
    assert manifest["run"]["resumed"] is True
    assert without_run(manifest) == without_run(load_manifest(c4_sharded))
    assert not list(out.glob("*/*.tmp"))

    # A third run with the same options has nothing to do.
    again = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "already complete" in again.stderr


def child_pids(pid: int) -> list[str]:
    """Pids whose parent is `pid` (from /proc, so no procps needed)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == str(pid):
            children.append(stat.parent.name)
    return children


def test_sigkill_mid_run_then_resume(tmp_path: Path, c4_train_path: Path, repo_root):
    """A real SIGKILL of the main process: its workers exit, and a rerun completes byte-identically."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    for c in range(6):  # ~3M tokens: long enough to be killed mid-run
        os.symlink(c4_train_path, inputs / f"part-{c:02d}.json.gz")
    cmd = [sys.executable, "-m", "data_prep.shard", "--input", str(inputs / "*.json.gz"), "--output"]
    opts = ["--rows-per-shard", "64", "--rows-per-block", "16", "--workers", "2", "--no-progress", "-q"]
    env = dict(os.environ, PYTHONPATH=str(repo_root))
    out = tmp_path / "killed"
    proc = subprocess.Popen(cmd + [str(out)] + opts, cwd=repo_root, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if len(load_progress(out)["splits"]["train"]["shards"]) >= 3:
                break
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.02)
    workers = child_pids(proc.pid)
    assert len(workers) >= 2, "the two encoder processes (spawned) should be running"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "manifest.json").exists()
    recorded = load_progress(out)["splits"]["train"]["shards"]
    assert 3 <= len(recorded) < 80  # killed mid-run (the whole run writes 84 shards)
    for pid in workers:  # encoder processes notice the dead parent within ~1 s
        for _ in range(100):
            if (
                not Path(f"/proc/{pid}").exists()
                or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
            ):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"worker {pid} outlived the killed main process")

    assert subprocess.run(cmd + [str(out)] + opts, cwd=repo_root, env=env).returncode == 0
    assert subprocess.run(cmd + [str(tmp_path / "clean")] + opts, cwd=repo_root, env=env).returncode == 0
    assert shard_bytes(out) == shard_bytes(tmp_path / "clean")
    assert without_run(load_manifest(out)) == without_run(load_manifest(tmp_path / "clean"))


def test_resume_tokenizes_only_the_rest(tmp_path: Path, c4_glob: str, c4_sharded: Path, monkeypatch):
    """In-process resume from a progress file: only documents after the position are encoded."""
    out = tmp_path / "ds"
    shutil.copytree(c4_sharded, out)
    state = load_progress(out)
    # Rewind the train split to after its 3rd shard as progress.json would record it mid-run.
    train = state["splits"]["train"]
    uninterrupted = load_manifest(c4_sharded)
    import data_prep.chunk_encoding as encoding_mod

    encoded = []
    original = encoding_mod.encode_chunk
    monkeypatch.setattr(
        encoding_mod, "encode_chunk", lambda fmt, p: (encoded.append(len(p)), original(fmt, p))[1]
    )
    tok = load_tokenizer()
    texts = c4_texts(Path(c4_glob).parent / "c4-train.00000-of-01024.json.gz")
    lengths = np.cumsum([len(d) for d in tokenize_documents(texts, tok)])
    boundary = 3 * 32 * ROW
    doc = int(np.searchsorted(lengths, boundary))  # the document whose tokens complete shard 2
    stream = np.concatenate([np.asarray(d) for d in tokenize_documents(texts[: doc + 1], tok)])
    train.update(
        done=False,
        shards=train["shards"][:3],
        position=[0, doc + 1],
        carry=stream[boundary:].tolist(),
        documents=doc + 1,
        records=doc + 1,
        skipped={},
        dropped_tail_tokens=0,
    )
    state["splits"]["validation"] = {
        **state["splits"]["validation"],
        "done": False,
        "shards": [],
        "position": [0, 0],
        "carry": [],
        "documents": 0,
        "records": 0,
    }
    save_progress(out, state)
    (out / "manifest.json").unlink()
    manifest = shard(out, c4_glob, workers=0)
    assert sum(encoded) == (len(texts) - doc - 1) + 448
    assert shard_bytes(out) == shard_bytes(c4_sharded)
    assert without_run(manifest) == without_run(uninterrupted)


def test_rerun_with_other_options_refuses(tmp_path: Path, c4_glob: str):
    out = tmp_path / "ds"
    shard(out, c4_glob, rows_per_shard=200)
    with pytest.raises(OptionsMismatch, match="rows_per_shard: 200 .in DIR. vs 100 .now."):
        shard(out, c4_glob, rows_per_shard=100)
    with pytest.raises(OptionsMismatch, match="row_length"):
        shard(out, c4_glob, rows_per_shard=200, input_length=256)
    rc = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep.shard",
            "--input",
            c4_glob,
            "--output",
            str(out),
            "--row-length",
            "100",
        ],
        capture_output=True,
        text=True,
    )
    assert rc.returncode == 2 and "different options" in rc.stderr


# ----------------------------------------------------------------------------------------------
# Source kinds


@pytest.fixture(scope="module")
def sample_texts(c4_validation_path: Path) -> list[str]:
    return c4_texts(c4_validation_path)[:120]


def expected_stream(texts: list[str], tok_path=None) -> np.ndarray:
    return np.concatenate([np.asarray(d) for d in tokenize_documents(texts, load_tokenizer(tok_path))])


def check_stream(out: Path, texts: list[str], split: str = "train", row: int = 64) -> None:
    got = split_stream(out, split)
    expected = expected_stream(texts)
    assert len(expected) - row < len(got) <= len(expected)
    np.testing.assert_array_equal(got, expected[: len(got)])
    assert load_manifest(out)["splits"][split]["documents"] == len(texts)


def test_source_jsonl_and_jsonl_gz(tmp_path: Path, sample_texts):
    lines = [json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(sample_texts)]
    (tmp_path / "a.jsonl").write_text("".join(lines[:50]))
    # Two gzip members in one file (as `cat a.gz b.gz` makes): both are read.
    (tmp_path / "b.jsonl.gz").write_bytes(
        gzip.compress("".join(lines[50:90]).encode()) + gzip.compress("".join(lines[90:]).encode())
    )
    manifest = shard(tmp_path / "out", str(tmp_path / "*.jsonl*"), row_length=64, rows_per_shard=50)
    check_stream(tmp_path / "out", sample_texts)
    assert [Path(f["path"]).name for f in manifest["source"]["train"]["files"]] == ["a.jsonl", "b.jsonl.gz"]
    assert "validation" not in manifest["splits"]


def test_source_txt_line_and_blank_line_modes(tmp_path: Path, sample_texts):
    one_line = [" ".join(t.split()) for t in sample_texts]  # documents without newlines
    (tmp_path / "lines.txt").write_text("\n".join(one_line) + "\n")
    shard(tmp_path / "o1", str(tmp_path / "lines.txt"), row_length=64)
    check_stream(tmp_path / "o1", one_line)

    paragraphs = [t.replace("\n\n", "\n").strip() for t in sample_texts[:40]]
    (tmp_path / "paras.txt").write_text("\n\n\n".join(paragraphs) + "\n")
    shard(tmp_path / "o2", str(tmp_path / "paras.txt"), row_length=64, txt_mode="blank-line")
    check_stream(tmp_path / "o2", paragraphs)


def test_source_parquet_with_other_text_field(tmp_path: Path, sample_texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"body": sample_texts, "n": list(range(len(sample_texts)))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=25)
    shard(tmp_path / "out", str(tmp_path / "d.parquet"), text_field="body", row_length=64)
    check_stream(tmp_path / "out", sample_texts)
    with pytest.raises(ValueError, match="no column 'text'.*--text-field"):
        shard(tmp_path / "out2", str(tmp_path / "d.parquet"), row_length=64)


def test_source_local_hf_dataset_streaming(tmp_path: Path, sample_texts):
    """A script-free local dataset directory read with load_dataset(path, streaming=True), both splits."""
    ds = tmp_path / "my_dataset"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts[:80]))
    (ds / "validation.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts[80:]))
    manifest = shard(tmp_path / "out", str(ds), row_length=64)
    check_stream(tmp_path / "out", sample_texts[:80], "train")
    check_stream(tmp_path / "out", sample_texts[80:], "validation")
    assert manifest["source"]["train"] == {
        "kind": "hf",
        "name": str(ds),
        "config": None,
        "split": "train",
        "revision": None,
        "text_field": "text",
    }
    assert manifest["source"]["validation"]["split"] == "validation"


def test_unknown_file_glob_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ValueError, match="no files match"):
        shard(tmp_path / "out", str(tmp_path / "nothing-*.jsonl"))


def test_hf_tokenizer_directory_matches_model_file(tmp_path: Path, spiece_path: Path, sample_texts):
    """T5Tokenizer.from_pretrained(dir with spiece.model) -> save_pretrained -> same ids as the .model."""
    from transformers import T5Tokenizer

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(spiece_path, src / "spiece.model")
    hf_dir = tmp_path / "hf_tok"
    T5Tokenizer.from_pretrained(str(src)).save_pretrained(str(hf_dir))
    hf = load_tokenizer(hf_dir)
    sp = load_tokenizer(spiece_path)
    assert hf.info.kind == "huggingface" and hf.info.vocab_size == sp.info.vocab_size == 32100
    assert (hf.info.eos_id, hf.info.pad_id) == (sp.info.eos_id, sp.info.pad_id) == (1, 0)
    docs = sample_texts[:20] + ["Hello world, this is a T5 test.", "  two  spaces\n\nnew line\ttab"]
    assert tokenize_documents(docs, hf) == tokenize_documents(docs, sp)
    assert tokenize_documents(["Hello world, this is a T5 test."], sp, add_eos=False) == [
        [8774, 296, 6, 48, 19, 3, 9, 332, 755, 794, 5]
    ]

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in sample_texts))
    m_hf = shard(tmp_path / "o_hf", str(tmp_path / "d.jsonl"), tokenizer=str(hf_dir), row_length=64)
    m_sp = shard(tmp_path / "o_sp", str(tmp_path / "d.jsonl"), row_length=64)
    assert shard_bytes(tmp_path / "o_hf") == shard_bytes(tmp_path / "o_sp")
    assert (
        m_hf["tokenizer"]["kind"] == "huggingface"
        and m_hf["tokenizer"]["sha256"] != m_sp["tokenizer"]["sha256"]
    )
    assert verify_dataset(tmp_path / "o_hf")[0] == []
