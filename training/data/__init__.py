"""Pre-training data: objectives (T5 span corruption, UL2, prefix LM) and the loader with a resumable
global cursor, over one corpus or a weighted mixture of corpora."""

from training.data.mixture import WeightedCorpus
from training.data.objectives import OBJECTIVES, build_objective
from training.data.permutation import EpochPermutation
from training.data.pretrain_loader import (
    Cursor,
    PretrainBatches,
    ValidationBatches,
    micro_batch_sample_indices,
    validation_batches,
)
from training.data.row_store import RowStore, SplitInfo, has_split, open_split
from training.data.span_corruption import SpanCorruption, expand_sentinels, noise_counts

__all__ = [
    "Cursor",
    "OBJECTIVES",
    "EpochPermutation",
    "PretrainBatches",
    "RowStore",
    "SpanCorruption",
    "SplitInfo",
    "ValidationBatches",
    "WeightedCorpus",
    "build_objective",
    "expand_sentinels",
    "has_split",
    "micro_batch_sample_indices",
    "noise_counts",
    "open_split",
    "validation_batches",
]
