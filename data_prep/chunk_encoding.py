"""The encoding side of `data_prep.shard`: documents grouped into chunks, encoded by a process
pool (line splitting, JSON parsing + tokenisation), results handed back in input order with a
bounded window.

Files with one document per line (JSON lines, .txt in line mode) are read by the workers themselves
when there are at least `_UNITS_PER_WORKER` of them per worker: a worker inflates a whole file, cuts
and encodes its blocks of lines and appends the tokens to a spill file, so the main process only
maps the tokens and packs them (no gunzip, no text through a pipe). Fewer such files travel as
blocks of raw lines that the workers split: the main process inflates and counts newlines. Other
units (parquet, paragraphs, Hugging Face datasets) travel as lists of records."""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.sources import (
    EMPTY_AFTER_TOKENIZATION,
    FMT_JSON,
    FMT_TEXT,
    FileSource,
    Record,
    Source,
    iter_line_blocks,
    payload_to_text,
)
from data_prep.tokenizer import load_tokenizer

_CHUNK_BYTES = 1 << 20  # a chunk (one pool task) holds at most ~1 MiB of text
# Workers read whole files when each gets at least this many: the files still to read then hold a
# worker idle for at most a small share of the run.
_UNITS_PER_WORKER = 4


# ----------------------------------------------------------------------------------------------
# Worker side: payloads -> EOS-terminated token ids

_WORKER: dict = {}


def _exit_with_parent(parent_pid: int) -> None:
    """Workers exit when the main process dies (killed runs must not leave encoders behind)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def init_worker(tokenizer_path: str, text_field: str, dtype: str, parent_pid: int | None = None,
                stop=None) -> None:
    """`stop`: a multiprocessing Event; once set, whole-file tasks end at their next chunk (the run failed)."""
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    _WORKER["stop"] = stop
    _WORKER["tokenizer"] = load_tokenizer(tokenizer_path)
    _WORKER["text_field"] = text_field
    _WORKER["dtype"] = np.dtype(dtype)


def encode_chunk(fmt: str, payloads: list) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[str, str]]]:
    """Encode one chunk: (tokens of kept documents each + EOS, per-payload length or -1, skips by index)."""
    tokenizer, text_field = _WORKER["tokenizer"], _WORKER["text_field"]
    texts, kept, skips = [], [], {}
    for i, payload in enumerate(payloads):
        text, reason, detail = payload_to_text(fmt, payload, text_field)
        if text is None:
            skips[i] = (reason, detail)
        else:
            texts.append(text)
            kept.append(i)
    ids = tokenizer.encode_batch(texts)
    lengths = np.full(len(payloads), -1, dtype=np.int64)
    eos = tokenizer.info.eos_id
    total = 0
    for i, doc in zip(kept, ids):
        if not doc:
            skips[i] = (EMPTY_AFTER_TOKENIZATION, "document encodes to no tokens")
            continue
        doc.append(eos)
        lengths[i] = len(doc)
        total += len(doc)
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=_WORKER["dtype"], count=total)
    return flat, lengths, skips


def split_lines(block: bytes) -> list[bytes]:
    """The payloads of a block of lines (`iter_line_blocks`), as `_iter_lines` gives them."""
    return [line.rstrip(b"\r\n") for line in block.split(b"\n")]


def encode_lines(fmt: str, block: bytes) -> tuple[np.ndarray, np.ndarray, dict[int, tuple[str, str]]]:
    """`encode_chunk` of a block of lines, split here in the worker."""
    return encode_chunk(fmt, split_lines(block))


@dataclass
class Chunk:
    """Consecutive records of one unit: `records` (each with its index and line), or `count` lines
    from index `start` in `block` (records without a read error; line = index + 1)."""

    unit: int
    label: str
    fmt: str
    records: list[Record] | None = None
    payloads: list | None = None  # payloads of the records without a read error, in order
    start: int = 0
    count: int = 0
    block: bytes = b""

    @property
    def num_records(self) -> int:
        return len(self.records) if self.records is not None else self.count

    def record_index(self, i: int) -> int:
        return self.records[i].index if self.records is not None else self.start + i

    def record_line(self, i: int) -> int:
        return self.records[i].line if self.records is not None else self.start + i + 1


def _line_blocks(source: Source, unit: int) -> bool:
    fmt = source.unit_format(unit)
    return isinstance(source, FileSource) and (fmt == FMT_JSON or (fmt == FMT_TEXT and source.txt_mode == "line"))


@dataclass
class UnitTask:
    """A whole line-per-document file from record `start`, read and encoded by one worker."""

    unit: int
    label: str
    fmt: str
    path: str
    start: int


def _line_chunks(task: UnitTask, chunk_docs: int) -> Iterator[Chunk]:
    for item in iter_line_blocks(task.path, task.start, _CHUNK_BYTES, chunk_docs):
        if isinstance(item, Record):  # a read error ends the unit
            yield Chunk(task.unit, task.label, task.fmt, records=[item], payloads=[])
        else:
            yield Chunk(task.unit, task.label, task.fmt, start=item[0], count=item[1], block=item[2])


def iter_chunks(source: Source, position: tuple[int, int], chunk_docs: int,
                workers: int = 0) -> Iterator[Chunk | UnitTask]:
    """The chunks of the source from `position`; with `workers`, files of lines that the workers
    read themselves come as `UnitTask`s (see the module docstring)."""
    unit0, record0 = position
    lines = [u for u in range(unit0, source.num_units) if _line_blocks(source, u)]
    whole_units = workers > 0 and len(lines) >= _UNITS_PER_WORKER * workers
    for unit in range(unit0, source.num_units):
        label, fmt = source.unit_label(unit), source.unit_format(unit)
        start = record0 if unit == unit0 else 0
        if _line_blocks(source, unit):
            task = UnitTask(unit, label, fmt, source.files[unit], start)
            if whole_units:
                yield task
            else:
                yield from _line_chunks(task, chunk_docs)
            continue
        chunk = Chunk(unit, label, fmt, [], [])
        nbytes = 0
        for record in source.iter_unit(unit, start):
            chunk.records.append(record)
            if record.error is None:
                chunk.payloads.append(record.payload)
                nbytes += len(record.payload) if isinstance(record.payload, bytes | str) else 0
            if len(chunk.records) >= chunk_docs or nbytes >= _CHUNK_BYTES:
                yield chunk
                chunk, nbytes = Chunk(unit, label, fmt, [], []), 0
        if chunk.records:
            yield chunk


def _encode_in_process(chunk: Chunk) -> tuple:
    """`encode_chunk` of a chunk in this process, splitting a block of raw lines first."""
    return encode_chunk(chunk.fmt, chunk.payloads if chunk.records is not None else split_lines(chunk.block))


def encode_unit(task: UnitTask, chunk_docs: int, spill: str) -> list[tuple[Chunk, int, int, np.ndarray, dict]]:
    """Read, cut and encode a whole file in the worker; its tokens go to the file `spill`, in chunk
    order. Returns per chunk (the chunk without its text, offset and count of its tokens in `spill`,
    per-record lengths, skips)."""
    out, offset = [], 0
    with open(spill, "wb") as f:
        for chunk in _line_chunks(task, chunk_docs):
            if _WORKER["stop"] is not None and _WORKER["stop"].is_set():
                break  # the answer is not read: the main process is stopping after an error
            tokens, lengths, skips = _encode_in_process(chunk)
            tokens.tofile(f)
            chunk.block = b""
            out.append((chunk, offset, len(tokens), lengths, skips))
            offset += len(tokens)
    return out


def _unit_results(parts: list, spill: Path, dtype: np.dtype) -> Iterator[tuple[Chunk, tuple]]:
    """A worker's `encode_unit` answer as (chunk, encoded), the tokens mapped from its spill file."""
    tokens = np.zeros(0, dtype)
    with open(spill, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # a plain array over the mapping: np.memmap's slices cost more
            tokens = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype)
    spill.unlink()  # the mapping keeps the data until the last view of it is gone
    for chunk, offset, count, lengths, skips in parts:
        yield chunk, (tokens[offset : offset + count], lengths, skips)


