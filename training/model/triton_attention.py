"""Fused T5 attention in Triton: flash attention with the shared relative bias and its gradient.

Computes out = softmax(q k^T + bias + key_mask [+ causal]) v without ever holding the
(batch, heads, q, k) scores in fp32, and in the backward pass the bias gradient
dbias[h, i, j] = sum_b dS[b, h, i, j].

Layout: the kernels read the fused projection outputs as the model produces them ("packed
sources"): self-attention q_src (B, S, 3 H D) = [q | k | v], cross-attention q_src (B, Sq, H D) and
kv_src (B, Sk, 2 H D) = [k | v], through strides and column offsets. The backward writes the
gradient of each source as one buffer, so autograd has no dq/dk/dv concatenation to do. Every
tensor a kernel writes is allocated in the op and passed whole: a kernel never writes through a view
(inductor's functionalisation may hand a written view over as a copy). Bias (H, Sq, Sk) fp32,
key_mask (B, Sk) bool. No 1/sqrt(D) scaling (T5). Masked scores get -1e30 (like HF's dtype
minimum: a fully masked row averages every key instead of giving NaN).

Kernels (in `triton_attention_kernels.py`; FlashAttention-2 structure, exp2 online softmax, fp32
accumulation); per-score work is kept small (scale and bias as one FMA on a bias pre-multiplied by
log2(e), bounds masks only on partial tiles, the masked-score guard on dS only with masks), since on
an H100 at d_kv 64 the element-wise work, not the tensor cores, bounds these kernels:
- `_fwd_kernel`: grid (q blocks, B*H); writes out and the row max / inverse sum (base 2).
- `_bwd_one_block_kernel`, for queries that fit one tile (at most ONE_BLOCK_TILES[class].block_m
  rows: T5's 114 targets, in the decoder and the cross-attention): grid (B*H,); the whole backward
  in one pass over the key blocks, each block's dK and dV stored at once, dQ kept in registers;
  stores dS where there is a bias.
- Longer queries (the encoder's 512): `_delta_kernel`, grid (q blocks, B*H), rowsum(dO * O) per
  query row; `_bwd_dkdv_kernel`, grid (k blocks, B*H), dK and dV of one key block, walking the query
  blocks. Where there is a bias it also stores dS (B, H, SQ, SK) in the input dtype and
  `_bwd_dq_from_ds_kernel` (grid (q blocks, B*H)) computes dQ = dS K from it without recomputing P:
  the encoder layer's backward 2.88 -> 2.61 ms on an H100. Without a bias (the cross-attention)
  `_bwd_dq_kernel` recomputes P and dP per tile instead, since there the dS round trip costs more
  than the recomputation saves (a layer without a bias: 2.05 ms recomputed, 2.25 from dS).
- The bias gradient is the stored dS summed over the batch by `triton_bias_grad.batch_sum`, in one
  fixed order (bit-identical from run to run); in the encoder, given `far`, it reads about half of dS.
- A relative bias given as its (H, SQ + SK - 1) row (long inputs, `attention.row_bias_applies`):
  the kernels read it as whole square tiles from a small table of the tiles on and near the
  diagonal (`_row_tiles`; every tile the same number of blocks off the diagonal is the same), and
  the backward stores no dS: dQ recomputed
  (`_bwd_dq_kernel`), and the dK/dV kernel, in square tiles (DKDV_ROW_TILES), keeps only the band
  of dS tiles within `far` of the diagonal and sums the others per head and side; the row's
  gradient comes from those (`triton_bias_grad.row_sum`), in fixed orders. The short-query
  one-block backward is not used with a row.

Wrapped with `torch.library.triton_op` so torch.compile traces it without graph breaks; the ops
take `launch_settings()`, a digest of the tile tables and of the source, so that compile caches
cannot hand back a graph traced under other tiles or by other code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import NamedTuple

import torch

from training.model import triton_bias_grad as bias_grad
from training.model.compile_key import settings_digest, source_digest

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when the fused kernel can run here (triton installed and a CUDA device present)."""
    return _HAS_TRITON and torch.cuda.is_available()


