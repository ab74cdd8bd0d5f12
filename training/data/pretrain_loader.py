"""The pre-training loader: micro-batches of an objective (T5 span corruption by default, see
`objectives.py`) with an exact, resumable global cursor.

Sample line. The split's rows are visited epoch by epoch; epoch e is a random permutation of all
N rows seeded by (seed, e) (`EpochPermutation`). Concatenating the epochs gives one infinite line
of samples; global sample index g = e * N + p is position p of epoch e, and it holds row
perm_e(p); a mixture of corpora splits this line between them (training/data/mixture.py). The
noise of sample g is keyed by (seed, g): the same sample gets the same objective draws on any rank,
worker or restart, and a row gets fresh noise each epoch.

Global batches. The cursor `samples_consumed` = c is a position on that line. The global batch at
c (size G = micro_batch_size * grad_acc * world_size) is the samples [c, c + G); a batch that
crosses an epoch end simply takes the last samples of epoch e and the first of epoch e + 1, so
nothing is dropped or repeated and every epoch is covered exactly once. Inside a global batch,
micro-step m (0 .. grad_acc - 1) of rank r (0 .. world_size - 1) gets

    [c + (m * world_size + r) * micro_batch_size, ... + micro_batch_size)

so the union over ranks of micro-step m is the contiguous block of micro_batch_size * world_size
samples starting at c + m * micro_batch_size * world_size, and the set of samples of one optimizer
step is [c, c + G) whatever the world size / micro-batch / accumulation split. A run resumed from a
cursor on a different number of GPUs (same G) sees exactly the batches it would have seen.

Workers. Rank r's micro-batches are numbered j = 0, 1, 2, ... (global batch j // grad_acc,
micro-step j % grad_acc). DataLoader worker w of k produces j = w, w + k, ...; the DataLoader
returns them round-robin, i.e. in order of j. Rows are read and corrupted in the workers. With
length groups (`target_buckets`, length_groups.py) a worker makes whole steps instead (step
s = w, w + k, ...: its grad_acc micro-batches, sorted by target length, as one item), handed out
one micro-batch at a time in the same order of j.

Cursor and prefetching. `PretrainBatches.cursor` is the position after the last global batch whose
last micro-batch the consumer has pulled: it advances by G just before the grad_acc-th micro-batch
of a global batch is handed out, whatever the workers have prefetched. Save it at a step boundary
(after the optimizer step); a cursor saved mid-accumulation points at the start of the unfinished
global batch, which a resume replays whole.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from training.data.length_groups import check_buckets, group_step
from training.data.mixture import (
    SampleRows,
    WeightedCorpus,
    check_compatible,
    check_same_mixture,
    corpora_of,
    integer_weights,
    mixture_errors,
)
from training.data.objectives import SpanCorruptionObjective
from training.data.row_store import RowStore, open_split
from training.data.span_corruption import NOISE_STREAM_TRAIN, NOISE_STREAM_VALIDATION, SpanCorruption
from training.stop_signals import ignore_stop_signals

logger = logging.getLogger(__name__)

CURSOR_VERSION = 1


@dataclass
class Cursor:
    """A position on the run's sample line (see the module docstring). Checkpoint it with state_dict()."""

    seed: int  # shuffle and noise seed of the run; a resume must use the same
    rows_per_epoch: int  # N, rows in the split; a resume on a dataset of another size is refused
    samples_consumed: int = 0  # global samples in all fully handed-out global batches since step 0

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.rows_per_epoch < 1:
            raise ValueError(f"rows_per_epoch must be >= 1, got {self.rows_per_epoch}")
        if self.samples_consumed < 0:
            raise ValueError(f"samples_consumed must be >= 0, got {self.samples_consumed}")

    @property
    def epoch(self) -> int:
        """Epoch of the next sample."""
        return self.samples_consumed // self.rows_per_epoch

    @property
    def position_in_epoch(self) -> int:
        """Permutation position of the next sample within `epoch`."""
        return self.samples_consumed % self.rows_per_epoch

    def state_dict(self) -> dict:
        """Plain ints; epoch and position_in_epoch are included for people reading checkpoints."""
        return {
            "version": CURSOR_VERSION,
            **asdict(self),
            "epoch": self.epoch,
            "position_in_epoch": self.position_in_epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != CURSOR_VERSION:
            raise ValueError(f"cursor state version {state.get('version')} is not {CURSOR_VERSION}")
        loaded = Cursor(int(state["seed"]), int(state["rows_per_epoch"]), int(state["samples_consumed"]))
        if (state.get("epoch"), state.get("position_in_epoch")) not in (
            (None, None),
            (loaded.epoch, loaded.position_in_epoch),
        ):
            raise ValueError(f"cursor state is inconsistent: {state}")
        self.seed, self.rows_per_epoch, self.samples_consumed = (
            loaded.seed,
            loaded.rows_per_epoch,
            loaded.samples_consumed,
        )

    @classmethod
    def from_state_dict(cls, state: dict) -> Cursor:
        cursor = cls(seed=0, rows_per_epoch=1)
        cursor.load_state_dict(state)
        return cursor


def micro_batch_sample_indices(
    samples_consumed: int,
    micro_index: int,
    *,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    grad_acc: int,
) -> np.ndarray:
    """Global sample indices of rank `rank`'s micro-batch `micro_index`, counted from cursor position
    `samples_consumed` (micro_index 0 = micro-step 0 of the global batch at the cursor)."""
    global_batch, micro_step = divmod(micro_index, grad_acc)
    start = (
        samples_consumed
        + global_batch * micro_batch_size * grad_acc * world_size
        + (micro_step * world_size + rank) * micro_batch_size
    )
    return start + np.arange(micro_batch_size, dtype=np.int64)


def _to_batch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def _check_token_ids(rows: np.ndarray, objective, stores: Sequence[RowStore], sources: np.ndarray | None = None) -> None:
    """Raw ids must stay below the sentinels (and so below the model's vocabulary). `sources` (a mixture:
    the corpus index of each row) names the corpus of an offending row; one pass over the batch either way."""
    top = int(rows.max())
    if top >= objective.lowest_special_id:
        store = stores[0 if sources is None else int(sources[int(np.argmax(rows.max(axis=1)))])]
        raise ValueError(
            f"{store.info.data_dir} ({store.info.split}): a row holds token id {top}, which is >= the lowest "
            f"sentinel id {objective.lowest_special_id}; the data was tokenised with another vocabulary "
            "(re-shard with the run's tokenizer) or sentinel_start_id is wrong."
        )


class _PretrainStream(IterableDataset):
    """Rank `rank`'s micro-batches from cursor position `start`, forever; split over DataLoader workers."""

    def __init__(
        self,
        sample_rows: SampleRows,
        objective,
        start: int,
        seed: int,
        *,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        grad_acc: int,
        include_indices: bool,
        buckets: tuple[int, ...] | None,
    ) -> None:
        self.sample_rows, self.objective, self.start, self.seed = sample_rows, objective, start, seed
        self.rank, self.world_size = rank, world_size
        self.micro_batch_size, self.grad_acc = micro_batch_size, grad_acc
        self.include_indices, self.buckets = include_indices, buckets

    def __iter__(self) -> Iterator[dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]]:
        """Micro-batches j = w, w + k, ... of worker w of k; with `buckets`, steps s = w, w + k, ... instead,
        each the list of its grad_acc length-grouped micro-batches (length_groups.py)."""
        worker = get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        index = worker_id
        while True:
            if self.buckets is None:
                yield _to_batch(self._arrays(self._samples(index)))
            else:
                samples = np.concatenate([self._samples(index * self.grad_acc + m) for m in range(self.grad_acc)])
                yield [_to_batch(micro) for micro in group_step(self._arrays(samples), self.grad_acc, self.buckets)]
            index += num_workers

    def _samples(self, micro_index: int) -> np.ndarray:
        return micro_batch_sample_indices(self.start, micro_index, rank=self.rank, world_size=self.world_size,
                                          micro_batch_size=self.micro_batch_size, grad_acc=self.grad_acc)

    def _arrays(self, samples: np.ndarray) -> dict[str, np.ndarray]:
        rows, row_ids, sources = self.sample_rows.read(samples)
        _check_token_ids(rows, self.objective, self.sample_rows.stores, sources)
        arrays = self.objective.make(rows, samples, self.seed, NOISE_STREAM_TRAIN)
        if self.include_indices:
            arrays["sample_index"], arrays["row_index"] = samples, row_ids
            if len(self.sample_rows.stores) > 1:
                arrays["source_index"] = sources
        return arrays


