"""The Triton kernels of the fused T5 attention. `training/model/triton_attention.py` launches them
and holds their tile tables; its docstring says what each kernel computes and why the per-score
work is kept small. Imported only where the triton package is installed.

Each loop over key or query blocks follows a `tl.assume` that it runs at least once, which the
launchers' `_check_lengths` makes true. Where the loop might run zero times, ptxas serializes every
wgmma of the kernel (its warning C7515; tests/test_kernels_sm90.py), and the encoder layer's
attention runs 8% slower. The exception: the dK/dV kernel with query blocks thinner than 64 rows,
where the assumption makes Triton 3.6's code race (tests/test_model_gpu.py checks every assumption
against the kernels without them).
"""

from __future__ import annotations

import triton
import triton.language as tl


# fmt: off
@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 inputs (tests): exact fp32 products instead of TF32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _inside(offs_m, offs_n, SQ, SK):
    """(BM, BN) mask of the tile's entries that lie inside the (SQ, SK) scores: queries offs_m, keys offs_n."""
    return (offs_m[:, None] < SQ) & (offs_n[None, :] < SK)


@triton.jit
def _bias_tile(BIAS, h, offs_m, offs_n, m0, n0, SQ, SK, WIDTH, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
               BIAS_ROW: tl.constexpr):
    """(BM, BN) fp32 tile of the (H, SQ, SK) bias (fp32 or fp16 in memory), already in base-2 units
    (the host multiplies it by log2(e)), for queries offs_m and keys offs_n (first query m0, first
    key n0); zeros without a bias. The bias is shared by the batch: the tile comes from L2. EVEN:
    the tile lies wholly inside the bias (SQ and SK are whole tiles), so the load takes no bounds
    mask. BIAS_ROW: the bias is a relative one, the same in every tile whose first key and first
    query are the same distance apart, and BIAS holds those tiles (H, 2 * WIDTH + 1, BM, BN), tile w
    at n0 - m0 = (w - WIDTH) * min(BM, BN); a tile farther off reads the outermost one
    (`triton_attention._row_tiles`). A whole tile read, contiguous: no bounds mask, no per-score
    address."""
    if HAS_BIAS:
        if BIAS_ROW:
            BM: tl.constexpr = offs_m.shape[0]
            BN: tl.constexpr = offs_n.shape[0]
            # m0 and n0 are whole BM and BN (powers of two): their distance is whole units of the smaller
            off_diagonal = (n0 - m0) // min(BM, BN)
            slot = tl.minimum(tl.maximum(off_diagonal, -WIDTH), WIDTH) + WIDTH
            tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            return tl.load(BIAS + (h * (2 * WIDTH + 1) + slot).to(tl.int64) * (BM * BN) + tile).to(tl.float32)
        else:
            ptrs = BIAS + h * SQ * SK + offs_m[:, None] * SK + offs_n[None, :]
            return _load_tile(ptrs, _inside(offs_m, offs_n, SQ, SK), EVEN).to(tl.float32)
    else:
        return tl.zeros([offs_m.shape[0], offs_n.shape[0]], dtype=tl.float32)


@triton.jit
def _load_tile(ptrs, inside, EVEN: tl.constexpr):
    """A tile through per-element pointers: masked by `inside` (zeros outside) unless EVEN says every
    pointer is inside. The mask costs per element even where it is all true."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=inside, other=0.0)


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
def _store_rows(PTR, x, b, h, offs_m, sb, ss, SQ, D: tl.constexpr):
    """Stores the (BM, D) tile x, cast to PTR's dtype, as head h of a row-major source (the twin of
    `_load_rows`); rows past SQ are skipped."""
    offs_d = tl.arange(0, D)
    tl.store(PTR + b * sb + h * D + offs_m[:, None] * ss + offs_d[None, :], x.to(PTR.dtype.element_ty),
             mask=offs_m[:, None] < SQ)


@triton.jit
def _store_ds_tile(DS, ds, bh, offs_m, offs_n, SQ, SK, EVEN: tl.constexpr):
    """Stores the (BM, BN) dS tile, cast to DS's dtype, into the (B, H, SQ, SK) buffer at (batch,
    head) bh, queries offs_m and keys offs_n; entries past SQ or SK are skipped (EVEN: there are
    none, SQ and SK are whole tiles: no mask)."""
    ptrs = DS + bh.to(tl.int64) * SQ * SK + offs_m[:, None] * SK + offs_n[None, :]
    if EVEN:
        tl.store(ptrs, ds.to(DS.dtype.element_ty))
    else:
        tl.store(ptrs, ds.to(DS.dtype.element_ty), mask=_inside(offs_m, offs_n, SQ, SK))


@triton.jit
def _keys_end(pid_m, SK, CAUSAL_OFFSET, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key that query block pid_m sees: SK, or the end of the causal diagonal."""
    if CAUSAL:
        return tl.minimum(SK, (pid_m + 1) * BLOCK_M + CAUSAL_OFFSET)
    else:
        return SK


