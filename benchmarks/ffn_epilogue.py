"""The gated GELU fused into the FFN's GEMMs, against cuBLAS GEMMs plus the separate GELU kernels.

T5 v1.1's FFN runs h = x [W0; W1]^T (one cuBLAS GEMM), then gelu_tanh(gate) * lin (one Triton
kernel, training/model/triton_gated_gelu.py) on the way forward, and dout = dy Wo (cuBLAS) then the
GELU's backward (one kernel) on the way back. Both element-wise kernels run at the copy bandwidth
(10.6 ms of a T5-base step, docs/model_speed.md). Here each is folded into a Triton GEMM's epilogue:

- forward: one kernel computes a tile of x W0^T and of x W1^T (two accumulators), stores both
  (the backward needs them) and gelu_tanh(gate) * lin, so h is never read back;
- backward: one kernel computes a tile of dy Wo and, before storing anything, loads that tile's
  gate and lin and writes [dgate | dlin], so dout is never written.

It prints ms per call (median of `--iters`, CUDA events) for the encoder's and the decoder's rows at
T5-base sizes, both ways, and the difference over a step's 12 + 12 layers; and how far the fused
results are from the unfused ones (the GEMMs sum in another order, so not bit-identical).

    python benchmarks/ffn_epilogue.py                    # T5 base, batch 128, 512 -> 114
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import median_cuda_ms  # noqa: E402
from training.model.triton_gated_gelu import (  # noqa: E402
    _launch_bwd,
    _launch_fwd,
    gated_gelu_fp32,
    gated_gelu_grads_fp32,
)


def _configs(shapes):
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in shapes
    ]


_FWD_CONFIGS = _configs(
    [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 64, 64, 4, 4), (128, 64, 64, 4, 8), (64, 128, 64, 4, 4),
     (128, 128, 32, 4, 8), (256, 64, 64, 3, 8), (128, 64, 64, 3, 4)]
)  # fmt: skip
_BWD_CONFIGS = _configs(
    [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 3, 4), (64, 256, 64, 4, 8), (256, 128, 64, 3, 8),
     (128, 128, 64, 4, 4), (128, 256, 32, 4, 8)]
)  # fmt: skip


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order (consecutive programs share A's rows in L2), as Triton's matmul tutorial."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_m, (pid % in_group) // group_m


@triton.autotune(configs=_FWD_CONFIGS, key=["M", "N", "K"])
@triton.jit
def _ffn_in_kernel(X, W0, W1, H, OUT, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # X (M, K), W0 and W1 (N, K) as nn.Linear keeps them; H (M, 2N) = [gate | lin], OUT (M, N).
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + (rows % M).to(tl.int64)[:, None] * K + ks[None, :]  # rows past M wrap; not stored
    w0_ptrs = W0 + cols[None, :] * K + ks[:, None]  # (BLOCK_K, BLOCK_N) of W0^T
    w1_ptrs = W1 + cols[None, :] * K + ks[:, None]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_l = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0, N % BLOCK_N == 0 (checked by the caller)
        x = tl.load(x_ptrs)
        acc_g = tl.dot(x, tl.load(w0_ptrs), acc_g)
        acc_l = tl.dot(x, tl.load(w1_ptrs), acc_l)
        x_ptrs += BLOCK_K
        w0_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K
    gate = acc_g.to(H.dtype.element_ty)  # stored as the unfused GEMM would; the GELU reads these
    lin = acc_l.to(H.dtype.element_ty)
    inside = (rows < M)[:, None]
    h_ptrs = H + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
    tl.store(h_ptrs, gate, mask=inside)
    tl.store(h_ptrs + N, lin, mask=inside)
    out = gated_gelu_fp32(gate.to(tl.float32), lin.to(tl.float32))
    tl.store(OUT + rows.to(tl.int64)[:, None] * N + cols[None, :], out.to(OUT.dtype.element_ty), mask=inside)


@triton.autotune(configs=_BWD_CONFIGS, key=["M", "N", "K"])
@triton.jit
def _ffn_out_grad_kernel(DY, WO, H, DH, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # DY (M, K), WO (K, N) as nn.Linear(N, K) keeps it; H (M, 2N) = [gate | lin]; DH (M, 2N).
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    dy_ptrs = DY + (rows % M).to(tl.int64)[:, None] * K + ks[None, :]
    wo_ptrs = WO + ks[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(dy_ptrs), tl.load(wo_ptrs), acc)
        dy_ptrs += BLOCK_K
        wo_ptrs += BLOCK_K * N
    dout = acc.to(DH.dtype.element_ty).to(tl.float32)  # rounded as the unfused GEMM's output
    inside = (rows < M)[:, None]
    h_ptrs = H + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
    gate = tl.load(h_ptrs, mask=inside, other=0.0).to(tl.float32)
    lin = tl.load(h_ptrs + N, mask=inside, other=0.0).to(tl.float32)
    dgate, dlin = gated_gelu_grads_fp32(gate, lin, dout)
    dh_ptrs = DH + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
    tl.store(dh_ptrs, dgate.to(DH.dtype.element_ty), mask=inside)
    tl.store(dh_ptrs + N, dlin.to(DH.dtype.element_ty), mask=inside)


@triton.autotune(configs=_FWD_CONFIGS, key=["M", "N", "K"])
@triton.jit
def _ffn_in_tma_kernel(X, W0, W1, H, OUT, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    # As _ffn_in_kernel, every load and store through a TMA descriptor (Hopper's bulk copies).
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w0_desc = tl.make_tensor_descriptor(W0, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    w1_desc = tl.make_tensor_descriptor(W1, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    h_desc = tl.make_tensor_descriptor(H, shape=[M, 2 * N], strides=[2 * N, 1], block_shape=[BLOCK_M, BLOCK_N])
    out_desc = tl.make_tensor_descriptor(OUT, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_l = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([off_m, k])
        acc_g = tl.dot(x, w0_desc.load([off_n, k]).T, acc_g)
        acc_l = tl.dot(x, w1_desc.load([off_n, k]).T, acc_l)
    gate = acc_g.to(H.dtype.element_ty)
    lin = acc_l.to(H.dtype.element_ty)
    h_desc.store([off_m, off_n], gate)
    h_desc.store([off_m, N + off_n], lin)
    out_desc.store([off_m, off_n], gated_gelu_fp32(gate.to(tl.float32), lin.to(tl.float32)).to(OUT.dtype.element_ty))


@triton.autotune(configs=_BWD_CONFIGS, key=["M", "N", "K"])
@triton.jit
def _ffn_out_grad_tma_kernel(DY, WO, H, DH, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    dy_desc = tl.make_tensor_descriptor(DY, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    wo_desc = tl.make_tensor_descriptor(WO, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    h_desc = tl.make_tensor_descriptor(H, shape=[M, 2 * N], strides=[2 * N, 1], block_shape=[BLOCK_M, BLOCK_N])
    dh_desc = tl.make_tensor_descriptor(DH, shape=[M, 2 * N], strides=[2 * N, 1], block_shape=[BLOCK_M, BLOCK_N])
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(dy_desc.load([off_m, k]), wo_desc.load([k, off_n]), acc)
    dout = acc.to(DH.dtype.element_ty).to(tl.float32)
    gate = h_desc.load([off_m, off_n]).to(tl.float32)
    lin = h_desc.load([off_m, N + off_n]).to(tl.float32)
    dgate, dlin = gated_gelu_grads_fp32(gate, lin, dout)
    dh_desc.store([off_m, off_n], dgate.to(DH.dtype.element_ty))
    dh_desc.store([off_m, N + off_n], dlin.to(DH.dtype.element_ty))


def ffn_in(x, w0, w1, kernel=_ffn_in_kernel):
    m, k = x.shape
    n = w0.shape[0]
    h = torch.empty((m, 2 * n), dtype=x.dtype, device=x.device)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def grid(meta):
        assert k % meta["BLOCK_K"] == 0 and n % meta["BLOCK_N"] == 0
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    kernel[grid](x, w0, w1, h, out, m, n, k)
    return h, out


def ffn_out_grad(dy, wo, h, kernel=_ffn_out_grad_kernel):
    m, k = dy.shape
    n = wo.shape[1]
    dh = torch.empty_like(h)

    def grid(meta):
        assert k % meta["BLOCK_K"] == 0 and n % meta["BLOCK_N"] == 0
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    kernel[grid](dy, wo, h, dh, m, n, k)
    return dh


def unfused_ffn_in(x, wcat):
    """What the step runs: one cuBLAS GEMM for [gate | lin], then the gated GELU kernel."""
    return _launch_fwd(x @ wcat.t())


def unfused_ffn_out_grad(dy, wo, h):
    """What the step's backward runs: dout = dy Wo (cuBLAS), then the GELU's backward kernel."""
    return _launch_bwd(h, dy @ wo)


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--d-ff", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12, help="encoder layers = decoder layers")
    parser.add_argument("--rows", default="65536,14592", help="encoder rows (batch x inputs), decoder rows")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ffn_epilogue.py needs triton and a CUDA GPU (it times Triton and cuBLAS GEMMs)")
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    d, f = args.d_model, args.d_ff
    w0, w1 = (torch.randn(f, d, device=dev, dtype=bf) * d**-0.5 for _ in range(2))
    wcat = torch.cat([w0, w1])
    wo = torch.randn(d, f, device=dev, dtype=bf) * f**-0.5
    # Scratch for the descriptors that the TMA kernels build on the device.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| rows | pass | loads | cuBLAS + GELU kernel ms | fused ms | saved ms/step | max rel. diff | config |")
    print("|---|---|---|---|---|---|---|---|")
    totals = {"pointers": 0.0, "TMA": 0.0}
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, d, device=dev, dtype=bf)
        dy = torch.randn(m, d, device=dev, dtype=bf) * 1e-2
        h_ref = x @ wcat.t()
        out_ref = _launch_fwd(h_ref)
        dh_ref = _launch_bwd(h_ref, dy @ wo)
        fwd_ms = median_cuda_ms(functools.partial(unfused_ffn_in, x, wcat), args.iters)
        bwd_ms = median_cuda_ms(functools.partial(unfused_ffn_out_grad, dy, wo, h_ref), args.iters)
        for loads, fwd_kernel, bwd_kernel in (
            ("pointers", _ffn_in_kernel, _ffn_out_grad_kernel), ("TMA", _ffn_in_tma_kernel, _ffn_out_grad_tma_kernel)
        ):
            h, out = ffn_in(x, w0, w1, fwd_kernel)
            diff = max(_rel(h, h_ref), _rel(out, out_ref))
            ms = median_cuda_ms(functools.partial(ffn_in, x, w0, w1, fwd_kernel), args.iters)
            rows = [("forward", fwd_ms, ms, diff, fwd_kernel)]
            diff = _rel(ffn_out_grad(dy, wo, h_ref, bwd_kernel), dh_ref)
            ms = median_cuda_ms(functools.partial(ffn_out_grad, dy, wo, h_ref, bwd_kernel), args.iters)
            rows.append(("backward (dout, GELU)", bwd_ms, ms, diff, bwd_kernel))
            for name, a, b, diff, kernel in rows:
                saved = (a - b) * args.layers
                totals[loads] += saved
                cfg = kernel.best_config
                cfg = f"{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}x{cfg.kwargs['BLOCK_K']}, {cfg.num_warps} warps, {cfg.num_stages} stages"
                print(f"| {m} | {name} | {loads} | {a:.3f} | {b:.3f} | {saved:+.2f} | {diff:.1e} | {cfg} |")
    for loads, total in totals.items():
        print(f"saved per step with {loads}, all {args.layers} + {args.layers} layers: {total:+.2f} ms")


if __name__ == "__main__":
    main()
