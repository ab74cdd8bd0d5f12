"""The encoding side of `data_prep.shard`: documents grouped into chunks, encoded by a process
pool (line splitting, JSON parsing + tokenisation), results handed back in input order with a
bounded window.

Files with one document per line (JSON lines, .txt in line mode) travel as blocks of raw lines that
the workers split: the reading process only inflates and counts newlines. Other units (parquet,
paragraphs, Hugging Face datasets) travel as lists of records."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

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


# ----------------------------------------------------------------------------------------------
# Worker side: payloads -> EOS-terminated token ids

_WORKER: dict = {}


def _exit_with_parent(parent_pid: int) -> None:
    """Workers exit when the main process dies (killed runs must not leave encoders behind)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def init_worker(tokenizer_path: str, text_field: str, dtype: str, parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
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


def iter_chunks(source: Source, position: tuple[int, int], chunk_docs: int) -> Iterator[Chunk]:
    unit0, record0 = position
    for unit in range(unit0, source.num_units):
        label, fmt = source.unit_label(unit), source.unit_format(unit)
        start = record0 if unit == unit0 else 0
        if _line_blocks(source, unit):
            for item in iter_line_blocks(source.files[unit], start, _CHUNK_BYTES, chunk_docs):
                if isinstance(item, Record):  # a read error ends the unit
                    yield Chunk(unit, label, fmt, records=[item], payloads=[])
                else:
                    yield Chunk(unit, label, fmt, start=item[0], count=item[1], block=item[2])
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


def _submit(executor: ProcessPoolExecutor, chunk: Chunk):
    if chunk.records is None:
        return executor.submit(encode_lines, chunk.fmt, chunk.block)
    return executor.submit(encode_chunk, chunk.fmt, chunk.payloads)


def ordered_results(chunks: Iterator[Chunk], executor: ProcessPoolExecutor | None, window: int):
    """(chunk, encoded) in input order; at most `window` chunks in flight (bounded memory)."""
    if executor is None:
        for chunk in chunks:
            payloads = chunk.payloads if chunk.records is not None else split_lines(chunk.block)
            yield chunk, encode_chunk(chunk.fmt, payloads)
        return
    pending: deque = deque()
    for chunk in chunks:
        pending.append((chunk, _submit(executor, chunk)))
        if len(pending) >= window:
            done, future = pending.popleft()
            yield done, future.result()
    while pending:
        done, future = pending.popleft()
        yield done, future.result()
