"""The on-disk format shared by `data_prep` (writer) and `training` (reader).

A prepared dataset is a directory:

    DIR/manifest.json
    DIR/train/shard-000000.tar, shard-000001.tar, ...
    DIR/validation/shard-000000.tar, ...

Each shard is a plain POSIX tar in WebDataset layout. Its samples are *blocks* of packed rows:
member `{key}.tokens.npy` holds a 2-D array (rows, row_length) of token ids, uint16 while the
vocabulary fits (else uint32). Blocks of rows instead of one sample per row keep the tar overhead
(512-byte header + padding per member) negligible: a 568-token row is 1136 bytes, so one member
per row would nearly double the size on disk. Keys are `{shard:06d}-{block:04d}` so sorting by key
is sorting by position in the token stream. `webdataset.WebDataset(url).decode()` reads the blocks.

Rows are the token stream of the split (documents in input order, each followed by EOS) cut into
consecutive pieces of `row_length` tokens; the final partial row is dropped and counted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "t5ds-packed-rows"
FORMAT_VERSION = 1
SPLITS = ("train", "validation")
_MEMBER_SUFFIX = ".tokens.npy"
# A fixed mtime/uid/gid/uname in every tar header makes shards byte-identical across runs.
_TAR_MTIME = 0


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids below `vocab_size` (uint16 for the T5 vocabulary, uint32 for mT5's)."""
    if vocab_size > np.iinfo(np.uint32).max + 1:
        raise ValueError(f"a vocabulary of {vocab_size} ids does not fit the shards' largest token type (uint32, "
                         f"{np.iinfo(np.uint32).max + 1} ids): use a tokenizer with fewer pieces")
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def t5_span_lengths(
    inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0
) -> tuple[int, int]:
    """Raw tokens per row and target length for T5 span corruption (T5's `random_spans_helper`).

    Returns (tokens_length, targets_length): the longest raw row whose corrupted inputs (non-noise
    tokens + one sentinel per noise span + EOS) fit in `inputs_length`. 512 / 0.15 / 3.0 gives
    (568, 114), the numbers nanoT5 and T5 use.
    """
    if inputs_length < 2:
        raise ValueError(f"inputs_length must be >= 2, got {inputs_length}")
    if not 0.0 < noise_density < 1.0:
        raise ValueError(f"noise_density must be in (0, 1), got {noise_density}")
    if mean_noise_span_length < 1.0:
        raise ValueError(f"mean_noise_span_length must be >= 1, got {mean_noise_span_length}")

    def lengths(tokens_length: int) -> tuple[int, int]:
        num_noise_tokens = int(round(tokens_length * noise_density))
        num_nonnoise_tokens = tokens_length - num_noise_tokens
        num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
        # +1 for EOS on each side; one sentinel per span on each side.
        return num_nonnoise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    return tokens_length, lengths(tokens_length)[1]


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def encode_shard(rows: np.ndarray, shard_index: int, rows_per_block: int) -> bytes:
    """Serialise a (rows, row_length) array into the bytes of one tar shard (deterministic)."""
    if rows.ndim != 2:
        raise ValueError(f"rows must be 2-D (rows, row_length), got shape {rows.shape}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for block, start in enumerate(range(0, len(rows), rows_per_block)):
            payload = io.BytesIO()
            np.save(payload, np.ascontiguousarray(rows[start : start + rows_per_block]), allow_pickle=False)
            data = payload.getvalue()
            info = tarfile.TarInfo(f"{shard_index:06d}-{block:04d}{_MEMBER_SUFFIX}")
            info.size = len(data)
            info.mtime = _TAR_MTIME
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_shard_atomic(path: str | os.PathLike, data: bytes) -> str:
    """Write `data` to `path` through a temporary name + fsync + rename; returns its sha256.

    A run killed mid-write leaves only `*.tmp` files, which no reader or resume treats as a shard.
    """
    path = Path(path)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def iter_shard_blocks(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (key, block) for each block of a shard, in file order. Raises on a damaged shard."""
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:
            if not member.isfile() or not member.name.endswith(_MEMBER_SUFFIX):
                raise ValueError(f"{path}: unexpected member {member.name!r} (not a {_MEMBER_SUFFIX} block)")
            f = tar.extractfile(member)
            assert f is not None
            block = np.load(io.BytesIO(f.read()), allow_pickle=False)
            if block.ndim != 2:
                raise ValueError(f"{path}: member {member.name} is not a 2-D block of rows")
            yield member.name[: -len(_MEMBER_SUFFIX)], block


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """All rows of one shard as a (rows, row_length) array in its stored dtype."""
    blocks = [block for _, block in iter_shard_blocks(path)]
    if not blocks:
        raise ValueError(f"{path}: shard holds no rows")
    return np.concatenate(blocks, axis=0)


@dataclass(frozen=True)
class ShardEntry:
    """One shard as listed in the manifest."""

    path: str  # relative to the dataset directory, e.g. "train/shard-000000.tar"
    rows: int
    tokens: int
    sha256: str


def load_manifest(data_dir: str | os.PathLike) -> dict:
    """Read DIR/manifest.json with a message that says what to do when it is missing or foreign."""
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: point at a directory written by `python -m data_prep.shard` "
            "(it holds manifest.json plus train/ and validation/ shards)."
        )
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{path}: not a {FORMAT_NAME} manifest (format={manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {manifest.get('format_version')} is not the supported "
            f"{FORMAT_VERSION}; re-shard the corpus with this version of data_prep."
        )
    return manifest


def split_shards(manifest: dict, split: str) -> list[ShardEntry]:
    """The shards of one split, in stream order."""
    splits = manifest.get("splits", {})
    if split not in splits:
        raise KeyError(f"split {split!r} not in manifest (has: {sorted(splits)})")
    return [ShardEntry(**entry) for entry in splits[split]["shards"]]