class Tiles(NamedTuple):
    """Launch settings of one kernel: BLOCK_M query rows and BLOCK_N keys per tile, warps, pipeline stages."""

    block_m: int
    block_n: int
    warps: int
    stages: int


# What an attention's tiles are chosen by: its kind, named after T5's three attentions ("enc" =
# bidirectional with a bias, the encoder's self-attention; "dec" = causal, the decoder's; "cross" =
# neither, the cross-attention), and whether its queries are short (at most SHORT_QUERIES rows, as
# T5's 114 pre-training targets are in the decoder and the cross-attention): "dec-short", ...
KINDS = ("enc", "dec", "cross")
SHORT_QUERIES = 128
TILE_CLASSES = (*KINDS, *(f"{kind}-short" for kind in KINDS))


def tile_class(causal: bool, has_bias: bool, queries: int) -> str:
    """The key (in TILE_CLASSES) of the tiles an attention with this many query rows runs with."""
    kind = "dec" if causal else "enc" if has_bias else "cross"
    return f"{kind}-short" if queries <= SHORT_QUERIES else kind


# Tiles per kernel and class, benchmarked on an H100 at d_kv 64 (tools/attention_tiles.py sweeps one
# kernel at a time at each class's shape, patching these tables). The forward: BLOCK_M queries per
# program, BLOCK_N keys per step. dK/dV kernel: BLOCK_N keys per program (its accumulators), BLOCK_M
# queries per step; 64 x 64 with 3 stages is the encoder's best with the dS store; short queries give
# each program only 2 query blocks of 64 to walk, and there the decoder runs best in 32 x 32 tiles
# and the cross-attention (no dS store) with 128 keys per program (-0.024 and -0.054 ms a layer at
# 114 queries); the cross-attention with long queries runs best with 2 stages (512 x 512: 1.01
# against 1.08 ms for the backward). dQ kernel: BLOCK_M queries per program, BLOCK_N keys per step.
# dQ from the stored dS: a streaming GEMM, BLOCK_M queries per program; 128 x 128 in the encoder.
# The short classes' entries of these three backward tables run where the queries do not fit the
# one-block tile (ONE_BLOCK_TILES below: with their default BLOCK_M of SHORT_QUERIES, they all do).
FWD_TILES = dict.fromkeys(TILE_CLASSES, Tiles(64, 64, 4, 3))
DKDV_TILES = {
    **dict.fromkeys(("enc", "enc-short", "dec"), Tiles(64, 64, 4, 3)),
    "dec-short": Tiles(32, 32, 4, 2),
    "cross": Tiles(64, 64, 4, 2),
    "cross-short": Tiles(32, 128, 4, 3),
}
DQ_TILES = dict.fromkeys(TILE_CLASSES, Tiles(64, 64, 4, 3))
DQDS_TILES = {**dict.fromkeys(TILE_CLASSES, Tiles(64, 64, 4, 3)), "enc": Tiles(128, 128, 4, 3)}
# dK/dV kernel of a bias given as its row (`_launch_bwd`): square tiles, so that each tile's offset
# from the diagonal is whole blocks and the band's tiles line up per diagonal (BLOCK_M == BLOCK_N).
DKDV_ROW_TILES = dict.fromkeys(TILE_CLASSES, Tiles(64, 64, 4, 3))
# The one-block backward of the short classes: BLOCK_M is the most query rows it takes (the kernel
# runs with the power of two that holds them, 16 at least), BLOCK_N keys per step. fp32 operands (no
# autocast) take twice the shared memory: at most 64 keys and 2 stages there.
ONE_BLOCK_TILES = {
    "enc-short": Tiles(SHORT_QUERIES, 128, 8, 2),
    "dec-short": Tiles(SHORT_QUERIES, 64, 8, 3),
    "cross-short": Tiles(SHORT_QUERIES, 128, 8, 3),
}
# The tables by kernel, for what sweeps them all (tools/attention_tiles.py)
TILE_TABLES = {
    "FWD": FWD_TILES,
    "DKDV": DKDV_TILES,
    "DQ": DQ_TILES,
    "DQDS": DQDS_TILES,
    "DKDV_ROW": DKDV_ROW_TILES,
    "ONEBLOCK": ONE_BLOCK_TILES,
}
DELTA_BLOCK_M = 64  # query rows per program of rowsum(dO * O)

