"""QuACK's CuTe-DSL GEMMs (`pip install quack-kernels`) against what the step runs: cuBLAS for the
linear layers, and for the FFN cuBLAS plus our gated GELU kernels.

QuACK (Tri Dao's kernels in NVIDIA's CUTLASS Python DSL) writes Hopper GEMMs with epilogues: its
`mlp_func(..., activation="geglu")` computes T5 v1.1's gelu_tanh(x W0^T) * x W1^T in the first
GEMM's epilogue and the activation's gradient in the epilogue of the backward's dy Wo GEMM. That is
the fusion docs/model_speed.md names as what the element-wise traffic needs ("the floor with the
default fp32 residual stream"); Triton's epilogue fusion lost 4-12 ms a step (benchmarks/ffn_epilogue.py).

Two parts, both T5-base sizes at batch 128, 512 -> 114, bf16 operands as under autocast:

- `gemms`: every linear-layer GEMM shape of the step, each pass (forward, input grad, weight grad),
  cuBLAS (`torch.matmul`) against QuACK's `gemm`; ms per call, TFLOP/s, the sum over a step.
- `ffn`: the FFN block forward and forward + backward, three ways: ours (cuBLAS GEMM, Triton gated
  GELU, cuBLAS GEMM; the model's default), QuACK's `mlp_func` (all four GEMMs QuACK's) with the
  [W0; W1] weight layout the model keeps, and `training.model.quack_ffn.EpilogueFFN` (QuACK's two
  epilogue GEMMs, cuBLAS for the rest; `model.ffn_kernel=quack`). For each: its largest error
  against an fp32 computation from the same bf16 inputs, the MiB its forward keeps for the
  backward, the first call's seconds (QuACK compiles, and autotunes with `--tuned`), and the
  difference from ours over the step's 12 + 12 layers; `--kernels` adds the profiler's kernel
  times at the encoder's rows.

Times are medians of `--iters` calls between CUDA events (benchmarks/cuda_timing.py), one eager call
at a time, so QuACK's host-side launch counts where it outlasts the GPU work. `--tuned` lets QuACK
autotune each shape first (minutes of compiling); without it QuACK runs its default Hopper tile.

    python benchmarks/quack_gemms.py                       # both parts, QuACK's default tiles
    python benchmarks/quack_gemms.py --parts ffn --tuned
    python benchmarks/quack_gemms.py --parts gemms --tuned --layers "encoder qkv,encoder o" --passes forward

`--layers` (names as the table prints them, or a prefix such as "encoder") and `--passes` keep the
autotuned run to the shapes asked for: autotuning takes about a minute per shape and pass.
`--split-k auto` lets QuACK's autotuner also split the K dimension (the weight gradients' 65536
rows); by default QuACK runs one CTA per output tile.
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_table, median_cuda_ms  # noqa: E402
from benchmarks.gemm_shapes import (  # noqa: E402
    PASSES,
    autograd_passes,
    chosen_layers,
    linear_shapes,
    step_layer_operands,
    step_shape_parser,
)
from benchmarks.options import comma_choices  # noqa: E402
from training.model import T5Config, quack_ffn  # noqa: E402
from training.model.flops import measure_matmul_tflops  # noqa: E402
from training.model.triton_gated_gelu import gated_gelu_packed  # noqa: E402


def ours_ffn(x: torch.Tensor, wcat: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """The model's FFN (T5DenseGatedActDense.forward) on bf16 weights: [gate | lin] in one GEMM."""
    return F.linear(gated_gelu_packed(F.linear(x, wcat)), wo)


