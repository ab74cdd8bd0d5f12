"""Fused T5 attention in Triton: flash attention with the shared relative bias and its gradient.

Computes out = softmax(q k^T + bias + key_mask [+ causal]) v without ever holding the
(batch, heads, q, k) scores, and in the backward pass the bias gradient
dbias[h, i, j] = sum_b dS[b, h, i, j] without materialising dS for the whole batch.

Layout: q (B, Sq, H, D), k/v (B, Sk, H, D) read through strides (views of the fused projection
output), bias (H, Sq, Sk) fp32, key_mask (B, Sk) bool. No 1/sqrt(D) scaling (T5). Masked scores
get -1e30 (like HF's dtype minimum: a fully masked row averages every key instead of giving NaN).

Kernels (FlashAttention-2 structure, exp2 online softmax, fp32 accumulation):
- `_fwd_kernel`: grid (q blocks, B*H); writes out and the row log-sum-exp (base 2).
- `_bwd_dkdv_kernel`: grid (k blocks, B*H); dK, dV of one key block, walking the query blocks.
- `_bwd_dq_kernel`: grid (q blocks, B*H); recomputes P and accumulates dQ.
- `_bwd_dbias_kernel`: grid (q blocks, k blocks, H); recomputes P and dO V^T for every batch element
  of its tile and sums dS over the batch in registers: the bias gradient costs one extra pass of two
  small GEMMs, no (B, H, Sq, Sk) buffer and no atomics. (An earlier version read-modified-wrote a
  per-group fp32 buffer from the dK/dV kernel: 2.5 ms of the 4.4 ms backward per layer on H100.)

Wrapped with `torch.library.triton_op` so torch.compile traces it without graph breaks.
"""

from __future__ import annotations

