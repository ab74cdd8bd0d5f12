"""Read t5ds shards with the `webdataset` package: from a dataset directory, over http(s), or from any
command that writes a shard to stdout (`pipe:`), for pipelines outside the trainer and for machines
that do not see the dataset directory.

    from data_prep.webdataset_rows import row_dataset, stream_rows

    for row in stream_rows("data/c4", "validation"): ...                  # a dataset directory
    for row in stream_rows("https://example.org/c4", "train"): ...        # fetched with curl
    rows = stream_rows("pipe:aws s3 cp s3://bucket/c4/{path} -", "train", rank=r, world_size=n, start_row=k)

A source is a dataset directory or URL prefix, to which the manifest's relative paths
(`train/shard-000000.tar`, and `manifest.json` itself) are appended, or a string holding `{path}`,
which each relative path replaces. Every row is a 1-D array of `row_length` token ids in the
manifest's dtype, exactly what `training.data.row_store.RowStore` reads from the same shards.

The shards are WebDataset tars whose samples are blocks of rows (`{key}.tokens.npy`,
data_prep/shard_format.py): `webdataset.WebDataset(urls).decode()` yields one block per sample, and
`rows_of_blocks` turns blocks into rows. `row_dataset(urls)` is that pipeline, to extend with
webdataset's own stages (`.shuffle(n)`, `.batched(b, collation_fn=np.stack)`) or hand to a DataLoader (its workers split
the shards). `stream_rows` reads one rank's share of a split in stored order and resumes exactly at
any row: see docs/data_prep.md for what that guarantees and why the trainer reads local shards.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from functools import partial

import numpy as np

from data_prep.shard_format import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, split_shards

_BLOCK_FIELD = "tokens.npy"  # a sample's block of rows, decoded by webdataset's .npy handler


def source_url(source: str, path: str) -> str:
    """The URL of `path` (relative to the dataset directory) in `source`."""
    if "{path}" in source:
        return source.replace("{path}", path)
    return source.rstrip("/") + "/" + path


def read_manifest(source: str) -> dict:
    """The dataset's manifest.json, read through webdataset's URL opener (file, http(s), pipe:, ...)."""
    import webdataset as wds  # imports torch: here, so that `data_prep` itself stays light

    url = source_url(source, MANIFEST_NAME)
    try:
        with wds.gopen(url) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"{url}: cannot read the dataset's manifest ({err}); point at a directory or URL "
                                "written by `python -m data_prep.shard`, or put {path} where its paths go") from err
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{url}: not a {FORMAT_NAME} v{FORMAT_VERSION} manifest (format={manifest.get('format')!r}, "
                         f"format_version={manifest.get('format_version')!r}); re-shard with this version of data_prep")
    return manifest


def rows_of_blocks(samples: Iterable[dict], row_length: int | None = None,
                   dtype: str | None = None) -> Iterator[np.ndarray]:
    """The rows of decoded WebDataset samples of t5ds shards, in order; a sample that is not a 2-D
    block of `row_length` columns in `dtype` (when given) raises ValueError."""
    for sample in samples:
        block = sample.get(_BLOCK_FIELD)
        if (not isinstance(block, np.ndarray) or block.ndim != 2
                or (row_length is not None and block.shape[1] != row_length)
                or (dtype is not None and block.dtype != np.dtype(dtype))):
            what = "no tokens.npy" if block is None else f"{getattr(block, 'dtype', type(block).__name__)}" \
                f"{list(getattr(block, 'shape', []))}"
            raise ValueError(f"{sample.get('__url__')}: sample {sample.get('__key__')!r} holds {what}, not a "
                             f"block of {row_length or 'N'}-token rows: the shard is not a t5ds shard of this dataset "
                             "(run data_prep.verify on it)")
        yield from block


def row_dataset(urls: list[str], row_length: int | None = None, dtype: str | None = None):
    """A `webdataset.WebDataset` pipeline over the shards `urls` (in this order) that yields rows.

    No node splitting (pass each rank its own URLs); DataLoader workers split the shards as
    webdataset does by default."""
    import webdataset as wds

    dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, empty_check=False)
    return dataset.decode().compose(partial(rows_of_blocks, row_length=row_length, dtype=dtype))


def stream_rows(source: str, split: str, *, rank: int = 0, world_size: int = 1, start_row: int = 0,
                manifest: dict | None = None) -> Iterator[np.ndarray]:
    """The rows of rank `rank`'s shards of `split` (shard i goes to rank i % world_size), in stored
    order, from the rank's row `start_row` on.

    Resuming with start_row = rows consumed gives exactly the rows an uninterrupted stream would
    give next, and the shards before the one holding that row are not read. `manifest` skips
    reading it from the source again."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    manifest = read_manifest(source) if manifest is None else manifest
    shards = split_shards(manifest, split)
    mine = shards[rank::world_size]
    if not mine:
        raise ValueError(f"split {split!r} has {len(shards)} shards, fewer than world_size={world_size}: "
                         "re-shard with a smaller --rows-per-shard or read with fewer ranks")
    total = sum(s.rows for s in mine)
    if not 0 <= start_row <= total:
        raise ValueError(f"start_row {start_row} is outside the {total} rows of rank {rank}'s shards of {split!r}")
    first, skip = 0, start_row
    while first < len(mine) and skip >= mine[first].rows:
        skip -= mine[first].rows
        first += 1
    if first == len(mine):
        return iter(())
    rows = row_dataset([source_url(source, s.path) for s in mine[first:]], manifest["row_length"],
                       manifest.get("dtype", "uint16"))
    return itertools.islice(iter(rows), skip, None)
