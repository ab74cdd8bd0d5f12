"""Blocks of raw lines (`sources.iter_line_blocks`), split by the workers, give exactly the records
that reading line by line gives: same payloads, indices, resume starts and broken-gzip record."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from data_prep.chunk_encoding import split_lines
from data_prep.sources import Record, _iter_lines, iter_line_blocks


def from_blocks(path: Path, start: int, max_bytes: int, max_lines: int) -> list[Record]:
    records = []
    for item in iter_line_blocks(str(path), start, max_bytes, max_lines):
        if isinstance(item, Record):
            records.append(item)
            continue
        first, count, block = item
        payloads = split_lines(block)
        assert len(payloads) == count and count <= max_lines
        records += [Record(index=first + i, line=first + i + 1, payload=p) for i, p in enumerate(payloads)]
    return records


@pytest.mark.parametrize("ending", [b"\n", b"", b"\n\n", b"\r\n"])
@pytest.mark.parametrize("compressed", [False, True])
def test_blocks_match_lines(tmp_path: Path, c4_train_path: Path, ending: bytes, compressed: bool):
    lines = gzip.decompress(c4_train_path.read_bytes()).split(b"\n")[:300]
    lines[7] = b""  # a blank line is a record too
    lines[8] = lines[8] + b"\r"
    data = b"\n".join(lines).rstrip(b"\n") + ending
    path = tmp_path / ("d.jsonl.gz" if compressed else "d.jsonl")
    path.write_bytes(gzip.compress(data) if compressed else data)
    for start in (0, 37, 300):
        expected = list(_iter_lines(str(path), start))
        for max_bytes, max_lines in ((1 << 20, 512), (5000, 512), (1, 1)):
            assert from_blocks(path, start, max_bytes, max_lines) == expected, (start, max_bytes, max_lines)


def test_broken_gzip_ends_with_the_same_error_record(tmp_path: Path, c4_train_path: Path):
    path = tmp_path / "cut.json.gz"
    path.write_bytes(c4_train_path.read_bytes()[:200_000])  # truncated mid-stream
    for start in (0, 10):
        expected = list(_iter_lines(str(path), start))
        assert expected[-1].error is not None and len(expected) > 10
        assert from_blocks(path, start, 30_000, 64) == expected