if _HAS_TRITON:
    import triton

    from training.model.triton_attention_kernels import (
        _bwd_dkdv_kernel,
        _bwd_dq_from_ds_kernel,
        _bwd_dq_kernel,
        _bwd_one_block_kernel,
        _delta_kernel,
        _fwd_kernel,
    )


def _flags(q_src: torch.Tensor, bias: torch.Tensor, key_mask: torch.Tensor) -> dict:
    return dict(HAS_BIAS=bias.numel() > 0, HAS_MASK=key_mask.numel() > 0, IEEE=q_src.dtype == torch.float32)


def _bias_row(bias: torch.Tensor) -> bool:
    """Whether the bias is a relative one held as its (H, SQ + SK - 1) row, not (H, SQ, SK)."""
    return bias.dim() == 2 and bias.numel() > 0


_LOG2E = 1.4426950408889634
_HALF_MAX = 65504.0


def _kernel_bias(bias: torch.Tensor, inputs_dtype: torch.dtype) -> torch.Tensor:
    """The (H, SQ, SK) bias as the kernels read it: in base-2 units, so that scale and bias are one FMA
    per score; in fp16 for bf16/fp16 inputs, fp32 for fp32 inputs. Every (batch, head) program reads
    the same bias tiles from L2, and fp16 halves those bytes: the encoder layer 2.106 -> 2.065 ms on
    an H100, the step 1.1-1.4 ms faster. fp16 keeps 11 significant bits (the bias is clamped to its
    range, +-65504, which T5's learned values are far inside): finer than the bf16 scores HF's T5
    adds its bias to under autocast."""
    if bias.numel() == 0:
        return bias
    scaled = bias * _LOG2E
    if inputs_dtype != torch.float32:
        scaled = scaled.clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)
    return scaled.contiguous()


def _even(SQ: int, SK: int, tiles: Tiles) -> dict:
    """Whether the query / key lengths are whole tiles: the kernels then skip their bounds masks."""
    return dict(EVEN_M=SQ % tiles.block_m == 0, EVEN_N=SK % tiles.block_n == 0)


def _row_tiles(row: torch.Tensor, SQ: int, SK: int, tiles: Tiles, far: int) -> tuple[torch.Tensor, int]:
    """A relative bias's (H, SQ + SK - 1) row as the kernels read it, in their (BM, BN) tiles: every
    tile whose first key is the same distance from its first query is the same, so the row becomes
    (H, 2 * width + 1, BM, BN), tile w at distance (w - width) * min(BM, BN), and width. Tiles
    farther off read the outermost ones, which with far > 0 lie wholly beyond far, where the bias is
    one value per head on each side; with far 0 the table reaches every tile. In 64 x 64 tiles with
    the far of T5's encoder (91): 7 tiles a head, 56 KiB in fp16 at any length, read as whole
    tiles, where the row read along each tile's diagonals takes an unaligned load per score."""
    unit = min(tiles.block_m, tiles.block_n)
    width = triton.cdiv(max(SQ, SK), unit)  # every tile
    if far > 0:  # tile w's keys - queries span [w * unit - BM + 1, w * unit + BN - 1]: past far on both sides
        width = min(width, triton.cdiv(far + max(tiles.block_m, tiles.block_n) - 1, unit))
    d = torch.arange(-width, width + 1, device=row.device)[:, None, None] * unit
    offsets = d + torch.arange(tiles.block_n, device=row.device) - torch.arange(tiles.block_m, device=row.device)[:, None]
    # offsets past the scores (partial tiles' padding, tiles past the ends) read the row's nearest end: masked there
    return row[:, (offsets + SQ - 1).clamp(0, SQ + SK - 2)].contiguous(), width


