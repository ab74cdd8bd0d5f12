"""The Triton kernels run by Triton's CPU interpreter, against torch's math: the attention kernels
(with and without the bias, padding and causal masks, packed and separate sources, the three
bias-gradient paths, dQ recomputed or from the stored dS, far tiles), the gated-GELU kernels, the
residual add + RMS norm kernels, and a tiny T5 whose attention runs through the attention kernels
(the model uses the GELU and the add + norm kernels on CUDA tensors only).

Run by tests/test_kernels_interpreted.py in a subprocess, because TRITON_INTERPRET and the tile
sizes must be set before the kernel modules are imported:

    TRITON_INTERPRET=1 T5DS_ATTN_FWD_BM=16 ... python -m tests.interpreted_kernels

(the dK/dV kernel's tiles, which differ per class of attention, are set below instead).

Tiles are small (16-32) so that several tiles, partial tiles and the causal diagonal all occur at
sequence lengths the interpreter runs in seconds. Exits non-zero on the first mismatch.
"""

from __future__ import annotations

import os

import torch

from benchmarks.ds_batch_sum import far_regions
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

# The dK/dV kernel's tiles differ per class of attention on the GPU (triton_attention.tile_class: the
# kind, and whether the queries are short): here too, small, with "short" at most 24 query rows so
# that the cases below cover every class (the other kernels' tiles come from the T5DS_ATTN_*
# variables that tests/test_kernels_interpreted.py sets).
ta.SHORT_QUERIES = 24
ta.DKDV_TILES.update({
    "enc": ta.Tiles(16, 32, 4, 1), "dec": ta.Tiles(32, 16, 4, 1), "cross": ta.Tiles(16, 16, 4, 1),
    "enc-short": ta.Tiles(32, 32, 4, 1), "dec-short": ta.Tiles(16, 16, 4, 1), "cross-short": ta.Tiles(16, 32, 4, 1),
})  # fmt: skip
# dQ from the stored dS: square tiles sum a relative bias's gradient in the kernel, the others leave
# it to the dense gradient's diagonal sums (triton_attention.relative_grad_in_kernel); both occur.
ta.DQDS_TILES.update({
    "enc": ta.Tiles(16, 16, 4, 1), "dec": ta.Tiles(16, 16, 4, 1), "enc-short": ta.Tiles(32, 32, 4, 1),
    "dec-short": ta.Tiles(16, 32, 4, 1),
})  # fmt: skip
# The one-block backward of short queries (at most 24 rows here): several key blocks, a partial last one.
ta.ONE_BLOCK_TILES.update({
    "enc-short": ta.Tiles(24, 16, 4, 1), "dec-short": ta.Tiles(24, 16, 4, 1), "cross-short": ta.Tiles(24, 32, 4, 1),
})  # fmt: skip

