"""Does a hand-written fused RMS norm pay in a T5 step? inductor's fused kernels against liger-kernel's.

Each T5 sublayer ends in a residual add, and the next one starts with an RMS norm of the sum, so the
unit measured here is the pair as the model runs it (training/model/t5.py):

    s = h + o                       # h: residual stream (fp32, or bf16 with residual_dtype=autocast)
    y = rms_norm(s, w).to(bf16)     # o: the sublayer's bf16 output; w: fp32 norm weight; y: GEMM input

forward, and backward from the gradients of y (bf16, from the next GEMM) and of s (the residual's,
from later layers) to those of h, o and w. Implementations:

- `torch`: the model's ops, eager (one kernel per op).
- `inductor`: the same function under torch.compile, one fused kernel each way, as in the compiled
  training step (where inductor may also fuse it with its neighbours).
- `triton`: the model's own kernels on CUDA (training/model/triton_add_norm.py): the add and the
  norm in one kernel each way, the backward writing the residual's gradient and its bf16 cast (the
  gradient of o) in one pass.
- `liger`: liger-kernel's Triton kernels (`pip install liger-kernel`; not a dependency of this repo)
  in the mode that matches T5 (`casting_mode="gemma"`: fp32 statistics and product, one rounding to
  the output dtype). With a bf16 residual, its fused add + RMS norm; with an fp32 one, torch's add,
  its RMS norm (which writes its output in the input's dtype, fp32) and torch's cast to bf16.

Prints per residual dtype and implementation the GPU time of the forward and of forward + backward
(the profiler's device time of every kernel, averaged over `--iters` calls, so launch gaps do not
count), the bandwidth that time implies for the bytes the pair must move at least (forward: read h
and o, write s and y; backward: read the two gradients and s, write the gradients of h and o), that
bandwidth as a share of a device-to-device copy measured in the same run, and each output's relative
error against `torch`. Then what the norms of one T5 step would take at each implementation's speed
(encoder: two per layer at batch x input rows, decoder: three per layer at batch x target rows, and
each stack's final norm).

    python benchmarks/rms_norm.py                           # T5 base shapes, batch 128, 512 -> 114
    python benchmarks/rms_norm.py --rows 14592 --impls torch,inductor,triton
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_backends import rel_err  # noqa: E402
from benchmarks.cuda_timing import kernel_ms  # noqa: E402
from benchmarks.options import comma_choices  # noqa: E402
from training.model.t5 import rms_norm  # noqa: E402

IMPLS = ("torch", "inductor", "triton", "liger")
RESIDUALS = {"fp32": torch.float32, "bf16": torch.bfloat16}
EPS = 1e-6


def add_norm(h: torch.Tensor, o: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, s): the next GEMM's bf16 input and the new residual stream, as a T5 block computes them."""
    s = h + o
    return rms_norm(s, w, EPS).to(torch.bfloat16), s


