"""The Triton kernels run by Triton's CPU interpreter, against torch's math: the attention kernels
(with and without the bias, padding and causal masks, packed and separate sources, the one-block
backward of short queries and the two-kernel backward of longer ones, the bias read in fp16 or fp32,
the bias gradient's batch sums, the bias given as its relative row as at long inputs), the
gated-GELU kernels, the residual add + RMS norm kernels, the decoding kernel, and a tiny T5 whose
attention runs through the attention kernels (the model uses the GELU and the add + norm kernels on
CUDA tensors only).

Run by tests/test_kernels_interpreted.py in a subprocess, because TRITON_INTERPRET must be set
before triton is imported:

    TRITON_INTERPRET=1 python -m tests.interpreted_kernels

The tile tables are patched below to small tiles (16-32), so that several tiles, partial tiles and
the causal diagonal all occur at sequence lengths the interpreter runs in seconds. Exits non-zero
on the first mismatch.
"""

from __future__ import annotations

import os

import torch

from training.model import T5Config, T5ForConditionalGeneration
from training.model import triton_add_norm as tn
from training.model import triton_attention as ta
from training.model import triton_bias_grad as bg
from training.model import triton_gated_gelu as tg
from training.model.attention import (
    _math_attention,
    bias_saturation_distance,
    dense_bias,
    relative_position_bucket,
)
from training.optim import AdamWScale

# Small tiles, per class of attention where the GPU's differ per class (triton_attention.tile_class:
# the kind, and whether the queries are short), with "short" at most 24 query rows so that the cases
# below cover every class. Short queries run the one-block backward (its tiles: at most 24 rows,
# several key blocks, a partial last one); the others the dK/dV kernel and dQ, recomputed (no bias) or
# from the stored dS (a bias).
ta.SHORT_QUERIES = 24
ta.FWD_TILES.update(dict.fromkeys(ta.TILE_CLASSES, ta.Tiles(16, 16, 4, 1)))
ta.DKDV_TILES.update({
    "enc": ta.Tiles(16, 32, 4, 1), "dec": ta.Tiles(32, 16, 4, 1), "cross": ta.Tiles(16, 16, 4, 1),
    "enc-short": ta.Tiles(32, 32, 4, 1), "dec-short": ta.Tiles(16, 16, 4, 1), "cross-short": ta.Tiles(16, 32, 4, 1),
})  # fmt: skip
ta.DQ_TILES.update(dict.fromkeys(ta.TILE_CLASSES, ta.Tiles(32, 16, 4, 1)))
ta.DQDS_TILES.update({**dict.fromkeys(ta.TILE_CLASSES, ta.Tiles(16, 32, 4, 1)), "enc": ta.Tiles(16, 16, 4, 1)})
ta.ONE_BLOCK_TILES.update({
    "enc-short": ta.Tiles(24, 16, 4, 1), "dec-short": ta.Tiles(24, 16, 4, 1), "cross-short": ta.Tiles(24, 32, 4, 1),
})  # fmt: skip
ta.DKDV_ROW_TILES.update(dict.fromkeys(ta.TILE_CLASSES, ta.Tiles(16, 16, 4, 1)))
ta.DELTA_BLOCK_M = 16
bg.DS_SUM_BLOCK, bg.DS_SUM_BLOCK_B = 64, 2
bg.DS_FAR_ROWS, bg.DS_FAR_COLS, bg.DS_FAR_BLOCK_B = 4, 8, 2

