"""T5's RMS norm, and the residual add with the RMS norm after it, h' = h + out, y = rms_norm(h') * w,
as one Triton kernel each way.

Every RMS norm of T5 but a stack's first follows a residual add. Under torch.compile inductor
fuses each add with its norm: one kernel forward, and one backward that computes the residual
stream's gradient dh (fp32 with the fp32 residual) and the weight gradient's partial sums. The
sublayer that produced `out` then needs dh in its own dtype (bf16 under autocast) for its GEMMs,
and inductor casts it in a separate kernel: a second read of the fp32 gradient (0.10 ms per T5-base
encoder norm at batch 128 x 512 on an H100, 22 of them a step, plus 35 on the decoder's rows). Here
the backward kernel writes both dh and its cast, and sums the weight gradient over the rows a
program walks, so the partial sums are few.

Arithmetic in fp32; h' is rounded to h's dtype before it is normalised (as eager torch computes
`rms_norm(h + out)`); y is written in the dtype its consumer asks for (the autocast dtype before a
linear layer, which would cast it anyway). `add_rms_norm` dispatches: CUDA tensors with triton
installed use the kernels (wrapped with `torch.library.triton_op`, so torch.compile keeps them in its
graph), anything else the torch ops of `rms_norm`, which are also the reference the kernels are
tested against.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from training.model.compile_key import settings_digest, source_digest

_HAS_TRITON = importlib.util.find_spec("triton") is not None
FWD_ROWS = 4  # rows per forward program (one 2-D tile of FWD_ROWS x d_model)
# The backward's programs are persistent: each walks BWD_ROWS rows at a time through a share of the
# rows, so its weight-gradient partial sums are one row of (programs, d_model).
# Swept on an H100 over 64 settings: the best with T5-base's fp32 residual stream. With a bf16 one
# (model.residual_dtype=autocast) the same setting with 2 pipeline stages is the best (0.1445 against
# 0.1581 ms at 1 stage).
BWD_ROWS, BWD_PROGRAMS_PER_SM, BWD_WARPS, BWD_STAGES = 8, 2, 4, 1
BWD_STAGES_HALF = 2  # BWD_STAGES when the residual stream is fp16 or bf16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (cast to a half-precision weight's dtype)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x32 = x32.to(weight.dtype)
    return weight * x32


def _half(dtype: torch.dtype) -> bool:
    """fp16 or bf16: rms_norm casts to a half weight's dtype, and a half residual's backward takes
    BWD_STAGES_HALF."""
    return dtype in (torch.float16, torch.bfloat16)


def backward_setting(residual: torch.dtype) -> tuple[int, int, int, int]:
    """(rows per step, programs per SM, warps, stages) the backward runs with for this residual dtype."""
    return BWD_ROWS, BWD_PROGRAMS_PER_SM, BWD_WARPS, BWD_STAGES_HALF if _half(residual) else BWD_STAGES


_SOURCE_DIGEST = source_digest(Path(__file__))  # the launchers and kernels below


@torch.compiler.assume_constant_result
def launch_settings() -> str:
    """A digest of the tiles the launchers read and of this module's source, which the ops take as
    an argument so that torch.compile's caches tell graphs traced under others apart
    (training/model/compile_key.py)."""
    return settings_digest(
        _SOURCE_DIGEST, FWD_ROWS, BWD_ROWS, BWD_PROGRAMS_PER_SM, BWD_WARPS, BWD_STAGES, BWD_STAGES_HALF
    )


if _HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rms_norm_fwd_kernel(
        H, OUT, W, HNEW, Y, RSTD, n_rows, D, eps,
        ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HALF_W: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        inside = (rows < n_rows)[:, None] & (cols < D)[None, :]
        at = rows.to(tl.int64)[:, None] * D + cols[None, :]
        s = tl.load(H + at, mask=inside, other=0.0).to(tl.float32)
        s += tl.load(OUT + at, mask=inside, other=0.0).to(tl.float32)
        h_new = s.to(HNEW.dtype.element_ty)
        tl.store(HNEW + at, h_new, mask=inside)
        x = h_new.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)
        x_hat = x * rstd[:, None]
        w = tl.load(W + cols, mask=cols < D, other=0.0)
        if HALF_W:  # rms_norm casts the normalised x to a half-precision weight's dtype first
            x_hat = x_hat.to(W.dtype.element_ty).to(tl.float32)
        tl.store(Y + at, (x_hat * w.to(tl.float32)[None, :]).to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _add_rms_norm_bwd_kernel(
        DY, DRES, X, W, RSTD, DH, DOUT, DW_PARTS, n_rows, D,
        HAS_DRES: tl.constexpr, SEPARATE_DOUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
        HALF_W: tl.constexpr, STAGES: tl.constexpr,
    ):  # fmt: skip
        cols = tl.arange(0, BLOCK_D)
        w = tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
        dw = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)  # summed over its rows once, at the end
        for start in tl.range(tl.program_id(0) * ROWS, n_rows, tl.num_programs(0) * ROWS, num_stages=STAGES):
            rows = start + tl.arange(0, ROWS)
            inside = (rows < n_rows)[:, None] & (cols < D)[None, :]
            at = rows.to(tl.int64)[:, None] * D + cols[None, :]
            dy = tl.load(DY + at, mask=inside, other=0.0).to(tl.float32)
            x = tl.load(X + at, mask=inside, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)
            x_hat = x * rstd[:, None]
            if HALF_W:  # the weight multiplied the normalised x after its cast to the weight's dtype
                dw += dy * x_hat.to(W.dtype.element_ty).to(tl.float32)
            else:
                dw += dy * x_hat
            g = dy * w[None, :]  # the gradient of x_hat (the cast to a half weight's dtype passes it on)
            dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / D)[:, None])
            if HAS_DRES:
                dx += tl.load(DRES + at, mask=inside, other=0.0).to(tl.float32)
            tl.store(DH + at, dx.to(DH.dtype.element_ty), mask=inside)
            if SEPARATE_DOUT:  # `out` is in another dtype than h + out: its gradient is dh cast
                tl.store(DOUT + at, dx.to(DOUT.dtype.element_ty), mask=inside)
        tl.store(DW_PARTS + tl.program_id(0) * D + cols, tl.sum(dw, axis=0), mask=cols < D)


def _launch_fwd(h, out, weight, eps: float, y_dtype: torch.dtype, wrap=lambda kernel: kernel):
    d = h.shape[-1]
    rows = h.numel() // d
    h_new = torch.empty(h.shape, dtype=torch.promote_types(h.dtype, out.dtype), device=h.device)
    y = torch.empty(h.shape, dtype=y_dtype, device=h.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=h.device)
    block_d = triton.next_power_of_2(d)
    wrap(_add_rms_norm_fwd_kernel)[(triton.cdiv(rows, FWD_ROWS),)](
        h, out, weight, h_new, y, rstd, rows, d, eps,
        ROWS=FWD_ROWS, BLOCK_D=block_d, HALF_W=_half(weight.dtype),
        num_warps=4 if block_d <= 1024 else 8,
    )  # fmt: skip
    return h_new, y, rstd


def _backward_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(triton.cdiv(rows, BWD_ROWS), sms * BWD_PROGRAMS_PER_SM))
    return max(1, min(triton.cdiv(rows, BWD_ROWS), 3))  # the interpreter: several programs, few rows


def _launch_bwd(dy, dres, h_new, weight, rstd, out_dtype: torch.dtype, wrap=lambda kernel: kernel):
    """(dh, dout, dweight): dout is empty when `out` has h + out's dtype (its gradient is dh then)."""
    d = h_new.shape[-1]
    rows = h_new.numel() // d
    programs = _backward_programs(rows, h_new.device)
    rows_per_step, _, warps, stages = backward_setting(h_new.dtype)
    dh = torch.empty_like(h_new)
    separate = out_dtype != h_new.dtype
    dout = torch.empty(h_new.shape if separate else (0,), dtype=out_dtype, device=h_new.device)
    parts = torch.empty((programs, d), dtype=torch.float32, device=h_new.device)
    block_d = triton.next_power_of_2(d)
    wrap(_add_rms_norm_bwd_kernel)[(programs,)](
        dy, dy if dres is None else dres, h_new, weight, rstd, dh, dout if separate else dh, parts, rows, d,
        HAS_DRES=dres is not None, SEPARATE_DOUT=separate, ROWS=rows_per_step, BLOCK_D=block_d,
        HALF_W=_half(weight.dtype), STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return dh, dout, parts.sum(0).to(weight.dtype)


def add_rms_norm_reference(
    h: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float, y_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + out, rms_norm(h + out) * weight) with torch ops; y cast to y_dtype when given."""
    h_new = h + out
    y = rms_norm(h_new, weight, eps)
    return h_new, y if y_dtype is None else y.to(y_dtype)


_OP = None
if _HAS_TRITON and hasattr(torch.library, "triton_op"):
    from torch.library import triton_op, wrap_triton

    # `settings` (launch_settings()) is not read: it tells compile caches graphs apart.
    @triton_op("t5ds::add_rms_norm_fwd", mutates_args={})
    def _add_rms_norm_fwd_op(
        h: torch.Tensor,
        out: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        y_dtype: torch.dtype,
        settings: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _launch_fwd(h, out, weight, eps, y_dtype, wrap=wrap_triton)

    @triton_op("t5ds::add_rms_norm_bwd", mutates_args={})
    def _add_rms_norm_bwd_op(
        dy: torch.Tensor, dres: torch.Tensor | None, h_new: torch.Tensor, weight: torch.Tensor,
        rstd: torch.Tensor, out_dtype: torch.dtype, settings: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        return _launch_bwd(dy, dres, h_new, weight, rstd, out_dtype, wrap=wrap_triton)

    def _setup_context(ctx, inputs, output):
        _, out, weight, _, _, settings = inputs
        h_new, _, rstd = output
        ctx.mark_non_differentiable(rstd)
        ctx.save_for_backward(h_new, weight, rstd)
        ctx.out_dtype, ctx.settings = out.dtype, settings

    def _backward(ctx, dh_new, dy, _drstd):
        h_new, weight, rstd = ctx.saved_tensors
        dres = None if dh_new is None else dh_new.contiguous()
        dy = torch.zeros_like(h_new) if dy is None else dy.contiguous()
        dh, dout, dw = _add_rms_norm_bwd_op(dy, dres, h_new, weight, rstd, ctx.out_dtype, ctx.settings)
        return dh, dout if dout.numel() else dh, dw, None, None, None

    _add_rms_norm_fwd_op.register_autograd(_backward, setup_context=_setup_context)
    _OP = _add_rms_norm_fwd_op


def kernel_applies(h: torch.Tensor) -> bool:
    """True when `add_rms_norm` would run the Triton kernels on `h`."""
    return _OP is not None and h.is_cuda


def add_rms_norm(
    h: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, eps: float, y_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add h + out (in the dtype torch adds them in) and the RMS norm of its result:
    (h + out, y).

    y is `rms_norm(h + out, weight, eps)` cast to y_dtype when given (pass the autocast dtype when a
    linear layer reads y), else in rms_norm's dtype. CUDA tensors (with triton and torch >= 2.6): the
    fused kernels; elsewhere `add_rms_norm_reference`."""
    if not kernel_applies(h) or h.shape != out.shape:
        return add_rms_norm_reference(h, out, weight, eps, y_dtype)
    # rms_norm's own output dtype, for y when no y_dtype is asked for
    natural = weight.dtype if _half(weight.dtype) else torch.promote_types(torch.float32, weight.dtype)
    h_new, y, _ = _OP(h.contiguous(), out.contiguous(), weight, eps, y_dtype or natural, launch_settings())
    return h_new, y