def liger_add_norm(h: torch.Tensor, o: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm` through liger-kernel's Triton kernels (see the module docstring)."""
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    if h.dtype == torch.bfloat16:  # X + R in one kernel; both outputs in X's dtype
        return LigerFusedAddRMSNormFunction.apply(o, h, w, EPS, 0.0, "gemma", False)
    s = h + o  # in_place: its backward may overwrite dy, a fresh tensor from the cast's backward
    return LigerRMSNormFunction.apply(s, w, EPS, 0.0, "gemma", True).to(torch.bfloat16), s


def min_bytes(rows: int, d_model: int, residual: torch.dtype) -> tuple[int, int]:
    """(forward, backward) bytes the pair must read and write at least (the (rows,) statistics and
    the (d_model,) weight and its gradient are left out: under 0.2 % at d_model 768)."""
    r, a = torch.finfo(residual).bits // 8, 2  # residual and bf16 activation bytes per element
    n = rows * d_model
    return n * (r + a + r + a), n * (a + r + r + r + a)


class Case:
    """Inputs of one add + norm at (rows, d_model): residual, sublayer output, weight, gradients."""

    def __init__(self, rows: int, d_model: int, residual: torch.dtype, device: str, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.h = torch.randn(rows, d_model, generator=gen, device=device).to(residual)
        self.o = torch.randn(rows, d_model, generator=gen, device=device).to(torch.bfloat16)
        self.w = 1 + 0.1 * torch.randn(d_model, generator=gen, device=device)
        self.dy = torch.randn(rows, d_model, generator=gen, device=device).to(torch.bfloat16)
        self.ds = torch.randn(rows, d_model, generator=gen, device=device).to(residual)

    def calls(self, fn):
        """(forward call, forward + backward call, outputs y, s, dh, do, dw) of fn(h, o, w)."""
        h, o, w = (t.detach().requires_grad_() for t in (self.h, self.o, self.w))

        def fwd():
            with torch.no_grad():
                fn(h, o, w)

        def fwd_bwd():
            y, s = fn(h, o, w)
            return (y, s, *torch.autograd.grad((y, s), (h, o, w), (self.dy, self.ds)))

        return fwd, fwd_bwd, [t.detach() for t in fwd_bwd()]


def triton_add_norm(h: torch.Tensor, o: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm` through the model's kernels (y written in bf16, as before a linear under autocast)."""
    from training.model.triton_add_norm import add_rms_norm

    s, y = add_rms_norm(h, o, w, EPS, torch.bfloat16)
    return y, s


def implementation(name: str):
    if name == "torch":
        return add_norm
    if name == "inductor":
        return torch.compile(add_norm)
    return triton_add_norm if name == "triton" else liger_add_norm


def copy_gbps(iters: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9) of a 1 GiB buffer."""
    src = torch.empty(2**28, device="cuda")
    dst = torch.empty_like(src)
    ms = kernel_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() * 4 / ms / 1e6


def step_rows(batch: int, input_len: int, target_len: int, layers: int) -> list[tuple[int, int]]:
    """(rows, how many per step) of the add + norm pairs in a T5 step: each sublayer's norm (the
    encoder's two per layer, the decoder's three) and each stack's final norm."""
    return [(batch * input_len, 2 * layers + 1), (batch * target_len, 3 * layers + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128 * 512, help="rows of one call (batch x sequence)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--residuals", default="fp32,bf16", help="comma list of fp32, bf16")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--step", default="128,512,114,12", help="batch,inputs,targets,layers of the step estimate")
    args = parser.parse_args()
    impls = comma_choices(args.impls, IMPLS, "--impls", "implementation")
    residuals = comma_choices(args.residuals, list(RESIDUALS), "--residuals", "dtype")
    batch, inputs, targets, layers = (int(v) for v in args.step.split(","))
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/rms_norm.py needs a CUDA GPU")
    ceiling = copy_gbps(args.iters)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | rows {args.rows}, d_model "
          f"{args.d_model} | copy {ceiling:.0f} GB/s")  # fmt: skip
    print("| residual | impl | fwd ms | fwd+bwd ms | GB/s | of copy | step ms | err y | err s | err dh | err do | err dw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rname in residuals:
        case = Case(args.rows, args.d_model, RESIDUALS[rname], "cuda")
        fwd_bytes, bwd_bytes = min_bytes(args.rows, args.d_model, RESIDUALS[rname])
        ref = None
        for name in impls:
            try:
                fwd, fwd_bwd, outputs = case.calls(implementation(name))
                f_ms, total_ms = kernel_ms(fwd, args.iters), kernel_ms(fwd_bwd, args.iters)
            except Exception as e:  # noqa: BLE001 - a missing or failing implementation is a row too
                print(f"| {rname} | {name} | {type(e).__name__}: {str(e)[:160]!r} |", flush=True)
                continue
            ref = outputs if name == "torch" or ref is None else ref
            gbps = (fwd_bytes + bwd_bytes) / total_ms / 1e6
            # A step's pairs at this implementation's bandwidth (time scales with the rows).
            step = sum(total_ms * rows / args.rows * n for rows, n in step_rows(batch, inputs, targets, layers))
            errs = " | ".join(rel_err(x, r) for x, r in zip(outputs, ref))
            print(f"| {rname} | {name} | {f_ms:.3f} | {total_ms:.3f} | {gbps:.0f} | {gbps / ceiling:.0%} | "
                  f"{step:.1f} | {errs} |", flush=True)  # fmt: skip
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
