"""Document sources for sharding: local files (C4 json.gz, jsonl, txt, parquet) or a Hugging Face dataset.

A source is an ordered list of *units* (one per file; a Hugging Face split is one unit). Each unit
yields `Record`s: one per document candidate, numbered from 0 inside its unit. `(unit, record)` is
the stream position that resume uses; `line` (1-based line, paragraph start line, parquet row or
dataset example number) is what messages name. A record carries the raw payload (bytes of a JSON
line or text line, or an already extracted value for parquet / datasets); the worker processes turn
payloads into text and tokens (see `payload_to_text`) so that JSON parsing runs in parallel too.

Problems found while reading (a corrupt gzip stream) become records with `error` set, so they are
counted and reported in stream order like every other skipped document.
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# ISA-L inflates gzip about 3.5x faster than zlib (14.6 MB of Wikipedia JSON lines: 0.035 against
# 0.123 CPU s), and in a sharding run every input byte is inflated once.
from isal import isal_zlib

logger = logging.getLogger(__name__)

# Payload formats, decided per unit.
FMT_JSON = "json"  # bytes of one JSON line; the text is `obj[text_field]`
FMT_TEXT = "text"  # bytes of one document of a .txt file
FMT_VALUE = "value"  # the text field's value as read by pyarrow / datasets (None when missing)

TXT_MODES = ("line", "blank-line")  # .txt: one document per line / documents separated by blank lines
SOURCE_KINDS = ("auto", "files", "hf")

# Skip reasons (keys of manifest["splits"][split]["skipped"]).
CORRUPT_GZIP = "corrupt_gzip"
NON_UTF8 = "non_utf8"
INVALID_JSON = "invalid_json"
MISSING_TEXT_FIELD = "missing_text_field"
TEXT_NOT_STRING = "text_not_string"
EMPTY_DOCUMENT = "empty_document"
EMPTY_AFTER_TOKENIZATION = "empty_after_tokenization"

_JSON_SUFFIXES = (".json.gz", ".jsonl.gz", ".jsonl", ".json")
_TEXT_SUFFIXES = (".txt", ".txt.gz")
_PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = _JSON_SUFFIXES + _TEXT_SUFFIXES + _PARQUET_SUFFIXES


class SourceError(ValueError):
    """A source that cannot be read at all (no files match, unknown extension, missing column)."""


@dataclass(frozen=True)
class Record:
    """One document candidate of a unit."""

    index: int  # 0-based position inside the unit (resume coordinate)
    line: int  # 1-based line / row / example number, for messages
    payload: object  # bytes (FMT_JSON, FMT_TEXT) or a value (FMT_VALUE); None with `error`
    error: tuple[str, str] | None = None  # (reason, detail) found while reading


def payload_to_text(fmt: str, payload: object, text_field: str) -> tuple[str | None, str, str]:
    """Turn a payload into document text: returns (text, reason, detail); text is None when skipped."""
    if fmt == FMT_JSON:
        try:
            line = payload.decode("utf-8")  # type: ignore[union-attr]
        except UnicodeDecodeError as exc:
            return None, NON_UTF8, f"invalid UTF-8 at byte {exc.start}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if not line.strip():
                return None, EMPTY_DOCUMENT, "blank line"
            return None, INVALID_JSON, f"invalid JSON ({exc.msg} at column {exc.colno})"
        if not isinstance(obj, dict) or text_field not in obj or obj[text_field] is None:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            return None, MISSING_TEXT_FIELD, f"no text field {text_field!r} (has {keys}); see --text-field"
        value = obj[text_field]
    elif fmt == FMT_TEXT:
        try:
            value = payload.decode("utf-8")  # type: ignore[union-attr]
        except UnicodeDecodeError as exc:
            return None, NON_UTF8, f"invalid UTF-8 at byte {exc.start}"
    else:
        value = payload
        if value is None:
            return None, MISSING_TEXT_FIELD, f"text field {text_field!r} is missing or null; see --text-field"
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                return None, NON_UTF8, f"invalid UTF-8 at byte {exc.start}"
    if not isinstance(value, str):
        return None, TEXT_NOT_STRING, f"text field {text_field!r} is a {type(value).__name__}, not a string"
    if not value.strip():
        return None, EMPTY_DOCUMENT, "empty document"
    return value, "", ""


# ----------------------------------------------------------------------------------------------
# Local files


def _suffix_of(path: str) -> str | None:
    name = path.lower()
    for suffix in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return None


_READ_SIZE = 1 << 16  # compressed bytes per read: what a CRC failure can take with it is small


def _inflate_blocks(path: str) -> Iterator[bytes]:
    """Decompressed blocks of a gzip file (multi-member aware); raises where the stream breaks:
    EOFError for a truncated file, isal_zlib.error for damaged data or a failed CRC."""
    with open(path, "rb") as f:
        d, in_member = isal_zlib.decompressobj(31), False
        while chunk := f.read(_READ_SIZE):
            while chunk:
                in_member = True
                data = d.decompress(chunk)
                chunk = b""
                if d.eof:  # end of a gzip member; the next (if any) starts in unused_data
                    chunk, d, in_member = d.unused_data, isal_zlib.decompressobj(31), False
                if data:
                    yield data
        if in_member:
            raise EOFError("compressed file ended before the end-of-stream marker was reached")


_END = object()
_PREFETCH_BLOCKS = 32  # decompressed blocks (~200 KB each) a reader thread may run ahead


def _iter_gzip_lines(path: str) -> Iterator[bytes]:
    """Lines (without the newline) of a gzip file. Every complete line decompressed before a break
    is yielded before the error is re-raised (unlike a GzipFile behind a buffer, which loses them)."""
    rest = b""
    for data in _iter_gzip_blocks(path):
        lines = (rest + data).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest


def _iter_gzip_blocks(path: str) -> Iterator[bytes]:
    """Decompressed blocks of a gzip file, inflated by a background thread up to `_PREFETCH_BLOCKS`
    ahead of the consumer (the inflater releases the GIL while it works); a break is raised after
    the blocks before it.
    """
    blocks: queue.Queue = queue.Queue(maxsize=_PREFETCH_BLOCKS)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                blocks.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for data in _inflate_blocks(path):
                if not put(data):
                    return
            put(_END)
        except BaseException as exc:  # handed to the consumer, raised there after the lines before it
            put(exc)

    reader = threading.Thread(target=produce, name=f"gunzip {path}", daemon=True)
    reader.start()
    try:
        while (item := blocks.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # a consumer that stops early (strict error, resume skip) releases the reader


def _iter_raw_blocks(path: str) -> Iterator[bytes]:
    """Decompressed bytes of a file in blocks (gzip inflated by a background thread, as above)."""
    if path.lower().endswith(".gz"):
        yield from _iter_gzip_blocks(path)
    else:
        with open(path, "rb") as f:
            while data := f.read(1 << 20):
                yield data


def _cut_lines(buf: bytes, max_lines: int) -> tuple[bytes, int, bytes]:
    """(the first whole lines of `buf`, at most `max_lines`, joined without their last newline;
    how many; the bytes after them)."""
    end = buf.rfind(b"\n")
    if end < 0:
        return b"", 0, buf
    count = buf.count(b"\n", 0, end + 1)
    if count > max_lines:
        end, count = -1, max_lines
        for _ in range(max_lines):
            end = buf.find(b"\n", end + 1)
    return buf[:end], count, buf[end + 1 :]


def iter_line_blocks(
    path: str, start: int, max_bytes: int, max_lines: int
) -> Iterator[tuple[int, int, bytes] | Record]:
    """The records of a line-per-document file as blocks of whole lines, for workers to split:
    (index of the first line, number of lines, the lines joined by b"\\n"), up to about `max_bytes`
    and at most `max_lines` lines each; lines before `start` are skipped. The records are those of
    `_iter_lines` (a broken gzip stream ends the unit with the same error record), but the reading
    process never touches a line: it counts newlines, so one reader keeps many encoders busy."""
    index, pieces, size = 0, [], 0
    try:
        for data in _iter_raw_blocks(path):
            pieces.append(data)
            size += len(data)
            if size < max_bytes:
                continue
            rest, count = b"".join(pieces), max_lines
            while count == max_lines:  # fewer lines cut: the rest holds no newline
                block, count, rest = _cut_lines(rest, max_lines)
                if count:
                    yield from _skip_to(start, index, count, block)
                    index += count
            pieces, size = [rest], len(rest)
        rest = b"".join(pieces)
        if rest and not rest.endswith(b"\n"):
            rest += b"\n"  # the last line of a file without a final newline is a record too
        while rest:
            block, count, rest = _cut_lines(rest, max_lines)
            yield from _skip_to(start, index, count, block)
            index += count
    except _GZIP_ERRORS as exc:
        rest = b"".join(pieces)
        while True:  # the complete lines decompressed before the break, as _iter_lines gives them
            block, count, rest = _cut_lines(rest, max_lines)
            if count == 0:
                break
            yield from _skip_to(start, index, count, block)
            index += count
        if index >= start:
            detail = f"stream broke after {index} complete lines ({type(exc).__name__}: {exc}){_crc_note(exc)}"
            yield Record(index=index, line=index + 1, payload=None, error=(CORRUPT_GZIP, detail))


def _skip_to(start: int, index: int, count: int, block: bytes) -> Iterator[tuple[int, int, bytes]]:
    """The block's lines from record `start` on (resume), as (first index, count, lines)."""
    if index + count <= start:
        return
    if index < start:
        skip = start - index
        cut = -1
        for _ in range(skip):
            cut = block.find(b"\n", cut + 1)
        block, index, count = block[cut + 1 :], start, count - skip
    yield index, count, block


