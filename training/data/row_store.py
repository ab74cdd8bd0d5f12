"""Random access to the rows of one split of a prepared dataset (`data_prep.shard_format`).

Row i of a split is addressed globally: the manifest's per-shard row counts give cumulative
offsets, so row i = (shard s, row i - start[s]). The loader visits rows in a full-epoch random
order, so consecutive samples come from different shards; reading whole shards (`read_shard`)
would load ~1 shard per sample. Instead rows are read in place: blocks are plain `.npy` members of
an uncompressed tar, so a block is a C-ordered (rows, row_length) array at a fixed byte offset.
Each shard's block offsets are parsed once (tar + npy headers only) and kept; reading a row is one
`os.pread` of row_length * 2 bytes (1136 for 568 uint16 tokens), from the page cache or the disk.

`open_split` checks the dataset against what the run expects (tokenizer hash, row length,
vocabulary) and refuses with a message that says what to do.
"""

from __future__ import annotations

import ast
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.shard_format import ShardEntry, load_manifest, split_shards, t5_span_lengths

logger = logging.getLogger(__name__)

_MEMBER_SUFFIX = ".tokens.npy"


@dataclass(frozen=True)
class SplitInfo:
    """What the loader needs to know about one split, read from the manifest and checked."""

    data_dir: str
    split: str
    row_length: int  # raw tokens per row
    dtype: str  # stored token dtype ("uint16")
    shards: tuple[ShardEntry, ...]
    tokenizer_sha256: str

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)


def _suggest_input_length(row_length: int, noise_density: float, mean_noise_span_length: float) -> str:
    for input_length in range(2, 16385):
        if t5_span_lengths(input_length, noise_density, mean_noise_span_length)[0] == row_length:
            return f"input_length={input_length}"
    return "an input_length whose row length matches"


def has_split(data_dir: str | os.PathLike, split: str) -> bool:
    """Whether the dataset in `data_dir` has `split` with at least one row (data_prep.shard writes a
    train-only dataset when it is given no validation source)."""
    info = load_manifest(data_dir).get("splits", {}).get(split)
    return bool(info) and info.get("rows", 0) > 0


def open_split(
    data_dir: str | os.PathLike,
    split: str,
    *,
    row_length: int,
    noise_density: float,
    mean_noise_span_length: float,
    vocab_size: int,
    eos_id: int,
    expected_tokenizer_sha256: str | None,
    sentinel_start_id: int | None = None,
) -> SplitInfo:
    """Read and check the manifest of `data_dir` for `split`. Raises ValueError on any mismatch."""
    manifest = load_manifest(data_dir)
    where = f"{Path(data_dir) / 'manifest.json'}"
    tokenizer = manifest.get("tokenizer", {})
    data_sha = tokenizer.get("sha256", "")
    if expected_tokenizer_sha256 is not None and data_sha != expected_tokenizer_sha256:
        raise ValueError(
            f"{where}: the dataset was tokenised with a tokenizer of sha256 {data_sha} "
            f"({tokenizer.get('path', '?')}), but this run's tokenizer hashes to {expected_tokenizer_sha256}. "
            "Re-shard the corpus with the run's tokenizer, or point the run at the tokenizer the data was made with."
        )
    if expected_tokenizer_sha256 is None:
        logger.warning("%s: tokenizer hash not checked (no expected_tokenizer_sha256 given)", where)
    if manifest.get("row_length") != row_length:
        raise ValueError(
            f"{where}: rows hold {manifest.get('row_length')} tokens, but input_length with noise_density="
            f"{noise_density} and mean_noise_span_length={mean_noise_span_length} needs rows of {row_length}. "
            f"Re-shard with row length {row_length}, or train with "
            f"{_suggest_input_length(manifest.get('row_length', 0), noise_density, mean_noise_span_length)}."
        )
    data_vocab = tokenizer.get("vocab_size")
    if data_vocab is not None and data_vocab > vocab_size:
        raise ValueError(
            f"{where}: the tokenizer has {data_vocab} ids but the model's vocabulary has only {vocab_size}: "
            "raise the model's vocab_size or re-shard with the model's tokenizer."
        )
    if sentinel_start_id is not None and tokenizer.get("sentinel_start_id", sentinel_start_id) != sentinel_start_id:
        raise ValueError(
            f"{where}: the data's tokenizer has <extra_id_0> = {tokenizer['sentinel_start_id']}, the run's "
            f"{sentinel_start_id}: re-shard the corpus with the run's tokenizer, or set data.tokenizer to the data's"
        )
    if tokenizer.get("eos_id", eos_id) != eos_id:
        raise ValueError(f"{where}: the data's EOS id is {tokenizer.get('eos_id')}, the run's is {eos_id}")
    dtype = manifest.get("dtype", "uint16")
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{where}: token dtype {dtype!r} is not uint16/uint32; re-shard with data_prep")
    shards = tuple(split_shards(manifest, split))
    if not shards or sum(s.rows for s in shards) == 0:
        raise ValueError(f"{where}: split {split!r} holds no rows; shard more data into it")
    missing = [s.path for s in shards if not (Path(data_dir) / s.path).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{where}: {len(missing)} shard(s) of split {split!r} are missing, e.g. {missing[:3]}; "
            "copy the whole dataset directory or re-run the sharding."
        )
    return SplitInfo(
        data_dir=str(data_dir),
        split=split,
        row_length=row_length,
        dtype=dtype,
        shards=shards,
        tokenizer_sha256=data_sha,
    )