# (batch, q length, k length, causal, padded keys, with a bias (H, SQ, SK) shared by the batch)
ATTENTION_CASES = [
    (2, 40, 40, False, True, True),
    (2, 37, 37, True, False, True),
    (2, 23, 50, False, True, False),
    (3, 40, 40, False, False, False),
    (2, 33, 33, True, True, True),
    (2, 48, 48, True, True, True),
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


# (bias-gradient path, dQ path, who sums the stored dS, one-block backward for short queries) the
# backward is checked with: the two kernels (dK/dV, dQ) with every bias-gradient path and dQ
# recomputed, the stored dS summed by torch, and dQ from the dS the dK/dV kernel stores (which sums
# dS for the bias gradient); and the one-block kernel where the queries are short.
BACKWARD_PATHS = [(path, "recompute", "kernel", False) for path in ta.DBIAS_PATHS] + [
    ("ds", "recompute", "torch", False),
    ("ds", "stored", "kernel", False),
    ("ds", "stored_bias", "kernel", True),
    ("ds", "recompute", "torch", True),
]


def _backward_tag(dbias_path: str, dq_path: str, ds_sum: str, one_block: bool) -> str:
    tag = f"bias gradient path {dbias_path}" + ("" if dq_path == "recompute" else f", dQ {dq_path}")
    tag += f", dS summed by {ds_sum}" if dbias_path == "ds" and ds_sum != "kernel" else ""
    return tag + (", one-block backward" if one_block else "")


DEFAULT_PATHS = (ta.DBIAS_PATH, ta.DQ_PATH, ta.DS_SUM, ta.ONE_BLOCK_BWD)


def _set_paths(*paths) -> None:
    ta.DBIAS_PATH, ta.DQ_PATH, ta.DS_SUM, ta.ONE_BLOCK_BWD = paths or DEFAULT_PATHS


def _repeats_the_two_kernels(tile_key: str, sq: int, has_bias: bool) -> bool:
    """After `_set_paths`: the one-block backward is on but does not apply to this attention, so the
    path would run what a path without it runs (skipped, not checked twice)."""
    return ta.ONE_BLOCK_BWD and not ta.one_block_applies(tile_key, sq, has_bias)


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
        for self_packed in [True, False] if sq == sk else [False]:
            tag = f"b{b} {sq}x{sk} causal={causal} padded={padded} bias={with_bias} packed={self_packed}"
            if self_packed:  # self-attention: one [q | k | v] source
                q_src, kv_src = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1), q.new_empty((0,))
            else:  # cross-attention layout: q, and one [k | v] source
                q_src, kv_src = q.flatten(2).contiguous(), torch.cat([k.flatten(2), v.flatten(2)], -1)
            out, lse = ta._launch_fwd(q_src, kv_src, bias_arg, mask_arg, causal, heads)
            _check(f"{tag} out", out, ref.detach().flatten(2), 3e-5)
            for paths in BACKWARD_PATHS:
                _set_paths(*paths)
                if _repeats_the_two_kernels(ta.tile_class(causal, with_bias, sq), sq, with_bias):
                    continue
                dq_src, dkv_src, dbias = ta._launch_bwd(
                    q_src, kv_src, bias_arg, mask_arg, out, lse, dout.flatten(2), causal, heads
                )
                how = _backward_tag(*paths)
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
        if with_bias:
            _check_relative_bias(q, k, v, q_src, kv_src, mask_arg, key_mask, causal, tag)
    _set_paths()


# The paths a relative bias's gradient is checked with: dQ from the stored dS (its sums in the dQ
# kernel where the tiles are square), dQ recomputed (the dense gradient's diagonal sums), and the
# one-block kernel where the queries are short (dense too).
RELATIVE_PATHS = [
    ("ds", "stored_bias", "kernel", False),
    ("ds", "recompute", "kernel", False),
    ("ds", "stored_bias", "kernel", True),
]


def _check_relative_bias(q, k, v, q_src, kv_src, mask_arg, key_mask, causal, tag) -> None:
    """The kernels given a relative bias (H, SQ + SK - 1) on the sources of q, k, v: the outputs of
    its dense expansion, and its gradient per key - query offset, against math attention on
    `dense_bias` of it."""
    sq, heads, sk = q.shape[1], q.shape[2], k.shape[1]
    rel = torch.randn(heads, sq + sk - 1)
    qr, kr, vr, rel_r = (t.clone().requires_grad_() for t in (q, k, v, rel))
    ref = _math_attention(qr, kr, vr, dense_bias(rel_r, sq, sk), key_mask, causal, 0.0)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    out, lse = ta._launch_fwd(q_src, kv_src, rel, mask_arg, causal, heads)
    _check(f"{tag} relative bias: out", out, ref.detach().flatten(2), 3e-5)
    key = ta.tile_class(causal, True, sq)
    for paths in RELATIVE_PATHS:
        _set_paths(*paths)
        if _repeats_the_two_kernels(key, sq, True):
            continue
        dq_src, dkv_src, drel = ta._launch_bwd(q_src, kv_src, rel, mask_arg, out, lse, dout.flatten(2), causal, heads)
        one_block = ta.one_block_applies(key, sq, True)
        in_kernel = paths[1] != "recompute" and ta.relative_grad_in_kernel(key) and not one_block
        how = "one-block backward" if one_block else f"dQ {paths[1]}"
        summed = "in the dQ kernel" if in_kernel else "densely"
        _check(f"  relative bias gradient, summed {summed} ({how})", drel, rel_r.grad, 3e-5)
        dq = dq_src[..., : heads * q.shape[-1]]
        _check(f"  dq with the relative bias ({how})", dq, qr.grad.flatten(2), 3e-5)


