"""The pre-training loader on a small real dataset (bundled C4, T5 tokenizer) written with shard_format."""

import gzip
import io
import json
import multiprocessing
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

from data_prep.shard_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    encode_shard,
    read_shard,
    sha256_file,
    shard_name,
    write_shard_atomic,
)
from training.data import (
    Cursor,
    EpochPermutation,
    PretrainBatches,
    RowStore,
    SpanCorruption,
    WeightedCorpus,
    expand_sentinels,
    micro_batch_sample_indices,
    open_split,
    validation_batches,
)

TRAIN_SHARD_ROWS = [17, 40, 3, 60]  # uneven on purpose; 120 rows = divisible by 1..6 and 8
VALIDATION_SHARD_ROWS = [13, 20]  # 33 rows: splits unevenly over 2 and 4 ranks


def tokenized_rows(sp, path, num_rows, row_length=568):
    """Documents joined with EOS, cut into rows, as data_prep packs them."""
    stream: list[int] = []
    with gzip.open(path, "rt") as f:
        for line in f:
            stream.extend(sp.encode(json.loads(line)["text"]) + [1])
            if len(stream) >= num_rows * row_length:
                break
    assert len(stream) >= num_rows * row_length, "not enough bundled text for the test dataset"
    return np.array(stream[: num_rows * row_length], dtype=np.uint16).reshape(num_rows, row_length)


def write_dataset(root: Path, splits: dict, spiece_path: Path, row_length=568, rows_per_block=8) -> Path:
    """Shards + manifest in the shape data_prep.shard writes. splits: name -> list of row arrays."""
    manifest_splits = {}
    for split, shard_rows in splits.items():
        (root / split).mkdir(parents=True)
        entries = []
        for index, rows in enumerate(shard_rows):
            rel = f"{split}/{shard_name(index)}"
            digest = write_shard_atomic(root / rel, encode_shard(rows, index, rows_per_block))
            entries.append({"path": rel, "rows": len(rows), "tokens": int(rows.size), "sha256": digest})
        manifest_splits[split] = {
            "shards": entries,
            "rows": sum(e["rows"] for e in entries),
            "tokens": sum(e["tokens"] for e in entries),
        }
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "row_length": row_length,
        "dtype": "uint16",
        "tokenizer": {
            "sha256": sha256_file(spiece_path),
            "vocab_size": 32100,
            "eos_id": 1,
            "pad_id": 0,
            "path": str(spiece_path),
        },
        "splits": manifest_splits,
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return root


def cut(rows, sizes):
    return np.split(rows, np.cumsum(sizes)[:-1])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, spiece_path, c4_train_path, c4_validation_path):
    sp = spm.SentencePieceProcessor(model_file=str(spiece_path))
    train = tokenized_rows(sp, c4_train_path, sum(TRAIN_SHARD_ROWS))
    validation = tokenized_rows(sp, c4_validation_path, sum(VALIDATION_SHARD_ROWS))
    root = write_dataset(
        tmp_path_factory.mktemp("c4_prepared"),
        {"train": cut(train, TRAIN_SHARD_ROWS), "validation": cut(validation, VALIDATION_SHARD_ROWS)},
        spiece_path,
    )
    return {"dir": root, "train": train, "validation": validation, "sha": sha256_file(spiece_path)}


def make_loader(dataset, **overrides):
    kwargs = dict(
        rank=0,
        world_size=1,
        micro_batch_size=4,
        grad_acc=1,
        seed=17,
        num_workers=0,
        expected_tokenizer_sha256=dataset["sha"],
        include_indices=True,
    )
    kwargs.update(overrides)
    return PretrainBatches(dataset["dir"], "train", **kwargs)


