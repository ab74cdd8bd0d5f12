"""The shards stay readable by the `webdataset` package: the bundled C4 sample's shards, read through
`webdataset.WebDataset` from a directory, a `pipe:` command and http, give exactly the rows our own
reader (`RowStore`) gives; rank splits and `start_row` resumes are exact."""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest

wds = pytest.importorskip("webdataset")

from data_prep.shard import ShardConfig, run_sharding  # noqa: E402
from data_prep.shard_format import load_manifest, split_shards  # noqa: E402
from data_prep.webdataset_rows import row_dataset, source_url, stream_rows  # noqa: E402
from training.data.row_store import RowStore, open_split  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, c4_train_path, c4_validation_path) -> Path:
    """The bundled C4 sample in several shards of several blocks each (the last block of a shard short)."""
    out = tmp_path_factory.mktemp("wds") / "c4"
    run_sharding(ShardConfig(input=str(c4_train_path), validation_input=str(c4_validation_path), output=str(out),
                             input_length=64, rows_per_shard=300, rows_per_block=128, workers=0, progress=False))
    return out


def our_rows(data_dir: Path, split: str) -> np.ndarray:
    """Every row of the split through the trainer's reader."""
    manifest = load_manifest(data_dir)
    info = open_split(data_dir, split, row_length=manifest["row_length"],
                      noise_density=manifest["options"]["noise_density"],
                      mean_noise_span_length=manifest["options"]["mean_noise_span_length"],
                      vocab_size=manifest["tokenizer"]["vocab_size"], eos_id=manifest["tokenizer"]["eos_id"],
                      expected_tokenizer_sha256=manifest["tokenizer"]["sha256"])
    store = RowStore(info)
    return store.read(np.arange(len(store)))


@pytest.mark.parametrize("split", ["train", "validation"])
def test_webdataset_reads_exactly_the_rows_of_our_reader(dataset, split):
    expected = our_rows(dataset, split)
    shards = split_shards(load_manifest(dataset), split)
    assert len(shards) > 1
    # webdataset alone: one sample per block, keyed {shard}-{block}, the block an npy array
    samples = list(wds.WebDataset([str(dataset / s.path) for s in shards], shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == sorted(s["__key__"] for s in samples)
    assert np.array_equal(np.concatenate([s["tokens.npy"] for s in samples]), expected)
    # our helper, rows one by one, dtype included
    rows = list(stream_rows(str(dataset), split))
    assert rows[0].dtype == expected.dtype and np.array_equal(np.stack(rows), expected)


def test_a_pipe_command_and_http_read_the_same_rows(dataset):
    expected = our_rows(dataset, "train")
    piped = np.stack(list(stream_rows(f"pipe:cat {dataset}/{{path}}", "train")))
    assert np.array_equal(piped, expected)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(dataset))
    handler.log_message = lambda *args: None
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            fetched = np.stack(list(stream_rows(f"http://127.0.0.1:{server.server_address[1]}", "train")))
        finally:
            server.shutdown()
    assert np.array_equal(fetched, expected)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_share_the_shards_and_start_row_resumes_exactly(dataset, tmp_path, world_size):
    expected = our_rows(dataset, "train")
    shards = split_shards(load_manifest(dataset), "train")
    starts = np.cumsum([0] + [s.rows for s in shards])
    seen = []
    for rank in range(world_size):
        mine = [i for i in range(len(shards)) if i % world_size == rank]
        rank_rows = np.concatenate([expected[starts[i]:starts[i + 1]] for i in mine])
        assert np.array_equal(np.stack(list(stream_rows(str(dataset), "train", rank=rank, world_size=world_size))),
                              rank_rows)
        seen += mine
        # resume inside the first block, at a shard boundary, inside a later shard, at the very end
        for start in sorted({5, shards[mine[0]].rows, len(rank_rows) - 7, len(rank_rows)}):
            log = tmp_path / f"opened_{rank}_{start}.txt"
            source = f"pipe:echo {{path}} >> {log}; cat {dataset}/{{path}}"
            resumed = list(stream_rows(source, "train", rank=rank, world_size=world_size, start_row=start))
            assert np.array_equal(np.array(resumed).reshape(-1, expected.shape[1]), rank_rows[start:])
            opened = log.read_text().split() if log.exists() else []
            # manifest.json, then only the shards from the one holding row `start` on
            first = np.searchsorted(np.cumsum([shards[i].rows for i in mine]), start, side="right")
            assert opened == ["manifest.json"] + [shards[i].path for i in mine[first:]]
    assert sorted(seen) == list(range(len(shards)))


def test_row_dataset_composes_with_webdataset_stages(dataset):
    manifest = load_manifest(dataset)
    urls = [source_url(str(dataset), s.path) for s in split_shards(manifest, "validation")]
    batches = list(row_dataset(urls, manifest["row_length"], manifest["dtype"]).batched(16, collation_fn=np.stack))
    assert np.array_equal(np.concatenate(batches), our_rows(dataset, "validation"))


def test_foreign_input_is_refused_with_a_message(dataset, tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest"):
        stream_rows(str(tmp_path), "train")
    with pytest.raises(ValueError, match="start_row"):
        stream_rows(str(dataset), "train", start_row=10**9)
    shards = len(split_shards(load_manifest(dataset), "validation"))
    with pytest.raises(ValueError, match="fewer than world_size"):
        stream_rows(str(dataset), "validation", rank=shards, world_size=shards + 1)
    other = tmp_path / "other.tar"
    other.write_bytes((dataset / split_shards(load_manifest(dataset), "train")[0].path).read_bytes())
    with pytest.raises(ValueError, match="not a t5ds shard"):
        list(row_dataset([str(other)], row_length=7))
