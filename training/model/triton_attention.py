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

Kernels (FlashAttention-2 structure, exp2 online softmax, fp32 accumulation); per-score work is kept
small (scale and bias as one FMA on a bias pre-multiplied by log2(e), bounds masks only on partial
tiles, the masked-score guard on dS only with masks), since on an H100 at d_kv 64 the element-wise
work, not the tensor cores, bounds these kernels:
- `_fwd_kernel`: grid (q blocks, B*H); writes out and the row max / inverse sum (base 2).
- `_bwd_dkdv_kernel`: grid (k blocks, B*H); dK, dV of one key block, walking the query blocks.
- `_bwd_dq_kernel`: grid (q blocks, B*H); recomputes P and accumulates dQ; with a bias it also
  stores dS (B, H, Sq, Sk) in the input dtype, and torch sums it over the batch (`DBIAS_PATH =
  "ds"`), or adds dS into one fp32 (H, Sq, Sk) buffer with atomic adds (`"atomic"`).
- `_bwd_dbias_kernel` (`DBIAS_PATH = "kernel"`): grid (q blocks, k blocks, H); recomputes P and
  dO V^T for every batch element of its tile and sums dS in registers (no buffer, two extra small
  GEMMs per tile and batch element).

Wrapped with `torch.library.triton_op` so torch.compile traces it without graph breaks.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def available() -> bool:
    """True when the fused kernel can run here (triton installed and a CUDA device present)."""
    return _HAS_TRITON and torch.cuda.is_available()


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# Tile sizes (benchmarked on H100, d_kv 64); env overrides exist for tuning runs only.
FWD_BLOCK_M = _env_int("T5DS_ATTN_FWD_BM", 64)
FWD_BLOCK_N = _env_int("T5DS_ATTN_FWD_BN", 64)
FWD_WARPS = _env_int("T5DS_ATTN_FWD_WARPS", 4)
FWD_STAGES = _env_int("T5DS_ATTN_FWD_STAGES", 3)
# dK/dV kernel: BLOCK_N keys per program (its accumulators), BLOCK_M queries per step; dQ kernel:
# BLOCK_M queries per program, BLOCK_N keys per step. Swept apart (benchmarks/attention_tiles.py);
# 64 x 64 for both stays the best in the whole model (docs/model.md). The fourth session's
# T5DS_ATTN_BWD_* variables still set both kernels when the kernel's own are not given.
def _bwd_env_int(kernel: str, name: str, default: int) -> int:
    return _env_int(f"T5DS_ATTN_{kernel}_{name}", _env_int(f"T5DS_ATTN_BWD_{name}", default))


DKDV_BLOCK_M = _bwd_env_int("DKDV", "BM", 64)
DKDV_BLOCK_N = _bwd_env_int("DKDV", "BN", 64)
DKDV_WARPS = _bwd_env_int("DKDV", "WARPS", 4)
DKDV_STAGES = _bwd_env_int("DKDV", "STAGES", 3)
DQ_BLOCK_M = _bwd_env_int("DQ", "BM", 64)
DQ_BLOCK_N = _bwd_env_int("DQ", "BN", 64)
DQ_WARPS = _bwd_env_int("DQ", "WARPS", 4)
DQ_STAGES = _bwd_env_int("DQ", "STAGES", 3)
DBIAS_BLOCK_M = _env_int("T5DS_ATTN_DBIAS_BM", 64)
DBIAS_BLOCK_N = _env_int("T5DS_ATTN_DBIAS_BN", 64)
DBIAS_WARPS = _env_int("T5DS_ATTN_DBIAS_WARPS", 4)
DBIAS_STAGES = _env_int("T5DS_ATTN_DBIAS_STAGES", 2)