def _layout(q_src: torch.Tensor, kv_src: torch.Tensor, heads: int) -> tuple[torch.Tensor, int, int, int]:
    """(the tensor holding k and v, d_kv, k column offset, v column offset) of packed sources:
    self-attention q_src = [q | k | v] with kv_src empty, cross-attention kv_src = [k | v]."""
    if kv_src.numel() == 0:
        hd = q_src.shape[-1] // 3
        return q_src, hd // heads, hd, 2 * hd
    hd = q_src.shape[-1]
    return kv_src, hd // heads, 0, hd


def _check_lengths(SQ: int, SK: int, causal: bool) -> None:
    """The kernels' loops over key (or query) blocks tell the compiler they run at least once
    (`tl.assume`: without it ptxas serializes their wgmma, tests/test_kernels_sm90.py). That holds
    with a query and a key at least and, for causal attention, no more queries than keys."""
    if SQ < 1 or SK < 1 or (causal and SQ > SK):
        raise ValueError(
            f"the fused attention got {SQ} queries x {SK} keys{' (causal)' if causal else ''}: it needs at "
            "least one of each, and causal attention no more queries than keys (the first queries would "
            "see no key); use the math attention backend for such shapes"
        )


def _launch_fwd(
    q_src, kv_src, bias, key_mask, causal: bool, heads: int, far: int = 0, *, wrap=lambda kernel: kernel
):
    """out (B, SQ, H * D) and the row statistics (2, B, H, SQ) for the backward. far: as `_launch_bwd`'s."""
    kv, D, k_off, v_off = _layout(q_src, kv_src, heads)
    B, SQ, SK, H = q_src.shape[0], q_src.shape[1], kv.shape[1], heads
    _check_lengths(SQ, SK, causal)
    out = torch.empty((B, SQ, H * D), dtype=q_src.dtype, device=q_src.device)
    lse = torch.empty((2, B, H, SQ), dtype=torch.float32, device=q_src.device)  # row max (base 2), 1/row sum
    flags = _flags(q_src, bias, key_mask)
    key = tile_class(causal, flags["HAS_BIAS"], SQ)
    t = FWD_TILES[key]
    kbias, width = _kernel_bias(bias, q_src.dtype), 0
    if _bias_row(bias):
        kbias, width = _row_tiles(kbias, SQ, SK, t, far)
    grid = (triton.cdiv(SQ, t.block_m), B * H)
    wrap(_fwd_kernel)[grid](
        q_src, kv, kbias, key_mask, out, lse, *q_src.stride()[:2], *kv.stride()[:2], *out.stride()[:2], k_off,
        v_off, H, SQ, SK, SK - SQ, B * H * SQ, width, **flags, CAUSAL=causal, D=D, BLOCK_M=t.block_m,
        BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t), BIAS_ROW=_bias_row(bias),
    )  # fmt: skip
    return out, lse