def reference_ffn(x: torch.Tensor, wcat: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """The same in fp32 from the same (bf16-valued) inputs: what both are held against."""
    gate, lin = F.linear(x, wcat).chunk(2, dim=-1)
    return F.linear(F.gelu(gate, approximate="tanh") * lin, wo)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((a.detach().float() - ref).abs().max() / ref.abs().max())


def fwd_bwd(fn, x, wcat, wo, dy):
    """One forward and backward, the gradients returned rather than accumulated into .grad."""
    out = fn(x, wcat, wo)
    return torch.autograd.grad(out, (x, wcat, wo), dy)


def kept_mib(fn, x, wcat, wo) -> float:
    """MiB that the forward leaves allocated for its backward (its output excluded)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = fn(x, wcat, wo)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    del out
    return held / 2**20


def ffn_part(args, quack_mlp) -> None:
    config = T5Config.from_preset(args.preset)
    d, f, layers = config.d_model, config.d_ff, config.num_layers
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    wcat = (torch.randn(2 * f, d, device=dev) * d**-0.5).to(bf).requires_grad_()
    wo = (torch.randn(d, f, device=dev) * f**-0.5).to(bf).requires_grad_()
    quack = functools.partial(quack_mlp, activation="geglu", concat_layout=True, tuned=args.tuned)
    variants = {
        "ours": ours_ffn,
        "QuACK mlp_func": lambda x, wcat, wo: quack(x, wcat, wo),
        "QuACK epilogues + cuBLAS": quack_ffn.EpilogueFFN.apply,
    }
    print(
        "\n| rows | FFN | forward ms | forward + backward ms | saved ms/step | max rel. err | kept MiB | first call s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    totals = dict.fromkeys(variants, 0.0)
    for rows in (args.batch_size * args.input_length, args.batch_size * args.target_length):
        x = torch.randn(rows, d, device=dev).to(bf).requires_grad_()
        dy = (torch.randn(rows, d, device=dev) * 1e-2).to(bf)
        leaves = [t.detach().float().requires_grad_() for t in (x, wcat, wo)]
        ref_out = reference_ffn(*leaves)
        ref_grads = torch.autograd.grad(ref_out, leaves, dy.float())
        base = None
        for name, fn in variants.items():
            start = time.perf_counter()
            with torch.no_grad():
                out = fn(x, wcat, wo)
            grads = fwd_bwd(fn, x, wcat, wo, dy)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            err = max(rel_err(out, ref_out), *(rel_err(g, r) for g, r in zip(grads, ref_grads)))
            del out, grads
            mem = kept_mib(fn, x, wcat, wo)
            fwd_ms = median_cuda_ms(functools.partial(torch.no_grad()(fn), x, wcat, wo), args.iters, warmup=3)
            both_ms = median_cuda_ms(functools.partial(fwd_bwd, fn, x, wcat, wo, dy), args.iters, warmup=3)
            base = both_ms if base is None else base
            totals[name] += (base - both_ms) * layers
            print(f"| {rows} | {name} | {fwd_ms:.3f} | {both_ms:.3f} | {(base - both_ms) * layers:+.2f} | {err:.1e} | "
                  f"{mem:.0f} | {first:.1f} |")  # fmt: skip
            if args.kernels and rows == args.batch_size * args.input_length:
                table = kernel_table(functools.partial(fwd_bwd, fn, x, wcat, wo, dy), 10)
                for kernel, ms in list(table.items())[:8]:
                    print(f"#   {ms:.3f} ms  {kernel[:110]}")
        del ref_out, ref_grads, leaves
    for name, total in totals.items():
        print(
            f"# FFN forward + backward, {layers} + {layers} layers, against ours: {name} {total:+.2f} ms a step"
        )


def gemm_part(args, quack_gemm) -> None:
    config = T5Config.from_preset(args.preset)
    device = torch.device("cuda")
    ceiling = measure_matmul_tflops(device)
    print(f"\n# bf16 8192^3 matmul (cuBLAS) {ceiling:.0f} TFLOP/s")
    print(
        "| layer | pass | (M x K) @ (K x N) | cuBLAS ms | QuACK ms | cuBLAS / QuACK TFLOP/s | per step | saved ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    totals = {"cuBLAS": 0.0, "QuACK": 0.0, "best": 0.0}
    quack = functools.partial(quack_gemm, tuned=args.tuned, split_k=None if args.split_k == "auto" else 1)
    for name, calls, x, w, dy in step_layer_operands(config, args, device, layers=args.layers):
        for label, a, b in autograd_passes(x, w, dy):
            if label not in args.passes:
                continue
            (m, k), n = a.shape, b.shape[1]
            ref = torch.matmul(a, b)
            err = rel_err(quack(a, b), ref.float())
            ms = {
                "cuBLAS": median_cuda_ms(functools.partial(torch.matmul, a, b), args.iters, warmup=3),
                "QuACK": median_cuda_ms(functools.partial(quack, a, b), args.iters, warmup=3),
            }
            for key in ms:
                totals[key] += ms[key] * calls
            totals["best"] += min(ms.values()) * calls
            tf = {key: 2 * m * k * n / v / 1e9 for key, v in ms.items()}
            print(f"| {name} | {label} | ({m} x {k}) @ ({k} x {n}) | {ms['cuBLAS']:.4f} | {ms['QuACK']:.4f} | "
                  f"{tf['cuBLAS']:.0f} / {tf['QuACK']:.0f} | {calls} | {(ms['cuBLAS'] - ms['QuACK']) * calls:+.2f} |"
                  + (f" err {err:.1e}" if err > 1e-2 else ""))  # fmt: skip
            del ref
        del x, w, dy
    print(f"# these shapes per step: cuBLAS {totals['cuBLAS']:.1f} ms, QuACK {totals['QuACK']:.1f} ms, "
          f"the faster of the two per shape and pass {totals['best']:.1f} ms")  # fmt: skip


def require_quack(script: str, *modules: str) -> list:
    """QuACK's `modules` (e.g. "quack.gemm_interface") imported, or a stop naming what `script` needs:
    a Hopper (sm90) or newer GPU, and quack-kernels installed."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit(f"{script} needs a Hopper (sm90) or newer GPU: QuACK's GEMMs target it")
    try:
        return [importlib.import_module(name) for name in modules]
    except ImportError as exc:
        raise SystemExit(f"{script} needs quack-kernels ({exc}): pip install '.[quack]'") from exc


def main(argv: list[str] | None = None) -> None:
    parser = step_shape_parser(__doc__)
    parser.add_argument("--parts", default="ffn,gemms", help="comma-separated: ffn, gemms")
    parser.add_argument(
        "--kernels", action="store_true", help="each FFN's kernels at the encoder's rows (profiler)"
    )
    parser.add_argument(
        "--tuned", action="store_true", help="let QuACK autotune each shape (slow first calls)"
    )
    parser.add_argument("--layers", default="", help="comma-separated layer names or prefixes (default: all)")
    parser.add_argument(
        "--passes", default="forward,input grad,weight grad", help="comma-separated: forward, input grad, weight grad"
    )
    parser.add_argument("--split-k", choices=("1", "auto"), default="1", help="QuACK's K split: none, or autotuned")
    args = parser.parse_args(argv)
    parts = comma_choices(args.parts, ["ffn", "gemms"], "--parts", "part")
    args.passes = comma_choices(args.passes, PASSES, "--passes", "pass")
    names = [shape[0] for shape in linear_shapes(T5Config.from_preset(args.preset), 1, 1, 1)]
    args.layers = chosen_layers(args.layers, names)
    quack, gemms, mlp = require_quack("benchmarks/quack_gemms.py", "quack", "quack.gemm_interface", "quack.mlp")
    quack_gemm, quack_mlp = gemms.gemm, mlp.mlp_func

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | quack-kernels {quack.__version__} | "
          f"{'autotuned' if args.tuned else 'default'} QuACK tiles")  # fmt: skip
    if "ffn" in parts:
        quack_ffn.load()
        quack_ffn.TUNED = args.tuned
        ffn_part(args, quack_mlp)
    if "gemms" in parts:
        gemm_part(args, quack_gemm)


if __name__ == "__main__":
    main()