FAR_TILE_PATHS = {
    "ds": ("ds", "recompute", "kernel", False),
    "atomic": ("atomic", "recompute", "kernel", False),
    "dQ stored": ("ds", "stored", "kernel", False),
}


def check_half_bias() -> None:
    """The kernels read the bias in fp16 (BIAS_HALF, for bf16/fp16 inputs) or fp32: either way they
    agree with the math attention given the bias they read (the fp16-rounded one for fp16), forward
    and backward: the encoder's, the decoder's, and short queries through the one-block kernel. The
    interpreter runs these kernels in fp32 only, so fp32 inputs are given the bias `_kernel_bias`
    makes for bf16 ones; the GPU tests run bf16 end to end."""
    heads, d = 2, 16
    default, kernel_bias = ta.BIAS_HALF, ta._kernel_bias
    for b, sq, sk, causal in [(2, 40, 40, False), (2, 37, 37, True), (2, 16, 48, False)]:
        q, k, v = (torch.randn(b, s, heads, d) for s in (sq, sk, sk))
        bias = 4 * torch.randn(heads, sq, sk)  # large enough to move the softmax
        q_src, kv_src = q.flatten(2).contiguous(), torch.cat([k.flatten(2), v.flatten(2)], -1)
        no_mask = q.new_empty((0,), dtype=torch.uint8)
        for half in (True, False):
            ta.BIAS_HALF = half
            as_read = kernel_bias(bias, sq, sk, torch.bfloat16)  # what bf16 inputs get
            assert as_read.dtype == (torch.float16 if half else torch.float32)
            ta._kernel_bias = lambda bias, SQ, SK, dtype: kernel_bias(bias, SQ, SK, torch.bfloat16)
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
            tag = f"{sq}x{sk} causal={causal}, bias read in {'fp16' if half else 'fp32'}"
            _check(f"{tag} out", out, ref.detach().flatten(2), 3e-5)
            _check(f"{tag} dq", dq, qr.grad.flatten(2), 3e-5)
            _check(f"{tag} dk|dv", dkv, torch.cat([kr.grad.flatten(2), vr.grad.flatten(2)], -1), 3e-5)
            _check(f"{tag} dbias", dbias, br.grad, 3e-5)
        ta.BIAS_HALF = True  # fp16 rounds by at most 2^-11 of the value; the test can tell it happened
        error = (kernel_bias(bias, sq, sk, torch.bfloat16).float() / ta._LOG2E - bias).abs()
        assert error.max() > 1e-4 and (error <= 2**-11 * bias.abs() + 1e-6).all()  # (fp32: < 1e-6)
    huge = torch.full((heads, 4, 4), 1e6)  # past fp16's range: clamped to its largest value, not inf
    assert kernel_bias(huge, 4, 4, torch.bfloat16).float().max() == 65504
    assert kernel_bias(huge, 4, 4, torch.float32).dtype == torch.float32  # fp32 inputs: the fp32 bias
    ta.BIAS_HALF = default