# (batch, q length, k length, causal, padded keys, with a bias (H, SQ, SK) shared by the batch)
ATTENTION_CASES = [
    (2, 40, 40, False, True, True),
    (2, 37, 37, True, False, True),
    (2, 23, 50, False, True, False),
    (3, 40, 40, False, False, False),
    (2, 33, 33, True, True, True),
    (2, 48, 48, True, True, True),
    (2, 35, 35, True, True, False),
    (2, 16, 48, False, True, False),
    (2, 16, 48, False, False, True),
    (2, 21, 21, True, True, True),
]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().float(), expected.detach().float()
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def _check(name: str, got: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    err = _relative_error(got, expected)
    print(f"{name:<64} max error {err:.1e} (of the largest value)")
    if not err < tol:
        raise SystemExit(f"MISMATCH: {name}: {err:.2e} >= {tol:.0e}")


def far_regions(sq: int, sk: int, far: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (sq, sk) masks of the keys >= query + far and of the keys <= query - far: where T5's
    bias saturates, each a region of one bias value per head."""
    offset = torch.arange(sk)[None, :] - torch.arange(sq)[:, None]
    return offset >= far, offset <= -far


def _backward_kind(causal: bool, with_bias: bool, sq: int) -> str:
    key = ta.tile_class(causal, with_bias, sq)
    if ta.one_block_applies(key, sq):
        return "one-block backward"
    return "dK/dV + " + ("dQ from the stored dS" if with_bias else "dQ recomputed")


def check_attention() -> None:
    heads, d = 2, 16
    for b, sq, sk, causal, padded, with_bias in ATTENTION_CASES:
        q, k, v = (torch.randn(b, s, heads, d) for s in (sq, sk, sk))
        bias = torch.randn(heads, sq, sk) if with_bias else None
        key_mask = None
        if padded:
            key_mask = torch.ones(b, sk, dtype=torch.bool)
            key_mask[0, sk // 2 :] = False
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        br = None if bias is None else bias.clone().requires_grad_()
        ref = _math_attention(qr, kr, vr, br, key_mask, causal, 0.0)
        dout = torch.randn_like(ref)
        ref.backward(dout)
        bias_arg = q.new_empty((0,)) if bias is None else bias
        mask_arg = q.new_empty((0,), dtype=torch.uint8) if key_mask is None else key_mask.to(torch.uint8)
        how = _backward_kind(causal, with_bias, sq)
        for self_packed in [True, False] if sq == sk else [False]:
            tag = f"b{b} {sq}x{sk} causal={causal} padded={padded} bias={with_bias} packed={self_packed}"
            if self_packed:  # self-attention: one [q | k | v] source
                q_src, kv_src = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1), q.new_empty((0,))
            else:  # cross-attention layout: q, and one [k | v] source
                q_src, kv_src = q.flatten(2).contiguous(), torch.cat([k.flatten(2), v.flatten(2)], -1)
            out, lse = ta._launch_fwd(q_src, kv_src, bias_arg, mask_arg, causal, heads)
            _check(f"{tag} out", out, ref.detach().flatten(2), 3e-5)
            dq_src, dkv_src, dbias = ta._launch_bwd(
                q_src, kv_src, bias_arg, mask_arg, out, lse, dout.flatten(2), causal, heads
            )
            if self_packed:
                expected = torch.cat([qr.grad.flatten(2), kr.grad.flatten(2), vr.grad.flatten(2)], -1)
                _check(f"  dq|dk|dv ({how})", dq_src, expected, 3e-5)
                assert dkv_src.numel() == 0
            else:
                _check(f"  dq ({how})", dq_src, qr.grad.flatten(2), 3e-5)
                expected = torch.cat([kr.grad.flatten(2), vr.grad.flatten(2)], -1)
                _check(f"  dk|dv ({how})", dkv_src, expected, 3e-5)
            if bias is not None:
                _check(f"  dbias ({how})", dbias, br.grad, 3e-5)


def _self_attention_inputs(b: int, sq: int, heads: int, d: int, padded: bool):
    """q, k, v (b, sq, heads, d); the key mask (uint8, padding in the second row, or empty); the
    packed [q | k | v] source, an empty kv source; and an output gradient (b, sq, heads * d)."""
    q, k, v = (torch.randn(b, sq, heads, d) for _ in range(3))
    key_mask = q.new_empty((0,), dtype=torch.uint8)
    if padded:
        key_mask = torch.ones(b, sq, dtype=torch.uint8)
        key_mask[1, sq // 3 :] = 0
    qkv, none = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1), q.new_empty((0,))
    return q, k, v, key_mask, qkv, none, torch.randn(b, sq, heads * d)


def check_far_bias_gradient() -> None:
    """The backward given `far` with a T5 bias (8 buckets up to distance 16, so that it saturates within
    these lengths): the source gradients are the very same as without it; without a causal mask the
    bias gradient is summed from the rows' zero sums (`triton_bias_grad.batch_sum` with far), exact
    in the band and per far region, so the bucket table's gradient is math attention's; with a causal
    mask `far` is not used (the bias gradient the same as without it)."""
    heads, d, b = 2, 16, 2
    for sq, causal, padded in [(64, False, True), (48, False, False), (48, True, False)]:
        far = bias_saturation_distance(not causal, 8, 16)
        table = torch.randn(8, heads)
        buckets = relative_position_bucket(torch.arange(sq)[None, :] - torch.arange(sq)[:, None], not causal, 8, 16)
        bias = table[buckets].permute(2, 0, 1).contiguous()
        q, k, v, key_mask, qkv, none, dout = _self_attention_inputs(b, sq, heads, d, padded)
        out, lse = ta._launch_fwd(qkv, none, bias, key_mask, causal, heads)
        whole = ta._launch_bwd(qkv, none, bias, key_mask, out, lse, dout, causal, heads)
        given_far = ta._launch_bwd(qkv, none, bias, key_mask, out, lse, dout, causal, heads, far)
        tag = f"far {far}, {sq}x{sq} causal={causal} padded={padded}"
        same = torch.equal(given_far[0], whole[0])
        print(f"{tag}: dq|dk|dv with and without far: {'identical' if same else 'DIFFERENT'}")
        if not same:
            raise SystemExit(f"MISMATCH: {tag}: far changed the source gradients")
        dbias, expected = given_far[2], whole[2]
        if causal:
            if not torch.equal(dbias, expected):
                raise SystemExit(f"MISMATCH: {tag}: far changed a causal attention's bias gradient")
            print(f"{tag}: causal, bias gradient as without far")
            continue
        right, left = far_regions(sq, sq, far)
        if torch.equal(dbias, expected):
            raise SystemExit(f"MISMATCH: {tag}: the far batch sum read every block")
        _check(f"{tag}: band", dbias[:, ~(right | left)], expected[:, ~(right | left)], 1e-5)
        for name, region in (("right", right), ("left", left)):
            _check(f"{tag}: {name} far region per row", (dbias * region).sum(-1), (expected * region).sum(-1), 1e-5)
        table_r = table.clone().requires_grad_()
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = _math_attention(qr, kr, vr, table_r[buckets].permute(2, 0, 1), key_mask.bool() if padded else None,
                              causal, 0.0)  # fmt: skip
        ref.backward(dout.view_as(ref))
        got = torch.zeros_like(table).index_put_((buckets,), dbias.permute(1, 2, 0), accumulate=True)
        _check(f"{tag}: bucket table gradient against math", got, table_r.grad, 1e-5)


def check_row_bias() -> None:
    """The bias given as its (H, SQ + SK - 1) row (long inputs: `attention.row_bias_applies`): the
    kernels read it along the tiles' diagonals, the backward recomputes dQ and keeps dS only in the
    band of tiles within `far` of the diagonal (`triton_bias_grad.row_sum`). Against math attention
    on the expanded row: out and the source gradients; the row's gradient exact per offset in the
    band (everywhere when far is 0) and per far region, so the bucket table's gradient is exact.
    T5's bias with 8 buckets up to distance 16; lengths of several 16-row tiles and a partial one."""
    heads, d, b = 2, 16, 2
    cases = [(77, False, True, True), (72, True, True, True), (37, True, False, True), (33, False, False, False)]
    for sq, causal, padded, t5_bias in cases:
        far = bias_saturation_distance(not causal, 8, 16) if t5_bias else 0
        tile = ta.DKDV_ROW_TILES["enc"].block_m
        assert not t5_bias or bg.band_radius(far, tile, sq, sq) < -(-sq // tile) - 1, "no tile beyond the band"
        if sq > 64:  # the long cases: tiles beyond the forward's table of the row, which read its outermost tiles
            fwd = ta.FWD_TILES["enc"]
            fwd_width = ta._row_tiles(torch.zeros(1, 2 * sq - 1), sq, sq, fwd, far)[1]
            fwd_unit = min(fwd.block_m, fwd.block_n)  # the table's tile distances are whole units of it
            assert fwd_width < -(-sq // fwd_unit) - 1, "no tile reads the row's table clamped"
        offsets = torch.arange(-(sq - 1), sq)
        buckets = relative_position_bucket(offsets, not causal, 8, 16)
        table = torch.randn(8, heads)
        row = table[buckets].t().contiguous() if t5_bias else torch.randn(heads, 2 * sq - 1)
        q, k, v, key_mask, qkv, none, dout = _self_attention_inputs(b, sq, heads, d, padded)
        out, lse = ta._launch_fwd(qkv, none, row, key_mask, causal, heads, far)
        dqkv, _, drow = ta._launch_bwd(qkv, none, row, key_mask, out, lse, dout, causal, heads, far)
        if t5_bias:  # tiles beyond far read the table's outermost tiles: the same bias, so the same bits
            out_0, lse_0 = ta._launch_fwd(qkv, none, row, key_mask, causal, heads)
            dqkv_0 = ta._launch_bwd(qkv, none, row, key_mask, out_0, lse_0, dout, causal, heads)[0]
            same = torch.equal(out, out_0) and torch.equal(lse, lse_0) and torch.equal(dqkv, dqkv_0)
            print(f"row bias, far {far}, {sq}x{sq}: tiles beyond far as without far: {'identical' if same else 'DIFFERENT'}")
            if not same:
                raise SystemExit(f"MISMATCH: row bias {sq}x{sq} causal={causal}: far changed out or dq|dk|dv")
        table_r, row_r = table.clone().requires_grad_(), row.clone().requires_grad_()
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        rel = table_r[buckets].t() if t5_bias else row_r
        ref = _math_attention(qr, kr, vr, dense_bias(rel, sq, sq), key_mask.bool() if padded else None, causal, 0.0)
        ref.backward(dout.view_as(ref))
        tag = f"row bias, far {far}, {sq}x{sq} causal={causal} padded={padded}"
        _check(f"{tag} out", out, ref.detach().flatten(2), 3e-5)
        _check(f"{tag} dq|dk|dv", dqkv, torch.cat([t.grad.flatten(2) for t in (qr, kr, vr)], -1), 3e-5)
        assert drow.shape == row.shape and drow.dtype == torch.float32
        if not t5_bias:
            _check(f"{tag} row gradient per offset", drow, row_r.grad, 3e-5)
            continue
        in_band = offsets.abs() < far
        rows = torch.zeros_like(table).index_put_((buckets,), drow.t(), accumulate=True)
        rel_grad = torch.autograd.grad(  # math's gradient of the row itself
            _math_attention(q, k, v, dense_bias(row_r, sq, sq), key_mask.bool() if padded else None, causal, 0.0),
            row_r, dout.view_as(ref))[0]  # fmt: skip
        _check(f"{tag} row gradient in the band", drow[:, in_band], rel_grad[:, in_band], 3e-5)
        _check(f"{tag} bucket table gradient against math", rows, table_r.grad, 3e-5)


def check_half_bias() -> None:
    """The kernels read the bias in fp16 for bf16/fp16 inputs and in fp32 for fp32 inputs: either way
    they agree with the math attention given the bias they read (the fp16-rounded one for fp16),
    forward and backward: the encoder's, the decoder's, and short queries through the one-block
    kernel. The interpreter runs these kernels in fp32 only, so fp32 inputs are given the bias
    `_kernel_bias` makes for bf16 ones; the GPU tests run bf16 end to end."""
    heads, d = 2, 16
    kernel_bias = ta._kernel_bias
    for b, sq, sk, causal in [(2, 40, 40, False), (2, 37, 37, True), (2, 16, 48, False)]:
        q, k, v = (torch.randn(b, s, heads, d) for s in (sq, sk, sk))
        bias = 4 * torch.randn(heads, sq, sk)  # large enough to move the softmax
        q_src, kv_src = q.flatten(2).contiguous(), torch.cat([k.flatten(2), v.flatten(2)], -1)
        no_mask = q.new_empty((0,), dtype=torch.uint8)
        for inputs in (torch.bfloat16, torch.float32):
            as_read = kernel_bias(bias, inputs)
            assert as_read.dtype == (torch.float32 if inputs == torch.float32 else torch.float16)
            ta._kernel_bias = lambda bias, dtype, inputs=inputs: kernel_bias(bias, inputs)
            try:
                out, lse = ta._launch_fwd(q_src, kv_src, bias, no_mask, causal, heads)
                dout = torch.randn_like(out)
                dq, dkv, dbias = ta._launch_bwd(q_src, kv_src, bias, no_mask, out, lse, dout, causal, heads)
            finally:
                ta._kernel_bias = kernel_bias
            qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
            br = (as_read.float() / ta._LOG2E).requires_grad_()  # the bias the kernels read
            ref = _math_attention(qr, kr, vr, br, None, causal, 0.0)
            ref.backward(dout.view_as(ref))
            tag = f"{sq}x{sk} causal={causal}, bias read in {'fp32' if inputs == torch.float32 else 'fp16'}"
            _check(f"{tag} out", out, ref.detach().flatten(2), 3e-5)
            _check(f"{tag} dq", dq, qr.grad.flatten(2), 3e-5)
            _check(f"{tag} dk|dv", dkv, torch.cat([kr.grad.flatten(2), vr.grad.flatten(2)], -1), 3e-5)
            _check(f"{tag} dbias", dbias, br.grad, 3e-5)
        # fp16 rounds by at most 2^-11 of the value; the test can tell it happened
        error = (kernel_bias(bias, torch.bfloat16).float() / ta._LOG2E - bias).abs()
        assert error.max() > 1e-4 and (error <= 2**-11 * bias.abs() + 1e-6).all()  # (fp32: < 1e-6)
    huge = torch.full((heads, 4, 4), 1e6)  # past fp16's range: clamped to its largest value, not inf
    assert kernel_bias(huge, torch.bfloat16).float().max() == 65504
    assert kernel_bias(huge, torch.float32).dtype == torch.float32  # fp32 inputs: the fp32 bias


def check_ds_batch_sum() -> None:
    """The stored dS's sum over the batch: several batch steps, a partial last one, a partial last
    block of elements (the test's block sizes, set above)."""
    for shape in [(5, 2, 24, 40), (3, 1, 7, 9)]:
        for dtype in (torch.float32, torch.bfloat16):
            ds = torch.randn(shape).to(dtype)
            got = bg.batch_sum(ds, lambda kernel: kernel)
            assert got.dtype == torch.float32 and got.shape == shape[1:]
            _check(f"dS summed over the batch {shape} {dtype}", got, ds.float().sum(0), 1e-6)
    _check_ds_batch_sum_far()


def _check_ds_batch_sum_far() -> None:
    """The batch sum given `far` (`_ds_batch_sum_far_kernel`, the test's ROWS=4 and COLS=8): given dS whose rows sum
    to 0, as the backward's do, the sums over each far region and every element outside the blocks it
    skips equal the whole sum's; rows that straddle the middle, a partial last row block and key block.
    Given rows that do not sum to 0 the far regions' sums differ: the kernel did not read them all.
    Small integers: every sum is exact, in bf16 too."""
    for (b, h, sq, sk), far in [((5, 2, 40, 40), 6), ((3, 1, 37, 37), 5)]:
        ds = torch.randint(-3, 4, (b, h, sq, sk)).float()
        ds[..., 0] -= ds.sum(-1)  # each row sums to 0
        right, left = far_regions(sq, sk, far)
        band = ~(right | left)
        for dtype in (torch.float32, torch.bfloat16):
            full = ds.sum(0)
            got = bg.batch_sum(ds.to(dtype), lambda kernel: kernel, far)
            tag = f"dS batch sum over far regions {(b, h, sq, sk)} far {far} {str(dtype)[6:]}"
            if not ((got != full) & (right | left)).any():
                raise SystemExit(f"MISMATCH: {tag}: no block was skipped")
            _check(f"{tag}: band", got[:, band], full[:, band], 1e-6)
            for name, region in (("right", right), ("left", left)):
                _check(f"{tag}: {name} far region per row", (got * region).sum(-1), (full * region).sum(-1), 1e-6)
        ds[..., 1] += 1  # rows that do not sum to 0: the skipped keys show
        got = bg.batch_sum(ds, lambda kernel: kernel, far)
        if torch.equal((got * (right | left)).sum(-1), (ds.sum(0) * (right | left)).sum(-1)):
            raise SystemExit(f"MISMATCH: {tag}: rows that do not sum to 0 gave the right far sums")


def check_gated_gelu() -> None:
    for shape, f in [((5,), 64), ((2, 3), 1500), ((4,), 2048)]:  # 1500: a partial column block
        for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
            h = (3 * torch.randn(*shape, 2 * f)).to(dtype)
            hr = h.float().clone().requires_grad_()
            ref = tg.gated_gelu_reference(hr)
            dout = torch.randn_like(ref).to(dtype)
            ref.backward(dout.float())
            _check(f"gated GELU {tuple(shape)} F={f} {dtype} forward", tg._launch_fwd(h), ref, tol)
            _check(f"gated GELU {tuple(shape)} F={f} {dtype} backward", tg._launch_bwd(h, dout), hr.grad, tol)


def check_add_rms_norm() -> None:
    """The residual add + RMS norm kernels against torch's autograd of `h + out, rms_norm(h + out)`:
    the fp32 residual with a bf16 sublayer output (the model under autocast: y written in bf16, the
    output's gradient cast), all fp32, the bf16 residual, a bf16 weight (DeepSpeed's bf16 mode), and
    no gradient from a later add (the stack's final norm). 100 columns: a partial column block; 13
    rows: a partial row block and programs that walk several blocks."""
    cases = [  # h, out, weight, y dtypes; tolerance
        (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, 1e-2),
        (torch.float32, torch.float32, torch.float32, torch.float32, 1e-5),
        (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, 2e-2),
        (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16, 2e-2),
    ]
    for shape in [(13, 100), (2, 3, 48)]:
        for h_dtype, out_dtype, w_dtype, y_dtype, tol in cases:
            for with_dres in (True, False):
                h, out = (3 * torch.randn(shape)).to(h_dtype), torch.randn(shape).to(out_dtype)
                weight = (1 + 0.1 * torch.randn(shape[-1])).to(w_dtype)
                h_ref, out_ref, w_ref = (t.clone().requires_grad_() for t in (h, out, weight))
                h_new_ref, y_ref = tn.add_rms_norm_reference(h_ref, out_ref, w_ref, 1e-6, y_dtype)
                dy, dres = torch.randn(shape).to(y_dtype), torch.randn(shape).to(h_new_ref.dtype)
                loss = (y_ref.float() * dy.float()).sum()
                if with_dres:
                    loss = loss + (h_new_ref.float() * dres.float()).sum()
                loss.backward()
                h_new, y, rstd = tn._launch_fwd(h, out, weight, 1e-6, y_dtype)
                dh, dout, dw = tn._launch_bwd(dy, dres if with_dres else None, h_new, weight, rstd, out_dtype)
                dout = dout if dout.numel() else dh
                tag = f"add + RMS norm {shape} h {h_dtype}, out {out_dtype}, weight {w_dtype}" + (
                    "" if with_dres else ", no later add"
                )
                assert h_new.dtype == h_new_ref.dtype and y.dtype == y_dtype, tag
                assert dh.dtype == h_new.dtype and dout.dtype == out_dtype and dw.dtype == w_dtype, tag
                _check(f"{tag}: h + out", h_new, h_new_ref, tol)
                _check(f"{tag}: y", y, y_ref, tol)
                _check(f"{tag}: dh", dh, h_ref.grad, tol)
                _check(f"{tag}: dout", dout, out_ref.grad, tol)
                _check(f"{tag}: dweight", dw, w_ref.grad, tol)


def check_fused_adamw_scale() -> None:
    """AdamWScale's update as one Triton launch (`fused=True`, training/optim/triton_adamw_scale.py)
    against its foreach path, three steps: with and without the non-finite guard (a NaN in the second
    step's gradients: skipped, the moments kept), clipping in the step, weight decay, and bf16
    gradients beside fp32 ones (two launches). Tensors of one element, of a partial block and of
    several blocks; after the first step every gradient is a new tensor, so the address table is
    rebuilt."""
    shapes = [(1,), (37, 5), (3000,), (2, 2100), (12,)]
    for guard, clip, decay, bf16 in [(False, 0.0, 0.0, False), (True, 0.0, 0.1, False), (True, 0.5, 0.0, True),
                                     (True, 0.5, 0.1, False)]:  # fmt: skip
        results = []
        for fused in (False, True):
            torch.manual_seed(3)
            params = [torch.nn.Parameter((0.1 * torch.randn(s)).to(torch.bfloat16 if bf16 and i % 2 else torch.float32))
                      for i, s in enumerate(shapes)]  # fmt: skip
            opt = AdamWScale(
                params, lr=1e-2, weight_decay=decay, skip_nonfinite=guard, max_grad_norm=clip, fused=fused
            )
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = torch.randn(p.shape, dtype=p.dtype)
                    if guard and step == 1 and i == 2:
                        p.grad[7] = float("nan")
                opt.step()
            grads = [p.grad.float() for p in params]  # clipped in place (zero after a skipped step)
            results.append(
                [p.detach() for p in params] + [opt.state[p]["exp_avg_sq"] for p in params] + grads
            )
        tag = f"fused AdamWScale, guard {guard}, clip {clip}, decay {decay}" + (
            ", bf16 tensors" if bf16 else ""
        )
        _check(f"{tag}: weights, moments, grads", torch.cat([t.float().reshape(-1) for t in results[1]]),
               torch.cat([t.float().reshape(-1) for t in results[0]]), 2e-2 if bf16 else 1e-6)  # fmt: skip


def check_decode_attention() -> None:
    """`triton_decode_attention` against the gather + math attention it replaces: one query per row
    over fixed-size caches, with and without beam search's history table, at the first, a middle
    and the last slot, fp32 and bf16 (slots past the position hold garbage the kernel must skip)."""
    from training.model.triton_decode_attention import decode_attention

    rows, length, heads, d = 6, 37, 2, 16  # 37 slots: partial blocks of the kernel's 32
    gen = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        for position in (0, 17, length - 1):
            q_src = torch.randn(rows, 1, 3 * heads * d, generator=gen).to(dtype)
            q = q_src[..., : heads * d].view(rows, 1, heads, d)  # strided, as the model's view
            k_buf = torch.randn(rows, length, heads, d, generator=gen).to(dtype)
            v_buf = torch.randn(rows, length, heads, d, generator=gen).to(dtype)
            bias = torch.randn(heads, 1, length, generator=gen)
            sources = torch.randint(0, rows, (rows, length), generator=gen)
            sources[:, position] = torch.arange(rows)  # the slot being written: the row's own
            history = sources * length + torch.arange(length)
            pos = torch.tensor(position)
            visible = (torch.arange(length) <= position).expand(rows, length)
            for table in (None, history):
                k_all, v_all = k_buf, v_buf
                if table is not None:
                    k_all, v_all = (t.flatten(0, 1)[table.view(-1)].view(t.shape) for t in (k_buf, v_buf))
                expected = _math_attention(q.float(), k_all.float(), v_all.float(), bias, visible, False, 0.0)
                got = decode_attention(q, k_buf, v_buf, table, bias, pos)
                tag = f"decode attention, {'history table' if table is not None else 'own slots'}"
                _check(f"{tag}, slot {position}, {str(dtype)[6:]}", got.view(rows, 1, heads, d), expected, tol)


def check_model() -> None:
    """A tiny T5 (padding in encoder and decoder) with attention_backend='triton' against 'math':
    the kernels as the model calls them (packed projections, the relative bias expanded per head,
    cross-attention, the encoder's bias gradient from the rows' zero sums), loss and every
    parameter's gradient. 8 buckets up to distance 16: the bias saturates within these lengths, so
    the far batch sum has blocks to skip. Targets of 17 (the one-block backward in the decoder and
    the cross-attention) and of 30 (the two-kernel backward); at 30 also with the bias handed over
    as its row (`T5Config.attention_bias_layout="row"`, the layout of long inputs), the bias
    tables' gradients included."""
    torch.manual_seed(0)  # the same model and batches in every run
    config = T5Config.from_preset(
        "tiny",
        attention_backend="math",
        num_layers=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    model = T5ForConditionalGeneration(config)

    def run(backend: str, ids, labels, attention_mask, decoder_mask, layout: str = "auto"):
        for m in model.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        model.config.attention_backend, model.config.attention_bias_layout = backend, layout
        model.zero_grad()
        loss = model(ids, labels=labels, attention_mask=attention_mask, decoder_attention_mask=decoder_mask).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    for target_length in (17, 30):
        ids, labels = torch.randint(2, 32128, (2, 40)), torch.randint(2, 32128, (2, target_length))
        attention_mask, decoder_mask = torch.ones_like(ids), torch.ones_like(labels)
        attention_mask[1, -9:] = 0
        decoder_mask[0, -5:] = 0
        batch = (ids, labels.masked_fill(decoder_mask == 0, -100), attention_mask, decoder_mask)
        ref_loss, ref_grads = run("math", *batch)
        loss, grads = run("triton", *batch)
        _check(f"tiny T5 loss, triton attention, {target_length} targets", loss, ref_loss, 1e-5)
        worst = max(grads, key=lambda n: _relative_error(grads[n], ref_grads[n]))
        _check(f"  worst parameter gradient: {worst}", grads[worst], ref_grads[worst], 1e-4)
    loss, grads = run("triton", *batch, layout="row")
    _check(f"tiny T5 loss, triton attention, bias as its row, {target_length} targets", loss, ref_loss, 1e-5)
    for stack in ("encoder", "decoder"):
        name = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        _check(f"  {name}", grads[name], ref_grads[name], 1e-4)
    worst = max(grads, key=lambda n: _relative_error(grads[n], ref_grads[n]))
    _check(f"  worst parameter gradient: {worst}", grads[worst], ref_grads[worst], 1e-4)


def check_generation() -> None:
    """Greedy decoding and 3-beam search of a tiny T5 with attention_backend='triton' (decoding's
    self-attention through `triton_decode_attention`, the beams' cross-attention as groups of query
    rows) give the tokens of attention_backend='math'."""
    torch.manual_seed(5)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math", num_layers=2)).eval()
    ids = torch.randint(2, 32128, (3, 11))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, -4:] = 0

    def tokens(backend: str, num_beams: int) -> torch.Tensor:
        for m in model.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=6, num_beams=num_beams)

    for num_beams in (1, 3):
        expected, got = tokens("math", num_beams), tokens("triton", num_beams)
        name = "greedy" if num_beams == 1 else f"{num_beams}-beam search"
        print(f"{'tiny T5 ' + name + ' tokens, triton against math':<64} {'equal' if torch.equal(got, expected) else 'DIFFER'}")
        if not torch.equal(got, expected):
            raise SystemExit(f"MISMATCH: {name} tokens\n{got}\n{expected}")


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(
            "set TRITON_INTERPRET=1 (this checks the kernels on the CPU, through Triton's interpreter)"
        )
    torch.manual_seed(0)
    check_attention()
    check_far_bias_gradient()
    check_row_bias()
    check_half_bias()
    check_ds_batch_sum()
    check_gated_gelu()
    check_add_rms_norm()
    check_model()
    check_decode_attention()
    check_generation()
    check_fused_adamw_scale()
    print("ALL KERNEL CHECKS PASSED")


if __name__ == "__main__":
    main()
