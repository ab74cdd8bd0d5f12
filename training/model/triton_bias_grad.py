"""The fused attention's bias gradient: the stored dS (`triton_attention`) summed over the batch.

The dK/dV kernel (or the one-block kernel) stores dS (B, H, SQ, SK) in the input dtype; the
gradient of a bias (H, SQ, SK) shared by the batch is its sum over the batch, dbias[h, q, k] =
sum_b dS[b, h, q, k]. `batch_sum` computes it in one fixed order, so that the bias gradient is
bit-identical from run to run:
- `_ds_batch_sum_kernel` reads all of dS (0.27 ms per T5 base encoder layer on an H100);
- with a bias that is one value per head beyond a distance (`far` > 0: T5's, whose buckets saturate
  at |key - query| >= 91 in the encoder) and no causal mask, `_ds_batch_sum_far_kernel` and
  `_far_region_sums_kernel` read about half of it (0.15 ms). Each row of dS sums to 0 over its keys,
  so the sum over a row's larger far region is minus the sum of the rest of the row. The result is
  then exact per region of one bias value, not per element: all that T5's bucket gather takes from
  it.
"""

from __future__ import annotations

import importlib.util

import torch

if importlib.util.find_spec("triton") is not None:
    import triton

    from training.model.triton_attention_kernels import (
        _ds_batch_sum_far_kernel,
        _ds_batch_sum_kernel,
        _far_region_sums_kernel,
    )


# The whole sum: BLOCK elements of one batch element per program, BLOCK_B batch elements per step.
DS_SUM_BLOCK = 1024
DS_SUM_BLOCK_B = 8
# The sum from the rows' zero sums: ROWS query rows by COLS keys per program, BLOCK_B batch elements
# per step (swept on an H100 at T5 base's encoder shape: 4 x 64 with 2 takes 0.178 ms, 8 x 64 with 4
# 0.185, 16 x 64 with 8 0.35; the whole sum 0.31).
DS_FAR_ROWS = 4
DS_FAR_COLS = 64
DS_FAR_BLOCK_B = 2


def batch_sum_settings() -> tuple[int, ...]:
    """The block settings `batch_sum` launches with (part of `triton_attention.launch_settings`)."""
    return DS_SUM_BLOCK, DS_SUM_BLOCK_B, DS_FAR_ROWS, DS_FAR_COLS, DS_FAR_BLOCK_B


def batch_sum(ds: torch.Tensor, wrap, far: int = 0) -> torch.Tensor:
    """(B, H, SQ, SK) dS -> its fp32 sum over the batch, (H, SQ, SK), in a fixed order. far > 0 (a bias
    of one value per head wherever |key - query| >= far, no causal mask): exact per such region and
    elsewhere, each row's larger far region read from the rows' zero sums. wrap: how the launcher
    wraps a kernel (`torch.library.wrap_triton` inside the custom op)."""
    B, H, SQ, SK = ds.shape
    dbias = torch.empty((H, SQ, SK), dtype=torch.float32, device=ds.device)
    if far > 0:
        row_blocks, col_blocks = triton.cdiv(SQ, DS_FAR_ROWS), triton.cdiv(SK, DS_FAR_COLS)
        wrap(_ds_batch_sum_far_kernel)[(row_blocks * col_blocks, H)](
            ds, dbias, B, H, SQ, SK, far, col_blocks, BLOCK_B=DS_FAR_BLOCK_B, ROWS=DS_FAR_ROWS, COLS=DS_FAR_COLS,
            num_warps=4,
        )  # fmt: skip
        wrap(_far_region_sums_kernel)[(row_blocks, H)](
            dbias, SQ, SK, far, ROWS=DS_FAR_ROWS, COLS=DS_FAR_COLS, num_warps=4
        )  # fmt: skip
        return dbias
    n = dbias.numel()
    wrap(_ds_batch_sum_kernel)[(triton.cdiv(n, DS_SUM_BLOCK),)](
        ds, dbias, B, n, BLOCK_B=DS_SUM_BLOCK_B, BLOCK=DS_SUM_BLOCK, num_warps=4
    )
    return dbias