@triton.jit
def _fwd_kernel(Q, KV, BIAS, KMASK, OUT, LSE, sqb, sqs, skb, sks, sob, sos, K_OFF, V_OFF,
                H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE, WIDTH,
                HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                IEEE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BIAS_ROW: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    end_n = _keys_end(pid_m, SK, CAUSAL_OFFSET, BLOCK_M, CAUSAL)
    tl.assume(end_n > 0)  # a key block at least (`_check_lengths`); else ptxas serializes the wgmma
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        bias = _bias_tile(BIAS, h, offs_m, offs_n, pid_m * BLOCK_M, start_n, SQ, SK, WIDTH, HAS_BIAS,
                          EVEN_M and EVEN_N, BIAS_ROW)
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
    _store_rows(OUT, acc, b, h, offs_m, sob, sos, SQ, D)
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
    return _probs_and_dscores_of_rows(q, kt, vt, do, bias, KMASK, row_max, inv_sum, delta, b, offs_m, offs_n,
                                      SK, CAUSAL_OFFSET, HAS_BIAS, HAS_MASK, CAUSAL, EVEN_N, IEEE)


@triton.jit
def _probs_and_dscores_of_rows(q, kt, vt, do, bias, KMASK, row_max, inv_sum, delta, b, offs_m, offs_n, SK,
                               CAUSAL_OFFSET, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                               CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, IEEE: tl.constexpr):
    """`_probs_and_dscores` given its rows' max, inverse sum and rowsum(dO * O) (BM,) in registers."""
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
def _bwd_dkdv_kernel(Q, KV, BIAS, KMASK, DO, LSE, DELTA, DKV, DS, FAR_SUMS,
                     sqb, sqs, skb, sks, sdob, sdos, sdkb, sdks, K_OFF, V_OFF,
                     H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE, BAND_RADIUS, WIDTH,
                     HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                     IEEE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, BIAS_ROW: tl.constexpr):
    """dK, dV of one key block of one (batch, head): walks all query blocks. Both land in DKV, laid
    out like KV (k at K_OFF, v at V_OFF): a packed source gets its gradient as one buffer.
    HAS_BIAS: also stores dS (B, H, SQ, SK) in the input dtype, for dQ = dS K
    (`_bwd_dq_from_ds_kernel`) and the bias gradient. HAS_BIAS and BIAS_ROW (a relative bias held
    as its row, one value per head beyond the band; BLOCK_M == BLOCK_N): stores only the dS tiles
    of the band, those at most BAND_RADIUS blocks off the diagonal, into DS (B, H, key blocks,
    2 * BAND_RADIUS + 1, BLOCK_M, BLOCK_N), and sums the tiles left and right of the band into
    FAR_SUMS (B, H, key blocks, 2) fp32 (`triton_bias_grad.row_sum` takes it from there)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
    vt = _load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    start_m = 0
    if CAUSAL:  # query rows before (key - offset) cannot see this key block
        start_m = tl.maximum(pid_n * BLOCK_N - CAUSAL_OFFSET, 0) // BLOCK_M * BLOCK_M
    if BLOCK_M >= 64:  # a query block at least (`_check_lengths`); else ptxas serializes the wgmma.
        # Not for thinner query blocks: with it, Triton 3.6's code for them races on an H200 (dK
        # wrong and different from run to run without a bias); serialized, it is right.
        tl.assume(SQ > start_m)
    # Per query row of the tiles: a row sum per tile stays within a warp, the whole sum once at the end
    far_left = tl.zeros([BLOCK_M], dtype=tl.float32)
    far_right = tl.zeros([BLOCK_M], dtype=tl.float32)
    for sm in range(start_m, SQ, BLOCK_M):
        offs_m = sm + tl.arange(0, BLOCK_M)
        q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
        do = _load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, EVEN_M)
        bias = _bias_tile(BIAS, h, offs_m, offs_n, sm, pid_n * BLOCK_N, SQ, SK, WIDTH, HAS_BIAS,
                          EVEN_M and EVEN_N, BIAS_ROW)
        p, ds = _probs_and_dscores(q, kt, vt, do, bias, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                   CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS, HAS_MASK, CAUSAL, EVEN_N, IEEE)
        if HAS_BIAS:
            if BIAS_ROW:
                off_diagonal = pid_n - sm // BLOCK_M  # key block - query block
                if off_diagonal > BAND_RADIUS:
                    far_right += tl.sum(ds, axis=1)
                elif off_diagonal < -BAND_RADIUS:
                    far_left += tl.sum(ds, axis=1)
                else:
                    slot = (bh * tl.num_programs(0) + pid_n).to(tl.int64) * (2 * BAND_RADIUS + 1) + (
                        off_diagonal + BAND_RADIUS)
                    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                    tl.store(DS + slot * (BLOCK_M * BLOCK_N) + tile, ds.to(DS.dtype.element_ty))
            else:
                _store_ds_tile(DS, ds, bh, offs_m, offs_n, SQ, SK, EVEN_M and EVEN_N)
        dv += _dot(tl.trans(p.to(do.dtype)), do, IEEE)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, IEEE)
    _store_rows(DKV + K_OFF, dk, b, h, offs_n, sdkb, sdks, SK, D)
    _store_rows(DKV + V_OFF, dv, b, h, offs_n, sdkb, sdks, SK, D)
    if BIAS_ROW:
        far = FAR_SUMS + (bh * tl.num_programs(0) + pid_n).to(tl.int64) * 2
        tl.store(far, tl.sum(far_left, axis=0))
        tl.store(far + 1, tl.sum(far_right, axis=0))


@triton.jit
def _bwd_dq_kernel(Q, KV, BIAS, KMASK, DO, LSE, DELTA, DQ,
                   sqb, sqs, skb, sks, sdob, sdos, sdqb, sdqs, K_OFF, V_OFF,
                   H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE, WIDTH,
                   HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                   EVEN_N: tl.constexpr, BIAS_ROW: tl.constexpr):
    """dQ of one query block of one (batch, head): walks all key blocks, recomputing P and dP = dO
    V^T per tile. For an attention without a bias, or with one read from its row (BIAS_ROW), whose
    dS is not stored; with a dense bias dQ comes from the stored dS (`_bwd_dq_from_ds_kernel`)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
    do = _load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, EVEN_M)
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    end_n = _keys_end(pid_m, SK, CAUSAL_OFFSET, BLOCK_M, CAUSAL)
    tl.assume(end_n > 0)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        vt = _load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        bias = _bias_tile(BIAS, h, offs_m, offs_n, pid_m * BLOCK_M, start_n, SQ, SK, WIDTH, HAS_BIAS,
                          EVEN_M and EVEN_N, BIAS_ROW)
        p, ds = _probs_and_dscores(q, kt, vt, do, bias, KMASK, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                   CAUSAL_OFFSET, LSE_STRIDE, HAS_BIAS, HAS_MASK, CAUSAL, EVEN_N, IEEE)
        dq += _dot(ds.to(q.dtype), tl.trans(kt), IEEE)
    _store_rows(DQ, dq, b, h, offs_m, sdqb, sdqs, SQ, D)