def _objective_and_store(
    data_dir: str | os.PathLike,
    split: str,
    *,
    objective,
    input_length: int,
    noise_density: float,
    mean_noise_span_length: float,
    vocab_size: int,
    sentinel_start_id: int,
    expected_tokenizer_sha256: str | None,
) -> tuple[object, RowStore]:
    """`objective` (see objectives.py), or T5 span corruption with the given settings when None, and
    the checked split it reads."""
    if objective is None:
        objective = SpanCorruptionObjective(SpanCorruption(
            input_length=input_length,
            noise_density=noise_density,
            mean_noise_span_length=mean_noise_span_length,
            sentinel_start_id=sentinel_start_id,
        ))
    if sentinel_start_id >= vocab_size:
        raise ValueError(f"sentinel_start_id={sentinel_start_id} must be below vocab_size={vocab_size}")
    corruption = objective.span_corruption  # its settings name the row length in open_split's messages
    info = open_split(
        data_dir,
        split,
        row_length=objective.row_length,
        noise_density=corruption.noise_density,
        mean_noise_span_length=corruption.mean_noise_span_length,
        vocab_size=vocab_size,
        eos_id=corruption.eos_id,
        expected_tokenizer_sha256=expected_tokenizer_sha256,
        sentinel_start_id=sentinel_start_id,
    )
    return objective, RowStore(info)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


