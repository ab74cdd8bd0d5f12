"""T5 v1.1's gated FFN with the GELU in QuACK's GEMM epilogues (opt-in, Hopper and newer GPUs).

The default FFN (`T5DenseGatedActDense`) runs its GEMMs on cuBLAS and the gated GELU as a Triton
kernel each way; each kernel reads and writes (rows, 2 d_ff) bf16 activations at the copy bandwidth.
QuACK (`pip install quack-kernels`, Tri Dao's GEMMs in NVIDIA's CUTLASS Python DSL) computes
gelu_tanh(gate) * lin in the epilogue of the x [W0; W1]^T GEMM, and the activation's gradient in the
epilogue of the backward's dy Wo GEMM, so neither element-wise pass runs on its own and the forward
keeps no copy of the activation (the backward's epilogue rewrites it). The forward's Wo GEMM and the
backward's other three stay on cuBLAS, which is faster than QuACK's for the weight gradients of these
shapes.

QuACK's epilogue writes the pre-activation with gate and lin columns interleaved (gate_0, lin_0,
gate_1, ...) and takes its gradient back in that order; the backward's cuBLAS GEMMs use the rows of
[W0; W1] in the same order, so the gradients of wi_0 and wi_1 come out in the model's layout.
`EpilogueFFN` calls QuACK through two module attributes, so that this bookkeeping is tested on CPU
with torch stand-ins in their place (tests/test_quack_ffn.py).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

TUNED = True
"""Let QuACK autotune its two GEMMs for each new input shape on first use (1-2 minutes per shape on
an H100; kept on disk, in QUACK_CACHE_DIR when set), instead of running its default tile."""


_HAS_QUACK = importlib.util.find_spec("quack") is not None


@torch.compiler.assume_constant_result  # torch.compile reads the answer, it does not trace the probe
def available() -> bool:
    """True when QuACK's GEMMs can run here: quack-kernels installed and a CUDA GPU of compute
    capability 9.0 (Hopper) or newer."""
    return _probe()


@functools.cache
def _probe() -> bool:
    return _HAS_QUACK and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


_gemm_gated = _gemm_dgated = None  # quack.gemm_interface's, once load() has imported them


def load() -> None:
    """Import QuACK's two GEMMs for `EpilogueFFN` (outside any torch.compile trace); raises with what
    to install when they cannot run here."""
    global _gemm_gated, _gemm_dgated
    if not available():
        raise RuntimeError(
            "model.ffn_kernel=quack needs quack-kernels (pip install '.[quack]' in this repository, plus "
            "'nvidia-cutlass-dsl[cu13]==4.7.0' for a CUDA 13 torch) and a CUDA GPU of compute capability "
            "9.0 (Hopper) or newer; set model.ffn_kernel=default to run without it"
        )
    from quack.gemm_interface import gemm_dgated, gemm_gated

    _gemm_gated, _gemm_dgated = gemm_gated, gemm_dgated


class EpilogueFFN(torch.autograd.Function):
    """wo(gelu_tanh(x W0^T) * x W1^T) for 2-D x, wcat = [W0; W1], through `_gemm_gated` and
    `_gemm_dgated` (QuACK's `gemm_gated(A, B, activation=, concat_layout=, tuned=)`, which returns the
    pre-activation with gate and lin interleaved and the activation of A @ B for B's columns
    [gate | lin]; and `gemm_dgated(A, B, preact, activation=, tuned=)`, which returns the interleaved
    pre-activation's gradient and the activation for upstream gradient A @ B)."""

    @staticmethod
    def forward(ctx, x, wcat, wo):
        preact, postact = _gemm_gated(x, wcat.T, activation="geglu", concat_layout=("B",), tuned=TUNED)
        ctx.save_for_backward(x, wcat, wo, preact)
        return postact @ wo.T

    @staticmethod
    def backward(ctx, dy):
        x, wcat, wo, preact = ctx.saved_tensors
        dpreact, postact = _gemm_dgated(dy.contiguous(), wo, preact, activation="geglu", tuned=TUNED)
        f, d = wcat.shape[0] // 2, wcat.shape[1]
        w_interleaved = wcat.view(2, f, d).transpose(0, 1).reshape(2 * f, d)  # rows gate_0, lin_0, ...
        dwcat = (dpreact.T @ x).view(f, 2, d).transpose(0, 1).reshape(2 * f, d)
        return dpreact @ w_interleaved, dwcat, dy.T @ postact


def applies(x: torch.Tensor, d_ff: int, dropout_active: bool) -> bool:
    """True when `gated_ffn` runs QuACK's kernels for this input: QuACK `load`ed (which it is only
    where `available()`), a CUDA tensor, gradients on (a training step: evaluation and generation, whose input shapes vary,
    keep the default path rather than autotune each new shape), no dropout between the GELU and wo
    (the epilogue has none), widths QuACK's TMA loads accept (multiples of 8, of 16 for the gated
    output)."""
    return (
        _gemm_gated is not None
        and x.is_cuda
        and torch.is_grad_enabled()
        and not dropout_active
        and x.shape[-1] % 8 == 0
        and d_ff % 16 == 0
    )


def gated_ffn(x: torch.Tensor, wcat: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """wo(gelu_tanh(x W0^T) * x W1^T) for x (..., d_model), wcat = [W0; W1] (2 d_ff, d_model), wo
    (d_model, d_ff), in the autocast dtype under autocast (the weights cast as F.linear would)."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    x2d = x.reshape(-1, x.shape[-1]).to(dtype)
    with torch.autocast("cuda", enabled=False):
        out = EpilogueFFN.apply(x2d, wcat.to(dtype), wo.to(dtype))
    return out.view(*x.shape[:-1], out.shape[-1])