def check_far_tiles() -> None:
    """FAR_TILES (every kernel) with a T5 bias (8 buckets up to distance 16, so that it saturates
    within these lengths): tiles wholly beyond the saturation distance read one element instead of a
    tile, which must give the very same outputs and gradients as reading every tile."""
    default_far = ta.FAR_TILES
    heads, d, b = 2, 16, 2
    for sq, causal, padded in [(64, False, True), (48, True, False), (64, True, True)]:
        far = bias_saturation_distance(not causal, 8, 16)
        table = torch.randn(8, heads)
        rel = torch.arange(-(sq - 1), sq)
        bias = dense_bias(table[relative_position_bucket(rel, not causal, 8, 16)].t(), sq, sq)
        q, k, v = (torch.randn(b, sq, heads, d) for _ in range(3))
        key_mask = q.new_empty((0,), dtype=torch.uint8)
        if padded:
            key_mask = torch.ones(b, sq, dtype=torch.uint8)
            key_mask[1, sq // 3 :] = 0
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1)
        dout = torch.randn(b, sq, heads * d)
        results = {}
        for far_tiles in (False, True):
            ta.FAR_TILES = ta.FAR_TILE_KERNELS if far_tiles else ()
            out, lse = ta._launch_fwd(qkv, q.new_empty((0,)), bias, key_mask, causal, heads, far)
            for path in FAR_TILE_PATHS:
                _set_paths(*FAR_TILE_PATHS[path])
                dqkv, _, dbias = ta._launch_bwd(
                    qkv, q.new_empty((0,)), bias, key_mask, out, lse, dout, causal, heads, far
                )
                results[far_tiles, path] = (out, dqkv, dbias)
        ta.FAR_TILES = default_far
        _set_paths()
        tag = f"far tiles {sq}x{sq} causal={causal} padded={padded} (saturated from {far})"
        for path in FAR_TILE_PATHS:
            for name, on, off in zip(("out", "dq|dk|dv", "dbias"), results[True, path], results[False, path]):
                same = (
                    torch.equal(on, off) if path != "atomic" else _relative_error(on, off) < 1e-6
                )  # atomics: any order
                print(
                    f"{tag}: {name} with and without far tiles (path {path}): {'identical' if same else 'DIFFERENT'}"
                )
                if not same:
                    raise SystemExit(f"MISMATCH: {tag} {name} (path {path}): far tiles changed the result")
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        br = bias.clone().requires_grad_()
        ref = _math_attention(qr, kr, vr, br, key_mask.bool() if padded else None, causal, 0.0)
        ref.backward(dout.view_as(ref))
        out, dqkv, dbias = results[True, "ds"]
        _check(f"{tag}: out against math", out, ref.detach().flatten(2), 3e-5)
        _check(
            f"{tag}: dq|dk|dv against math",
            dqkv,
            torch.cat([qr.grad.flatten(2), kr.grad.flatten(2), vr.grad.flatten(2)], -1),
            3e-5,
        )
        _check(f"{tag}: dbias against math", dbias, br.grad, 3e-5)


def check_ds_batch_sum() -> None:
    """The stored dS's sum over the batch: several batch steps, a partial last one, a partial last
    block of elements (the test's tile sizes: tests/test_kernels_interpreted.py)."""
    for shape in [(5, 2, 24, 40), (3, 1, 7, 9)]:
        for dtype in (torch.float32, torch.bfloat16):
            ds = torch.randn(shape).to(dtype)
            got = bg.batch_sum(ds, lambda kernel: kernel)
            assert got.dtype == torch.float32 and got.shape == shape[1:]
            _check(f"dS summed over the batch {shape} {dtype}", got, ds.float().sum(0), 1e-6)
    _check_ds_batch_sum_far()


