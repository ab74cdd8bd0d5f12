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
- `_bwd_dkdv_kernel`: grid (k blocks, B*H); dK, dV of one key block, walking the query blocks; with
  `DQ_PATH` "stored" (by default "stored_bias": where there is a bias) it also stores dS (B, H, Sq,
  Sk) in the input dtype, `triton_bias_grad.batch_sum` sums it over the batch for the bias gradient
  (in a fixed order: `DS_SUM`; in the encoder it reads about half of it, taking each row's larger far
  region from the row's zero sum), and
- `_bwd_dq_from_ds_kernel`: grid (q blocks, B*H); dQ = dS K from the stored dS (no recomputation);
  given a relative bias (RELATIVE_BIAS) it also sums dS per key - query offset, and
  `_rel_grad_reduce_kernel` (grid (H, offset chunks)) adds those sums up into the bias's gradient.
- `_bwd_dq_kernel` (`DQ_PATH` "recompute", and attention without a bias by default): grid (q
  blocks, B*H); recomputes P and accumulates dQ; with a bias it also stores dS for the bias gradient
  (`DBIAS_PATH = "ds"`), or adds dS into one fp32 (H, Sq, Sk) buffer with atomic adds (`"atomic"`).
- `_bwd_one_block_kernel` (ONE_BLOCK_BWD, queries that fit one tile: T5's 114 targets): grid
  (B*H,); the whole backward in one pass over the key blocks, each block's dK and dV stored at
  once, dQ kept in registers; stores dS where there is a bias, for the bias gradient's sum.
- `_delta_kernel`: grid (q blocks, B*H); rowsum(dO * O) per query row, which every backward
  kernel but the one-block one reads.
- `_bwd_dbias_kernel` (`DBIAS_PATH = "kernel"`): grid (q blocks, k blocks, H); recomputes P and
  dO V^T for every batch element of its tile and sums dS in registers (no buffer, two extra small
  GEMMs per tile and batch element).

Wrapped with `torch.library.triton_op` so torch.compile traces it without graph breaks; the ops
take `launch_settings()`, a digest of the module settings above and of the source, so that
compile caches cannot hand back a graph traced under other settings or by other code.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import NamedTuple

import torch

from training.model import triton_bias_grad as bias_grad
from training.model.compile_key import settings_digest, source_digest

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when the fused kernel can run here (triton installed and a CUDA device present)."""
    return _HAS_TRITON and torch.cuda.is_available()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


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


def _tiles(kernel: str, block_m: int, block_n: int, warps: int, stages: int) -> Tiles:
    """Tiles with the environment's overrides for tuning runs, which set the kernel's tiles for every
    class: T5DS_ATTN_{kernel}_BM / _BN / _WARPS / _STAGES, and for the backward's kernels the fourth
    session's T5DS_ATTN_BWD_* (all of them at once)."""
    names, values = ("BM", "BN", "WARPS", "STAGES"), (block_m, block_n, warps, stages)
    if kernel in ("DKDV", "DQ", "DQDS"):
        values = tuple(_env_int(f"T5DS_ATTN_BWD_{name}", value) for name, value in zip(names, values))
    return Tiles(*(_env_int(f"T5DS_ATTN_{kernel}_{name}", value) for name, value in zip(names, values)))


# Tiles per kernel and class (benchmarked on an H100 at d_kv 64 with benchmarks/attention_tiles.py,
# each kernel swept alone at each class's shape; docs/model_speed.md). The forward: BLOCK_M queries per
# program, BLOCK_N keys per step. dK/dV kernel: BLOCK_N keys per program (its accumulators),
# BLOCK_M queries per step; 64 x 64 with 3 stages is the encoder's best with the dS store; short
# queries give each program only 2 query blocks of 64 to walk, and there the decoder runs best in
# 32 x 32 tiles and the cross-attention (no dS store) with 128 keys per program (-0.024 and -0.054
# ms a layer at 114 queries); the cross-attention with long queries runs best with 2 stages (512 x
# 512: 1.01 against 1.08 ms for the backward). dQ kernel: BLOCK_M queries per program, BLOCK_N keys
# per step. dQ from the stored dS (DQ_PATH "stored*"): a streaming GEMM, BLOCK_M queries per program.
FWD_TILES = dict.fromkeys(TILE_CLASSES, _tiles("FWD", 64, 64, 4, 3))
DKDV_TILES = {
    **dict.fromkeys(("enc", "enc-short", "dec"), _tiles("DKDV", 64, 64, 4, 3)),
    "dec-short": _tiles("DKDV", 32, 32, 4, 2),
    "cross": _tiles("DKDV", 64, 64, 4, 2),
    "cross-short": _tiles("DKDV", 32, 128, 4, 3),
}
DQ_TILES = dict.fromkeys(TILE_CLASSES, _tiles("DQ", 64, 64, 4, 3))
DQDS_TILES = {  # the encoder's with 128 x 128 since the twenty-fifth session's sweep (unserialized wgmma)
    **dict.fromkeys(TILE_CLASSES, _tiles("DQDS", 64, 64, 4, 3)),
    "enc": _tiles("DQDS", 128, 128, 4, 3),
}
# The one-block backward (ONE_BLOCK_BWD) of the short classes: BLOCK_M is the most query rows it
# takes (the kernel runs with the power of two that holds them, 16 at least), BLOCK_N keys per step.
# fp32 operands (no autocast) take twice the shared memory: at most 64 keys and 2 stages there.
ONE_BLOCK_TILES = {
    "enc-short": _tiles("ONEBLOCK", SHORT_QUERIES, 128, 8, 2),
    "dec-short": _tiles("ONEBLOCK", SHORT_QUERIES, 64, 8, 3),  # 1 stage until the twenty-fifth session
    "cross-short": _tiles("ONEBLOCK", SHORT_QUERIES, 128, 8, 3),
}
# The tables by kernel, for what sets or sweeps them all (the benchmark's `enctiles`, attention_tiles.py)
TILE_TABLES = {
    "FWD": FWD_TILES,
    "DKDV": DKDV_TILES,
    "DQ": DQ_TILES,
    "DQDS": DQDS_TILES,
    "ONEBLOCK": ONE_BLOCK_TILES,
}
DBIAS_TILES = _tiles("DBIAS", 64, 64, 4, 2)  # the dbias kernel (DBIAS_PATH "kernel"), every class
DELTA_BLOCK_M = _env_int("T5DS_ATTN_DELTA_BM", 64)  # query rows per program of rowsum(dO * O)

if _HAS_TRITON:
    import triton

    from training.model.triton_attention_kernels import (
        _bwd_dbias_kernel,
        _bwd_dkdv_kernel,
        _bwd_dq_from_ds_kernel,
        _bwd_dq_kernel,
        _bwd_one_block_kernel,
        _delta_kernel,
        _fwd_kernel,
        _rel_grad_reduce_kernel,
    )


# Far tiles (benchmark variants `fartiles`, `fartiles=fwd+dq`, `nofartiles`): with a bias that says
# from which distance it is constant (T5's, through `far`), the kernels named in FAR_TILES skip the
# bias loads of tiles wholly beyond that distance. Off by default since the twenty-fifth session:
# once ptxas stopped serializing the kernels' wgmma (`_check_lengths`), reading every tile through
# the pipelined loads is the faster forward (0.351 against 0.421 ms per encoder layer), and the
# branch slows dK/dV (0.748 -> 0.976 ms). It was on in the forward from the eighth session
# (0.65 -> 0.47 ms then, with serialized wgmma and the fp32 bias; docs/model_speed.md).
FAR_TILE_KERNELS = ("fwd", "dq", "dkdv")
FAR_TILES: tuple[str, ...] = ()


def _flags(q_src: torch.Tensor, bias: torch.Tensor, key_mask: torch.Tensor, far: int, kernel: str) -> dict:
    if not set(FAR_TILES) <= set(FAR_TILE_KERNELS):
        raise ValueError(
            f"triton_attention.FAR_TILES must name kernels among {FAR_TILE_KERNELS}, got {FAR_TILES!r}"
        )
    far_tiles = kernel in FAR_TILES and far > 0 and bias.numel() > 0
    return dict(
        HAS_BIAS=bias.numel() > 0, HAS_MASK=key_mask.numel() > 0,
        IEEE=q_src.dtype == torch.float32,
        FAR_TILES=far_tiles, FAR=far if far_tiles else 0,
    )  # fmt: skip


_LOG2E = 1.4426950408889634

# The dense bias the kernels read, for bf16/fp16 inputs: fp16 (True) or fp32 (False; fp32 inputs
# always read it in fp32). Every (batch, head) program reads the same (H, SQ, SK) bias tiles from L2;
# fp16 halves those bytes. Measured on the H100 (docs/model_speed.md, "The bias in fp16"): the encoder
# layer 2.106 -> 2.065 ms, the step 1.1-1.4 ms faster. fp16 keeps 11 significant bits (the bias is
# clamped to its range, +-65504, which T5's learned values are far inside): finer than the bf16
# scores HF's T5 adds its bias to under autocast. Benchmark variants `biashalf`, `biasfp32`.
BIAS_HALF = True
_HALF_MAX = 65504.0


def _kernel_bias(bias: torch.Tensor, SQ: int, SK: int, inputs_dtype: torch.dtype) -> torch.Tensor:
    """The (H, SQ, SK) bias as the kernels read it, in base-2 units so that scale and bias are one FMA
    per score, in fp16 under BIAS_HALF for half-precision inputs; a relative bias (H, SQ + SK - 1) is
    expanded here (`attention.dense_bias`)."""
    if bias.numel() == 0:
        return bias
    scaled = bias * _LOG2E
    if BIAS_HALF and inputs_dtype != torch.float32:
        scaled = scaled.clamp(-_HALF_MAX, _HALF_MAX).to(torch.float16)
    if bias.dim() == 2:
        from training.model.attention import dense_bias  # attention.py imports this module

        return dense_bias(scaled, SQ, SK).contiguous()
    return scaled.contiguous()


def _even(SQ: int, SK: int, tiles: Tiles) -> dict:
    """Whether the query / key lengths are whole tiles: the kernels then skip their bounds masks."""
    return dict(EVEN_M=SQ % tiles.block_m == 0, EVEN_N=SK % tiles.block_n == 0)


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


def _launch_fwd(q_src, kv_src, bias, key_mask, causal: bool, heads: int, far: int = 0, wrap=lambda kernel: kernel):
    """out (B, SQ, H * D) and the row statistics (2, B, H, SQ) for the backward. far > 0: the bias is
    constant per head and direction wherever |key - query| >= far (see _bias_tile)."""
    kv, D, k_off, v_off = _layout(q_src, kv_src, heads)
    B, SQ, SK, H = q_src.shape[0], q_src.shape[1], kv.shape[1], heads
    _check_lengths(SQ, SK, causal)
    out = torch.empty((B, SQ, H * D), dtype=q_src.dtype, device=q_src.device)
    lse = torch.empty((2, B, H, SQ), dtype=torch.float32, device=q_src.device)  # row max (base 2), 1/row sum
    flags = _flags(q_src, bias, key_mask, far, "fwd")
    kbias = _kernel_bias(bias, SQ, SK, q_src.dtype)
    t = FWD_TILES[tile_class(causal, flags["HAS_BIAS"], SQ)]
    grid = (triton.cdiv(SQ, t.block_m), B * H)
    wrap(_fwd_kernel)[grid](
        q_src, kv, kbias, key_mask, out, lse, *q_src.stride()[:2], *kv.stride()[:2], *out.stride()[:2], k_off, v_off,
        H, SQ, SK, SK - SQ, B * H * SQ, **flags, CAUSAL=causal, D=D,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
    )  # fmt: skip
    return out, lse


# The bias gradient: "ds" = the dQ kernel writes dS and torch sums it over the batch (one extra
# (B, H, SQ, SK) buffer in the input dtype for the length of the backward); "atomic" = the dQ kernel
# adds dS into one fp32 (H, SQ, SK) buffer with atomic adds (no batch-sized buffer; the summation
# order, so the last bits, vary from run to run); "kernel" = the separate dbias kernel that
# recomputes P and dO V^T per batch element (no buffer). Benchmark variants `dbiasatomic`, `dbiaskernel`.
DBIAS_PATHS = ("ds", "atomic", "kernel")
DBIAS_PATH = "ds"
# Who sums the stored dS over the batch (bias-gradient path "ds"): "kernel" = `_ds_batch_sum_kernel`,
# in one fixed order; "torch" = `ds.sum(0)`, which torch.compile fuses with the other layers' sums and
# the bias table's scatter-add. Under deterministic algorithms inductor no longer autotunes that
# reduction, and its fixed choice took 8.4 ms a step instead of 3.2; the kernel takes 3.6 ms in
# either mode, the same step time by default and 6 ms less per step under deterministic algorithms
# (T5 base, H100, docs/model_speed.md). "far" = `triton_bias_grad.batch_sum` given `far` where the
# caller promises a bias that is one value per head beyond a distance (`far` > 0: T5's) and the
# attention is not causal (the encoder), "kernel" elsewhere: each row of dS sums to 0, so the sum of
# each row's larger far region is minus that of the rest of the row, and about half of dS is never
# read. The gradient is then exact per region of one bias value, not per element, which is all T5's
# bucket gather needs (thirty-seventh session). Benchmark variants `dssumkernel`, `dssumfar`,
# `dssumtorch`.
DS_SUMS = ("kernel", "far", "torch")
DS_SUM = "far"
# dQ: "recompute" = the dQ kernel recomputes P and dP = dO V^T per tile (FlashAttention-2's two
# kernels); "stored" = the dK/dV kernel stores dS (B, H, SQ, SK) in the input dtype and
# `_bwd_dq_from_ds_kernel` computes dQ = dS K from it (no recomputation; one batch-sized buffer for
# the length of the backward, which the bias gradient, when there is one, sums as under "ds");
# "stored_bias" = "stored" where the bias gradient is summed from dS anyway (a bias, DBIAS_PATH
# "ds"), "recompute" elsewhere (T5's cross-attention; the other bias-gradient paths). Benchmark
# variants `dqrecompute`, `dqstored`, `dqstoredbias`. Measured (docs/model_speed.md, tenth session): with
# T5's bias the encoder layer's backward 2.88 -> 2.61 ms, the step 0.1570 -> 0.1514 s; without a
# bias 2.05 -> 2.25 ms (the dS round trip costs more than the recomputation saves), hence
# "stored_bias".
DQ_PATHS = ("recompute", "stored", "stored_bias")
DQ_PATH = "stored_bias"
# A relative bias (H, SQ + SK - 1), one value per key - query offset as T5's, has as its gradient the
# sums of dS along those offsets, over the batch. The kernels take one (a 2-D bias; `attention.
# packed_attention`'s bias_rel) and return that gradient. With dQ from the stored dS and square dQ
# tiles (DQDS_TILES), `_bwd_dq_from_ds_kernel` sums each dS tile along its offsets (two gathers and a
# sum over the rows) as it reads it for dQ, and `_rel_grad_reduce_kernel` adds the sums up, so the
# stored dS is not read a second time by the batch sum; otherwise the dense gradient is computed and
# summed along its diagonals (`triton_bias_grad.diagonal_sums`). RELATIVE_BIAS: whether
# `packed_attention` hands the kernel the relative bias when the caller has it (benchmark variant
# `relbias`), or the dense one (`densebias`): the dense gradient per layer, which autograd sums over
# the layers and scatters onto the bias table. Off: the sums cost more in the dQ kernel than the
# second read of dS they save (an encoder layer's backward 1.75 ms against 1.63, eighteenth session,
# docs/model_speed.md).
RELATIVE_BIAS = False
# Attention whose queries fit one tile (at most ONE_BLOCK_TILES[class].block_m rows: T5's 114
# targets, in the decoder's self-attention and the cross-attention) runs its backward as one kernel
# per (batch, head), `_bwd_one_block_kernel`: each key block meets the one query block once, so dK
# and dV need no walk over query blocks and dQ no second kernel. Where there is a bias it stores dS
# for the bias gradient's sum; the other bias-gradient paths (DBIAS_PATH "atomic", "kernel") keep
# the two kernels. Benchmark variant `nooneblock` (False), attention_backends.py's `triton-split`.
ONE_BLOCK_BWD = True
REL_GRAD_BLOCK_B = _env_int("T5DS_ATTN_REL_GRAD_BLOCK_B", 16)  # rows per step of `_rel_grad_reduce_kernel`


def _launch_bwd(
    q_src, kv_src, bias, key_mask, out, lse, dout, causal: bool, heads: int, far: int = 0, wrap=lambda kernel: kernel
):
    """Gradients of the sources (each one buffer, laid out like its source; an empty kv_src gets an
    empty gradient) and of the bias, in its shape: dense (H, SQ, SK) or relative (H, SQ + SK - 1)."""
    kv, D, k_off, v_off = _layout(q_src, kv_src, heads)
    B, SQ, SK, H = q_src.shape[0], q_src.shape[1], kv.shape[1], heads
    _check_lengths(SQ, SK, causal)
    flags = _flags(q_src, bias, key_mask, far, "dq")
    kbias = _kernel_bias(bias, SQ, SK, q_src.dtype)
    dout, out = dout.contiguous(), out.contiguous()
    dq_src = torch.empty(q_src.shape, dtype=q_src.dtype, device=q_src.device)
    dkv_src = torch.empty(kv_src.shape, dtype=kv_src.dtype, device=kv_src.device)
    dkv = dq_src if kv_src.numel() == 0 else dkv_src  # self-attention: dq, dk, dv all in dq_src
    if DBIAS_PATH not in DBIAS_PATHS:
        raise ValueError(f"triton_attention.DBIAS_PATH must be one of {DBIAS_PATHS}, got {DBIAS_PATH!r}")
    if DQ_PATH not in DQ_PATHS:
        raise ValueError(f"triton_attention.DQ_PATH must be one of {DQ_PATHS}, got {DQ_PATH!r}")
    if DS_SUM not in DS_SUMS:
        raise ValueError(f"triton_attention.DS_SUM must be one of {DS_SUMS}, got {DS_SUM!r}")
    strides = (*q_src.stride()[:2], *kv.stride()[:2], *dout.stride()[:2])
    if DQ_PATH == "stored" and flags["HAS_BIAS"] and DBIAS_PATH != "ds":
        raise ValueError(
            f"triton_attention.DQ_PATH 'stored' stores dS, from which the bias gradient is summed: set "
            f"DBIAS_PATH to 'ds' (it is {DBIAS_PATH!r}) or DQ_PATH to 'recompute' or 'stored_bias'"
        )
    key = tile_class(causal, flags["HAS_BIAS"], SQ)
    one_block = one_block_applies(key, SQ, flags["HAS_BIAS"])
    dq_from_ds = not one_block and (
        DQ_PATH == "stored" or (DQ_PATH == "stored_bias" and flags["HAS_BIAS"] and DBIAS_PATH == "ds")
    )
    # ds_mode (the dQ kernel's DS_MODE): 1 = a (B, H, SQ, SK) dS buffer for the bias gradient (written
    # by the dQ kernel, by the dK/dV kernel for dQ from dS, or by the one-block kernel); 2 = an fp32
    # (H, SQ, SK) buffer that the dQ kernel adds dS into; 0 = none.
    ds_mode = 1 if dq_from_ds else 0 if not flags["HAS_BIAS"] else {"ds": 1, "atomic": 2, "kernel": 0}[DBIAS_PATH]
    if ds_mode == 2 and torch.are_deterministic_algorithms_enabled():
        raise RuntimeError(
            "triton_attention.DBIAS_PATH 'atomic' sums the bias gradient with atomic adds, which is not "
            "deterministic: set it to 'ds' (the default) or 'kernel', or turn deterministic algorithms off"
        )
    ds = q_src.new_empty((0,))
    if ds_mode == 1:  # causal: tiles above the diagonal are never visited (but by the one-block kernel),
        # so they must read as 0
        alloc = torch.zeros if causal and not one_block else torch.empty
        ds = alloc((B, H, SQ, SK), dtype=q_src.dtype, device=q_src.device)
    elif ds_mode == 2:
        ds = torch.zeros((H, SQ, SK), dtype=torch.float32, device=q_src.device)
    if one_block:  # (computes rowsum(dO * O) itself)
        t = ONE_BLOCK_TILES[key]
        if flags["IEEE"]:  # fp32 tiles: twice the bytes of the bf16 ones the table is tuned for
            t = t._replace(block_n=min(t.block_n, 64), stages=min(t.stages, 2))
        block_m = max(16, triton.next_power_of_2(SQ))
        wrap(_bwd_one_block_kernel)[(B * H,)](
            q_src, kv, kbias, key_mask, dout, out, lse, dq_src, dkv_src, ds, *strides, *out.stride()[:2],
            *dq_src.stride()[:2], *dkv.stride()[:2], k_off, v_off, H, SQ, SK, SK - SQ, B * H * SQ, **flags,
            CAUSAL=causal, STORE_DS=ds_mode == 1, PACKED_GRAD=kv_src.numel() == 0, D=D, BLOCK_M=block_m,
            BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, EVEN_M=SQ == block_m, EVEN_N=SK % t.block_n == 0,
        )  # fmt: skip
    else:  # rowsum(dO * O) per query row, (B, H, SQ), for the kernels below
        delta = torch.empty((B, H, SQ), dtype=torch.float32, device=q_src.device)
        wrap(_delta_kernel)[(triton.cdiv(SQ, DELTA_BLOCK_M), B * H)](
            dout, out, delta, *dout.stride()[:2], *out.stride()[:2], H, SQ, D=D, BLOCK_M=DELTA_BLOCK_M,
            EVEN_M=SQ % DELTA_BLOCK_M == 0, num_warps=4,
        )  # fmt: skip
    if not one_block and not dq_from_ds:
        t = DQ_TILES[key]
        wrap(_bwd_dq_kernel)[(triton.cdiv(SQ, t.block_m), B * H)](
            q_src, kv, kbias, key_mask, dout, lse, delta, dq_src, ds, *strides, *dq_src.stride()[:2], k_off, v_off,
            H, SQ, SK, SK - SQ, B * H * SQ, **flags, CAUSAL=causal, DS_MODE=ds_mode, D=D,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
        )  # fmt: skip
    if not one_block:
        t = DKDV_TILES[key]
        wrap(_bwd_dkdv_kernel)[(triton.cdiv(SK, t.block_n), B * H)](
            q_src, kv, kbias, key_mask, dout, lse, delta, dkv, ds, *strides, *dkv.stride()[:2], k_off, v_off,
            H, SQ, SK, SK - SQ, B * H * SQ, **_flags(q_src, bias, key_mask, far, "dkdv"), CAUSAL=causal,
            STORE_DS=dq_from_ds, D=D,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
        )  # fmt: skip
    relative = flags["HAS_BIAS"] and bias.dim() == 2
    rel_in_kernel = relative and dq_from_ds and relative_grad_in_kernel(key)
    if dq_from_ds:
        t = DQDS_TILES[key]
        n_m, chunks = triton.cdiv(SQ, t.block_m), triton.cdiv(SK, t.block_n) + 1
        # (B * H, query blocks, chunks, BLOCK_N) sums of dS per key - query offset; causal: the chunks
        # past a block's diagonal are never written, so they must read as 0
        drel = q_src.new_empty((0,), dtype=torch.float32)
        if rel_in_kernel:
            drel = (torch.zeros if causal else torch.empty)(
                (B * H, n_m, chunks, t.block_n), dtype=torch.float32, device=q_src.device
            )
        wrap(_bwd_dq_from_ds_kernel)[(n_m, B * H)](
            ds, kv, dq_src, drel, *kv.stride()[:2], *dq_src.stride()[:2], k_off, H, SQ, SK, SK - SQ, chunks,
            CAUSAL=causal, IEEE=flags["IEEE"], REL_GRAD=rel_in_kernel, D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
            num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
        )  # fmt: skip
        if rel_in_kernel:
            dbias = torch.empty(bias.shape, dtype=torch.float32, device=q_src.device)
            wrap(_rel_grad_reduce_kernel)[(H, n_m + chunks - 1)](
                drel, dbias, B, H, n_m, chunks, SQ + SK - 1, SQ - n_m * t.block_m,
                BLOCK_B=REL_GRAD_BLOCK_B, T=t.block_n, num_warps=4,
            )  # fmt: skip
            return dq_src, dkv_src, dbias
    if not flags["HAS_BIAS"]:
        dbias = torch.zeros_like(bias)
    elif ds_mode == 1:
        if DS_SUM == "torch":
            dbias = ds.sum(0, dtype=torch.float32)
        else:
            dbias = bias_grad.batch_sum(ds, wrap, far if DS_SUM == "far" and not causal and bias.dim() == 3 else 0)
    elif ds_mode == 2:
        dbias = ds
    else:
        dbias = torch.empty((H, SQ, SK), dtype=torch.float32, device=q_src.device)
        t = DBIAS_TILES
        grid = (triton.cdiv(SQ, t.block_m), triton.cdiv(SK, t.block_n), H)
        wrap(_bwd_dbias_kernel)[grid](
            q_src, kv, kbias, key_mask, dout, lse, delta, dbias, *strides, k_off, v_off,
            B, H, SQ, SK, SK - SQ, B * H * SQ, HAS_MASK=flags["HAS_MASK"], CAUSAL=causal, IEEE=flags["IEEE"], D=D,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.warps, num_stages=t.stages, **_even(SQ, SK, t),
        )  # fmt: skip
    return dq_src, dkv_src, bias_grad.diagonal_sums(dbias) if relative else dbias


def one_block_applies(tile_key: str, queries: int, has_bias: bool) -> bool:
    """Whether the backward of an attention of this TILE_CLASSES key and query length runs as the
    one-block kernel (ONE_BLOCK_BWD): its queries fit the class's one-block tile, and a bias's
    gradient, if any, is summed from the stored dS (DBIAS_PATH "ds")."""
    tiles = ONE_BLOCK_TILES.get(tile_key)
    return (
        ONE_BLOCK_BWD
        and tiles is not None
        and queries <= tiles.block_m
        and (not has_bias or DBIAS_PATH == "ds")
    )


def relative_grad_in_kernel(tile_key: str) -> bool:
    """Whether a relative bias's gradient is summed by the dQ-from-dS kernel (square tiles) for the
    attentions of this TILE_CLASSES key, when dQ comes from the stored dS; else
    `triton_bias_grad.diagonal_sums`."""
    return DQDS_TILES[tile_key].block_m == DQDS_TILES[tile_key].block_n


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
        return _launch_bwd(q_src, kv_src, bias, key_mask, out, lse, dout, causal, heads, far, wrap=wrap_triton)

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
    *(Path(__file__).with_name(name) for name in ("triton_attention.py", "triton_attention_kernels.py", "triton_bias_grad.py"))
)


@torch.compiler.assume_constant_result
def launch_settings() -> str:
    """A digest of every module setting the launchers read when torch.compile traces them (the
    backward's paths and switches, far tiles, tile tables) and of the launchers' and kernels' source.
    The custom ops take it as an argument: AOTAutograd's and inductor's compile caches key a graph
    on the ops and their arguments, not on the Python the ops ran when traced, so without it a graph
    traced under other settings (a benchmark's previous variant, a process with other T5DS_ATTN_*
    tiles) or by other code (an edited kernel, another checkout on the same machine) could come back
    from the cache with that graph's kernels (training/model/compile_key.py)."""
    return settings_digest(
        _SOURCE_DIGEST,
        DBIAS_PATH, DQ_PATH, DS_SUM, RELATIVE_BIAS, ONE_BLOCK_BWD, FAR_TILES, BIAS_HALF, SHORT_QUERIES, TILE_TABLES,
        DBIAS_TILES, bias_grad.batch_sum_settings(), DELTA_BLOCK_M, REL_GRAD_BLOCK_B,
    )  # fmt: skip


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
    (B, SQ, H D), kv_src (B, SK, 2 H D) = [k | v]. The bias is (H, SQ, SK) fp32, or a relative one
    (H, SQ + SK - 1), one value per key - query offset (`attention.dense_bias`), whose gradient is
    then returned per offset (see RELATIVE_BIAS). The backward returns each source's gradient
    as one tensor (the kernels write dq, dk, dv into it; autograd has no concatenation to do).
    bias_far > 0 promises that the bias is constant per head wherever key - query >= bias_far and
    wherever query - key >= bias_far (`attention.bias_saturation_distance`); the kernels named in
    FAR_TILES then skip the bias loads of tiles wholly inside those regions. 0: no promise.
    """
    _check_supported(q_src.shape[-1] // (3 if kv_src is None else 1) // heads)
    q_src = _kernel_ready(q_src)
    kv_src = q_src.new_empty((0,)) if kv_src is None else _kernel_ready(kv_src).to(q_src.dtype)
    bias = q_src.new_empty((0,), dtype=torch.float32) if bias is None else bias.float().contiguous()
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
