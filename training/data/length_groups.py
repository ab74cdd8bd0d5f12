"""Length-grouped micro-batches for objectives of variable target length (`data.target_buckets`).

A denoising objective (ul2, prefix_lm) pads every sample's labels to the mixture's `target_length`,
the longest target any denoiser makes: with UL2's seven denoisers a third of the label positions
are padding. Grouping takes the samples of one optimizer step's share of a rank (grad_acc
micro-batches, exactly the samples the loader hands out without grouping), sorts them by real
target length (stable: equal lengths keep their order on the sample line, so the order is a pure
function of the samples), cuts the sorted list into the grad_acc micro-batches and trims each
micro-batch's labels to the smallest bucket that holds its longest target. The buckets are the
configured widths plus `target_length` itself, so the compiled model sees at most len(buckets) + 1
label widths. Inputs keep their full width (one encoder shape).

The training loop divides each micro-batch's summed token loss by micro_batch_size x target_length,
not by its trimmed width (`pretrain.LogWindow.count`), so the step's gradient is the one of the
ungrouped step. With grad_acc = 1 a step is one micro-batch and nearly always holds a target of the
longest bucket: grouping then saves nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from training.config import ConfigError
from training.data.span_corruption import LABEL_PAD_ID


def check_buckets(buckets: Sequence[int], target_length: int) -> tuple[int, ...]:
    """`buckets` (ascending label widths below `target_length`) with `target_length` appended;
    ConfigError saying what to change otherwise."""
    if any(width >= target_length for width in buckets):
        raise ConfigError(f"data.target_buckets={list(buckets)} must all be below the objective's target length "
                         f"{target_length} (always the last bucket): drop the larger ones")
    return (*buckets, target_length)


def group_step(arrays: dict[str, np.ndarray], grad_acc: int, buckets: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """One step's share of a rank (every array has grad_acc x micro_batch_size rows, "labels" padded
    with -100 to buckets[-1]) -> its grad_acc micro-batches, sorted by real target length, each with
    labels trimmed to the smallest of `buckets` (ascending) that holds its longest target."""
    lengths = (arrays["labels"] != LABEL_PAD_ID).sum(1)
    order = np.argsort(lengths, kind="stable")
    micro_batches = []
    for part in np.split(order, grad_acc):
        micro = {name: array[part] for name, array in arrays.items()}
        width = next(b for b in buckets if b >= lengths[part].max())
        micro["labels"] = np.ascontiguousarray(micro["labels"][:, :width])
        micro_batches.append(micro)
    return micro_batches