def _launch_bwd(
    q_src,
    kv_src,
    bias,
    key_mask,
    out,
    lse,
    dout,
    causal: bool,
    heads: int,
    far: int = 0,
    *,
    wrap=lambda kernel: kernel,
):
    """Gradients of the sources (each one buffer, laid out like its source; an empty kv_src gets an
    empty gradient) and of the bias, fp32 and shaped like it. far > 0 promises that the bias is one
    value per head wherever key - query >= far and wherever query - key >= far (T5's: `attention.
    bias_saturation_distance`); without a causal mask the bias gradient's batch sum then reads about
    half of dS (`triton_bias_grad.batch_sum`). A bias given as its (H, SQ + SK - 1) row takes the
    backward that stores no dS: dQ recomputed, dS kept only in the band of tiles within `far` of the
    diagonal (all of it for far 0) and summed per head beyond it (`triton_bias_grad.row_sum`)."""
    kv, D, k_off, v_off = _layout(q_src, kv_src, heads)
    B, SQ, SK, H = q_src.shape[0], q_src.shape[1], kv.shape[1], heads
    _check_lengths(SQ, SK, causal)
    flags = _flags(q_src, bias, key_mask)
    has_bias = flags["HAS_BIAS"]
    kbias = _kernel_bias(bias, q_src.dtype)
    dout, out = dout.contiguous(), out.contiguous()
    dq_src = torch.empty(q_src.shape, dtype=q_src.dtype, device=q_src.device)
    dkv_src = torch.empty(kv_src.shape, dtype=kv_src.dtype, device=kv_src.device)
    dkv = dq_src if kv_src.numel() == 0 else dkv_src  # self-attention: dq, dk, dv all in dq_src
    strides = (*q_src.stride()[:2], *kv.stride()[:2], *dout.stride()[:2])
    key = tile_class(causal, has_bias, SQ)
    row = _bias_row(bias)
    one_block = one_block_applies(key, SQ) and not row
    # dS (B, H, SQ, SK) in the input dtype where there is a dense bias, for its gradient (and, in the
    # two-kernel backward, for dQ). Causal: the two kernels never visit tiles above the diagonal, so
    # those must read as 0.
    ds, far_sums, radius = q_src.new_empty((0,)), q_src.new_empty((0,), dtype=torch.float32), 0
    if row:  # the band's dS tiles; tiles the kernel does not visit (off the scores, causal) read as 0
        t = DKDV_ROW_TILES[key]
        if t.block_m != t.block_n:
            raise ValueError(f"DKDV_ROW_TILES[{key!r}] = {t}: the row bias's dK/dV tiles must be square")
        blocks = triton.cdiv(SK, t.block_n)
        radius = bias_grad.band_radius(far, t.block_m, SQ, SK)
        ds = q_src.new_zeros((B, H, blocks, 2 * radius + 1, t.block_m, t.block_n))
        far_sums = torch.empty((B, H, blocks, 2), dtype=torch.float32, device=q_src.device)
    elif has_bias:
        alloc = torch.zeros if causal and not one_block else torch.empty
        ds = alloc((B, H, SQ, SK), dtype=q_src.dtype, device=q_src.device)
    if one_block:  # (computes rowsum(dO * O) itself)
        t = ONE_BLOCK_TILES[key]
        if flags["IEEE"]:  # fp32 tiles: twice the bytes of the bf16 ones the table is tuned for
            t = t._replace(block_n=min(t.block_n, 64), stages=min(t.stages, 2))
        block_m = max(16, triton.next_power_of_2(SQ))
        wrap(_bwd_one_block_kernel)[(B * H,)](
            q_src, kv, kbias, key_mask, dout, out, lse, dq_src, dkv_src, ds, *strides, *out.stride()[:2],
            *dq_src.stride()[:2], *dkv.stride()[:2], k_off, v_off, H, SQ, SK, SK - SQ, B * H * SQ, **flags,
            CAUSAL=causal, PACKED_GRAD=kv_src.numel() == 0, D=D, BLOCK_M=block_m, BLOCK_N=t.block_n,
            num_warps=t.warps, num_stages=t.stages, EVEN_M=SQ == block_m, EVEN_N=SK % t.block_n == 0,
        )  # fmt: skip
    else:
        delta = torch.empty((B, H, SQ), dtype=torch.float32, device=q_src.device)  # rowsum(dO * O)
        wrap(_delta_kernel)[(triton.cdiv(SQ, DELTA_BLOCK_M), B * H)](
            dout, out, delta, *dout.stride()[:2], *out.stride()[:2], H, SQ, D=D, BLOCK_M=DELTA_BLOCK_M,
            EVEN_M=SQ % DELTA_BLOCK_M == 0, num_warps=4,
        )  # fmt: skip
        tables = {}  # the row's tile table per tile shape: dQ's and dK/dV's tiles are the same by default

        def kernel_bias(t: Tiles) -> tuple[torch.Tensor, int]:
            if not row:
                return kbias, 0
            if (t.block_m, t.block_n) not in tables:
                tables[t.block_m, t.block_n] = _row_tiles(kbias, SQ, SK, t, far)
            return tables[t.block_m, t.block_n]

        if not has_bias or row:
            t = DQ_TILES[key]
            dq_bias, width = kernel_bias(t)
            wrap(_bwd_dq_kernel)[(triton.cdiv(SQ, t.block_m), B * H)](
                q_src, kv, dq_bias, key_mask, dout, lse, delta, dq_src, *strides, *dq_src.stride()[:2], k_off,
                v_off, H, SQ, SK, SK - SQ, B * H * SQ, width, **flags, CAUSAL=causal, D=D,
                BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
                BIAS_ROW=row,
            )  # fmt: skip
        t = DKDV_ROW_TILES[key] if row else DKDV_TILES[key]
        dkdv_bias, width = kernel_bias(t)
        wrap(_bwd_dkdv_kernel)[(triton.cdiv(SK, t.block_n), B * H)](
            q_src, kv, dkdv_bias, key_mask, dout, lse, delta, dkv, ds, far_sums, *strides, *dkv.stride()[:2], k_off,
            v_off, H, SQ, SK, SK - SQ, B * H * SQ, radius, width, **flags, CAUSAL=causal, D=D,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
            BIAS_ROW=row,
        )  # fmt: skip
        if has_bias and not row:
            t = DQDS_TILES[key]
            wrap(_bwd_dq_from_ds_kernel)[(triton.cdiv(SQ, t.block_m), B * H)](
                ds, kv, dq_src, *kv.stride()[:2], *dq_src.stride()[:2], k_off, H, SQ, SK, SK - SQ,
                CAUSAL=causal, IEEE=flags["IEEE"], D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
            )  # fmt: skip
    if not has_bias:
        return dq_src, dkv_src, torch.zeros_like(bias)
    if row:
        return dq_src, dkv_src, bias_grad.row_sum(ds, far_sums, SQ, SK, radius)
    return dq_src, dkv_src, bias_grad.batch_sum(ds, wrap, 0 if causal else far)


