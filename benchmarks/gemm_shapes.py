"""cuBLAS time of every linear-layer GEMM shape of a T5 training step, against the matmul ceiling.

A T5 v1.1 step at batch B, inputs S, targets T runs each linear layer three times: the forward
(x @ W^T), the input gradient (dy @ W) and the weight gradient (dy^T @ x), with B*S rows in the
encoder and B*T in the decoder; the lm_head runs in the fused cross-entropy's chunks of 2048 rows.
For each shape this prints ms per call (median of `--iters`, CUDA events, bf16 operands as under
autocast), TFLOP/s, how often a step runs it and its ms per step, then the sum: how far the linear
layers are from the bf16 8192^3 matmul measured in the same run (`training.model.flops`).

    python benchmarks/gemm_shapes.py                       # T5 base, batch 128, 512 -> 114
    python benchmarks/gemm_shapes.py --preset large --batch-size 64
    python benchmarks/gemm_shapes.py --merge-cross-kv      # the decoder's cross k/v as one GEMM
    python benchmarks/gemm_shapes.py --inductor --layers "decoder self,decoder wi,decoder wo"

`--merge-cross-kv` times what the step's GEMMs would be if the cross-attention k/v projections of
all decoder layers (they all read the encoder output) ran as one GEMM: rows x d_model x (layers x 2
x inner) once, instead of rows x d_model x (2 x inner) once per layer. The model does not do that;
this measures whether it would pay.

`--inductor` also times each GEMM as torch.compile's max-autotune (`max-autotune-no-cudagraphs`)
compiles it on its own: inductor times cuBLAS against its Triton matmul templates for that shape and
layout and keeps the fastest, which says how much a Triton GEMM could take out of a shape where
cuBLAS is slow (8-20 s of tuning per GEMM; `--layers` picks the layers). Both columns are then the
profiler's kernel time per call (a compiled call's host-side guards outlast these GEMMs).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_ms, median_cuda_ms  # noqa: E402
from training.model import T5Config  # noqa: E402
from training.model.flops import measure_matmul_tflops  # noqa: E402

CE_CHUNK_ROWS = 2048  # training.model.cross_entropy's default chunk


def linear_shapes(
    config: T5Config, batch: int, inputs: int, targets: int, merge_cross_kv: bool = False
) -> list[tuple[str, int, int, int, int]]:
    """(name, rows, in_features, out_features, calls per step) of every linear layer's forward,
    as the model runs them (q/k/v, cross-attention k/v and wi_0/wi_1 concatenated into one GEMM).
    `merge_cross_kv`: the cross-attention k/v of all decoder layers as one GEMM (same FLOPs)."""
    d, inner, ff, vocab = config.d_model, config.num_heads * config.d_kv, config.d_ff, config.vocab_size
    enc, dec = batch * inputs, batch * targets
    n_enc, n_dec = config.num_layers, config.num_decoder_layers
    wi = 2 * ff if config.feed_forward_proj == "gated-gelu" else ff
    chunks, tail = divmod(dec, CE_CHUNK_ROWS)
    shapes = [
        ("encoder qkv", enc, d, 3 * inner, n_enc), ("encoder o", enc, inner, d, n_enc),
        ("encoder wi", enc, d, wi, n_enc), ("encoder wo", enc, ff, d, n_enc),
        ("decoder self qkv", dec, d, 3 * inner, n_dec), ("decoder self o, cross q, cross o", dec, d, d, 3 * n_dec),
        ("decoder cross kv (encoder output)", enc, d, 2 * inner, n_dec) if not merge_cross_kv
        else ("decoder cross kv, all layers in one GEMM", enc, d, 2 * inner * n_dec, 1),
        ("decoder wi", dec, d, wi, n_dec), ("decoder wo", dec, ff, d, n_dec),
        ("lm_head chunk", CE_CHUNK_ROWS, d, vocab, chunks),
    ]  # fmt: skip
    if tail:
        shapes.append(("lm_head last chunk", tail, d, vocab, 1))
    return shapes


def step_layer_operands(
    config: T5Config, args: argparse.Namespace, device, merge_cross_kv: bool = False, layers=None
):
    """Each linear layer of the step (`linear_shapes` at the batch and lengths of `args`, from
    `step_shape_parser`) as (name, calls per step, x, w, dy): random bf16 operands as under autocast,
    input x (rows, in), weight w (out, in) and output gradient dy (rows, out), made one layer at a
    time so that only one layer's are held. `layers`: the names to make (`chosen_layers`); None: all."""
    for name, rows, k_in, n_out, calls in linear_shapes(
        config, args.batch_size, args.input_length, args.target_length, merge_cross_kv
    ):
        if layers is not None and name not in layers:
            continue
        x = torch.randn(rows, k_in, device=device, dtype=torch.bfloat16)
        w = torch.randn(n_out, k_in, device=device, dtype=torch.bfloat16)
        dy = torch.randn(rows, n_out, device=device, dtype=torch.bfloat16)
        yield name, calls, x, w, dy
        del x, w, dy