def _iter_raw_lines(path: str) -> Iterator[bytes]:
    if path.lower().endswith(".gz"):
        yield from _iter_gzip_lines(path)
    else:
        with open(path, "rb", buffering=1 << 20) as f:
            yield from f


_GZIP_ERRORS = (EOFError, isal_zlib.error, gzip.BadGzipFile, OSError)


def _crc_note(exc: BaseException) -> str:
    if "check" in str(exc) or "length" in str(exc):
        return "; the check runs at the end of the gzip member, so lines read before it may be damaged"
    return ""


def _iter_lines(path: str, start: int) -> Iterator[Record]:
    """One record per line (JSON lines, or .txt in line mode); a broken gzip ends the unit with an error."""
    n = 0
    try:
        for n, raw in enumerate(_iter_raw_lines(path), start=1):  # noqa: B007 - n is used after the loop
            if n - 1 < start:
                continue
            yield Record(index=n - 1, line=n, payload=raw.rstrip(b"\r\n"))
    except _GZIP_ERRORS as exc:
        if n >= start:
            yield Record(
                index=n,
                line=n + 1,
                payload=None,
                error=(
                    CORRUPT_GZIP,
                    f"stream broke after {n} complete lines ({type(exc).__name__}: {exc}){_crc_note(exc)}",
                ),
            )