if _HAS_TRITON:
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:  # fp32 inputs (tests): exact fp32 products instead of TF32
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _bias_tile(BIAS, h, m0, n0, offs_m, offs_n, SQ, SK, FAR, HAS_BIAS: tl.constexpr,
                   FAR_TILES: tl.constexpr):
        """(BM, BN) fp32 tile of the (H, SQ, SK) bias, already in base-2 units (the host multiplies it
        by log2(e)), for queries m0.. and keys n0... The bias is shared by the batch: the tile comes
        from L2. (A relative bias, one (H, SQ + SK - 1) row per head gathered in the kernel, measured
        slower: see docs/model.md.) FAR_TILES: the caller promises that the bias is one value per head
        wherever key - query >= FAR, and one wherever query - key >= FAR (T5's last buckets); a tile
        wholly inside either region reads one element and loads nothing else."""
        if HAS_BIAS:
            inside = (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)
            ptrs = BIAS + h * SQ * SK + offs_m[:, None] * SK + offs_n[None, :]
            if FAR_TILES:  # a branch, not a masked load; the corner read outside it (docs/model.md)
                near = (n0 - m0 < FAR + offs_m.shape[0] - 1) & (m0 - n0 < FAR + offs_n.shape[0] - 1)
                corner = tl.load(BIAS + h * SQ * SK + m0 * SK + n0)  # (m0, n0) is inside every tile
                if near:
                    tile = tl.load(ptrs, mask=inside, other=0.0)
                else:  # every element of a far tile has the corner's value
                    tile = tl.zeros([offs_m.shape[0], offs_n.shape[0]], dtype=tl.float32) + corner
                return tile
            else:
                return tl.load(ptrs, mask=inside, other=0.0)
        else:
            return tl.zeros([offs_m.shape[0], offs_n.shape[0]], dtype=tl.float32)

    @triton.jit
    def _scores(q, kt, bias, KMASK, b, offs_m, offs_n, SK, CAUSAL_OFFSET, HAS_BIAS: tl.constexpr,
                HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
        """(BM, BN) fp32 scores in base-2 units, (q k^T + bias) * log2(e), masked. Every element-wise
        op here runs per score: the scale and the bias are one FMA, the masks only when needed."""
        if HAS_BIAS:
            s = _dot(q, kt, IEEE) * 1.4426950408889634 + bias
        else:
            s = _dot(q, kt, IEEE) * 1.4426950408889634
        if HAS_MASK:
            km = tl.load(KMASK + b * SK + offs_n, mask=offs_n < SK, other=0)
            s = tl.where(km[None, :] != 0, s, -1.0e30)
        if CAUSAL:
            s = tl.where(offs_n[None, :] <= offs_m[:, None] + CAUSAL_OFFSET, s, -1.0e30)
        if not EVEN_N:  # keys past SK (the last, partial key block)
            s = tl.where(offs_n[None, :] < SK, s, float("-inf"))
        return s

    @triton.jit
    def _load_rows(PTR, b, h, offs_m, sb, ss, SQ, D: tl.constexpr, EVEN: tl.constexpr):
        """(BM, D) tile of head h of a (B, S, ..., H * D ...) row-major source; zeros past SQ."""
        offs_d = tl.arange(0, D)
        ptrs = PTR + b * sb + h * D + offs_m[:, None] * ss + offs_d[None, :]
        if EVEN:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=offs_m[:, None] < SQ, other=0.0)

    @triton.jit
    def _load_cols(PTR, b, h, offs_n, sb, ss, SK, D: tl.constexpr, EVEN: tl.constexpr):
        """(D, BN) transposed tile of head h of a row-major source; zeros past SK."""
        offs_d = tl.arange(0, D)
        ptrs = PTR + b * sb + h * D + offs_n[None, :] * ss + offs_d[:, None]
        if EVEN:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=offs_n[None, :] < SK, other=0.0)

    @triton.jit
    def _fwd_kernel(Q, KV, BIAS, KMASK, OUT, LSE, sqb, sqs, skb, sks, sob, sos, K_OFF, V_OFF,
                    H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE, FAR,
                    HAS_BIAS: tl.constexpr, FAR_TILES: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                    IEEE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        end_n = SK
        if CAUSAL:
            end_n = tl.minimum(SK, (pid_m + 1) * BLOCK_M + CAUSAL_OFFSET)
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
            bias = _bias_tile(BIAS, h, pid_m * BLOCK_M, start_n, offs_m, offs_n, SQ, SK, FAR, HAS_BIAS, FAR_TILES)
            s = _scores(q, kt, bias, KMASK, b, offs_m, offs_n, SK, CAUSAL_OFFSET, HAS_BIAS, HAS_MASK, CAUSAL,
                        EVEN_N, IEEE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_rows(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(OUT + b * sob + h * D + offs_m[:, None] * sos + offs_d[None, :], acc.to(OUT.dtype.element_ty),
                 mask=offs_m[:, None] < SQ)
        # Row max (base 2) and 1/sum kept apart: m + log2(l) would lose log2(l) on rows with no visible key.
        tl.store(LSE + bh * SQ + offs_m, m_i, mask=offs_m < SQ)
        tl.store(LSE + LSE_STRIDE + bh * SQ + offs_m, 1.0 / l_i, mask=offs_m < SQ)

    @triton.jit
    def _probs_and_dscores(q, kt, vt, do, bias, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                           CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                           CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
        """P and dS = P * (dO V^T - delta) of one (BM, BN) tile; both 0 on masked entries and rows past SQ."""
        in_m = offs_m < SQ
        row_max = tl.load(LSE + (b * H + h) * SQ + offs_m, mask=in_m, other=0.0)
        inv_sum = tl.load(LSE + LSE_STRIDE + (b * H + h) * SQ + offs_m, mask=in_m, other=0.0)
        delta = tl.load(DELTA + (b * H + h) * SQ + offs_m, mask=in_m, other=0.0)
        s = _scores(q, kt, bias, KMASK, b, offs_m, offs_n, SK, CAUSAL_OFFSET, HAS_BIAS, HAS_MASK, CAUSAL,
                    EVEN_N, IEEE)
        p = tl.exp2(s - row_max[:, None]) * inv_sum[:, None]
        dp = _dot(do, vt, IEEE)
        ds = p * (dp - delta[:, None])
        if HAS_MASK or CAUSAL:
            # Masked scores are constants: no gradient. Only a row with no visible key has P > 0 there.
            ds = tl.where(s > -1.0e29, ds, 0.0)
        return p, ds

    @triton.jit
    def _bwd_dkdv_kernel(Q, KV, BIAS, KMASK, DO, LSE, DELTA, DKV,
                         sqb, sqs, skb, sks, sdob, sdos, sdkb, sdks, K_OFF, V_OFF,
                         H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE, FAR,
                         HAS_BIAS: tl.constexpr, FAR_TILES: tl.constexpr, HAS_MASK: tl.constexpr,
                         CAUSAL: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
        """dK, dV of one key block of one (batch, head): walks all query blocks. Both land in DKV, laid
        out like KV (k at K_OFF, v at V_OFF): a packed source gets its gradient as one buffer."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        vt = _load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        start_m = 0
        if CAUSAL:  # query rows before (key - offset) cannot see this key block
            start_m = tl.maximum(pid_n * BLOCK_N - CAUSAL_OFFSET, 0) // BLOCK_M * BLOCK_M
        for sm in range(start_m, SQ, BLOCK_M):
            offs_m = sm + tl.arange(0, BLOCK_M)
            q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
            do = _load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, EVEN_M)
            bias = _bias_tile(BIAS, h, sm, pid_n * BLOCK_N, offs_m, offs_n, SQ, SK, FAR, HAS_BIAS, FAR_TILES)
            p, ds = _probs_and_dscores(q, kt, vt, do, bias, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                       CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS, HAS_MASK, CAUSAL, EVEN_N, IEEE)
            dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
        mask = offs_n[:, None] < SK
        ptrs = b * sdkb + h * D + offs_n[:, None] * sdks + offs_d[None, :]
        tl.store(DKV + K_OFF + ptrs, dk.to(DKV.dtype.element_ty), mask=mask)
        tl.store(DKV + V_OFF + ptrs, dv.to(DKV.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_dq_kernel(Q, KV, BIAS, KMASK, DO, LSE, DELTA, DQ, DS,
                       sqb, sqs, skb, sks, sdob, sdos, sdqb, sdqs, K_OFF, V_OFF,
                       H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE, FAR,
                       HAS_BIAS: tl.constexpr, FAR_TILES: tl.constexpr, HAS_MASK: tl.constexpr,
                       CAUSAL: tl.constexpr, IEEE: tl.constexpr, DS_MODE: tl.constexpr, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
        """dQ of one query block of one (batch, head): walks all key blocks. DS_MODE 1: also stores
        dS (B, H, SQ, SK) in the input dtype, which the bias gradient then sums over the batch; 2: adds
        dS into DS, one fp32 (H, SQ, SK) buffer, with atomic adds (the bias gradient itself)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
        do = _load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, EVEN_M)
        dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        end_n = SK
        if CAUSAL:
            end_n = tl.minimum(SK, (pid_m + 1) * BLOCK_M + CAUSAL_OFFSET)
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
            vt = _load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
            bias = _bias_tile(BIAS, h, pid_m * BLOCK_M, start_n, offs_m, offs_n, SQ, SK, FAR, HAS_BIAS, FAR_TILES)
            p, ds = _probs_and_dscores(q, kt, vt, do, bias, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                       CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS, HAS_MASK, CAUSAL, EVEN_N, IEEE)
            if DS_MODE == 1:
                tl.store(DS + bh * SQ * SK + offs_m[:, None] * SK + offs_n[None, :], ds.to(DS.dtype.element_ty),
                         mask=(offs_m[:, None] < SQ) & (offs_n[None, :] < SK))
            elif DS_MODE == 2:
                tl.atomic_add(DS + h * SQ * SK + offs_m[:, None] * SK + offs_n[None, :], ds,
                              mask=(offs_m[:, None] < SQ) & (offs_n[None, :] < SK), sem="relaxed")
            dq += _dot(ds.to(q.dtype), tl.trans(kt), IEEE)
        tl.store(DQ + b * sdqb + h * D + offs_m[:, None] * sdqs + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=offs_m[:, None] < SQ)

    @triton.jit
    def _bwd_dbias_kernel(Q, KV, BIAS, KMASK, DO, LSE, DELTA, DBIAS,
                          sqb, sqs, skb, sks, sdob, sdos, K_OFF, V_OFF,
                          B, H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE,
                          HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                          EVEN_N: tl.constexpr):
        """dbias[h, tile] = sum over the batch of dS, reduced in registers (recomputes P and dO V^T).
        """
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        h = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        visible = True
        if CAUSAL:  # tiles wholly above the diagonal have no gradient
            visible = pid_n * BLOCK_N <= pid_m * BLOCK_M + BLOCK_M - 1 + CAUSAL_OFFSET
        if visible:
            bias = _bias_tile(BIAS, h, 0, 0, offs_m, offs_n, SQ, SK, 0, True, False)  # the same for every b
            for b in range(0, B):
                q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
                do = _load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, EVEN_M)
                kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
                vt = _load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
                p, ds = _probs_and_dscores(q, kt, vt, do, bias, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ,
                                           SK, CAUSAL_OFFSET, LSE_STRIDE, True, HAS_MASK, CAUSAL, EVEN_N, IEEE)
                acc += ds
        tl.store(DBIAS + h * SQ * SK + offs_m[:, None] * SK + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < SQ) & (offs_n[None, :] < SK))
    # fmt: on


# Far tiles (benchmark variants `fartiles`, `fartiles=fwd+dq`, `nofartiles`): with a bias that says
# from which distance it is constant (T5's, through `far`), the kernels named in FAR_TILES skip the
# bias loads of tiles wholly beyond that distance. The forward only by default: measured there
# 0.65 -> 0.47 ms per encoder layer, and no faster in the dQ or dK/dV kernel (docs/model.md).
FAR_TILE_KERNELS = ("fwd", "dq", "dkdv")
FAR_TILES: tuple[str, ...] = ("fwd",)


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


def _kernel_bias(bias: torch.Tensor) -> torch.Tensor:
    """The bias as the kernels read it: in base-2 units, so that scale and bias are one FMA per score."""
    return bias if bias.numel() == 0 else (bias * _LOG2E).contiguous()


def _even(SQ: int, SK: int, block_m: int, block_n: int) -> dict:
    """Whether the query / key lengths are whole tiles: the kernels then skip their bounds masks."""
    return dict(EVEN_M=SQ % block_m == 0, EVEN_N=SK % block_n == 0)


def _layout(q_src: torch.Tensor, kv_src: torch.Tensor, heads: int) -> tuple[torch.Tensor, int, int, int]:
    """(the tensor holding k and v, d_kv, k column offset, v column offset) of packed sources:
    self-attention q_src = [q | k | v] with kv_src empty, cross-attention kv_src = [k | v]."""
    if kv_src.numel() == 0:
        hd = q_src.shape[-1] // 3
        return q_src, hd // heads, hd, 2 * hd
    hd = q_src.shape[-1]
    return kv_src, hd // heads, 0, hd


def _launch_fwd(q_src, kv_src, bias, key_mask, causal: bool, heads: int, far: int = 0, wrap=lambda kernel: kernel):
    """out (B, SQ, H * D) and the row statistics (2, B, H, SQ) for the backward. far > 0: the bias is
    constant per head and direction wherever |key - query| >= far (see _bias_tile)."""
    kv, D, k_off, v_off = _layout(q_src, kv_src, heads)
    B, SQ, SK, H = q_src.shape[0], q_src.shape[1], kv.shape[1], heads
    out = torch.empty((B, SQ, H * D), dtype=q_src.dtype, device=q_src.device)
    lse = torch.empty((2, B, H, SQ), dtype=torch.float32, device=q_src.device)  # row max (base 2), 1/row sum
    flags = _flags(q_src, bias, key_mask, far, "fwd")
    kbias = _kernel_bias(bias)
    grid = (triton.cdiv(SQ, FWD_BLOCK_M), B * H)
    wrap(_fwd_kernel)[grid](
        q_src, kv, kbias, key_mask, out, lse, *q_src.stride()[:2], *kv.stride()[:2], *out.stride()[:2], k_off, v_off,
        H, SQ, SK, SK - SQ, B * H * SQ, **flags, CAUSAL=causal, D=D,
        BLOCK_M=FWD_BLOCK_M, BLOCK_N=FWD_BLOCK_N, num_warps=FWD_WARPS, num_stages=FWD_STAGES,
        **_even(SQ, SK, FWD_BLOCK_M, FWD_BLOCK_N),
    )  # fmt: skip
    return out, lse


# The bias gradient: "ds" = the dQ kernel writes dS and torch sums it over the batch (one extra
# (B, H, SQ, SK) buffer in the input dtype for the length of the backward); "atomic" = the dQ kernel
# adds dS into one fp32 (H, SQ, SK) buffer with atomic adds (no batch-sized buffer; the summation
# order, so the last bits, vary from run to run); "kernel" = the separate dbias kernel that
# recomputes P and dO V^T per batch element (no buffer). Benchmark variants `dbiasatomic`, `dbiaskernel`.
DBIAS_PATHS = ("ds", "atomic", "kernel")
DBIAS_PATH = "ds"


def _launch_bwd(
    q_src, kv_src, bias, key_mask, out, lse, dout, causal: bool, heads: int, far: int = 0, wrap=lambda kernel: kernel
):
    """Gradients of the sources (each one buffer, laid out like its source; an empty kv_src gets an
    empty gradient) and of the (H, SQ, SK) bias."""
    kv, D, k_off, v_off = _layout(q_src, kv_src, heads)
    B, SQ, SK, H = q_src.shape[0], q_src.shape[1], kv.shape[1], heads
    flags = _flags(q_src, bias, key_mask, far, "dq")
    kbias = _kernel_bias(bias)
    dout = dout.contiguous()
    # rowsum(dO * O) per query row, (B, H, SQ)
    delta = (dout.float() * out.float()).view(B, SQ, H, D).sum(-1).transpose(1, 2).contiguous()
    dq_src = torch.empty(q_src.shape, dtype=q_src.dtype, device=q_src.device)
    dkv_src = torch.empty(kv_src.shape, dtype=kv_src.dtype, device=kv_src.device)
    dkv = dq_src if kv_src.numel() == 0 else dkv_src  # self-attention: dq, dk, dv all in dq_src
    if DBIAS_PATH not in DBIAS_PATHS:
        raise ValueError(f"triton_attention.DBIAS_PATH must be one of {DBIAS_PATHS}, got {DBIAS_PATH!r}")
    ds_mode = 0 if not flags["HAS_BIAS"] else {"ds": 1, "atomic": 2, "kernel": 0}[DBIAS_PATH]
    ds = q_src.new_empty((0,))
    if ds_mode == 1:  # causal: tiles above the diagonal are never visited, so they must read as 0
        ds = (torch.zeros if causal else torch.empty)((B, H, SQ, SK), dtype=q_src.dtype, device=q_src.device)
    elif ds_mode == 2:
        ds = torch.zeros((H, SQ, SK), dtype=torch.float32, device=q_src.device)
    strides = (*q_src.stride()[:2], *kv.stride()[:2], *dout.stride()[:2])
    wrap(_bwd_dq_kernel)[(triton.cdiv(SQ, DQ_BLOCK_M), B * H)](
        q_src, kv, kbias, key_mask, dout, lse, delta, dq_src, ds, *strides, *dq_src.stride()[:2], k_off, v_off,
        H, SQ, SK, SK - SQ, B * H * SQ, **flags, CAUSAL=causal, DS_MODE=ds_mode, D=D,
        BLOCK_M=DQ_BLOCK_M, BLOCK_N=DQ_BLOCK_N, num_warps=DQ_WARPS, num_stages=DQ_STAGES,
        **_even(SQ, SK, DQ_BLOCK_M, DQ_BLOCK_N),
    )  # fmt: skip
    wrap(_bwd_dkdv_kernel)[(triton.cdiv(SK, DKDV_BLOCK_N), B * H)](
        q_src, kv, kbias, key_mask, dout, lse, delta, dkv, *strides, *dkv.stride()[:2], k_off, v_off,
        H, SQ, SK, SK - SQ, B * H * SQ, **_flags(q_src, bias, key_mask, far, "dkdv"), CAUSAL=causal, D=D,
        BLOCK_M=DKDV_BLOCK_M, BLOCK_N=DKDV_BLOCK_N, num_warps=DKDV_WARPS, num_stages=DKDV_STAGES,
        **_even(SQ, SK, DKDV_BLOCK_M, DKDV_BLOCK_N),
    )  # fmt: skip
    if not flags["HAS_BIAS"]:
        dbias = torch.zeros_like(bias)
    elif ds_mode == 1:
        dbias = ds.sum(0, dtype=torch.float32)
    elif ds_mode == 2:
        dbias = ds
    else:
        dbias = torch.empty((H, SQ, SK), dtype=torch.float32, device=q_src.device)
        grid = (triton.cdiv(SQ, DBIAS_BLOCK_M), triton.cdiv(SK, DBIAS_BLOCK_N), H)
        wrap(_bwd_dbias_kernel)[grid](
            q_src, kv, kbias, key_mask, dout, lse, delta, dbias, *strides, k_off, v_off,
            B, H, SQ, SK, SK - SQ, B * H * SQ, HAS_MASK=flags["HAS_MASK"], CAUSAL=causal, IEEE=flags["IEEE"], D=D,
            BLOCK_M=DBIAS_BLOCK_M, BLOCK_N=DBIAS_BLOCK_N, num_warps=DBIAS_WARPS, num_stages=DBIAS_STAGES,
            **_even(SQ, SK, DBIAS_BLOCK_M, DBIAS_BLOCK_N),
        )  # fmt: skip
    return dq_src, dkv_src, dbias


if _HAS_TRITON and hasattr(torch.library, "triton_op"):
    from torch.library import triton_op, wrap_triton

    # Every tensor a kernel writes is allocated here and passed whole (offsets are ints): the kernels
    # never write through a view, which inductor's functionalisation could hand over as a copy.
    @triton_op("t5ds::flash_attention_fwd", mutates_args={})
    def _flash_fwd_op(
        q_src: torch.Tensor,
        kv_src: torch.Tensor,
        bias: torch.Tensor,
        key_mask: torch.Tensor,
        causal: bool,
        heads: int,
        far: int,
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch_bwd(q_src, kv_src, bias, key_mask, out, lse, dout, causal, heads, far, wrap=wrap_triton)

    def _setup_context(ctx, inputs, output):
        q_src, kv_src, bias, key_mask, causal, heads, far = inputs
        ctx.save_for_backward(q_src, kv_src, bias, key_mask, *output)
        ctx.causal, ctx.heads, ctx.far = causal, heads, far

    def _backward(ctx, dout, dlse):
        q_src, kv_src, bias, key_mask, out, lse = ctx.saved_tensors
        dq_src, dkv_src, dbias = _flash_bwd_op(
            q_src, kv_src, bias, key_mask, out, lse, dout, ctx.causal, ctx.heads, ctx.far
        )
        return _grads_or_none(kv_src, bias, dq_src, dkv_src, dbias)

    _flash_fwd_op.register_autograd(_backward, setup_context=_setup_context)

    def _fwd(q_src, kv_src, bias, key_mask, causal, heads, far):
        return _flash_fwd_op(q_src, kv_src, bias, key_mask, causal, heads, far)

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
    (B, SQ, H D), kv_src (B, SK, 2 H D) = [k | v]. The bias is (H, SQ, SK) fp32 (a relative one
    is expanded by the caller, `attention.dense_bias`). The backward returns each source's gradient
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
