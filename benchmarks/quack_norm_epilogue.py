"""The residual add and RMS norm folded into QuACK's GEMM epilogues, at one block boundary of T5.

docs/model_speed.md ("What is left for 0.12 s/step") ends on the norms: with cuBLAS's GEMMs as black
boxes each norm's output must sit in memory for the next GEMM. QuACK (quack-kernels 0.6.5) has the
two epilogues that take it out of the forward:

- `gemm_rms(O, Wo^T, C=h)`: the attention's output projection, the residual add in its epilogue
  (h' = h + O Wo^T), and each row's sum of squares of h' as per-tile partials, finished into rstd;
- `gemm_norm_act(h', (W * g)^T, rstd)`: the next layer's GEMM reads h' itself and scales each output
  row by rstd in its epilogue, the norm's weight g folded into W's columns, since
  (rstd h' * g) W^T = rstd (h' (W * g)^T).

So the normalised activations are never written in the forward. The backward still needs them, for
the weight gradient dy^T (rstd h'), so its norm kernel writes them once (`norm_backward` below).

This times the boundary "a sublayer's output projection, add + norm, the next qkv projection"
(`FusedBoundary`; by default the FFN's wo, 2048 -> 768, as between two encoder layers: 11 a step),
forward and forward + backward against what the model runs (`model_boundary`: cuBLAS, our add + norm kernel,
cuBLAS), with the residual stream in bf16 (`model.residual_dtype=autocast`) and in fp32 (the
default, HF's numerics; there `gemm_rms` writes h' in fp32 and a bf16 copy for the next GEMM). It
prints the profiler's kernel time and the CUDA-event time per call, what that makes over the step's
boundaries of this kind, and each output's and gradient's largest error against a float64 computation
from the same bf16 inputs. Both ways must agree with it as closely: the fused path rounds h' to bf16
before the qkv GEMM as the model does, and folds g into bf16 weights, which the model does not.

    python benchmarks/quack_norm_epilogue.py                   # encoder rows, both residual dtypes
    python benchmarks/quack_norm_epilogue.py --rows 14592 --residual bf16 --no-tuned
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_ms, kernel_table, median_cuda_ms  # noqa: E402
from benchmarks.options import comma_choices  # noqa: E402
from benchmarks.quack_gemms import require_quack  # noqa: E402
from training.model import triton_add_norm  # noqa: E402

LOW = torch.bfloat16  # the GEMMs' operand dtype (tests run the algebra in float64 with torch stand-ins)
EPS = 1e-6
TUNED = True  # QuACK autotunes each GEMM shape on first use (--no-tuned: its default tile)
_gemm_rms = _gemm_norm_act = None  # quack.gemm_interface's, once main() has imported them


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or dtype where that is wider: what the epilogues and the norm compute in."""
    return torch.promote_types(dtype, torch.float32)


def wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(wide_dtype(t.dtype))


def norm_backward(dxr: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor, dh_new: torch.Tensor):
    """The RMS norm's backward from dxr = dy (W * g) (the gradient of rstd h' before the row scale
    is taken out): the residual gradient dh (in dh_new's dtype and as bf16 for the output
    projection's GEMMs; one tensor with a bf16 residual) and xhat = rstd h' in bf16 for the next
    layer's weight gradient."""
    xhat = wide(a) * rstd[:, None]
    dxr = wide(dxr)
    mean = (dxr * xhat).mean(-1, keepdim=True)
    dh = wide(dh_new) + rstd[:, None] * (dxr - xhat * mean)
    if dh_new.dtype == LOW:
        return dh.to(LOW), None, xhat.to(LOW)
    return dh.to(dh_new.dtype), dh.to(LOW), xhat.to(LOW)


_norm_backward = torch.compile(norm_backward, dynamic=False)


class FusedBoundary(torch.autograd.Function):
    """(h', y) = (h + O Wo^T, rms_norm(h') * g W^T) with the add and the norm in QuACK's epilogues.
    O (rows, inner), Wo (d, inner), W (n, d) bf16; h (rows, d) bf16 or fp32; g (d,) fp32."""

    @staticmethod
    def forward(ctx, o, wo, h, g, w):
        half = h.dtype == LOW
        h_new = torch.empty_like(h)
        copy = None if half else torch.empty(h.shape, dtype=LOW, device=h.device)
        _, rstd = _gemm_rms(o, wo.T, C=h, out=h_new, premult_out=copy, eps=EPS, tuned=TUNED)
        a = h_new if half else copy  # what the next GEMM reads: h' in bf16
        wg = (wide(w) * g).to(LOW)
        _, y = _gemm_norm_act(a, wg.T, rstd=rstd, activation=None, tuned=TUNED)
        ctx.save_for_backward(o, wo, a, rstd, g, w, wg)
        return h_new, y

    @staticmethod
    def backward(ctx, dh_new, dy):
        o, wo, a, rstd, g, w, wg = ctx.saved_tensors
        dy = dy.contiguous()
        dh, dh16, xhat = _norm_backward(dy @ wg, a, rstd, dh_new.contiguous())
        dh16 = dh if dh16 is None else dh16
        dwg = dy.T @ xhat  # the gradient of W * g
        dw = (wide(dwg) * g).to(LOW)
        dg = (wide(dwg) * wide(w)).sum(0)
        return dh16 @ wo, dh16.T @ o, dh, dg, dw


def fused_boundary(o, wo, h, g, w):
    return FusedBoundary.apply(o, wo, h, g, w)


def model_boundary(o, wo, h, g, w):
    """What the model runs: cuBLAS, our add + norm kernel (norm output in bf16), cuBLAS."""
    h_new, normed = triton_add_norm.add_rms_norm(h, F.linear(o, wo), g, EPS, LOW)
    return h_new, F.linear(normed, w)