@triton.jit
def _bwd_one_block_kernel(Q, KV, BIAS, KMASK, DO, OUT, LSE, DQ, DKV, DS,
                          sqb, sqs, skb, sks, sdob, sdos, sob, sos, sdqb, sdqs, sdkb, sdks, K_OFF, V_OFF,
                          H, SQ, SK, CAUSAL_OFFSET, LSE_STRIDE,
                          HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
                          IEEE: tl.constexpr, PACKED_GRAD: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """dQ, dK and dV of one (batch, head) whose SQ <= BLOCK_M queries are one block (T5's 114
    targets): walks the key blocks once. Each key block has this one query block to see, so its dK
    and dV are final after one tile and are stored at once, while dQ gathers in registers: one pass,
    5 GEMMs and one exp2 per score, where the two kernels of longer queries take 7 and two (or a
    round trip of dS through memory). It holds all the rows, so it computes their rowsum(dO * O)
    itself and loads their softmax statistics once. HAS_BIAS: also stores dS (B, H, SQ, SK) for the
    bias gradient. PACKED_GRAD (self-attention): dK and dV go into DQ, the [q | k | v] source's gradient,
    and DKV is not read (one buffer passed twice would be two written arguments to torch.compile,
    which copies one of them)."""
    if PACKED_GRAD:
        DKV = DQ
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    offs_m = tl.arange(0, BLOCK_M)
    q = _load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, EVEN_M)
    do = _load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, EVEN_M)
    delta = tl.sum(do.to(tl.float32) * _load_rows(OUT, b, h, offs_m, sob, sos, SQ, D, EVEN_M).to(tl.float32), 1)
    in_m = offs_m < SQ
    row_max = tl.load(LSE + bh * SQ + offs_m, mask=in_m, other=0.0)
    inv_sum = tl.load(LSE + LSE_STRIDE + bh * SQ + offs_m, mask=in_m, other=0.0)
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    tl.assume(SK > 0)
    for start_n in range(0, SK, BLOCK_N):  # every key: BLOCK_M >= SQ reaches the causal diagonal's end
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        vt = _load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        bias = _bias_tile(BIAS, h, offs_m, offs_n, 0, start_n, SQ, SK, 0, HAS_BIAS, EVEN_M and EVEN_N, False)
        p, ds = _probs_and_dscores_of_rows(q, kt, vt, do, bias, KMASK, row_max, inv_sum, delta, b, offs_m, offs_n,
                                           SK, CAUSAL_OFFSET, HAS_BIAS, HAS_MASK, CAUSAL, EVEN_N, IEEE)
        if HAS_BIAS:
            _store_ds_tile(DS, ds, bh, offs_m, offs_n, SQ, SK, EVEN_M and EVEN_N)
        ds = ds.to(q.dtype)
        _store_rows(DKV + V_OFF, _dot(tl.trans(p.to(do.dtype)), do, IEEE), b, h, offs_n, sdkb, sdks, SK, D)
        _store_rows(DKV + K_OFF, _dot(tl.trans(ds), q, IEEE), b, h, offs_n, sdkb, sdks, SK, D)
        dq += _dot(ds, tl.trans(kt), IEEE)
    _store_rows(DQ, dq, b, h, offs_m, sdqb, sdqs, SQ, D)