def one_block_applies(tile_key: str, queries: int) -> bool:
    """Whether the backward of an attention of this TILE_CLASSES key and query length runs as the
    one-block kernel: its queries fit the class's one-block tile."""
    tiles = ONE_BLOCK_TILES.get(tile_key)
    return tiles is not None and queries <= tiles.block_m


if _HAS_TRITON and hasattr(torch.library, "triton_op"):
    from torch.library import triton_op, wrap_triton

    # Every tensor a kernel writes is allocated here and passed whole (offsets are ints): the kernels
    # never write through a view, which inductor's functionalisation could hand over as a copy.
    # `settings` (launch_settings()) is not read: it is there so that compile caches tell graphs
    # traced under other module settings, or by other code, apart.
    @triton_op("t5ds::flash_attention_fwd", mutates_args={})
    def _flash_fwd_op(
        q_src: torch.Tensor,
        kv_src: torch.Tensor,
        bias: torch.Tensor,
        key_mask: torch.Tensor,
        causal: bool,
        heads: int,
        far: int,
        settings: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch_fwd(q_src, kv_src, bias, key_mask, causal, heads, far, wrap=wrap_triton)

    @triton_op("t5ds::flash_attention_bwd", mutates_args={})
    def _flash_bwd_op(
        q_src: torch.Tensor,
        kv_src: torch.Tensor,
        bias: torch.Tensor,
        key_mask: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        causal: bool,
        heads: int,
        far: int,
        settings: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch_bwd(
            q_src, kv_src, bias, key_mask, out, lse, dout, causal, heads, far, wrap=wrap_triton
        )

    def _setup_context(ctx, inputs, output):
        q_src, kv_src, bias, key_mask, causal, heads, far, settings = inputs
        ctx.save_for_backward(q_src, kv_src, bias, key_mask, *output)
        ctx.causal, ctx.heads, ctx.far, ctx.settings = causal, heads, far, settings

    def _backward(ctx, dout, dlse):
        q_src, kv_src, bias, key_mask, out, lse = ctx.saved_tensors
        dq_src, dkv_src, dbias = _flash_bwd_op(
            q_src, kv_src, bias, key_mask, out, lse, dout, ctx.causal, ctx.heads, ctx.far, ctx.settings
        )
        return (*_grads_or_none(kv_src, bias, dq_src, dkv_src, dbias), None)

    _flash_fwd_op.register_autograd(_backward, setup_context=_setup_context)

    def _fwd(q_src, kv_src, bias, key_mask, causal, heads, far):
        return _flash_fwd_op(q_src, kv_src, bias, key_mask, causal, heads, far, launch_settings())

elif _HAS_TRITON:  # older torch: a plain autograd.Function (graph break under torch.compile)

    class _FlashFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q_src, kv_src, bias, key_mask, causal, heads, far):
            out, lse = _launch_fwd(q_src, kv_src, bias, key_mask, causal, heads, far)
            ctx.save_for_backward(q_src, kv_src, bias, key_mask, out, lse)
            ctx.causal, ctx.heads, ctx.far = causal, heads, far
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q_src, kv_src, bias, key_mask, out, lse = ctx.saved_tensors
            grads = _launch_bwd(q_src, kv_src, bias, key_mask, out, lse, dout, ctx.causal, ctx.heads, ctx.far)
            return _grads_or_none(kv_src, bias, *grads)

    def _fwd(q_src, kv_src, bias, key_mask, causal, heads, far):
        return _FlashFunction.apply(q_src, kv_src, bias, key_mask, causal, heads, far)


# What the launchers do and launch: part of launch_settings().
_SOURCE_DIGEST = source_digest(
    *(
        Path(__file__).with_name(name)
        for name in ("triton_attention.py", "triton_attention_kernels.py", "triton_bias_grad.py")
    )
)


@torch.compiler.assume_constant_result
def launch_settings() -> str:
    """A digest of what the launchers read when torch.compile traces them (the tile tables and the
    batch sum's blocks) and of the launchers' and kernels' source. The custom ops take it as an
    argument: AOTAutograd's and inductor's compile caches key a graph on the ops and their
    arguments, not on the Python the ops ran when traced, so without it a graph traced under other
    tiles (a tile sweep's previous setting) or by other code (an edited kernel, another checkout on
    the same machine) could come back from the cache with that graph's kernels
    (training/model/compile_key.py)."""
    return settings_digest(
        _SOURCE_DIGEST, SHORT_QUERIES, TILE_TABLES, DELTA_BLOCK_M, bias_grad.batch_sum_settings()
    )


def _grads_or_none(kv_src, bias, dq_src, dkv_src, dbias):
    """Autograd's gradient tuple for (q_src, kv_src, bias, key_mask, causal, heads, far)."""
    return (
        dq_src,
        dkv_src if kv_src.numel() > 0 else None,
        dbias if bias.numel() > 0 else None,
        None,
        None,
        None,
        None,
    )


def _check_supported(d_kv: int) -> None:
    if not _HAS_TRITON:
        raise RuntimeError(
            "attention_backend='triton' needs the triton package (pip install triton) and CUDA"
        )
    if d_kv not in (16, 32, 64, 128):
        raise ValueError(
            f"the triton attention kernel supports d_kv in (16, 32, 64, 128), got {d_kv}; use 'sdpa'"
        )


# Elements from which a dense (H, SQ, SK) bias has offsets the kernels' int32 arithmetic cannot hold
# (T5 base at 16,384 x 16,384: 3.2e9).
_INT32_OFFSETS = 2**31


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The autocast dtype when autocast is on, unit last stride."""
    if torch.is_autocast_enabled(t.device.type):
        t = t.to(torch.get_autocast_dtype(t.device.type))
    return t if t.stride(-1) == 1 else t.contiguous()


def t5_flash_attention_packed(
    q_src: torch.Tensor,
    kv_src: torch.Tensor | None,
    heads: int,
    bias: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    causal: bool,
    bias_far: int = 0,
) -> torch.Tensor:
    """Fused attention read straight from the projection outputs, (B, SQ, H * D) out.

    Self-attention: q_src (B, S, 3 H D) = [q | k | v], kv_src None. Cross-attention: q_src
    (B, SQ, H D), kv_src (B, SK, 2 H D) = [k | v]. The bias is (H, SQ, SK) fp32, shared by the
    batch, or a relative one as its (H, SQ + SK - 1) row, bias[h, q, k] = row[h, k - q + SQ - 1]
    (long inputs: no (H, SQ, SK) tensor in the forward or the backward). The backward returns each
    source's gradient as one tensor (the kernels write dq, dk, dv into it; autograd has no
    concatenation to do). bias_far > 0 promises that the bias is constant per head wherever key -
    query >= bias_far and wherever query - key >= bias_far (`attention.bias_saturation_distance`);
    the bias gradient's batch sum of an attention without a causal mask then reads about half of
    dS, and a row's backward keeps dS only within bias_far of the diagonal. 0: no promise.
    """
    _check_supported(q_src.shape[-1] // (3 if kv_src is None else 1) // heads)
    if bias is not None and bias.dim() == 3 and bias.numel() >= _INT32_OFFSETS:
        raise ValueError(f"a dense bias of {bias.numel()} elements is past the fused kernel's 32-bit offsets: hand "
                         "it the bias as its row (T5Config.attention_bias_layout 'auto' or 'row')")  # fmt: skip
    q_src = _kernel_ready(q_src)
    kv_src = q_src.new_empty((0,)) if kv_src is None else _kernel_ready(kv_src).to(q_src.dtype)
    bias = q_src.new_empty((0,), dtype=torch.float32) if bias is None else bias.float().contiguous()
    sq, sk = q_src.shape[1], (q_src if kv_src.numel() == 0 else kv_src).shape[1]
    if bias.dim() == 2 and bias.shape[-1] != sq + sk - 1:
        raise ValueError(f"a relative bias row of {bias.shape[-1]} offsets for {sq} queries x {sk} keys: "
                         f"it needs queries + keys - 1 = {sq + sk - 1}")  # fmt: skip
    key_mask = (
        q_src.new_empty((0,), dtype=torch.uint8)
        if key_mask is None
        else key_mask.to(torch.uint8).contiguous()
    )
    with torch.autocast(device_type=q_src.device.type, enabled=False):
        out, _ = _fwd(q_src, kv_src, bias, key_mask, causal, heads, bias_far)
    return out


def t5_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """Fused attention on separate q (B, SQ, H, D), k/v (B, SK, H, D) -> (B, SQ, H, D), semantics as
    `training.model.attention.attention`. Packs k and v into one tensor first (a copy): the model
    calls `t5_flash_attention_packed` on its projection outputs instead."""
    b, sq, h, d = q.shape
    kv = torch.cat([k.flatten(2), v.flatten(2)], dim=-1)
    return t5_flash_attention_packed(q.flatten(2), kv, h, bias, key_mask, causal).view(b, sq, h, d)