def reference_boundary(o, wo, h, g, w):
    """The same in the inputs' dtype (float64 from `errors`), h' not rounded."""
    h_new = h + o @ wo.T
    rstd = torch.rsqrt(h_new.square().mean(-1, keepdim=True) + EPS)
    return h_new, (h_new * rstd * g) @ w.T


def inputs(rows: int, inner: int, d: int, n: int, residual: torch.dtype, device, seed: int = 0):
    """Random operands at T5 v1.1's scales: unit-variance activations, weights at the init's std."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std=1.0, dtype=None):
        return (torch.randn(shape, generator=gen, device=device) * std).to(dtype or LOW).requires_grad_()

    return (randn(rows, inner), randn(d, inner, std=inner**-0.5), randn(rows, d, dtype=residual),
            (1 + 0.1 * torch.randn(d, generator=gen, device=device, dtype=wide_dtype(LOW))).requires_grad_(),
            randn(n, d, std=d**-0.5))  # fmt: skip


def forward_backward(fn, args, grads):
    outs = fn(*args)
    return torch.autograd.grad(outs, args, grads)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().double() - ref.detach()).abs().max() / ref.detach().abs().max())


def errors(fn, args, grads) -> list[float]:
    """Largest error over the largest magnitude, against `reference_boundary`'s in float64 from the
    same inputs, of h', y and the gradients of O, Wo, h, g and W."""
    ref_args = [t.detach().double().requires_grad_() for t in args]
    ref = [*reference_boundary(*ref_args)]
    ref_grads = torch.autograd.grad(ref, ref_args, [t.double() for t in grads])
    outs = fn(*args)
    got = torch.autograd.grad(outs, args, grads)
    return [rel_err(x, r) for x, r in zip([*outs, *got], [*ref, *ref_grads])]


def main(argv: list[str] | None = None) -> None:
    global TUNED, _gemm_rms, _gemm_norm_act
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128 * 512, help="rows (default: the encoder's at batch 128)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument(
        "--inner", type=int, default=2048, help="the output projection's input width (FFN: d_ff; attention: 768)"
    )
    parser.add_argument("--next", type=int, default=2304, help="the next GEMM's width (qkv: 3 x heads x d_kv)")
    parser.add_argument("--residual", default="bf16,fp32", help="comma-separated: bf16, fp32")
    parser.add_argument("--per-step", type=int, default=11, help="boundaries of this kind a step (encoder: 11)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-tuned", action="store_true", help="QuACK's default tiles, no autotuning")
    parser.add_argument("--kernels", action="store_true", help="each way's kernels, forward + backward (profiler)")
    args = parser.parse_args(argv)
    residuals = comma_choices(args.residual, ["bf16", "fp32"], "--residual", "residual dtype")
    quack, gemms = require_quack("benchmarks/quack_norm_epilogue.py", "quack", "quack.gemm_interface")

    TUNED, _gemm_rms, _gemm_norm_act = not args.no_tuned, gemms.gemm_rms, gemms.gemm_norm_act
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | quack-kernels {quack.__version__} | "
          f"{'autotuned' if TUNED else 'default'} QuACK tiles | rows {args.rows}, d {args.d_model}, "
          f"inner {args.inner}, next GEMM {args.next}")  # fmt: skip
    print("| residual | boundary | fwd kernel ms | fwd+bwd kernel ms | fwd ms (events) | fwd+bwd ms (events) | "
          f"fwd+bwd kernel ms x {args.per_step} | errors h', y, dO, dWo, dh, dg, dW |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for residual in residuals:
        dtype = LOW if residual == "bf16" else torch.float32
        tensors = inputs(args.rows, args.inner, args.d_model, args.next, dtype, device)
        grads = (torch.randn(args.rows, args.d_model, device=device).to(dtype) * 0.01,
                 torch.randn(args.rows, args.next, device=device, dtype=LOW) * 0.01)  # fmt: skip
        rows = {}
        for name, fn in (("model", model_boundary), ("QuACK epilogues", fused_boundary)):
            try:  # the first call compiles, and QuACK autotunes
                fn(*tensors)
            except ValueError as exc:  # QuACK 0.6.5: gemm_rms's first autotuned call can hand its
                # final reduction a strided slice of partial sums ("expected to be divisible by 4");
                # later calls allocate them whole
                print(f"# {name}: first call failed ({str(exc).splitlines()[0][:80]}...); calling again")
            errs = errors(fn, tensors, grads)
            fwd = functools.partial(fn, *tensors)
            both = functools.partial(forward_backward, fn, tensors, grads)
            rows[name] = (kernel_ms(fwd, args.iters), kernel_ms(both, args.iters),
                          median_cuda_ms(fwd, args.iters), median_cuda_ms(both, args.iters))  # fmt: skip
            k_fwd, k_both, e_fwd, e_both = rows[name]
            print(f"| {residual} | {name} | {k_fwd:.3f} | {k_both:.3f} | {e_fwd:.3f} | {e_both:.3f} | "
                  f"{k_both * args.per_step:.2f} | {', '.join(f'{e:.1e}' for e in errs)} |")  # fmt: skip
            if args.kernels:
                for part, call in (("forward", fwd), ("forward + backward", both)):
                    for kernel, ms in kernel_table(call, args.iters).items():
                        print(f"#   {part}: {ms:.4f} ms  {kernel[:100]}")
        saved = (rows["model"][1] - rows["QuACK epilogues"][1]) * args.per_step
        print(f"# {residual} residual: the QuACK epilogues save {saved:+.2f} ms of kernel time "
              f"over {args.per_step} boundaries")  # fmt: skip
        del tensors, grads


if __name__ == "__main__":
    main()
