"""The relative bias's gradient from the fused attention's dS: the batch sum, with far tiles pre-summed.

The dQ kernel (`triton_attention._bwd_dq_kernel`) stores dS (B, H, Sq, Sk) in the input dtype and
the bias gradient is its sum over the batch. T5's bias is one value per head and direction wherever
|key - query| >= far (`attention.bias_saturation_distance`), so the gradient that reaches the
parameters from such a region is only the region's total. With `triton_attention.FAR_DS_SUMS`, the
dQ kernel stores, for a tile wholly inside such a region ("far tile", 30 of 64 at 512 x 512), one
fp32 sum per (batch, head, tile) instead of the tile, and `dbias_from_ds` below builds the
(H, Sq, Sk) gradient: near tiles summed over the batch, far tiles filled with their total spread
evenly over their elements. That is not the element-wise gradient of a dense bias, but every sum of
it over a far region is exact, which is all T5's bucket table sees (every far element of a
direction feeds one bucket). It halves the dS bytes written and read back at 512 x 512.
"""

from __future__ import annotations

import importlib.util

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None

if _HAS_TRITON:
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit
    def far_tile(m0, n0, FAR, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Whether the tile of queries m0.. and keys n0.. lies wholly where key - query >= FAR or
        wholly where query - key >= FAR (FAR > 0: T5's saturated bias; the same test everywhere)."""
        return (FAR > 0) & ((n0 - m0 >= FAR + BLOCK_M - 1) | (m0 - n0 >= FAR + BLOCK_N - 1))

    @triton.jit
    def _dbias_sum_kernel(DS, FARSUM, DBIAS, B, H, SQ, SK, FAR, NUM_M, NUM_N,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        """One (BLOCK_M, BLOCK_N) tile of one head of the bias gradient: dS summed over the batch, or
        for a far tile the dQ kernel's per-tile sums summed over the batch and spread evenly."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        h = tl.program_id(2)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        inside = (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)
        if far_tile(m0, n0, FAR, BLOCK_M, BLOCK_N):
            total = 0.0
            for b0 in range(0, B, BLOCK_B):
                offs_b = b0 + tl.arange(0, BLOCK_B)
                sums = tl.load(FARSUM + ((offs_b * H + h) * NUM_M + pid_m) * NUM_N + pid_n, mask=offs_b < B,
                               other=0.0)
                total += tl.sum(sums, 0)
            count = tl.minimum(BLOCK_M, SQ - m0) * tl.minimum(BLOCK_N, SK - n0)
            tile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32) + total / count
        else:
            tile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for b in range(0, B):
                tile += tl.load(DS + ((b * H + h) * SQ + offs_m[:, None]) * SK + offs_n[None, :], mask=inside,
                                other=0.0).to(tl.float32)
        tl.store(DBIAS + (h * SQ + offs_m[:, None]) * SK + offs_n[None, :], tile, mask=inside)
    # fmt: on


def dbias_from_ds(
    ds: torch.Tensor,
    far_sums: torch.Tensor,
    far: int,
    block_m: int,
    block_n: int,
    wrap=lambda kernel: kernel,
) -> torch.Tensor:
    """(H, Sq, Sk) fp32 bias gradient from dS (B, H, Sq, Sk) and the far tiles' sums (B, H, Sq
    blocks, Sk blocks) fp32, with the dQ kernel's tiles (block_m x block_n) and saturation distance."""
    B, H, SQ, SK = ds.shape
    num_m, num_n = triton.cdiv(SQ, block_m), triton.cdiv(SK, block_n)
    if far_sums.shape != (B, H, num_m, num_n):
        raise ValueError(f"far-tile sums of shape {tuple(far_sums.shape)}, expected {(B, H, num_m, num_n)}")
    dbias = torch.empty((H, SQ, SK), dtype=torch.float32, device=ds.device)
    wrap(_dbias_sum_kernel)[(num_m, num_n, H)](
        ds, far_sums, dbias, B, H, SQ, SK, far, num_m, num_n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=64, num_warps=4, num_stages=3,
    )  # fmt: skip
    return dbias