class PretrainBatches:
    """Infinite iterable of this rank's span-corrupted micro-batches, with a resumable global cursor.

    Use `for batch in loader` or `next(loader)` (one internal iterator), not both at once: every
    iterator advances the same cursor.

    Each item is {"input_ids": int64[micro_batch_size, input_length], "labels": int64[micro_batch_size,
    targets_length]} (labels are -100 only where padded, which never happens at the standard lengths),
    plus "sample_index" and "row_index" (int64[micro_batch_size]) when include_indices=True, and for a
    mixture of corpora (training/data/mixture.py) "source_index", the corpus of each row. Every
    grad_acc consecutive items make this rank's share of one optimizer step. `data_dir` is one
    directory or the corpora of a mixture. `objective` (`objectives.build_objective`) replaces the
    span corruption the length and noise arguments set; its batches may add keys (attention_mask,
    denoiser). `target_buckets` (label widths below the objective's target_length) groups each
    step's grad_acc micro-batches by target length (length_groups.py): labels are then as wide as
    the smallest bucket (or target_length) that holds the micro-batch's longest target.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike | Sequence[WeightedCorpus],
        split: str = "train",
        *,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        grad_acc: int,
        seed: int,
        input_length: int = 512,
        noise_density: float = 0.15,
        mean_noise_span_length: float = 3.0,
        expected_tokenizer_sha256: str | None = None,
        vocab_size: int = 32128,
        sentinel_start_id: int = 32099,
        num_workers: int = 2,
        prefetch_factor: int = 4,
        pin_memory: bool = False,
        cursor: Cursor | dict | None = None,
        include_indices: bool = False,
        objective=None,
        target_buckets: Sequence[int] | None = None,
    ) -> None:
        _check_rank(rank, world_size)
        if micro_batch_size < 1 or grad_acc < 1 or num_workers < 0:
            raise ValueError(
                f"need micro_batch_size >= 1, grad_acc >= 1, num_workers >= 0; got {micro_batch_size}, "
                f"{grad_acc}, {num_workers}"
            )
        self.corpora = corpora_of(data_dir)
        if self.corpora is not None:
            check_compatible(self.corpora)
        stores = []
        for k, corpus_dir in enumerate([data_dir] if self.corpora is None else [c.dir for c in self.corpora]):
            with mixture_errors(self.corpora, k):
                self.objective, store = _objective_and_store(
                    corpus_dir,
                    split,
                    objective=objective,
                    input_length=input_length,
                    noise_density=noise_density,
                    mean_noise_span_length=mean_noise_span_length,
                    vocab_size=vocab_size,
                    sentinel_start_id=sentinel_start_id,
                    expected_tokenizer_sha256=expected_tokenizer_sha256,
                )
            stores.append(store)
        weights = (1,) if self.corpora is None else integer_weights([c.weight for c in self.corpora])
        self.sample_rows = SampleRows(stores, seed, weights)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.micro_batch_size, self.grad_acc = micro_batch_size, grad_acc
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.include_indices = include_indices
        self.buckets = None if target_buckets is None else check_buckets(target_buckets, self.target_length)
        self._cursor = Cursor(seed=seed, rows_per_epoch=self.rows_per_epoch)
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None
        if cursor is not None:
            self.load_state_dict(cursor.state_dict() if isinstance(cursor, Cursor) else cursor)

    @property
    def global_batch_size(self) -> int:
        """G: samples per optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_acc * self.world_size

    @property
    def rows_per_epoch(self) -> int:
        """Rows of the split; of all corpora together for a mixture."""
        return sum(len(store) for store in self.sample_rows.stores)

    def mixture_proportions(self, run_samples: int) -> list[dict] | None:
        """Per corpus of a mixture: name, share of the samples, rows, and epochs of it in `run_samples`
        samples; None for one corpus."""
        if self.corpora is None:
            return None
        return self.sample_rows.describe([c.name for c in self.corpora], run_samples)

    @property
    def input_length(self) -> int:
        """Encoder tokens per sample (columns of input_ids)."""
        return self.objective.input_length

    @property
    def target_length(self) -> int:
        """Decoder targets per sample (columns of labels): 114 for span corruption at input_length 512."""
        return self.objective.target_length

    @property
    def cursor(self) -> Cursor:
        """A copy of the position after the last global batch whose last micro-batch was handed out."""
        return Cursor(self._cursor.seed, self._cursor.rows_per_epoch, self._cursor.samples_consumed)

    def state_dict(self) -> dict:
        """The cursor's; a mixture adds its corpora's rows and integer weights, which a resume must match."""
        if self.corpora is None:
            return self._cursor.state_dict()
        return {**self._cursor.state_dict(), "sources": self._mixture_state()}

    def _mixture_state(self) -> list[dict] | None:
        if self.corpora is None:
            return None
        return [
            {"name": c.name, "rows": len(store), "weight": w}
            for c, store, w in zip(self.corpora, self.sample_rows.stores, self.sample_rows.schedule.weights)
        ]

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved cursor (any world size / micro-batch split). Call before iterating."""
        cursor = Cursor.from_state_dict(state)
        check_same_mixture(state.get("sources"), self._mixture_state())
        if cursor.seed != self.seed:
            raise ValueError(
                f"the cursor was saved with seed={cursor.seed}; pass seed={cursor.seed} to resume"
            )
        if cursor.rows_per_epoch != self.rows_per_epoch:
            raise ValueError(
                f"the cursor was saved on a split of {cursor.rows_per_epoch} rows, this one has "
                f"{self.rows_per_epoch}: resume on the same prepared dataset (the epoch order depends on it)."
            )
        self._cursor = cursor
        self._iterator = None  # the next `next()` starts at the loaded cursor

    def close(self) -> None:
        """Stop the internal iterator's loader workers now (at the end of a run). Left to the garbage
        collector, the iterator goes with its queues in one reference cycle, and the loader then waits
        5 s for a worker that is never told to stop."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None

    def __next__(self) -> dict[str, torch.Tensor]:
        """`next(loader)` works too: it draws from one internal iterator, started at the cursor."""
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches from the current cursor. A new iterator restarts at the cursor (micro-batches of
        an unfinished global batch are handed out again)."""
        stream = _PretrainStream(
            self.sample_rows,
            self.objective,
            self._cursor.samples_consumed,
            self.seed,
            rank=self.rank,
            world_size=self.world_size,
            micro_batch_size=self.micro_batch_size,
            grad_acc=self.grad_acc,
            include_indices=self.include_indices,
            buckets=self.buckets,
        )
        loader = DataLoader(
            stream,
            batch_size=None,  # the stream yields ready micro-batches
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            pin_memory=self.pin_memory,
            worker_init_fn=ignore_stop_signals,  # the rank decides when its workers end (stop_signals.py)
        )
        micro_index = 0
        for item in loader:
            for batch in item if self.buckets else (item,):  # grouped: a step's micro-batches at once
                micro_index += 1
                if micro_index % self.grad_acc == 0:
                    self._cursor.samples_consumed += self.global_batch_size  # before handing out the last one
                yield batch


class ValidationBatches:
    """Finite, deterministic validation batches of one rank (see `validation_batches`)."""

    def __init__(
        self,
        store: RowStore,
        objective,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        num_samples: int,
        seed: int,
        num_workers: int,
        include_indices: bool,
    ) -> None:
        self.store, self.objective = store, objective
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.num_samples, self.seed = num_samples, seed
        self.num_workers, self.include_indices = num_workers, include_indices

    def __len__(self) -> int:
        """Batches per rank; the same on every rank."""
        return -(-self.num_samples // (self.batch_size * self.world_size))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        stream = _ValidationStream(self)
        yield from DataLoader(
            stream,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=2 if self.num_workers > 0 else None,
            worker_init_fn=ignore_stop_signals,
        )


class _ValidationStream(IterableDataset):
    def __init__(self, spec: ValidationBatches) -> None:
        self.spec = spec

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        spec = self.spec
        worker = get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        for batch_index in range(worker_id, len(spec), num_workers):
            start = (batch_index * spec.world_size + spec.rank) * spec.batch_size
            positions = start + np.arange(spec.batch_size, dtype=np.int64)
            real = positions < spec.num_samples
            row_ids = np.where(real, positions, positions % spec.num_samples)  # padding repeats real rows
            rows = spec.store.read(row_ids)
            _check_token_ids(rows, spec.objective, [spec.store])
            arrays = spec.objective.make(rows, row_ids, spec.seed, NOISE_STREAM_VALIDATION)
            arrays["labels"][~real] = -100  # padding rows carry no loss and no tokens
            batch = _to_batch(arrays)
            if spec.include_indices:
                batch["row_index"] = torch.from_numpy(np.where(real, row_ids, -1))
            yield batch


def validation_batches(
    data_dir: str | os.PathLike,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    max_samples: int | None = None,
    seed: int = 0,
    split: str = "validation",
    input_length: int = 512,
    noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0,
    expected_tokenizer_sha256: str | None = None,
    vocab_size: int = 32128,
    sentinel_start_id: int = 32099,
    num_workers: int = 0,
    include_indices: bool = False,
    objective=None,
) -> ValidationBatches:
    """The first `max_samples` rows of `split` (all by default), in order, with fixed noise keyed by
    (seed, row id), split over ranks without duplicates or losses.

    Evaluation batch t covers rows [t * B * W, (t + 1) * B * W) (B = batch_size, W = world_size); rank r
    takes rows [t * B * W + r * B, ... + B). Every rank gets the same number of batches, len(result), of
    the same shape (collectives such as ZeRO-3 parameter gathering need equal call counts): positions
    past the last row are padding, a copy of a real row with all labels -100. Weight the loss by the
    number of labels != -100 (sum of token losses / token count, all-reduced), and padding counts for
    nothing. The noise does not depend on the world size, so the loss does not either.
    """
    _check_rank(rank, world_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    objective, store = _objective_and_store(
        data_dir,
        split,
        objective=objective,
        input_length=input_length,
        noise_density=noise_density,
        mean_noise_span_length=mean_noise_span_length,
        vocab_size=vocab_size,
        sentinel_start_id=sentinel_start_id,
        expected_tokenizer_sha256=expected_tokenizer_sha256,
    )
    num_samples = len(store) if max_samples is None else min(max_samples, len(store))
    if num_samples < 1:
        raise ValueError(f"max_samples must be >= 1, got {max_samples}")
    return ValidationBatches(
        store,
        objective,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        num_samples=num_samples,
        seed=seed,
        num_workers=num_workers,
        include_indices=include_indices,
    )