@triton.jit
def _bwd_dq_from_ds_kernel(DS, KV, DQ, skb, sks, sdqb, sdqs, K_OFF, H, SQ, SK, CAUSAL_OFFSET,
                           CAUSAL: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                           EVEN_N: tl.constexpr):
    """dQ = dS K of one query block of one (batch, head) from the dS the dK/dV kernel stored: the
    same products, in the same order, as `_bwd_dq_kernel` with its tiles, without recomputing P
    and dP. Reads dS once (a streaming GEMM)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ds_rows = DS + bh.to(tl.int64) * SQ * SK + offs_m[:, None] * SK
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    end_n = _keys_end(pid_m, SK, CAUSAL_OFFSET, BLOCK_M, CAUSAL)  # dS is 0 past the causal diagonal
    tl.assume(end_n > 0)
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, EVEN_N)
        if EVEN_M and EVEN_N:
            ds = tl.load(ds_rows + offs_n[None, :])
        else:
            ds = tl.load(ds_rows + offs_n[None, :], mask=_inside(offs_m, offs_n, SQ, SK), other=0.0)
        dq += _dot(ds, tl.trans(kt), IEEE)
    _store_rows(DQ, dq, b, h, offs_m, sdqb, sdqs, SQ, D)
# fmt: on


@triton.jit
def _ds_batch_sum_kernel(DS, DBIAS, B, N, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """DBIAS[i] = sum over b of DS[b, i], in fp32, for the N = H * SQ * SK elements of one batch
    element: BLOCK contiguous elements per program, BLOCK_B batch elements per step, always added in
    the same order (so the bias gradient is bit-identical from run to run, which an autotuned
    reduction is not)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    rows = tl.arange(0, BLOCK_B)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b0 in range(0, B, BLOCK_B):
        b = b0 + rows
        x = tl.load(DS + b.to(tl.int64)[:, None] * N + offs[None, :], mask=(b < B)[:, None] & inside[None, :],
                    other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    tl.store(DBIAS + offs, acc, mask=inside)


@triton.jit
def _far_read_range(rb, SQ, SK, FAR, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The keys [lo, hi) of row block rb that `_ds_batch_sum_far_kernel` reads (whole COLS blocks): the
    blocks before lo or from hi on lie wholly in each of the block's rows' larger far region (keys >=
    row + FAR in the first half of the rows, keys <= row - FAR in the second; none for a block that
    straddles the middle)."""
    r0 = rb * ROWS
    r_last = tl.minimum(r0 + ROWS, SQ) - 1
    mid = (SK - 1) // 2
    lo = tl.where(r0 > mid, tl.maximum(r0 - FAR + 1, 0) // COLS * COLS, 0)
    hi = tl.where(r_last <= mid, tl.minimum(tl.cdiv(r_last + FAR, COLS) * COLS, SK), SK)
    return lo, hi


@triton.jit
def _ds_batch_sum_far_kernel(DS, DBIAS, B, H, SQ, SK, FAR, COL_BLOCKS, BLOCK_B: tl.constexpr, ROWS: tl.constexpr,
                             COLS: tl.constexpr):
    """`_ds_batch_sum_kernel` for a bias that is one value per head wherever key - query >= FAR and
    wherever query - key >= FAR (T5's encoder, not causal), reading about half of dS.

    Each row of dS sums to 0 over its keys (sum_k P (dP - delta) = delta - delta; masked keys 0), so
    each row of its batch sum does too. A row's larger far region takes one bias value, whose gradient
    is that region's sum: minus the sum of the rest of the row. A program sums one (ROWS, COLS) block
    over the batch (BLOCK_B elements per step, always in the same order), or writes 0 for a block
    wholly inside its rows' larger far regions (`_far_read_range`) without reading it; then
    `_far_region_sums_kernel` writes each such region's sum at its outermost key. The result is exact
    per region of one bias value, not per element. Grid (row blocks * COL_BLOCKS, H)."""
    rb = tl.program_id(0) // COL_BLOCKS
    c0 = tl.program_id(0) % COL_BLOCKS * COLS
    h = tl.program_id(1)
    lo, hi = _far_read_range(rb, SQ, SK, FAR, ROWS, COLS)
    rows = rb * ROWS + tl.arange(0, ROWS)
    cols = c0 + tl.arange(0, COLS)
    inside = (rows < SQ)[:, None] & (cols < SK)[None, :]
    offs = (h * SQ + rows).to(tl.int64)[:, None] * SK + cols[None, :]
    acc = tl.zeros([ROWS, COLS], dtype=tl.float32)
    if (c0 >= lo) & (c0 < hi):
        batch = tl.arange(0, BLOCK_B)
        for b0 in range(0, B, BLOCK_B):
            b = b0 + batch
            x = tl.load(DS + (b.to(tl.int64) * H * SQ * SK)[:, None, None] + offs[None, :, :],
                        mask=(b < B)[:, None, None] & inside[None, :, :], other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=0)
    tl.store(DBIAS + offs, acc, mask=inside)


@triton.jit
def _far_region_sums_kernel(DBIAS, SQ, SK, FAR, ROWS: tl.constexpr, COLS: tl.constexpr):
    """After `_ds_batch_sum_far_kernel`: for each row of a block that skipped keys, the sum over its
    skipped keys, which is minus the sum over the keys it read, written at the skipped region's
    outermost key (key 0 for the left region, SK - 1 for the right one; written 0 before). Grid (row
    blocks, H)."""
    rb = tl.program_id(0)
    h = tl.program_id(1)
    lo, hi = _far_read_range(rb, SQ, SK, FAR, ROWS, COLS)
    rows = rb * ROWS + tl.arange(0, ROWS)
    row_offs = (h * SQ + rows).to(tl.int64) * SK
    if (lo > 0) | (hi < SK):
        total = tl.zeros([ROWS], dtype=tl.float32)
        for c0 in range(lo, hi, COLS):
            cols = c0 + tl.arange(0, COLS)
            x = tl.load(DBIAS + row_offs[:, None] + cols[None, :], mask=(rows < SQ)[:, None] & (cols < hi)[None, :],
                        other=0.0)
            total += tl.sum(x, axis=1)
        tl.store(DBIAS + row_offs + tl.where(lo > 0, 0, SK - 1), -total, mask=rows < SQ)


@triton.jit
def _delta_kernel(DO, OUT, DELTA, sdob, sdos, sob, sos, H, SQ, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  EVEN_M: tl.constexpr):
    """DELTA[b, h, m] = sum over d of dO * O (fp32) for one query block of one (batch, head): the
    backward's rowsum(dO * O), written (B, H, SQ) as the other kernels read it. One fixed order, and
    one read of dO and O at the copy bandwidth (inductor's reduction, which this replaces, got a slower
    fixed configuration under deterministic algorithms)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    do = _load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, EVEN_M).to(tl.float32)
    o = _load_rows(OUT, b, h, offs_m, sob, sos, SQ, D, EVEN_M).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * SQ + offs_m, tl.sum(do * o, axis=1), mask=offs_m < SQ)