def _iter_paragraphs(path: str, start: int) -> Iterator[Record]:
    """.txt in blank-line mode: documents are runs of non-blank lines; `line` is a run's first line."""
    index, first_line, lines, n = 0, 0, [], 0

    def flush() -> Iterator[Record]:
        nonlocal index, lines
        if lines:
            if index >= start:
                yield Record(index=index, line=first_line, payload=b"\n".join(lines))
            index += 1
            lines = []

    try:
        for n, raw in enumerate(_iter_raw_lines(path), start=1):  # noqa: B007
            line = raw.rstrip(b"\r\n")
            if line.strip():
                if not lines:
                    first_line = n
                lines.append(line)
            else:
                yield from flush()
        yield from flush()
    except _GZIP_ERRORS as exc:  # the paragraph being read when the stream broke is dropped
        if index >= start:
            yield Record(index=index, line=n + 1, payload=None, error=(CORRUPT_GZIP, f"stream broke ({exc})"))


def _iter_parquet(path: str, text_field: str, start: int) -> Iterator[Record]:
    import pyarrow.parquet as pq  # here: slow to import, and only parquet inputs need it

    pf = pq.ParquetFile(path)
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise SourceError(f"{path}: no column {text_field!r} (columns: {columns}); pass --text-field NAME")
    index = 0
    for group in range(pf.num_row_groups):
        group_rows = pf.metadata.row_group(group).num_rows
        if index + group_rows <= start:  # resume: skip whole row groups without reading them
            index += group_rows
            continue
        values = pf.read_row_group(group, columns=[text_field]).column(0).to_pylist()
        for value in values:
            if index >= start:
                yield Record(index=index, line=index + 1, payload=value)
            index += 1


_GZIP_MAGIC = b"\x1f\x8b"


def _check_gzip_magic(path: str) -> None:
    """A file named .gz must start as gzip does (an empty one is an empty input); SourceError if not."""
    if not path.lower().endswith(".gz") or not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        head = f.read(16)
    if head and not head.startswith(_GZIP_MAGIC):
        plain = path[: -len(".gz")]
        raise SourceError(f"{path} is named .gz but is not gzip-compressed (it starts with {head!r}): rename it to "
                          f"{Path(plain).name} if it is plain text, or compress it with gzip")