PASSES = ("forward", "input grad", "weight grad")  # the GEMMs of a linear layer, as `autograd_passes` names them


def autograd_passes(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple:
    """(pass, A, B) of each GEMM A @ B a linear layer runs, in the layouts autograd hands cuBLAS."""
    return tuple(zip(PASSES, (x, dy, dy.t()), (w.t(), w, x)))


def step_shape_parser(description: str) -> argparse.ArgumentParser:
    """The arguments of the GEMM-shape benchmarks: the model preset, the step's batch and lengths,
    and the timed calls per shape."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--iters", type=int, default=20)
    return parser


def chosen_layers(text: str | None, names: list[str]) -> list[str]:
    """The layers a `--layers` option names: comma-separated layer names, or prefixes such as
    "encoder" (a name may itself hold commas, and is chosen by a prefix of it: "decoder self o").
    All of them for None or ""; an item that no name starts with stops the script with the names."""
    if not text:
        return names
    prefixes = [part.strip() for part in text.split(",")]
    for prefix in prefixes:
        if not any(name.startswith(prefix) for name in names):
            raise SystemExit(f"--layers: no layer named {prefix!r} or starting so; the layers: {'; '.join(names)}")
    return [name for name in names if any(name.startswith(prefix) for prefix in prefixes)]


def main(argv: list[str] | None = None) -> None:
    parser = step_shape_parser(__doc__)
    parser.add_argument("--merge-cross-kv", action="store_true", help="the decoder's cross k/v as one GEMM")
    parser.add_argument("--inductor", action="store_true",
                        help="also time each GEMM as max-autotune compiles it (cuBLAS or a Triton template)")
    parser.add_argument("--layers", default=None,
                        help="comma-separated layer names or prefixes such as 'encoder' (default: all)")
    args = parser.parse_args(argv)
    config = T5Config.from_preset(args.preset)
    names = [name for name, *_ in linear_shapes(config, 1, 1, 1, args.merge_cross_kv)]
    layers = chosen_layers(args.layers, names)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gemm_shapes.py needs a CUDA GPU (it times cuBLAS)")
    device = torch.device("cuda")
    ceiling = measure_matmul_tflops(device)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 8192^3 matmul {ceiling:.0f} TFLOP/s")
    tuned_cols = " | max-autotune ms | TFLOP/s | saved ms/step" if args.inductor else ""
    print(f"| layer | pass | (M x K) @ (K x N) | ms | TFLOP/s | of ceiling | per step | ms/step{tuned_cols} |")
    print("|---|---|---|---|---|---|---|---|" + "---|---|---|" * args.inductor)
    total_ms = total_flop = total_saved = 0.0
    for name, calls, x, w, dy in step_layer_operands(config, args, device, args.merge_cross_kv, layers):
        passes = autograd_passes(x, w, dy)
        for label, a, b in passes:
            (m, k), n = a.shape, b.shape[1]
            cublas = functools.partial(torch.matmul, a, b)
            # --inductor: the profiler's kernel time, for both columns, since a compiled call's guards
            # and wrapper take longer on the host than these GEMMs on the GPU, which CUDA events
            # around one call would count
            ms = kernel_ms(cublas, args.iters) if args.inductor else median_cuda_ms(cublas, args.iters, warmup=3)
            tflops = 2 * m * k * n / ms / 1e9
            total_ms += ms * calls
            total_flop += 2 * m * k * n * calls
            row = (f"| {name} | {label} | ({m} x {k}) @ ({k} x {n}) | {ms:.4f} | {tflops:.0f} | "
                   f"{tflops / ceiling:.0%} | {calls} | {ms * calls:.2f} |")  # fmt: skip
            if args.inductor:  # a fresh compile per GEMM: each is its own graph, tuned for its shape
                torch._dynamo.reset()
                tuned = torch.compile(torch.matmul, mode="max-autotune-no-cudagraphs", dynamic=False)
                tuned(a, b)  # tunes
                tuned_ms = kernel_ms(functools.partial(tuned, a, b), args.iters)
                total_saved += (ms - tuned_ms) * calls
                row += f" {tuned_ms:.4f} | {2 * m * k * n / tuned_ms / 1e9:.0f} | {(ms - tuned_ms) * calls:.2f} |"
            print(row)
        del x, w, dy, passes, a, b
    what = "linear layers" if layers == names else "these layers"
    print(f"# {what}: {total_ms:.1f} ms per step at {total_flop / total_ms / 1e9:.0f} TFLOP/s "
          f"({total_flop / total_ms / 1e9 / ceiling:.0%} of the ceiling); at the ceiling: "
          f"{total_flop / ceiling / 1e9:.1f} ms")  # fmt: skip
    if args.inductor:
        print(f"# max-autotune's GEMMs would save {total_saved:.2f} ms per step on these layers")


if __name__ == "__main__":
    main()