class _Spills:
    """Spill files of whole-file tasks, in a directory that is emptied at start and removed at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.rmtree(root, ignore_errors=True)  # what a killed run left

    def path(self, unit: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f"unit-{unit:06d}.{os.getpid()}.tokens"  # not a name a killed run's worker may open

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _submit(executor: ProcessPoolExecutor, task: Chunk | UnitTask, chunk_docs: int, spills: _Spills):
    if isinstance(task, UnitTask):
        return executor.submit(encode_unit, task, chunk_docs, str(spills.path(task.unit)))
    if task.records is None:
        return executor.submit(encode_lines, task.fmt, task.block)
    return executor.submit(encode_chunk, task.fmt, task.payloads)


def _results(task: Chunk | UnitTask, future, spills: _Spills, dtype: np.dtype) -> Iterator[tuple[Chunk, tuple]]:
    if isinstance(task, UnitTask):
        yield from _unit_results(future.result(), spills.path(task.unit), dtype)
    else:
        yield task, future.result()


def ordered_results(tasks: Iterator[Chunk | UnitTask], executor: ProcessPoolExecutor | None, window: int,
                    spill_dir: Path, chunk_docs: int, dtype: np.dtype) -> Iterator[tuple[Chunk, tuple]]:
    """(chunk, encoded) in input order; at most `window` chunks (or window / 2 whole files, whose
    tokens wait on disk) in flight, so memory stays bounded."""
    if executor is None:
        for chunk in tasks:
            yield chunk, _encode_in_process(chunk)
        return
    pending: deque = deque()
    weight, spills = 0, _Spills(spill_dir)
    try:
        for task in tasks:
            pending.append((task, _submit(executor, task, chunk_docs, spills)))
            weight += 2 if isinstance(task, UnitTask) else 1
            while weight >= window:
                done, future = pending.popleft()
                weight -= 2 if isinstance(done, UnitTask) else 1
                yield from _results(done, future, spills, dtype)
        while pending:
            done, future = pending.popleft()
            yield from _results(done, future, spills, dtype)
    finally:
        for _, future in pending:
            future.cancel()
        spills.close()
