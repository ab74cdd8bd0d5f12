"""Does the bias gradient's batch sum of dS hide behind the GEMMs that follow it in the backward?

With T5's bias the encoder attention's backward stores dS, (B, H, SQ, SK) in bf16 (805 MB a layer at
batch 128), and `_ds_batch_sum_kernel` sums it over the batch into the bias gradient: ~0.27 ms per
encoder layer on an H100, 3.2 ms a step, spent reading memory while the tensor cores idle. Nothing in
the layer's backward waits for that sum: the bias gradient is only needed once all 12 layers have
added theirs. The GEMMs that follow it (the qkv projection's two gradients, then the previous
layer's FFN) are bound by the tensor cores. So the sum could run on a second CUDA stream beside them.

This times, for one encoder layer's worth of work on the encoder's 65536 rows:
- `sum`: the batch sum alone (our kernel, or torch's `ds.sum(0)` with `--sum torch`);
- `gemms`: the GEMMs that follow it alone (as autograd runs them, `--gemms` picks which);
- `serial`: the sum, then the GEMMs, on one stream (what the model does now);
- `overlap`: the sum on a second stream (priority `--priority`), the GEMMs on the current one, both
  waited for.
Each row is the median over `--rounds` rounds, in which the rows take turns, of the median
CUDA-event time of `--iters` calls. `saved` is serial minus overlap, and what that makes over the
step's 12 encoder layers.

    python benchmarks/stream_overlap.py
    python benchmarks/stream_overlap.py --gemms qkv --priority -1 --sum torch
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import median_cuda_ms  # noqa: E402
from benchmarks.gemm_shapes import autograd_passes  # noqa: E402
from benchmarks.options import comma_choices  # noqa: E402

# The GEMMs of an encoder layer's backward that follow its attention kernels, in the order autograd
# runs them (input gradient, then weight gradient, of each projection). "qkv": the attention's input
# projection; "ffn": the previous layer's FFN (wo, then the fused wi_0/wi_1), which comes after the
# add + norm backward between them.
GEMM_GROUPS = ("qkv", "ffn")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=512, help="encoder length (queries = keys)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--gemms", default=",".join(GEMM_GROUPS),
                   help=f"which GEMMs run beside the sum, comma-separated from {GEMM_GROUPS}")
    p.add_argument("--sum", choices=("kernel", "torch"), default="kernel",
                   help="our fixed-order batch-sum kernel (the model's DS_SUM) or torch's ds.sum(0)")
    p.add_argument("--priority", type=int, default=0,
                   help="the second stream's priority (0: as the current stream's; -1: higher)")
    p.add_argument("--iters", type=int, default=10, help="calls per row and round")
    p.add_argument("--rounds", type=int, default=7, help="rounds in which the rows take turns")
    args = p.parse_args(argv)
    args.gemms = comma_choices(args.gemms, GEMM_GROUPS, "--gemms", "GEMM group")
    return args


def gemm_calls(rows: int, d_model: int, d_ff: int, groups, device, dtype=torch.bfloat16):
    """The listed groups' backward GEMMs as zero-argument calls, on random bf16 operands."""
    calls = []

    def add(n_out: int, n_in: int):
        x = torch.randn(rows, n_in, device=device, dtype=dtype)
        w = torch.randn(n_out, n_in, device=device, dtype=dtype)
        dy = torch.randn(rows, n_out, device=device, dtype=dtype)
        for label, a, b in autograd_passes(x, w, dy):
            if label != "forward":  # the input gradient, then the weight gradient
                calls.append(functools.partial(torch.matmul, a, b))

    for group in groups:
        if group == "qkv":
            add(3 * d_model, d_model)
        else:
            add(d_model, d_ff)  # wo
            add(2 * d_ff, d_model)  # wi_0 and wi_1 as one
    return calls


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/stream_overlap.py times CUDA streams: it needs a CUDA GPU")
    from training.model import triton_bias_grad

    dev = torch.device("cuda")
    ds = torch.randn(args.batch, args.heads, args.seq, args.seq, device=dev, dtype=torch.bfloat16)
    if args.sum == "kernel":
        batch_sum = lambda: triton_bias_grad.batch_sum(ds, lambda k: k)  # noqa: E731
    else:
        batch_sum = lambda: ds.sum(0, dtype=torch.float32)  # noqa: E731
    gemms = gemm_calls(args.batch * args.seq, args.d_model, args.d_ff, args.gemms, dev)
    side = torch.cuda.Stream(device=dev, priority=args.priority)

    def run_gemms():
        for call in gemms:
            call()

    def serial():
        batch_sum()
        run_gemms()

    def overlap():
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)  # dS is written on the current stream
        with torch.cuda.stream(side):
            batch_sum()
        run_gemms()
        main_stream.wait_stream(side)  # the bias gradient is ready from here on

    fns = {"sum": batch_sum, "gemms": run_gemms, "serial": serial, "overlap": overlap}
    samples = {name: [] for name in fns}
    for _ in range(args.rounds):  # the rows take turns, so that clock and power drift hit them alike
        for name, fn in fns.items():
            samples[name].append(median_cuda_ms(fn, args.iters, warmup=2))
    rows = {name: statistics.median(times) for name, times in samples.items()}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; batch {args.batch}, "
          f"{args.heads} heads, {args.seq} x {args.seq}; GEMMs {','.join(args.gemms)} of "
          f"{args.batch * args.seq} rows; sum '{args.sum}'; second stream priority {args.priority}")
    print(f"| row | ms (median of {args.rounds} rounds' medians) | rounds' range |\n|---|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.3f} | {min(samples[name]):.3f}-{max(samples[name]):.3f} |")
    saved = rows["serial"] - rows["overlap"]
    print(f"saved by the second stream: {saved:.3f} ms per layer of the sum's {rows['sum']:.3f} "
          f"({saved / rows['sum']:.0%}); over 12 encoder layers {12 * saved:.2f} ms a step")


if __name__ == "__main__":
    main()
