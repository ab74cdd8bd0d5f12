"""Bad input: each case is counted in the manifest, named by file and line, and an error under --strict."""

from __future__ import annotations

import gzip
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.shard import DataError, EmptySplitError, ShardConfig, load_progress, run_sharding
from data_prep.shard_format import sha256_file
from data_prep.verify import verify_dataset

ROW = 64


def good_lines(c4_path: Path, n: int) -> list[bytes]:
    with gzip.open(c4_path, "rb") as f:
        return [next(f).rstrip(b"\n") for _ in range(n)]


# (reason, bad line bytes); each is placed at line 41 of a .jsonl after 40 good C4 documents.
CASES = {
    "invalid_json": b'{"text": "unterminated',
    "missing_text_field": b'{"content": "the text is under another key"}',
    "empty_document": b'{"text": "   "}',
    "non_utf8": b'{"text": "caf\xe9 au lait"}',
    "text_not_string": b'{"text": 42}',
}
BAD_LINE = 41


def config(inp: Path, out: Path, **kw) -> ShardConfig:
    return ShardConfig(
        input=str(inp), output=str(out), row_length=ROW, rows_per_shard=50, workers=0, progress=False, **kw
    )


@pytest.fixture(scope="module")
def bad_jsonl(tmp_path_factory, c4_train_path: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad")
    good = good_lines(c4_train_path, 80)
    files = {}
    for reason, bad in CASES.items():
        path = root / f"{reason}.jsonl"
        path.write_bytes(b"\n".join(good[:40] + [bad] + good[40:]) + b"\n")
        files[reason] = path
    return files


@pytest.mark.parametrize("reason", sorted(CASES))
def test_bad_document_is_counted_and_named(reason, bad_jsonl, tmp_path: Path, caplog):
    path = bad_jsonl[reason]
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        manifest = run_sharding(config(path, tmp_path / "out"))
    split = manifest["splits"]["train"]
    assert split["skipped"] == {reason: 1} and split["skipped_total"] == 1
    assert split["documents"] == 80 and split["records"] == 81
    messages = [r.getMessage() for r in caplog.records if reason in r.getMessage()]
    assert any(f"{path}:{BAD_LINE}: skipped document ({reason})" in m for m in messages), messages
    assert verify_dataset(tmp_path / "out")[0] == []


@pytest.mark.parametrize("reason", sorted(CASES))
def test_strict_makes_it_an_error_and_keeps_finished_shards(reason, bad_jsonl, tmp_path: Path):
    path, out = bad_jsonl[reason], tmp_path / "out"
    with pytest.raises(DataError, match=rf"{path}:{BAD_LINE}: {reason}:.*--strict"):
        run_sharding(config(path, out, strict=True))
    assert not (out / "manifest.json").exists()
    state = load_progress(out)
    shards = state["splits"]["train"]["shards"]
    assert shards, "40 C4 documents fill several 50x64 shards before the bad line"
    for entry in shards:  # what was written before the error is complete and recorded
        assert sha256_file(out / entry["path"]) == entry["sha256"]
    assert not list(out.glob("train/*.tmp"))
    # Rerunning without --strict resumes and gives exactly what a fresh non-strict run gives.
    resumed = run_sharding(config(path, out))
    fresh = run_sharding(config(path, tmp_path / "fresh"))
    assert {k: v for k, v in resumed.items() if k != "run"} == {k: v for k, v in fresh.items() if k != "run"}
    assert resumed["splits"]["train"]["skipped"] == {reason: 1}


def test_strict_cli_exits_nonzero_with_file_and_line(bad_jsonl, tmp_path: Path, repo_root):
    path = bad_jsonl["invalid_json"]
    cmd = [sys.executable, "-m", "data_prep.shard", "--input", str(path), "--output", str(tmp_path / "o")]
    proc = subprocess.run(
        cmd + ["--row-length", "64", "--strict", "--no-progress"],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert f"error: {path}:{BAD_LINE}: invalid_json" in proc.stderr


def corrupt_gzip(c4_train_path: Path, tmp_path: Path, truncate: bool) -> Path:
    data = bytearray(c4_train_path.read_bytes())
    if truncate:
        data = data[: len(data) // 2]
    else:
        mid = len(data) // 2
        data[mid : mid + 64] = bytes(64)  # zeroed block in the deflate stream
    path = tmp_path / ("c4-train.truncated.json.gz" if truncate else "c4-train.damaged.json.gz")
    path.write_bytes(bytes(data))
    return path


def test_truncated_gzip_counts_what_was_read(c4_train_path: Path, tmp_path: Path, caplog):
    path = corrupt_gzip(c4_train_path, tmp_path, truncate=True)
    readable = 0
    with gzip.open(path, "rb") as f, pytest.raises(EOFError):
        for _ in f:
            readable += 1
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        manifest = run_sharding(config(path, tmp_path / "out"))
    split = manifest["splits"]["train"]
    assert 0 < split["documents"] == readable < 1000  # every complete line before the break was used
    assert split["skipped"] == {"corrupt_gzip": 1}
    messages = " ".join(r.getMessage() for r in caplog.records)
    expected = f"{path}:{readable + 1}: skipped document (corrupt_gzip): stream broke after {readable} complete lines"
    assert expected in messages
    with pytest.raises(DataError, match=rf"{path}:{readable + 1}: corrupt_gzip"):
        run_sharding(config(path, tmp_path / "strict", strict=True))


def test_damaged_gzip_block_is_reported(c4_train_path: Path, tmp_path: Path, caplog):
    """Zeroed bytes inside the deflate stream: gzip only checks its CRC at the end of the member, so the
    garbled lines before it are skipped as invalid JSON / UTF-8 and the CRC failure is reported too."""
    path = corrupt_gzip(c4_train_path, tmp_path, truncate=False)
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        manifest = run_sharding(config(path, tmp_path / "out"))
    split = manifest["splits"]["train"]
    assert split["skipped"]["corrupt_gzip"] == 1 and split["documents"] < 1000
    assert split["documents"] + split["skipped_total"] == split["records"]
    assert any(f"{path}:" in r.getMessage() and "corrupt_gzip" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataError, match=rf"{path}:\d+: "):
        run_sharding(config(path, tmp_path / "strict", strict=True))


def test_many_bad_lines_warn_capped_but_all_counted(c4_train_path: Path, tmp_path: Path, caplog):
    good = good_lines(c4_train_path, 10)
    path = tmp_path / "many.jsonl"
    path.write_bytes(b"\n".join(good + [b"{broken"] * 30 + good) + b"\n")
    with caplog.at_level(logging.WARNING, logger="data_prep"):
        manifest = run_sharding(config(path, tmp_path / "out", max_warnings=5))
    assert manifest["splits"]["train"]["skipped"] == {"invalid_json": 30}
    per_line = [r for r in caplog.records if "skipped document (invalid_json)" in r.getMessage()]
    assert len(per_line) == 5
    assert any("skipped 30 documents (invalid_json=30)" in r.getMessage() for r in caplog.records)


def _shard_cli(repo_root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_prep.shard", *args, "--row-length", "64", "--no-progress",
                           "--workers", "0"], cwd=repo_root, capture_output=True, text=True)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_file_named_gz_that_is_not_gzip_is_one_line_error_and_writes_nothing(c4_train_path, tmp_path, repo_root):
    path = tmp_path / "c4-train.plain.json.gz"
    path.write_bytes(b"\n".join(good_lines(c4_train_path, 20)) + b"\n")
    proc = _shard_cli(repo_root, "--input", str(path), "--output", str(tmp_path / "out"))
    assert proc.returncode == 2
    [line] = _error_lines(proc.stderr)
    assert f"{path} is named .gz but is not gzip-compressed" in line and "c4-train.plain.json" in line
    assert not (tmp_path / "out").exists()


def test_an_empty_input_is_one_line_error_and_leaves_nothing_to_block_a_rerun(tmp_path, repo_root):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    proc = _shard_cli(repo_root, "--input", str(path), "--output", str(tmp_path / "out"))
    assert proc.returncode == 2
    [line] = _error_lines(proc.stderr)
    assert "train: no rows were written: 1 input file(s) gave 0 records" in line and "the input is empty" in line
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / "progress.json").exists()


def test_lines_without_the_text_field_name_the_counts_and_text_field_then_the_fix_works(
        c4_train_path, tmp_path, repo_root):
    path = tmp_path / "body.jsonl"
    path.write_bytes(b"\n".join(line.replace(b'"text"', b'"body"') for line in good_lines(c4_train_path, 60)) + b"\n")
    out = tmp_path / "out"
    proc = _shard_cli(repo_root, "--input", str(path), "--output", str(out))
    assert proc.returncode == 2
    [line] = _error_lines(proc.stderr)
    assert "60 records, 0 documents, 60 skipped (missing_text_field=60)" in line
    assert "pass --text-field" in line and "'body'" in line  # the first record's keys show the field to use
    # the same command with the fix, into the same directory, works
    fixed = _shard_cli(repo_root, "--input", str(path), "--output", str(out), "--text-field", "body")
    assert fixed.returncode == 0, fixed.stderr
    assert verify_dataset(out)[0] == []


def test_too_little_text_for_one_row_is_an_error(tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_bytes(b'{"text": "only a few words"}\n')
    with pytest.raises(EmptySplitError, match="1 documents, 0 skipped; its [0-9]+ tokens make no row of 64"):
        run_sharding(config(path, tmp_path / "out"))


def test_an_empty_validation_split_keeps_the_train_shards(c4_train_path, tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_bytes(b"\n".join(good_lines(c4_train_path, 40)) + b"\n")
    (tmp_path / "validation.jsonl").write_bytes(b"")
    out = tmp_path / "out"
    with pytest.raises(EmptySplitError, match="validation: no rows .* the shards of train in .* are kept"):
        run_sharding(config(train, out, validation_input=str(tmp_path / "validation.jsonl")))
    state = load_progress(out)
    assert state["splits"]["train"]["shards"] and not (out / "manifest.json").exists()
    for entry in state["splits"]["train"]["shards"]:
        assert sha256_file(out / entry["path"]) == entry["sha256"]
