"""The chunked lm_head + cross-entropy of a T5 step alone: GPU time per kernel, compiled as in the step.

`training/model/cross_entropy.py` forms the loss and both gradients in the forward pass, chunk by
chunk of `chunk_rows` target rows: per chunk a GEMM for the logits, the log-sum-exp and the
gradient of the logits (inductor's kernels), and two GEMMs for the gradients of the hidden states
and of the weight. This script runs that function on T5 base's shapes at batch 128 (14592 target
rows, d_model 768, vocabulary 32128; hidden states and weight in fp32 under bf16 autocast, as the
model holds them), forward and backward under torch.compile, and prints the GPU ms per call of the
whole and of every kernel (the profiler's device time over `--iters` calls), then the loss and the
gradients' norms, so that two checkouts can be compared for time and values:

    python benchmarks/cross_entropy.py
    (cd /path/to/old/checkout && python benchmarks/cross_entropy.py)   # e.g. before a change

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_table  # noqa: E402
from training.model.cross_entropy import fused_linear_cross_entropy  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128 * 114, help="target tokens (batch x target length)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--chunk-rows", type=int, default=2048, help="the model's default chunk")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/cross_entropy.py needs a CUDA GPU")

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.rows, args.d_model, device="cuda", generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.d_model, device="cuda", generator=gen) * args.d_model**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=gen)
    labels[::10] = -100  # padding, as T5's targets have

    @torch.compile(fullgraph=True)
    def forward():  # AOTAutograd compiles its backward as well
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=args.chunk_rows)

    def step():
        hidden.grad = weight.grad = None
        loss = forward()
        loss.backward()
        return loss

    step()  # compiles
    table = kernel_table(step, args.iters)
    total = sum(table.values())  # what kernel_ms would give, from this one profile rather than a second
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | rows {args.rows}, d_model "
          f"{args.d_model}, vocab {args.vocab}, chunks of {args.chunk_rows} | forward + backward, compiled")  # fmt: skip
    print(f"| all kernels | {total:.3f} ms per call |\n|---|---|")
    for name, ms in table.items():
        print(f"| {name[:110]} | {ms:.3f} |")
    loss = step()
    print(f"loss {loss.item():.6f} | grad norms: hidden {hidden.grad.norm().item():.6e}, "
          f"weight {weight.grad.norm().item():.6e}")  # fmt: skip


if __name__ == "__main__":
    main()