def _check_ds_batch_sum_far() -> None:
    """DS_SUM "far" (`_ds_batch_sum_far_kernel`, the test's ROWS 4 and COLS 8): given dS whose rows sum
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


def check_add_norm_sweep() -> None:
    """benchmarks/add_norm_sweep.py's loop on two settings (13 rows: partial row blocks): both give
    the default setting's results, and the module's launch settings are restored afterwards."""
    from benchmarks import add_norm_sweep

    default = (tn.BWD_ROWS, tn.BWD_PROGRAMS_PER_SM, tn.BWD_WARPS, tn.BWD_STAGES, tn.BWD_STAGES_HALF)
    inputs = add_norm_sweep.backward_inputs(13, 40, torch.float32, device="cpu")
    settings = [(1, 2, 4, 1), (8, 16, 4, 2)]
    timed, failed = add_norm_sweep.sweep(inputs, lambda fn: (fn(), 1.0)[1], settings)
    assert [s for _, s in timed] == settings and not failed, (timed, failed)
    assert (tn.BWD_ROWS, tn.BWD_PROGRAMS_PER_SM, tn.BWD_WARPS, tn.BWD_STAGES, tn.BWD_STAGES_HALF) == default
    print("add + norm launch-setting sweep: both settings give the default's results")


def check_ffn_epilogue() -> None:
    """benchmarks/ffn_epilogue.py's GEMMs with the gated GELU in their epilogues (pointer loads and
    TMA descriptors) against the unfused FFN: h = x [W0; W1]^T, gelu_tanh(gate) * lin, and the
    GELU's gradient from dout = dy Wo. 70 rows: a partial row tile."""
    import triton

    from benchmarks import ffn_epilogue as fe

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    kernels = (fe._ffn_in_kernel, fe._ffn_out_grad_kernel, fe._ffn_in_tma_kernel, fe._ffn_out_grad_tma_kernel)
    saved = [k.configs for k in kernels]
    for k in kernels:
        k.configs = fe._configs([(32, 32, 16, 1, 4)])
    m, d, f = 70, 48, 64
    x, dy = torch.randn(m, d), torch.randn(m, d)
    w0, w1, wo = torch.randn(f, d), torch.randn(f, d), torch.randn(d, f)
    h_ref = (x @ torch.cat([w0, w1]).t()).requires_grad_()
    out_ref = tg.gated_gelu_reference(h_ref)
    out_ref.backward(dy @ wo)
    for loads, fwd, bwd in (("pointers", *kernels[:2]), ("TMA", *kernels[2:])):
        h, out = fe.ffn_in(x, w0, w1, fwd)
        _check(f"FFN epilogue ({loads}) h", h, h_ref, 1e-5)
        _check(f"FFN epilogue ({loads}) gelu_tanh(gate) * lin", out, out_ref, 1e-5)
        _check(f"FFN epilogue ({loads}) [dgate | dlin]", fe.ffn_out_grad(dy, wo, h_ref.detach(), bwd), h_ref.grad, 1e-5)
    for k, configs in zip(kernels, saved):
        k.configs = configs


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
    cross-attention), loss and every parameter's gradient. 8 buckets up to distance 16: the bias
    saturates within these lengths, so the far-tile path has tiles to skip."""
    config = T5Config.from_preset(
        "tiny",
        attention_backend="math",
        num_layers=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    model = T5ForConditionalGeneration(config)
    ids, labels = torch.randint(2, 32128, (2, 40)), torch.randint(2, 32128, (2, 17))
    attention_mask, decoder_mask = torch.ones_like(ids), torch.ones_like(labels)
    attention_mask[1, -9:] = 0
    decoder_mask[0, -5:] = 0
    labels = labels.masked_fill(decoder_mask == 0, -100)

    def run(backend: str):
        for m in model.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        model.zero_grad()
        loss = model(
            ids, labels=labels, attention_mask=attention_mask, decoder_attention_mask=decoder_mask
        ).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = run("math")
    default_far = ta.FAR_TILES
    default_relative = ta.RELATIVE_BIAS
    cases = [(*paths, False, False) for paths in BACKWARD_PATHS + [("ds", "stored_bias", "kernel", False)]]
    cases.append(("ds", "stored_bias", "far", False, False, False))  # the encoder's far regions' row sums
    cases.append(("ds", "recompute", "kernel", False, True, False))
    cases.append(("ds", "stored_bias", "kernel", True, False, True))  # the kernels given the relative bias
    for dbias_path, dq_path, ds_sum, one_block, far_tiles, relative in cases:
        _set_paths(dbias_path, dq_path, ds_sum, one_block)
        ta.FAR_TILES = ta.FAR_TILE_KERNELS if far_tiles else ()
        ta.RELATIVE_BIAS = relative
        loss, grads = run("triton")
        tag = _backward_tag(dbias_path, dq_path, ds_sum, one_block) + (", far tiles" if far_tiles else "")
        tag += ", relative bias" if relative else ""
        _check(f"tiny T5 loss, triton attention ({tag})", loss, ref_loss, 1e-5)
        worst = max(grads, key=lambda n: _relative_error(grads[n], ref_grads[n]))
        _check(f"  worst parameter gradient: {worst}", grads[worst], ref_grads[worst], 1e-4)
    ta.FAR_TILES = default_far
    ta.RELATIVE_BIAS = default_relative
    _set_paths()


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
    check_far_tiles()
    check_half_bias()
    check_ds_batch_sum()
    check_gated_gelu()
    check_add_rms_norm()
    check_add_norm_sweep()
    check_ffn_epilogue()
    check_model()
    check_decode_attention()
    check_generation()
    print("ALL KERNEL CHECKS PASSED")


if __name__ == "__main__":
    main()