def take_steps(
    dataset, steps, *, world_size, micro_batch_size, grad_acc, num_workers=0, cursor=None, seed=17
):
    """Run `steps` optimizer steps on all ranks; returns per-step lists of (rank, micro-batch) and the
    loaders (their cursors are at the step boundary after the last step)."""
    loaders = [
        make_loader(
            dataset,
            rank=r,
            world_size=world_size,
            micro_batch_size=micro_batch_size,
            grad_acc=grad_acc,
            num_workers=num_workers,
            cursor=cursor,
            seed=seed,
        )
        for r in range(world_size)
    ]
    iterators = [iter(loader) for loader in loaders]
    per_step = []
    for _ in range(steps):
        step = []
        for _ in range(grad_acc):
            for r, it in enumerate(iterators):
                step.append((r, next(it)))
        per_step.append(step)
    return per_step, loaders


def step_samples(step):
    """Sorted global sample indices of one optimizer step, over all ranks and micro-steps."""
    return sorted(int(i) for _, batch in step for i in batch["sample_index"])


def step_contents(step):
    """The multiset of (input_ids, labels) pairs of one step, independent of rank / micro-step."""
    return sorted(
        (batch["input_ids"][b].numpy().tobytes(), batch["labels"][b].numpy().tobytes())
        for _, batch in step
        for b in range(len(batch["input_ids"]))
    )


def test_epoch_permutation_is_a_bijection_without_locality():
    for n in [1, 2, 3, 5, 16, 17, 120, 4099]:
        for epoch in range(3):
            perm = EpochPermutation(n, seed=3, epoch=epoch)(np.arange(n))
            np.testing.assert_array_equal(np.sort(perm), np.arange(n))
    a = EpochPermutation(4099, 3, 0)(np.arange(4099))
    assert not np.array_equal(a, EpochPermutation(4099, 3, 1)(np.arange(4099)))
    assert not np.array_equal(a, EpochPermutation(4099, 4, 0)(np.arange(4099)))
    assert abs(np.corrcoef(np.arange(4099), a)[0, 1]) < 0.1
    # Neighbouring positions land far apart (no blocks of consecutive rows).
    assert np.median(np.abs(np.diff(a))) > 4099 / 10
    big = EpochPermutation(10**9, 1, 0)(np.arange(10**9 - 5000, 10**9))
    assert len(np.unique(big)) == 5000 and big.min() >= 0 and big.max() < 10**9


def test_row_store_reads_the_rows_of_the_shards(dataset):
    info = open_split(
        dataset["dir"], "train", row_length=568, noise_density=0.15, mean_noise_span_length=3.0,
        vocab_size=32128, eos_id=1, expected_tokenizer_sha256=dataset["sha"],
    )  # fmt: skip
    assert info.num_rows == 120 and [s.rows for s in info.shards] == TRAIN_SHARD_ROWS
    via_read_shard = np.concatenate([read_shard(dataset["dir"] / s.path) for s in info.shards])
    np.testing.assert_array_equal(via_read_shard, dataset["train"])
    store = RowStore(info, max_open_files=2)  # fewer than the 4 shards: the LRU closes and reopens
    ids = np.random.default_rng(0).integers(0, 120, size=300)
    np.testing.assert_array_equal(store.read(ids), dataset["train"][ids])
    assert len(store._files) == 2
    with pytest.raises(IndexError):
        store.read([120])


def test_micro_batch_layout():
    # G = 16: micro-step 0 is samples 0..7 (rank 0: 0..3, rank 1: 4..7), micro-step 1 is 8..15.
    layout = {
        (j, r): micro_batch_sample_indices(
            100, j, rank=r, world_size=2, micro_batch_size=4, grad_acc=2
        ).tolist()
        for j in range(3)
        for r in range(2)
    }
    assert layout[0, 0] == [100, 101, 102, 103] and layout[0, 1] == [104, 105, 106, 107]
    assert layout[1, 0] == [108, 109, 110, 111] and layout[1, 1] == [112, 113, 114, 115]
    assert layout[2, 0] == [116, 117, 118, 119]  # next global batch