@dataclass(frozen=True)
class _ShardIndex:
    """Where the rows of one shard lie in its tar file."""

    block_starts: np.ndarray  # int64[blocks + 1]: first row of each block within the shard, then rows
    data_offsets: np.ndarray  # int64[blocks]: byte offset of each block's first row in the file


_TAR_BLOCK = 512  # tar headers and member data are laid out in 512-byte blocks
_NPY_MAGIC = b"\x93NUMPY"
_npy_header_cache: dict[bytes, tuple] = {}  # raw npy header -> (shape, fortran_order, dtype)


def _npy_header(raw: bytes) -> tuple:
    """Parse an npy header dict (cached: a shard's blocks share one or two headers)."""
    parsed = _npy_header_cache.get(raw)
    if parsed is None:
        header = ast.literal_eval(raw.decode("latin1"))
        parsed = (tuple(header["shape"]), bool(header["fortran_order"]), np.dtype(header["descr"]))
        if len(_npy_header_cache) < 1024:
            _npy_header_cache[raw] = parsed
    return parsed


def _index_shard(path: Path, entry: ShardEntry, row_length: int, dtype: np.dtype) -> _ShardIndex:
    """Parse the tar and npy headers of one shard (no row data is read).

    A direct parse of the USTAR headers `shard_format.encode_shard` writes (name, size, type): about
    10x faster than `tarfile` + `numpy.lib.format`, which matters because a random epoch order
    touches every shard of the split early on, in every worker. Checksums are not verified here
    (`data_prep.verify` does that); structure, dtype, shape and sizes are.
    """

    def damaged(what: str) -> ValueError:
        return ValueError(
            f"{path}: {what}; the shard is damaged or not a t5ds shard: re-shard or run data_prep.verify"
        )

    starts, offsets = [0], []
    file_size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        pos = 0
        while pos + _TAR_BLOCK <= file_size:
            head = os.pread(fd, 2 * _TAR_BLOCK, pos)  # tar header + the start of the member's data
            if head[:_TAR_BLOCK].count(0) == _TAR_BLOCK:
                break  # end-of-archive marker
            name = head[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
            if head[257:262] != b"ustar" or head[156:157] not in (b"0", b"\0"):
                raise damaged(f"member {name!r} at byte {pos} is not a plain USTAR file")
            if not name.endswith(_MEMBER_SUFFIX):
                raise damaged(f"unexpected member {name!r}")
            try:
                size = int(head[124:136].strip(b"\0 ") or b"0", 8)
            except ValueError:
                raise damaged(f"member {name!r} has an unreadable size field") from None
            data = pos + _TAR_BLOCK
            if data + size > file_size:
                raise damaged(f"block {name} is truncated")
            npy = head[_TAR_BLOCK:]
            if npy[:6] != _NPY_MAGIC or npy[6] not in (1, 2, 3):
                raise damaged(f"block {name} is not an npy array")
            header_at = 10 if npy[6] == 1 else 12
            header_len = int.from_bytes(npy[8:header_at], "little")
            raw = os.pread(fd, header_len, data + header_at)
            shape, fortran_order, block_dtype = _npy_header(raw)
            if fortran_order or len(shape) != 2 or shape[1] != row_length or block_dtype != dtype:
                raise ValueError(
                    f"{path}: block {name} is {block_dtype}{list(shape)} (fortran_order={fortran_order}), "
                    f"expected C-ordered {dtype}[rows, {row_length}]; the shard does not match the manifest: "
                    "re-shard or run data_prep.verify."
                )
            rows_at = data + header_at + header_len
            if rows_at + shape[0] * row_length * dtype.itemsize > data + size:
                raise damaged(f"block {name} is truncated")
            offsets.append(rows_at)
            starts.append(starts[-1] + shape[0])
            pos = data + -(-size // _TAR_BLOCK) * _TAR_BLOCK
    finally:
        os.close(fd)
    if starts[-1] != entry.rows:
        raise ValueError(
            f"{path}: holds {starts[-1]} rows but the manifest lists {entry.rows}; "
            "the shard is damaged or from another run: re-shard or run data_prep.verify."
        )
    return _ShardIndex(np.array(starts, dtype=np.int64), np.array(offsets, dtype=np.int64))


class RowStore:
    """Global row ids -> token arrays for one split. Picklable; files are opened lazily per process.

    A shard's block index (a few integers per block) is parsed on first use and kept; rows are read
    with `os.pread` from the `max_open_files` most recently used file descriptors (LRU), so a
    random order over tens of thousands of shards costs one small read per row, not a shard load.
    """

    def __init__(self, info: SplitInfo, max_open_files: int = 128) -> None:
        self.info = info
        self.max_open_files = max_open_files
        self.shard_starts = np.cumsum([0] + [s.rows for s in info.shards])
        self._dtype = np.dtype(info.dtype)
        self._row_bytes = info.row_length * self._dtype.itemsize
        self._index: dict[int, _ShardIndex] = {}
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> open file descriptor

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_files"] = OrderedDict()  # file descriptors are per process
        return state

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _path(self, shard: int) -> Path:
        return Path(self.info.data_dir) / self.info.shards[shard].path

    def _shard_index(self, shard: int) -> _ShardIndex:
        index = self._index.get(shard)
        if index is None:
            entry = self.info.shards[shard]
            index = _index_shard(self._path(shard), entry, self.info.row_length, self._dtype)
            self._index[shard] = index
        return index

    def _fd(self, shard: int) -> int:
        fd = self._files.get(shard)
        if fd is None:
            fd = os.open(self._path(shard), os.O_RDONLY)
            self._files[shard] = fd
            if len(self._files) > self.max_open_files:
                os.close(self._files.popitem(last=False)[1])
        else:
            self._files.move_to_end(shard)
        return fd

    def read(self, row_ids: np.ndarray) -> np.ndarray:
        """Rows `row_ids` (global ids within the split) as a (len, row_length) array, in that order."""
        row_ids = np.asarray(row_ids, dtype=np.int64)
        if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= len(self)):
            raise IndexError(f"row ids must lie in [0, {len(self)})")
        shards = np.searchsorted(self.shard_starts, row_ids, side="right") - 1
        out = bytearray(len(row_ids) * self._row_bytes)
        for i, (shard, row_id) in enumerate(zip(shards.tolist(), row_ids.tolist())):
            index = self._shard_index(shard)
            row = row_id - int(self.shard_starts[shard])
            block = int(np.searchsorted(index.block_starts, row, side="right")) - 1
            offset = int(index.data_offsets[block]) + (row - int(index.block_starts[block])) * self._row_bytes
            data = os.pread(self._fd(shard), self._row_bytes, offset)
            if len(data) != self._row_bytes:
                raise ValueError(f"{self._path(shard)}: short read at byte {offset}; the shard is truncated")
            out[i * self._row_bytes : (i + 1) * self._row_bytes] = data
        return np.frombuffer(out, dtype=self._dtype).reshape(len(row_ids), self.info.row_length)