import importlib.util
import os

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None
_MASKED = -1.0e30


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
BWD_BLOCK_M = _env_int("T5DS_ATTN_BWD_BM", 64)
BWD_BLOCK_N = _env_int("T5DS_ATTN_BWD_BN", 64)
BWD_WARPS = _env_int("T5DS_ATTN_BWD_WARPS", 4)
BWD_STAGES = _env_int("T5DS_ATTN_BWD_STAGES", 3)
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
    def _scores(q, kt, BIAS, KMASK, b, h, offs_m, offs_n, SQ, SK, CAUSAL_OFFSET,
                HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
        """(BM, BN) fp32 scores in base-2 units: (q k^T + bias, masked) * log2(e)."""
        s = _dot(q, kt, IEEE)
        in_k = offs_n[None, :] < SK
        if HAS_BIAS:
            in_q = offs_m[:, None] < SQ
            s += tl.load(BIAS + h * SQ * SK + offs_m[:, None] * SK + offs_n[None, :], mask=in_q & in_k, other=0.0)
        if HAS_MASK:
            km = tl.load(KMASK + b * SK + offs_n, mask=offs_n < SK, other=0)
            s = tl.where(km[None, :] != 0, s, -1.0e30)
        if CAUSAL:
            s = tl.where(offs_n[None, :] <= offs_m[:, None] + CAUSAL_OFFSET, s, -1.0e30)
        s = tl.where(in_k, s, float("-inf"))
        return s * 1.4426950408889634

    @triton.jit
    def _load_rows(PTR, b, h, offs_m, sb, ss, sh, SQ, D: tl.constexpr):
        """(BM, D) tile of a (B, S, H, D) strided tensor; zeros past SQ."""
        offs_d = tl.arange(0, D)
        return tl.load(PTR + b * sb + h * sh + offs_m[:, None] * ss + offs_d[None, :], mask=offs_m[:, None] < SQ,
                       other=0.0)

    @triton.jit
    def _load_cols(PTR, b, h, offs_n, sb, ss, sh, SK, D: tl.constexpr):
        """(D, BN) transposed tile of a (B, S, H, D) strided tensor; zeros past SK."""
        offs_d = tl.arange(0, D)
        return tl.load(PTR + b * sb + h * sh + offs_n[None, :] * ss + offs_d[:, None], mask=offs_n[None, :] < SK,
                       other=0.0)

    @triton.jit
    def _fwd_kernel(Q, K, V, BIAS, KMASK, OUT, LSE,
                    sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
                    H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE,
                    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = _load_rows(Q, b, h, offs_m, sqb, sqs, sqh, SQ, D)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        end_n = SK
        if CAUSAL:
            end_n = tl.minimum(SK, (pid_m + 1) * BLOCK_M + CAUSAL_OFFSET)
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_cols(K, b, h, offs_n, skb, sks, skh, SK, D)
            s = _scores(q, kt, BIAS, KMASK, b, h, offs_m, offs_n, SQ, SK, CAUSAL_OFFSET,
                        HAS_BIAS, HAS_MASK, CAUSAL, IEEE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_rows(V, b, h, offs_n, svb, svs, svh, SK, D)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(OUT + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], acc.to(OUT.dtype.element_ty),
                 mask=offs_m[:, None] < SQ)
        # Row max (base 2) and 1/sum kept apart: m + log2(l) would lose log2(l) on rows with no visible key.
        tl.store(LSE + bh * SQ + offs_m, m_i, mask=offs_m < SQ)
        tl.store(LSE + LSE_STRIDE + bh * SQ + offs_m, 1.0 / l_i, mask=offs_m < SQ)

    @triton.jit
    def _probs_and_dscores(q, kt, vt, do, BIAS, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                           CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                           CAUSAL: tl.constexpr, IEEE: tl.constexpr):
        """P and dS = P * (dO V^T - delta) of one (BM, BN) tile; both 0 on masked entries and rows past SQ."""
        in_m = offs_m < SQ
        row_max = tl.load(LSE + (b * H + h) * SQ + offs_m, mask=in_m, other=0.0)
        inv_sum = tl.load(LSE + LSE_STRIDE + (b * H + h) * SQ + offs_m, mask=in_m, other=0.0)
        delta = tl.load(DELTA + (b * H + h) * SQ + offs_m, mask=in_m, other=0.0)
        s = _scores(q, kt, BIAS, KMASK, b, h, offs_m, offs_n, SQ, SK, CAUSAL_OFFSET, HAS_BIAS, HAS_MASK, CAUSAL, IEEE)
        p = tl.exp2(s - row_max[:, None]) * inv_sum[:, None]
        dp = _dot(do, vt, IEEE)
        # Masked scores are constants: no gradient (matters only for rows with no visible key).
        ds = tl.where(s > -1.0e29, p * (dp - delta[:, None]), 0.0)
        return p, ds

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, BIAS, KMASK, DO, LSE, DELTA, DK, DV,
                         sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdkb, sdks, sdkh,
                         H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE,
                         HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                         IEEE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """dK, dV of one key block of one (batch, head): walks all query blocks."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        kt = _load_cols(K, b, h, offs_n, skb, sks, skh, SK, D)
        vt = _load_cols(V, b, h, offs_n, svb, svs, svh, SK, D)
        dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        start_m = 0
        if CAUSAL:  # query rows before (key - offset) cannot see this key block
            start_m = tl.maximum(pid_n * BLOCK_N - CAUSAL_OFFSET, 0) // BLOCK_M * BLOCK_M
        for sm in range(start_m, SQ, BLOCK_M):
            offs_m = sm + tl.arange(0, BLOCK_M)
            q = _load_rows(Q, b, h, offs_m, sqb, sqs, sqh, SQ, D)
            do = _load_rows(DO, b, h, offs_m, sdob, sdos, sdoh, SQ, D)
            p, ds = _probs_and_dscores(q, kt, vt, do, BIAS, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                       CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS, HAS_MASK, CAUSAL, IEEE)
            dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
        mask = offs_n[:, None] < SK
        ptrs = b * sdkb + h * sdkh + offs_n[:, None] * sdks + offs_d[None, :]
        tl.store(DK + ptrs, dk.to(DK.dtype.element_ty), mask=mask)
        tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=mask)

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, BIAS, KMASK, DO, LSE, DELTA, DQ,
                       sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, sdqb, sdqs, sdqh,
                       H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE,
                       HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """dQ of one query block of one (batch, head): walks all key blocks."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = _load_rows(Q, b, h, offs_m, sqb, sqs, sqh, SQ, D)
        do = _load_rows(DO, b, h, offs_m, sdob, sdos, sdoh, SQ, D)
        dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        end_n = SK
        if CAUSAL:
            end_n = tl.minimum(SK, (pid_m + 1) * BLOCK_M + CAUSAL_OFFSET)
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kt = _load_cols(K, b, h, offs_n, skb, sks, skh, SK, D)
            vt = _load_cols(V, b, h, offs_n, svb, svs, svh, SK, D)
            p, ds = _probs_and_dscores(q, kt, vt, do, BIAS, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                       CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS, HAS_MASK, CAUSAL, IEEE)
            dq += _dot(ds.to(q.dtype), tl.trans(kt), IEEE)
        tl.store(DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqs + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=offs_m[:, None] < SQ)

    @triton.jit
    def _bwd_dbias_kernel(Q, K, V, BIAS, KMASK, DO, LSE, DELTA, DBIAS,
                          sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh,
                          B, H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE,
                          HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """dbias[h, tile] = sum over the batch of dS, reduced in registers (recomputes P and dO V^T)."""
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
            for b in range(0, B):
                q = _load_rows(Q, b, h, offs_m, sqb, sqs, sqh, SQ, D)
                do = _load_rows(DO, b, h, offs_m, sdob, sdos, sdoh, SQ, D)
                kt = _load_cols(K, b, h, offs_n, skb, sks, skh, SK, D)
                vt = _load_cols(V, b, h, offs_n, svb, svs, svh, SK, D)
                p, ds = _probs_and_dscores(q, kt, vt, do, BIAS, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ,
                                           SK, CAUSAL_OFFSET, LSE_STRIDE, True, HAS_MASK, CAUSAL, IEEE)
                acc += ds
        tl.store(DBIAS + h * SQ * SK + offs_m[:, None] * SK + offs_n[None, :], acc,
                 mask=(offs_m[:, None] < SQ) & (offs_n[None, :] < SK))
    # fmt: on


def _flags(q: torch.Tensor, bias: torch.Tensor, key_mask: torch.Tensor) -> tuple[bool, bool, bool]:
    return bias.numel() > 0, key_mask.numel() > 0, q.dtype == torch.float32


def _launch_fwd(q, k, v, bias, key_mask, causal: bool, wrap=lambda kernel: kernel):
    B, SQ, H, D = q.shape
    SK = k.shape[1]
    has_bias, has_mask, ieee = _flags(q, bias, key_mask)
    out = torch.empty((B, SQ, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((2, B, H, SQ), dtype=torch.float32, device=q.device)  # row max (base 2), 1/row sum
    grid = (triton.cdiv(SQ, FWD_BLOCK_M), B * H)
    wrap(_fwd_kernel)[grid](
        q, k, v, bias, key_mask, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        H, SQ, SK, SK - SQ, B * H * SQ,
        HAS_BIAS=has_bias, HAS_MASK=has_mask, CAUSAL=causal, IEEE=ieee, D=D,
        BLOCK_M=FWD_BLOCK_M, BLOCK_N=FWD_BLOCK_N, num_warps=FWD_WARPS, num_stages=FWD_STAGES,
    )  # fmt: skip
    return out, lse


def _launch_bwd(q, k, v, bias, key_mask, out, lse, dout, causal: bool, wrap=lambda kernel: kernel):
    B, SQ, H, D = q.shape
    SK = k.shape[1]
    has_bias, has_mask, ieee = _flags(q, bias, key_mask)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2).contiguous()  # (B, H, SQ) rowsum(dO * O)
    dq = torch.empty((B, SQ, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, SK, H, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((B, SK, H, D), dtype=v.dtype, device=v.device)
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3])
    flags = dict(HAS_BIAS=has_bias, HAS_MASK=has_mask, CAUSAL=causal, IEEE=ieee, D=D)
    tiles = dict(BLOCK_M=BWD_BLOCK_M, BLOCK_N=BWD_BLOCK_N, num_warps=BWD_WARPS, num_stages=BWD_STAGES)
    wrap(_bwd_dkdv_kernel)[(triton.cdiv(SK, BWD_BLOCK_N), B * H)](
        q, k, v, bias, key_mask, dout, lse, delta, dk, dv, *common, *dk.stride()[:3],
        H, SQ, SK, SK - SQ, B * H * SQ, **flags, **tiles,
    )  # fmt: skip
    wrap(_bwd_dq_kernel)[(triton.cdiv(SQ, BWD_BLOCK_M), B * H)](
        q, k, v, bias, key_mask, dout, lse, delta, dq, *common, *dq.stride()[:3],
        H, SQ, SK, SK - SQ, B * H * SQ, **flags, **tiles,
    )  # fmt: skip
    if has_bias:
        dbias = torch.empty((H, SQ, SK), dtype=torch.float32, device=q.device)
        grid = (triton.cdiv(SQ, DBIAS_BLOCK_M), triton.cdiv(SK, DBIAS_BLOCK_N), H)
        wrap(_bwd_dbias_kernel)[grid](
            q, k, v, bias, key_mask, dout, lse, delta, dbias, *common,
            B, H, SQ, SK, SK - SQ, B * H * SQ, HAS_MASK=has_mask, CAUSAL=causal, IEEE=ieee, D=D,
            BLOCK_M=DBIAS_BLOCK_M, BLOCK_N=DBIAS_BLOCK_N, num_warps=DBIAS_WARPS, num_stages=DBIAS_STAGES,
        )  # fmt: skip
    else:
        dbias = torch.zeros_like(bias)
    return dq, dk, dv, dbias


def _prepare(q, k, v, bias, key_mask):
    """Kernel-ready tensors: a common dtype, unit last stride, fp32 contiguous bias, uint8 mask (empty = none)."""
    dtype = q.dtype
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bias = q.new_empty((0,), dtype=torch.float32) if bias is None else bias.float().contiguous()
    key_mask = (
        q.new_empty((0,), dtype=torch.uint8) if key_mask is None else key_mask.to(torch.uint8).contiguous()
    )
    return q, k, v, bias, key_mask


if _HAS_TRITON and hasattr(torch.library, "triton_op"):
    from torch.library import triton_op, wrap_triton

    @triton_op("t5ds::flash_attention_fwd", mutates_args={})
    def _flash_fwd_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        key_mask: torch.Tensor,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _launch_fwd(q, k, v, bias, key_mask, causal, wrap=wrap_triton)

    @triton_op("t5ds::flash_attention_bwd", mutates_args={})
    def _flash_bwd_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        key_mask: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch_bwd(q, k, v, bias, key_mask, out, lse, dout, causal, wrap=wrap_triton)

    def _setup_context(ctx, inputs, output):
        q, k, v, bias, key_mask, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, bias, key_mask, out, lse)
        ctx.causal = causal
        ctx.bias_dtype = bias.dtype

    def _backward(ctx, dout, dlse):
        q, k, v, bias, key_mask, out, lse = ctx.saved_tensors
        dq, dk, dv, dbias = _flash_bwd_op(q, k, v, bias, key_mask, out, lse, dout, ctx.causal)
        return dq, dk, dv, dbias if bias.numel() > 0 else None, None, None

    _flash_fwd_op.register_autograd(_backward, setup_context=_setup_context)

    def _fwd(q, k, v, bias, key_mask, causal):
        return _flash_fwd_op(q, k, v, bias, key_mask, causal)

elif _HAS_TRITON:  # older torch: a plain autograd.Function (graph break under torch.compile)

    class _FlashFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bias, key_mask, causal):
            out, lse = _launch_fwd(q, k, v, bias, key_mask, causal)
            ctx.save_for_backward(q, k, v, bias, key_mask, out, lse)
            ctx.causal = causal
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, bias, key_mask, out, lse = ctx.saved_tensors
            dq, dk, dv, dbias = _launch_bwd(q, k, v, bias, key_mask, out, lse, dout, ctx.causal)
            return dq, dk, dv, dbias if bias.numel() > 0 else None, None, None

    def _fwd(q, k, v, bias, key_mask, causal):
        return _FlashFunction.apply(q, k, v, bias, key_mask, causal)


def t5_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """Fused attention; shapes and semantics as `training.model.attention.attention`."""
    if not _HAS_TRITON:
        raise RuntimeError(
            "attention_backend='triton' needs the triton package (pip install triton) and CUDA"
        )
    d = q.shape[-1]
    if d not in (16, 32, 64, 128):
        raise ValueError(
            f"the triton attention kernel supports d_kv in (16, 32, 64, 128), got {d}; use 'sdpa'"
        )
    q, k, v, bias_t, mask_t = _prepare(q, k, v, bias, key_mask)
    with torch.autocast(device_type=q.device.type, enabled=False):
        out, _ = _fwd(q, k, v, bias_t, mask_t, causal)
    return out
