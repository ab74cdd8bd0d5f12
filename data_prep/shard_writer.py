"""Rows and shards: `Packer` cuts a split's token stream into shards of whole rows, and
`ShardWriter` serialises, hashes and writes them (atomically) in a background thread, in order.

The thread takes the tar encoding, the sha256 and the write + fsync off the main process's Python
thread (hashlib and file writes release the GIL), which with many encoder workers is the one that
limits the rate. Shards are written and recorded strictly in stream order, so progress.json always
describes a prefix of the stream; the queue is bounded (a few shards) so memory stays flat.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from data_prep.shard_format import encode_shard, shard_name, write_shard_atomic

# Test hook: exit abruptly (no cleanup, like SIGKILL) right after shard number K (0-based) is renamed
# into place and before progress.json records it.
KILL_AFTER_SHARD_ENV = "T5DS_DATA_PREP_KILL_AFTER_SHARD"
_QUEUED_SHARDS = 4  # shards waiting for the writer thread (each 9.3 MB at the default sizes)
_DONE = object()


class ShardWriter:
    """Writes shards in a background thread, appends each one's entry to its split's shard list and
    then applies the state update given with it and calls `save` (progress.json)."""

    def __init__(self, rows_per_block: int, save: Callable[[], None] | None = None) -> None:
        self.rows_per_block, self.save = rows_per_block, save
        self.queue: queue.Queue = queue.Queue(maxsize=_QUEUED_SHARDS)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="shard writer", daemon=True)
        self.thread.start()

    def put(self, split_dir: Path, entries: list, rows: np.ndarray, update: tuple[dict, dict] | None) -> None:
        """Queue one shard of `rows` for `split_dir`; `update` = (state, values): state.update(values)
        and save once the shard is recorded (None: record it only)."""
        self._raise()
        self.queue.put((split_dir, entries, rows, update))

    def drain(self) -> None:
        """Wait until every queued shard is written and recorded; raises the writer's error, if any."""
        self.queue.join()
        self._raise()

    def close(self) -> None:
        self.queue.put(_DONE)
        self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (item := self.queue.get()) is not _DONE:
            try:
                if self.error is None:  # after an error, queued shards are dropped (not recorded)
                    self._write(*item)
            except BaseException as exc:  # handed to the main thread at its next put / drain
                self.error = exc
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _write(self, split_dir: Path, entries: list, rows: np.ndarray, update: tuple[dict, dict] | None) -> None:
        index = len(entries)
        data = encode_shard(rows, index, self.rows_per_block)
        digest = write_shard_atomic(split_dir / shard_name(index), data)
        kill_after = os.environ.get(KILL_AFTER_SHARD_ENV)
        if kill_after is not None and index >= int(kill_after):
            os._exit(75)  # simulate a kill: shard renamed into place, progress.json not yet updated
        entries.append({"path": f"{split_dir.name}/{shard_name(index)}", "rows": int(rows.shape[0]),
                        "tokens": int(rows.size), "sha256": digest})
        if update is not None:
            update[0].update(update[1])
            if self.save is not None:
                self.save()


class Packer:
    """Cuts a token stream into shards of `rows_per_shard` rows of `row_length` tokens."""

    def __init__(self, row_length: int, rows_per_shard: int, dtype: np.dtype, carry: list[int]) -> None:
        self.row_length, self.dtype = row_length, dtype
        self.shard_tokens = row_length * rows_per_shard
        carry_array = np.asarray(carry, dtype=dtype)
        self.pieces, self.buffered = ([carry_array] if len(carry_array) else []), len(carry_array)

    def add(self, tokens: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Append tokens; returns the finished shards as (end, rows): `end` is where the shard ends,
        as an offset into `tokens` (what follows it up to the end of `tokens` is then buffered)."""
        before = self.buffered
        self.pieces.append(tokens)
        self.buffered += len(tokens)
        if self.buffered < self.shard_tokens:
            return []
        flat, start, shards = np.concatenate(self.pieces), 0, []
        while len(flat) - start >= self.shard_tokens:
            start += self.shard_tokens
            shards.append((start - before, flat[start - self.shard_tokens : start].reshape(-1, self.row_length)))
        rest = flat[start:].copy()
        self.pieces, self.buffered = ([rest] if len(rest) else []), len(rest)
        return shards

    def finish(self) -> tuple[np.ndarray | None, np.ndarray]:
        """(rows of the last, short shard or None, the tail shorter than a row that makes no row)."""
        flat = np.concatenate(self.pieces) if self.pieces else np.zeros(0, self.dtype)
        rows = len(flat) // self.row_length
        self.pieces, self.buffered = [], 0
        last = flat[: rows * self.row_length].reshape(-1, self.row_length) if rows else None
        return last, flat[rows * self.row_length :]