def test_batches_hold_real_rows_corrupted_by_t5_rules(dataset):
    loader = make_loader(dataset, micro_batch_size=8)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "sample_index", "row_index"}
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (8, 512)
    assert batch["labels"].dtype == torch.int64 and batch["labels"].shape == (8, 114)
    assert (batch["labels"] != -100).all()
    corruption = SpanCorruption()
    for b in range(8):
        row = dataset["train"][int(batch["row_index"][b])]
        restored = expand_sentinels(batch["input_ids"][b].numpy(), batch["labels"][b].numpy(), 32099, 32072)
        np.testing.assert_array_equal(restored, row)
        inputs, labels = corruption.corrupt(row[None], [int(batch["sample_index"][b])], seed=17)
        np.testing.assert_array_equal(batch["input_ids"][b].numpy(), inputs[0])
    plain = make_loader(dataset, include_indices=False)
    assert set(next(iter(plain))) == {"input_ids", "labels"}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_one_epoch_is_covered_exactly_once(dataset, world_size, num_workers):
    micro, grad_acc = 4, 2
    n = len(dataset["train"])
    global_batch = micro * grad_acc * world_size
    steps = -(-n // global_batch) + 1  # one step into the next epoch
    per_step, loaders = take_steps(
        dataset,
        steps,
        world_size=world_size,
        micro_batch_size=micro,
        grad_acc=grad_acc,
        num_workers=num_workers,
    )
    samples = [int(i) for step in per_step for _, b in step for i in b["sample_index"]]
    rows = [int(i) for step in per_step for _, b in step for i in b["row_index"]]
    assert len(samples) == len(set(samples)) == steps * global_batch  # disjoint over ranks and workers
    assert sorted(samples) == list(range(steps * global_batch))  # and contiguous from the cursor
    by_sample = dict(zip(samples, rows))
    epoch0 = [by_sample[g] for g in range(n)]
    assert sorted(epoch0) == list(range(n))  # every row exactly once in epoch 0
    assert epoch0 != list(range(n))  # shuffled
    epoch1 = [by_sample[g] for g in range(n, steps * global_batch)]
    assert len(set(epoch1)) == len(epoch1)
    for step_index, step in enumerate(per_step):  # step s is the global batch [s*G, (s+1)*G)
        assert step_samples(step) == list(range(step_index * global_batch, (step_index + 1) * global_batch))
    # Micro-step m of rank r: the documented layout; the union over ranks of a micro-step is contiguous.
    for step_index, step in enumerate(per_step):
        for m in range(grad_acc):
            union = sorted(
                int(i) for _, b in step[m * world_size : (m + 1) * world_size] for i in b["sample_index"]
            )
            start = step_index * global_batch + m * micro * world_size
            assert union == list(range(start, start + micro * world_size))
        for position, (r, batch) in enumerate(step):
            m = position // world_size
            expected = micro_batch_sample_indices(
                step_index * global_batch,
                m,
                rank=r,
                world_size=world_size,
                micro_batch_size=micro,
                grad_acc=grad_acc,
            )
            np.testing.assert_array_equal(batch["sample_index"].numpy(), expected)
    for loader in loaders:
        assert loader.cursor.samples_consumed == steps * global_batch
        assert loader.cursor.epoch == 1


def test_global_batch_identical_for_any_world_size_and_split(dataset):
    reference, _ = take_steps(dataset, 4, world_size=1, micro_batch_size=8, grad_acc=1)
    for world_size, micro, grad_acc, workers in [(2, 4, 1, 0), (1, 4, 2, 2), (2, 2, 2, 1), (4, 1, 2, 0)]:
        other, _ = take_steps(
            dataset, 4, world_size=world_size, micro_batch_size=micro, grad_acc=grad_acc, num_workers=workers
        )
        for ref_step, step in zip(reference, other):
            assert step_samples(step) == step_samples(ref_step)
            assert step_contents(step) == step_contents(ref_step)  # same rows, same noise


def test_resume_from_cursor_equals_uninterrupted_run(dataset):
    total_steps, stop = 20, 13  # G = 8, 120 rows: runs through epoch 1 into epoch 2 (wrap mid-batch)
    uninterrupted, _ = take_steps(dataset, total_steps, world_size=2, micro_batch_size=2, grad_acc=2)
    first, loaders = take_steps(dataset, stop, world_size=2, micro_batch_size=2, grad_acc=2)
    state = json.loads(json.dumps(loaders[0].cursor.state_dict()))  # as a checkpoint stores it
    assert state == loaders[1].cursor.state_dict()  # every rank agrees
    assert state["samples_consumed"] == stop * 8
    assert (state["epoch"], state["position_in_epoch"]) == divmod(stop * 8, 120)
    # Resume on the same world size, on 1 rank with grad_acc 4, and on 4 ranks with workers.
    for world_size, micro, grad_acc, workers in [(2, 2, 2, 0), (1, 2, 4, 0), (4, 1, 2, 2)]:
        resumed, _ = take_steps(
            dataset,
            total_steps - stop,
            world_size=world_size,
            micro_batch_size=micro,
            grad_acc=grad_acc,
            num_workers=workers,
            cursor=state,
        )
        for ref_step, step in zip(uninterrupted[stop:], resumed):
            assert step_samples(step) == step_samples(ref_step)
            assert step_contents(step) == step_contents(ref_step)
    for ref_step, step in zip(uninterrupted[:stop], first):
        assert step_contents(step) == step_contents(ref_step)


def test_epoch_wrap_inside_a_global_batch(dataset):
    n = len(dataset["train"])  # 120; G = 7 does not divide it
    per_step, loaders = take_steps(dataset, 18, world_size=1, micro_batch_size=7, grad_acc=1)
    wrap_step = per_step[17][0][1]  # samples 119 .. 125: the last of epoch 0, then 6 of epoch 1
    assert wrap_step["sample_index"].tolist() == list(range(119, 126))
    rows = [int(i) for step in per_step for _, b in step for i in b["row_index"]]
    assert sorted(rows[:n]) == list(range(n))
    assert EpochPermutation(n, 17, 1)(np.arange(6)).tolist() == rows[n:]
    # The noise of a sample in epoch 1 is keyed by its global sample index (n + position), not the position.
    row = dataset["train"][rows[n]]
    inputs, _ = SpanCorruption().corrupt(row[None], [n], seed=17)
    np.testing.assert_array_equal(wrap_step["input_ids"][1].numpy(), inputs[0])
    assert loaders[0].cursor.state_dict()["epoch"] == 1 and loaders[0].cursor.position_in_epoch == 6


def test_cursor_advances_only_when_a_global_batch_is_handed_out(dataset):
    loader = make_loader(dataset, micro_batch_size=2, grad_acc=3, num_workers=2)
    it = iter(loader)
    seen = []
    for _ in range(2):
        seen.append(next(it))
        assert loader.cursor.samples_consumed == 0  # prefetching workers do not move it
    seen.append(next(it))
    assert loader.cursor.samples_consumed == 6
    next(it)  # first micro-batch of step 2, then the step is abandoned (e.g. a crash)
    assert loader.cursor.samples_consumed == 6
    replay = next(iter(loader))  # a new iterator restarts at the cursor: the unfinished step again
    assert replay["sample_index"].tolist() == [6, 7]
    cursor = Cursor.from_state_dict(loader.state_dict())
    assert cursor == loader.cursor and cursor.seed == 17 and cursor.rows_per_epoch == 120


def test_next_on_the_loader_and_load_state_dict(dataset):
    loader = make_loader(dataset, micro_batch_size=2, grad_acc=2, world_size=2, rank=1)
    assert (loader.input_length, loader.target_length, loader.global_batch_size) == (512, 114, 8)
    first = [next(loader)["sample_index"].tolist() for _ in range(4)]
    assert first == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert loader.cursor.samples_consumed == 16
    saved = loader.state_dict()
    next(loader)
    resumed = make_loader(dataset, micro_batch_size=4, grad_acc=1, world_size=2, rank=1)
    resumed.load_state_dict(saved)
    assert next(resumed)["sample_index"].tolist() == [20, 21, 22, 23]
    loader.load_state_dict(saved)  # rewinds the internal iterator to the cursor
    assert next(loader)["sample_index"].tolist() == [18, 19]


def test_close_stops_the_workers_and_a_later_next_resumes_at_the_cursor(dataset):
    """close() ends the loader's worker processes at once (left to the garbage collector, the
    iterator's reference cycle makes the loader wait 5 s for a worker that is never told to stop)."""
    before = set(multiprocessing.active_children())  # loaders of other tests may still hold workers
    loader = make_loader(dataset, micro_batch_size=2, grad_acc=1, num_workers=1)
    assert [next(loader)["sample_index"].tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    (worker,) = set(multiprocessing.active_children()) - before
    loader.close()
    assert not worker.is_alive()
    loader.close()  # twice is fine
    assert next(loader)["sample_index"].tolist() == [4, 5]
    loader.close()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_workers_preserve_micro_batch_order(dataset):
    for workers in (1, 2, 3):
        loader = make_loader(
            dataset, micro_batch_size=3, grad_acc=2, world_size=2, rank=1, num_workers=workers
        )
        it = iter(loader)
        got = [next(it)["sample_index"].tolist() for _ in range(10)]
        expected = [
            micro_batch_sample_indices(0, j, rank=1, world_size=2, micro_batch_size=3, grad_acc=2).tolist()
            for j in range(10)
        ]
        assert got == expected


def test_refuses_mismatched_dataset(dataset):
    with pytest.raises(ValueError, match="tokenizer of sha256 .* Re-shard"):
        make_loader(dataset, expected_tokenizer_sha256="0" * 64)
    with pytest.raises(ValueError, match="rows hold 568 tokens.*needs rows of 284.*input_length=512"):
        make_loader(dataset, input_length=256)
    with pytest.raises(ValueError, match="vocabulary has only 32000"):
        make_loader(dataset, vocab_size=32000, sentinel_start_id=31999)
    loader = make_loader(dataset)
    bad = loader.state_dict()
    with pytest.raises(ValueError, match="pass seed=17 to resume"):
        make_loader(dataset, seed=18, cursor=bad)
    with pytest.raises(ValueError, match="split of 121 rows"):
        make_loader(dataset, cursor={**bad, "rows_per_epoch": 121, "epoch": 0, "position_in_epoch": 0})
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        make_loader({**dataset, "dir": dataset["dir"] / "train"})


def test_refuses_token_ids_that_collide_with_sentinels(tmp_path, spiece_path):
    rows = np.full((4, 568), 5, dtype=np.uint16)
    rows[2, 100] = 32090  # a sentinel id inside the raw data: another vocabulary
    root = write_dataset(tmp_path / "d", {"train": [rows], "validation": [rows]}, spiece_path)
    loader = PretrainBatches(
        root, rank=0, world_size=1, micro_batch_size=4, grad_acc=1, seed=0, num_workers=0
    )
    with pytest.raises(ValueError, match="token id 32090.*lowest sentinel id 32072"):
        next(iter(loader))


def test_refusing_token_ids_names_the_corpus_of_a_mixture_that_holds_them(tmp_path, spiece_path):
    clean = np.full((4, 568), 5, dtype=np.uint16)
    bad = clean.copy()
    bad[1, 7] = 32095
    dirs = [write_dataset(tmp_path / name, {"train": [rows], "validation": [rows]}, spiece_path)
            for name, rows in (("clean", clean), ("other_vocabulary", bad))]
    loader = PretrainBatches([WeightedCorpus("clean", str(dirs[0]), 1), WeightedCorpus("other", str(dirs[1]), 1)],
                             rank=0, world_size=1, micro_batch_size=8, grad_acc=1, seed=0, num_workers=0)
    with pytest.raises(ValueError, match=r"other_vocabulary.*token id 32095.*lowest sentinel id 32072"):
        next(iter(loader))


def test_refuses_a_shard_that_does_not_match_the_manifest(tmp_path, spiece_path):
    rows = np.full((10, 568), 5, dtype=np.uint16)
    root = write_dataset(tmp_path / "d", {"train": [rows], "validation": [rows]}, spiece_path)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["rows"] = 12
    (root / "manifest.json").write_text(json.dumps(manifest))
    loader = PretrainBatches(
        root, rank=0, world_size=1, micro_batch_size=4, grad_acc=1, seed=0, num_workers=0
    )
    with pytest.raises(ValueError, match="holds 10 rows but the manifest lists 12"):
        next(iter(loader))


def test_refuses_a_truncated_shard(tmp_path, spiece_path):
    rows = np.full((10, 568), 5, dtype=np.uint16)
    root = write_dataset(
        tmp_path / "d", {"train": [rows], "validation": [rows]}, spiece_path, rows_per_block=4
    )
    path = root / "train" / shard_name(0)
    path.write_bytes(path.read_bytes()[:7000])  # the second block is cut off
    loader = PretrainBatches(
        root, rank=0, world_size=1, micro_batch_size=4, grad_acc=1, seed=0, num_workers=0
    )
    with pytest.raises(ValueError, match="block 000000-0001.tokens.npy is truncated"):
        next(iter(loader))


def test_refuses_a_shard_with_a_foreign_member(tmp_path, spiece_path):
    rows = np.full((10, 568), 5, dtype=np.uint16)
    root = write_dataset(tmp_path / "d", {"train": [rows], "validation": [rows]}, spiece_path)
    path = root / "train" / shard_name(0)
    with tarfile.open(path, "a", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("notes.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    loader = PretrainBatches(
        root, rank=0, world_size=1, micro_batch_size=4, grad_acc=1, seed=0, num_workers=0
    )
    with pytest.raises(ValueError, match="unexpected member 'notes.txt'"):
        next(iter(loader))


@pytest.mark.parametrize(
    "world_size,batch_size,max_samples", [(1, 8, None), (2, 4, None), (4, 3, 30), (3, 16, 5)]
)
def test_validation_covers_each_row_once_with_padding(dataset, world_size, batch_size, max_samples):
    n = len(dataset["validation"]) if max_samples is None else max_samples
    per_rank = [
        list(
            validation_batches(
                dataset["dir"],
                rank=r,
                world_size=world_size,
                batch_size=batch_size,
                max_samples=max_samples,
                expected_tokenizer_sha256=dataset["sha"],
                include_indices=True,
                num_workers=r % 3,
            )
        )
        for r in range(world_size)
    ]
    assert len({len(batches) for batches in per_rank}) == 1  # same number of batches on every rank
    for batches in per_rank:  # in order, whatever the number of workers
        real = [row for batch in batches for row in batch["row_index"].tolist() if row >= 0]
        assert real == sorted(real)
    counted = Counter()
    tokens = 0
    for batches in per_rank:
        for batch in batches:
            assert batch["input_ids"].shape == (batch_size, 512) and batch["labels"].shape == (
                batch_size,
                114,
            )
            for b, row in enumerate(batch["row_index"].tolist()):
                if row < 0:  # padding: no loss anywhere
                    assert (batch["labels"][b] == -100).all()
                    continue
                counted[row] += 1
                tokens += int((batch["labels"][b] != -100).sum())
                restored = expand_sentinels(
                    batch["input_ids"][b].numpy(), batch["labels"][b].numpy(), 32099, 32072
                )
                np.testing.assert_array_equal(restored, dataset["validation"][row])
    assert counted == Counter(range(n))  # every row exactly once, no duplicates
    assert tokens == n * 114


def test_validation_is_deterministic_and_independent_of_world_size(dataset):
    def by_row(world_size):
        out = {}
        for r in range(world_size):
            for batch in validation_batches(
                dataset["dir"], rank=r, world_size=world_size, batch_size=5, include_indices=True
            ):
                for b, row in enumerate(batch["row_index"].tolist()):
                    if row >= 0:
                        out[row] = (
                            batch["input_ids"][b].numpy().tobytes(),
                            batch["labels"][b].numpy().tobytes(),
                        )
        return out

    assert by_row(1) == by_row(3) == by_row(1)
