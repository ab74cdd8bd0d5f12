"""T5 v1.1's gated GELU on the fused wi_0 | wi_1 projection output, as one Triton kernel each way.

The FFN runs wi_0 and wi_1 as one GEMM, h = x [W0; W1]^T of shape (..., 2F) = [gate | lin], and
needs gelu_tanh(gate) * lin (..., F). Its backward must hand the GEMM one (..., 2F) gradient
[dgate | dlin]. Under torch.compile inductor writes that gradient as a concatenation, one kernel
over the 2F output columns in which every element loads its gate, lin and upstream gradient, so
each input is read twice (0.75 ms per T5-base encoder layer at batch 128 x 512 on an H100, about
1.8 TB/s). Here one program covers a block of columns of one row in both halves: gate, lin and
the upstream gradient are read once and both halves of the gradient written once.

Arithmetic in fp32 whatever the storage dtype; one rounding to the output dtype.
`gated_gelu_packed` dispatches: CUDA tensors with triton installed use the kernels (wrapped with
`torch.library.triton_op`, so torch.compile keeps them in its graph), anything else the torch ops of
`gated_gelu_reference`, which are also the reference the kernels are tested against.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

from training.model.compile_key import settings_digest, source_digest

_HAS_TRITON = importlib.util.find_spec("triton") is not None
BLOCK = 1024  # columns per program (of F); T5 v1.1 d_ff: 1024 (small) ... 10240 (xxl)
_SOURCE_DIGEST = source_digest(Path(__file__))  # the launchers and kernels below


@torch.compiler.assume_constant_result
def launch_settings() -> str:
    """A digest of BLOCK and of this module's source, which the ops take as an argument so that
    torch.compile's caches tell graphs traced under others apart (training/model/compile_key.py)."""
    return settings_digest(_SOURCE_DIGEST, BLOCK)


if _HAS_TRITON:
    import triton
    import triton.language as tl

    # Module-level numbers in a kernel must be constexpr (the GPU compiler refuses a plain float).
    # Keep them right of a tensor in products: Triton 3.9's interpreter turns `constexpr * tensor`
    # into a constexpr that a nested @triton.jit call cannot take (same values either way).
    _SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
    _GELU_CUBIC = tl.constexpr(0.044715)

    @triton.jit
    def _tanh(z):
        return 2.0 * tl.sigmoid(2.0 * z) - 1.0

    @triton.jit
    def gated_gelu_fp32(gate, lin):
        """gelu_tanh(gate) * lin on fp32 tiles (the forward kernel's arithmetic)."""
        t = _tanh((gate + gate * _GELU_CUBIC * gate * gate) * _SQRT_2_OVER_PI)
        return 0.5 * gate * (1.0 + t) * lin

    @triton.jit
    def gated_gelu_grads_fp32(gate, lin, dout):
        """(dgate, dlin) of gelu_tanh(gate) * lin for the upstream gradient dout, on fp32 tiles."""
        gate2 = gate * gate
        t = _tanh((gate + gate2 * _GELU_CUBIC * gate) * _SQRT_2_OVER_PI)
        gelu = 0.5 * gate * (1.0 + t)
        # d gelu / d gate = 0.5 (1 + t) + 0.5 gate (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 gate^2)
        dgelu = 0.5 * (1.0 + t) + 0.5 * gate * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + gate2 * (3.0 * _GELU_CUBIC)
        )
        return dout * lin * dgelu, dout * gelu

    @triton.jit
    def _gated_gelu_fwd_kernel(H, OUT, F_DIM, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < F_DIM
        gate = tl.load(H + row * 2 * F_DIM + cols, mask=inside, other=0.0).to(tl.float32)
        lin = tl.load(H + row * 2 * F_DIM + F_DIM + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(OUT + row * F_DIM + cols, gated_gelu_fp32(gate, lin).to(OUT.dtype.element_ty), mask=inside)

    @triton.jit
    def _gated_gelu_bwd_kernel(H, DOUT, DH, F_DIM, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < F_DIM
        gate = tl.load(H + row * 2 * F_DIM + cols, mask=inside, other=0.0).to(tl.float32)
        lin = tl.load(H + row * 2 * F_DIM + F_DIM + cols, mask=inside, other=0.0).to(tl.float32)
        dout = tl.load(DOUT + row * F_DIM + cols, mask=inside, other=0.0).to(tl.float32)
        dgate, dlin = gated_gelu_grads_fp32(gate, lin, dout)
        tl.store(DH + row * 2 * F_DIM + cols, dgate.to(DH.dtype.element_ty), mask=inside)
        tl.store(DH + row * 2 * F_DIM + F_DIM + cols, dlin.to(DH.dtype.element_ty), mask=inside)


def _launch_fwd(h: torch.Tensor, wrap=lambda kernel: kernel) -> torch.Tensor:
    rows, f = h.numel() // h.shape[-1], h.shape[-1] // 2
    out = torch.empty((*h.shape[:-1], f), dtype=h.dtype, device=h.device)
    wrap(_gated_gelu_fwd_kernel)[(rows, triton.cdiv(f, BLOCK))](h, out, f, BLOCK=BLOCK, num_warps=4)
    return out


def _launch_bwd(h: torch.Tensor, dout: torch.Tensor, wrap=lambda kernel: kernel) -> torch.Tensor:
    rows, f = h.numel() // h.shape[-1], h.shape[-1] // 2
    dh = torch.empty_like(h)
    wrap(_gated_gelu_bwd_kernel)[(rows, triton.cdiv(f, BLOCK))](h, dout, dh, f, BLOCK=BLOCK, num_warps=4)
    return dh


_OP = None
if _HAS_TRITON and hasattr(torch.library, "triton_op"):
    from torch.library import triton_op, wrap_triton

    # `settings` (launch_settings()) is not read: it tells compile caches graphs apart.
    @triton_op("t5ds::gated_gelu_fwd", mutates_args={})
    def _gated_gelu_fwd_op(h: torch.Tensor, settings: str) -> torch.Tensor:
        return _launch_fwd(h, wrap=wrap_triton)

    @triton_op("t5ds::gated_gelu_bwd", mutates_args={})
    def _gated_gelu_bwd_op(h: torch.Tensor, dout: torch.Tensor, settings: str) -> torch.Tensor:
        return _launch_bwd(h, dout, wrap=wrap_triton)

    def _setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.settings = inputs[1]

    def _backward(ctx, dout):
        (h,) = ctx.saved_tensors
        return _gated_gelu_bwd_op(h, dout.contiguous(), ctx.settings), None

    _gated_gelu_fwd_op.register_autograd(_backward, setup_context=_setup_context)
    _OP = _gated_gelu_fwd_op


def gated_gelu_reference(h: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * lin of h = [gate | lin] with torch ops (what HF computes)."""
    gate, lin = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * lin


def kernel_applies(h: torch.Tensor) -> bool:
    """True when `gated_gelu_packed` would run the Triton kernels on `h`."""
    return _OP is not None and h.is_cuda


def gated_gelu_packed(h: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(h[..., :F]) * h[..., F:] for h = [gate | lin] (..., 2F) -> (..., F).

    CUDA tensors (with triton and torch >= 2.6): the fused kernels, in h's dtype (bf16 under
    autocast: h is a GEMM output). Elsewhere: `gated_gelu_reference`."""
    if not kernel_applies(h):
        return gated_gelu_reference(h)
    return _OP(h.contiguous(), launch_settings())