@dataclass(frozen=True)
class FileSource:
    """An ordered list of local files (sorted glob matches)."""

    files: tuple[str, ...]
    text_field: str = "text"
    txt_mode: str = "line"

    kind = "files"

    def __post_init__(self) -> None:
        if self.txt_mode not in TXT_MODES:
            raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {self.txt_mode!r}")
        for path in self.files:
            if _suffix_of(path) is None:
                raise SourceError(
                    f"{path}: unsupported file type; supported: {', '.join(SUPPORTED_SUFFIXES)}"
                )
            _check_gzip_magic(path)

    @property
    def num_units(self) -> int:
        return len(self.files)

    def unit_label(self, unit: int) -> str:
        return self.files[unit]

    def unit_format(self, unit: int) -> str:
        suffix = _suffix_of(self.files[unit])
        if suffix in _JSON_SUFFIXES:
            return FMT_JSON
        return FMT_TEXT if suffix in _TEXT_SUFFIXES else FMT_VALUE

    def iter_unit(self, unit: int, start: int = 0) -> Iterator[Record]:
        path = self.files[unit]
        suffix = _suffix_of(path)
        if suffix in _PARQUET_SUFFIXES:
            return _iter_parquet(path, self.text_field, start)
        if suffix in _TEXT_SUFFIXES and self.txt_mode == "blank-line":
            return _iter_paragraphs(path, start)
        return _iter_lines(path, start)

    def describe(self) -> dict:
        """What was read, for the manifest (and the resume fingerprint): files with their sizes."""
        return {
            "kind": "files",
            "files": [{"path": p, "bytes": os.path.getsize(p)} for p in self.files],
            "text_field": self.text_field,
            "txt_mode": self.txt_mode,
        }


# ----------------------------------------------------------------------------------------------
# Hugging Face datasets (streaming)


@dataclass(frozen=True)
class HFSource:
    """One split of a Hugging Face dataset read with `load_dataset(..., streaming=True)`.

    `name` is a Hub name (`allenai/c4`) or a local dataset directory that `load_dataset(path)`
    accepts (e.g. a folder with train.jsonl / validation.jsonl).
    """

    name: str
    config: str | None
    split: str
    revision: str | None = None
    text_field: str = "text"

    kind = "hf"
    num_units = 1

    def unit_label(self, unit: int) -> str:
        config = f"[{self.config}]" if self.config else ""
        return f"{self.name}{config}/{self.split}"

    def unit_format(self, unit: int) -> str:
        return FMT_VALUE

    def iter_unit(self, unit: int, start: int = 0) -> Iterator[Record]:
        from datasets import load_dataset  # here: slow to import, and only hub datasets need it

        ds = load_dataset(self.name, self.config, split=self.split, streaming=True, revision=self.revision)
        if start:
            ds = ds.skip(start)  # resume: examples before `start` are not tokenised again
        for index, example in enumerate(ds, start=start):
            yield Record(index=index, line=index + 1, payload=example.get(self.text_field))

    def describe(self) -> dict:
        return {
            "kind": "hf",
            "name": self.name,
            "config": self.config,
            "split": self.split,
            "revision": self.revision,
            "text_field": self.text_field,
        }


Source = FileSource | HFSource

_GLOB_CHARS = set("*?[")


def resolve_source(
    spec: str,
    kind: str = "auto",
    text_field: str = "text",
    txt_mode: str = "line",
    hf_config: str | None = None,
    hf_split: str = "train",
    hf_revision: str | None = None,
) -> Source:
    """Turn `--input` into a source.

    auto: an existing directory is a local Hugging Face dataset; a glob matching files is a file
    source; a pattern without glob characters or file suffix that matches nothing (`allenai/c4`) is a
    Hugging Face Hub name; anything else is an error naming the pattern.
    """
    if kind not in SOURCE_KINDS:
        raise ValueError(f"source kind must be one of {SOURCE_KINDS}, got {kind!r}")
    if kind == "hf" or (kind == "auto" and os.path.isdir(spec)):
        return HFSource(spec, hf_config, hf_split, hf_revision, text_field)
    files = sorted(p for p in glob.glob(os.path.expanduser(spec)) if os.path.isfile(p))
    if files:
        return FileSource(tuple(files), text_field, txt_mode)
    looks_like_path = (
        bool(_GLOB_CHARS & set(spec)) or _suffix_of(spec) is not None or spec.startswith(("/", "."))
    )
    if kind == "files" or looks_like_path:
        raise SourceError(f"no files match {spec!r}; check the path or quote the glob so the shell keeps it")
    return HFSource(spec, hf_config, hf_split, hf_revision, text_field)


def split_c4_layout(source: FileSource) -> tuple[FileSource, FileSource | None]:
    """Split a file source holding both `c4-train.*` and `c4-validation.*` files by name.

    Returns (train, validation); validation is None unless both kinds are present.
    """
    train = tuple(p for p in source.files if not Path(p).name.startswith("c4-validation."))
    validation = tuple(p for p in source.files if Path(p).name.startswith("c4-validation."))
    has_c4_train = any(Path(p).name.startswith("c4-train.") for p in train)
    if not (validation and has_c4_train):
        return source, None
    return (
        FileSource(train, source.text_field, source.txt_mode),
        FileSource(validation, source.text_field, source.txt_mode),
    )
