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

A relative bias given as its (H, SQ + SK - 1) row (long inputs, `attention.row_bias_applies`) gets
its gradient as a row too, without dS ever stored whole: the dK/dV kernel keeps the dS tiles of the
band within `far` of the diagonal and one sum per head and (batch, key block) of the tiles left and
right of it; `row_sum` adds the band's tiles along their diagonals and the far sums to the row's
two ends (offsets -(SQ - 1) and SK - 1, inside the far regions), all in fixed orders. Memory
O(B H L band) instead of O(B H L^2).
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


def band_radius(far: int, tile: int, SQ: int, SK: int) -> int:
    """How many square tiles of `tile` rows off the diagonal hold a score with |key - query| < far
    (tiles farther off lie wholly in a region of one bias value per head); every tile when far is 0
    (no promise)."""
    whole = max(triton.cdiv(SQ, tile), triton.cdiv(SK, tile))
    return whole if far <= 0 else min(whole, triton.cdiv(far + tile - 1, tile) - 1)


def row_sum(band: torch.Tensor, far_sums: torch.Tensor, SQ: int, SK: int, radius: int) -> torch.Tensor:
    """The gradient (H, SQ + SK - 1) fp32 of a bias given as its row, from the dK/dV kernel's band
    tiles (B, H, key blocks, 2 * radius + 1, T, T), the tile at slot w lying w - radius blocks right
    of the diagonal, and its far sums (B, H, key blocks, 2) of the tiles left and right of the band.
    Exact per diagonal in the band and per far region; fixed-order sums only."""
    H, width, T = band.shape[1], band.shape[3], band.shape[-1]
    tiles = band.sum((0, 2), dtype=torch.float32)  # (H, width, T, T): tiles the same blocks off the diagonal
    # Each tile's diagonal sums: row i shifted by T - 1 - i (a flip, a pad and a reshape), then a
    # column sum; column c holds key - query = (w - radius) T + c - (T - 1).
    skewed = torch.nn.functional.pad(tiles.flip(-2), (0, T)).flatten(-2)[..., : T * (2 * T - 1)]
    diagonals = torch.nn.functional.pad(skewed.view(H, width, T, 2 * T - 1).sum(-2), (0, 1))
    # Tile w's diagonals overlap tile w + 1's by T: add the halves that cover the same offsets
    low, high = diagonals[..., :T], diagonals[..., T:]
    merged = torch.cat([low[:, :1], high[:, :-1] + low[:, 1:], high[:, -1:]], dim=1).flatten(1)
    start = -radius * T - (T - 1) + SQ - 1  # the row index of merged's first offset
    grad = torch.zeros((H, SQ + SK - 1), dtype=torch.float32, device=band.device)
    lo, hi = max(start, 0), min(start + merged.shape[1], SQ + SK - 1)
    grad[:, lo:hi] = merged[:, lo - start : hi - start]
    far = far_sums.sum((0, 2))  # (H, 2): left and right of the band
    grad[:, 0] += far[:, 0]
    grad[:, -1] += far[:, 1]
    return grad
