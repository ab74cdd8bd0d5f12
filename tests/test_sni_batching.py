"""Length-grouped batches and the padding collator."""

from pathlib import Path

import numpy as np
import pytest
import torch

from training.sni.encoding import (
    EncodedExample,
    SNITokenizer,
    choose_label,
    collate,
    encode_tasks,
    length_grouped_batches,
    num_train_batches,
    train_batches,
)
from training.sni.tasks import load_sni

SNI_ASSETS = Path(__file__).resolve().parent / "assets" / "sni"


def _lengths(n, seed=0):
    return np.random.default_rng(seed).integers(5, 1024, size=n).tolist()


@pytest.mark.parametrize("n,batch_size,world_size", [(1000, 8, 1), (1003, 8, 2), (37, 4, 3), (5, 4, 2)])
def test_batches_cover_every_example_disjointly(n, batch_size, world_size):
    lengths = _lengths(n)
    per_rank = [length_grouped_batches(lengths, batch_size, 1, 0, r, world_size) for r in range(world_size)]
    counts = {len(b) for b in per_rank}
    assert counts == {num_train_batches(n, batch_size, world_size)}  # same step count on every rank
    flat = [i for batches in per_rank for b in batches for i in b]
    assert set(flat) == set(range(n))
    assert len(flat) - n == (-n) % world_size  # only the DistributedSampler-style padding repeats
    for step in range(len(per_rank[0])):  # ranks get equal batch sizes at a step
        assert len({len(per_rank[r][step]) for r in range(world_size)}) == 1
        assert all(0 < len(per_rank[r][step]) <= batch_size for r in range(world_size))


def test_drop_last_and_determinism():
    lengths = _lengths(1003)
    a = [length_grouped_batches(lengths, 8, 3, 5, r, 2, drop_last=True) for r in range(2)]
    flat = [i for batches in a for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 1003 // 16 * 16  # disjoint, the incomplete global batch dropped
    assert all(len(b) == 8 for batches in a for b in batches)
    assert len(a[0]) == num_train_batches(1003, 8, 2, drop_last=True)
    assert a == [length_grouped_batches(lengths, 8, 3, 5, r, 2, drop_last=True) for r in range(2)]
    assert a[0] != length_grouped_batches(lengths, 8, 3, 6, 0, 2, drop_last=True)  # new epoch, new order
    assert a[0] != length_grouped_batches(lengths, 8, 4, 5, 0, 2, drop_last=True)  # new seed, new order


def test_grouping_reduces_padding_and_longest_first():
    lengths = _lengths(4000)
    batches = length_grouped_batches(lengths, 16, 0, 0)
    assert max(lengths[i] for i in batches[0]) == max(lengths)  # an OOM shows at the first step

    def padding(bs):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in bs)

    rng = np.random.default_rng(0).permutation(4000).tolist()
    random_batches = [rng[i : i + 16] for i in range(0, 4000, 16)]
    assert padding(batches) < 0.2 * padding(random_batches)


@pytest.fixture(scope="module")
def examples(spiece_path):
    return encode_tasks(load_sni(SNI_ASSETS, "train"), SNITokenizer(spiece_path))


def test_collate_pads_dynamically(examples):
    chosen = [examples[0], examples[9], examples[17]]
    batch = collate(chosen, seed=0, epoch=0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(t.dtype == torch.long for t in batch.values())
    longest = max(e.length for e in chosen)
    assert batch["input_ids"].shape == (3, longest)
    for row, e in enumerate(chosen):
        assert batch["input_ids"][row, : e.length].tolist() == e.input_ids.tolist()
        assert (batch["input_ids"][row, e.length :] == 0).all()
        assert batch["attention_mask"][row].sum() == e.length
        label = choose_label(e, 0, 0)
        assert batch["labels"][row, : len(label)].tolist() == label.tolist()
        assert (batch["labels"][row, len(label) :] == -100).all()
    assert batch["labels"].shape[1] == max(len(choose_label(e, 0, 0)) for e in chosen)
    padded = collate(chosen, pad_to_multiple_of=8)
    assert padded["input_ids"].shape[1] % 8 == 0 and padded["input_ids"].shape[1] - longest < 8


def test_label_choice_is_seeded_and_covers_references(examples):
    multi = next(e for e in examples if len(e.label_choices) > 1)
    picks = {tuple(choose_label(multi, 0, epoch).tolist()) for epoch in range(40)}
    assert picks == {tuple(c.tolist()) for c in multi.label_choices}  # every reference gets drawn
    assert choose_label(multi, 0, 3).tolist() == choose_label(multi, 0, 3).tolist()
    with pytest.raises(ValueError, match="no output"):
        choose_label(EncodedExample("x", "t", np.array([1], dtype=np.int32), []), 0, 0)


def test_train_batches_resume(examples):
    full = list(train_batches(examples, 4, seed=0, epoch=1, rank=1, world_size=2))
    resumed = list(train_batches(examples, 4, seed=0, epoch=1, rank=1, world_size=2, start_batch=2))
    assert len(full) == num_train_batches(len(examples), 4, 2)
    assert len(resumed) == len(full) - 2
    for a, b in zip(full[2:], resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)
