"""Would FP8 linear layers make a T5 step faster? cuBLAS bf16 against FP8 `_scaled_mm` per GEMM shape.

Every linear-layer GEMM of a T5 training step (the shapes of `benchmarks/gemm_shapes.py`: forward
x @ W^T, input gradient dy @ W, weight gradient dy^T @ x) timed three ways:

- `bf16`: torch.matmul on bf16 operands, as the step runs them under autocast.
- `fp8`: `torch._scaled_mm` on float8_e4m3 operands with row-wise scales (one fp32 scale per row of
  A and per column of B, the recipe torchao calls "rowwise"), bf16 out, in the layouts cuBLAS takes
  (A row-major, B column-major); fast accumulation in the forward only, as torchao does.
- `quant`: what it costs to make those FP8 operands from bf16 ones: the amax along the scaled
  dimension, the scale and the cast (and, for the weight gradient, the transposed copy that layout
  needs), compiled with torch.compile, for each operand that is an activation or a gradient (the
  weights' casts are per step, not per token, and left out). A model that quantizes inside the
  kernel producing the activation (the norm, the gated GELU) pays less than this; one that does it
  as here pays all of it. So `fp8` and `fp8 + quant` bracket what FP8 linears could save.

Prints per shape and pass the three times, then per step: the bf16 total, the FP8 GEMMs' total and
that plus the quantization (`--iters` calls each, median, CUDA events).

    python benchmarks/fp8_gemm_shapes.py                       # T5 base, batch 128, 512 -> 114
    python benchmarks/fp8_gemm_shapes.py --preset large --batch-size 64
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import median_cuda_ms  # noqa: E402
from benchmarks.gemm_shapes import step_layer_operands, step_shape_parser  # noqa: E402
from training.model import T5Config  # noqa: E402
from training.model.flops import measure_matmul_tflops  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x in float8_e4m3 scaled along `dim` (amax over `dim`, one scale per remaining index), and the
    fp32 inverse scale that `_scaled_mm` multiplies back, shaped to broadcast against x."""
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = FP8_MAX / amax
    return (x.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reciprocal()


def quantize_transposed(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize`, then the transposed contiguous copy the weight gradient's operands need."""
    q, inv = quantize(x, dim)
    return q.t().contiguous(), inv.reshape(-1, 1)  # (n, 1) with unit strides, as _scaled_mm checks


class Fp8Pass(NamedTuple):
    """One GEMM pass of a linear layer: A @ B in bf16 as autograd hands it to cuBLAS, the same
    product's FP8 operands as `_scaled_mm` takes them (A row-major scaled per row, B column-major
    scaled per column, fp32 inverse scales), and the quantizations of its activation/gradient
    operands as calls to time."""

    label: str
    a: torch.Tensor
    b: torch.Tensor
    a_fp8: torch.Tensor
    b_fp8: torch.Tensor
    a_inv_scale: torch.Tensor
    b_inv_scale: torch.Tensor
    fast_accum: bool  # the forward only, as torchao does
    quantizations: list


def fp8_passes(x, w, dy, quant=quantize, quant_t=quantize_transposed) -> list[Fp8Pass]:
    """The forward (x @ W^T), input gradient (dy @ W) and weight gradient (dy^T @ x) of a linear
    layer with input x (M, K), weight W (N, K) and output gradient dy (M, N). `quant`/`quant_t` are
    what the timed quantization calls run (the compiled functions on the GPU)."""
    wq_rows, w_inv_rows = quantize(w, 1)  # W (N, K) scaled per output row: B = W^T of the forward
    wq_cols, w_inv_cols = quantize_transposed(w, 0)  # W^T (K, N) contiguous, scaled per input column
    xq, x_inv = quantize(x, 1)
    dyq, dy_inv = quantize(dy, 1)
    dytq, dyt_inv = quantize_transposed(dy, 0)  # dy^T (N, M), scaled per column of dy
    xtq, xt_inv = quantize_transposed(x, 0)  # x^T (K, M), scaled per column of x
    return [
        Fp8Pass("forward", x, w.t(), xq, wq_rows.t(), x_inv, w_inv_rows.t(), True,
                [functools.partial(quant, x, 1)]),
        Fp8Pass("input grad", dy, w, dyq, wq_cols.t(), dy_inv, w_inv_cols.t(), False,
                [functools.partial(quant, dy, 1)]),
        Fp8Pass("weight grad", dy.t(), x, dytq, xtq.t(), dyt_inv, xt_inv.t(), False,
                [functools.partial(quant_t, dy, 0), functools.partial(quant_t, x, 0)]),
    ]  # fmt: skip


def scaled_mm(gemm: Fp8Pass) -> torch.Tensor:
    """The pass's product from its FP8 operands, in bf16."""
    return torch._scaled_mm(gemm.a_fp8, gemm.b_fp8, gemm.a_inv_scale, gemm.b_inv_scale,
                            out_dtype=torch.bfloat16, use_fast_accum=gemm.fast_accum)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = step_shape_parser(__doc__).parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit(
            "benchmarks/fp8_gemm_shapes.py needs a CUDA GPU with FP8 tensor cores (sm_89 or newer)"
        )
    device = torch.device("cuda")
    config = T5Config.from_preset(args.preset)
    ceiling = measure_matmul_tflops(device)
    torch._dynamo.config.recompile_limit = 64  # one compiled quantization per operand shape
    quant = torch.compile(quantize, dynamic=False)
    quant_t = torch.compile(quantize_transposed, dynamic=False)
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 8192^3 matmul {ceiling:.0f} TFLOP/s"
    )
    print(
        "| layer | pass | (M x K) @ (K x N) | bf16 ms | fp8 ms | quant ms | bf16 TFLOP/s | fp8 TFLOP/s | per step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    total = {"bf16": 0.0, "fp8": 0.0, "quant": 0.0}
    for name, calls, x, w, dy in step_layer_operands(config, args, device):
        passes = fp8_passes(x, w, dy, quant, quant_t)
        for gemm in passes:
            (m, k), n = gemm.a.shape, gemm.b.shape[1]
            bf16_ms = median_cuda_ms(functools.partial(torch.matmul, gemm.a, gemm.b), args.iters, warmup=3)
            fp8_ms = median_cuda_ms(functools.partial(scaled_mm, gemm), args.iters, warmup=3)
            quant_ms = sum(median_cuda_ms(fn, args.iters, warmup=3) for fn in gemm.quantizations)
            for key, ms in (("bf16", bf16_ms), ("fp8", fp8_ms), ("quant", quant_ms)):
                total[key] += ms * calls
            flop = 2 * m * k * n
            print(f"| {name} | {gemm.label} | ({m} x {k}) @ ({k} x {n}) | {bf16_ms:.4f} | {fp8_ms:.4f} | {quant_ms:.4f} | "
                  f"{flop / bf16_ms / 1e9:.0f} | {flop / fp8_ms / 1e9:.0f} | {calls} |")  # fmt: skip
        del x, w, dy, passes, gemm
    print(f"# per step: bf16 GEMMs {total['bf16']:.1f} ms; FP8 GEMMs {total['fp8']:.1f} ms; FP8 GEMMs + "
          f"standalone quantization {total['fp8'] + total['quant']:.1f} ms "
          f"(saves {total['bf16'] - total['fp8']:.1f} ms at best, {total['bf16'] - total['fp8'] - total['quant']:.1f} "
          "ms with the quantization as separate kernels)")  # fmt: skip


if __name__ == "__main__":
    main()
