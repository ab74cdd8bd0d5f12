"""The bias gradient's batch sum of the stored dS alone, at T5 base's encoder shape: the whole sum
(`_ds_batch_sum_kernel`, DS_SUM "kernel") against the far regions' row identity
(`_ds_batch_sum_far_kernel`, DS_SUM "far"), for a sweep of the latter's blocks.

dS is random bf16 with each row summing to 0, as the backward's does; the far sum's result is checked
per far region and row against the whole sum's (largest difference over the largest row sum). Times
are CUDA events, median of --iters calls after 2 warm-up calls, with the GB/s the whole sum's bytes
would take at that time.

    python benchmarks/ds_batch_sum.py
    python benchmarks/ds_batch_sum.py --blocks 4x64,8x64,8x32 --batch-steps 2,4,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import median_cuda_ms  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402
from training.model import triton_bias_grad as bg  # noqa: E402
from training.model.attention import bias_saturation_distance  # noqa: E402


def far_regions(sq: int, sk: int, far: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (sq, sk) masks of the keys >= query + far and of the keys <= query - far: where T5's
    bias saturates, each a region of one bias value per head."""
    offset = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
    return offset >= far, offset <= -far


def region_error(got: torch.Tensor, whole: torch.Tensor, far: int) -> float:
    """Largest difference of the far regions' row sums and of the band's elements, over the largest
    row sum of |whole|."""
    right, left = far_regions(*whole.shape[-2:], far, whole.device)
    band = ~(right | left)
    scale = (whole.abs().sum(-1)).max()
    diffs = [((got - whole) * region).sum(-1).abs().max() for region in (right, left)]
    diffs.append((got - whole)[:, band].abs().max())
    return float(max(diffs) / scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--blocks", default="8x64,16x64,32x32",
                        help="comma list of ROWSxCOLS for the far sum")  # fmt: skip
    parser.add_argument("--batch-steps", default="4,8", help="comma list of BLOCK_B (batch elements per step)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not ta.available():
        raise SystemExit("benchmarks/ds_batch_sum.py needs triton and a CUDA GPU")
    b, h, s = args.batch_size, args.heads, args.length
    far = bias_saturation_distance(True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ds = torch.randn(b, h, s, s, device="cuda", generator=g)
    ds -= ds.mean(-1, keepdim=True)
    ds = ds.to(torch.bfloat16)
    gb = ds.numel() * ds.element_size() / 1e9
    wrap = lambda kernel: kernel  # noqa: E731
    whole = bg.batch_sum(ds, wrap)
    defaults = bg.DS_FAR_ROWS, bg.DS_FAR_COLS, bg.DS_FAR_BLOCK_B, bg.DS_SUM_BLOCK_B
    print(f"# {torch.cuda.get_device_name()} | dS ({b}, {h}, {s}, {s}) bf16, {gb:.3f} GB | far {far}")
    print("| sum | ROWS x COLS | BLOCK_B | ms | GB/s of the whole dS | region error |")
    print("|---|---|---|---|---|---|")
    try:
        for steps in (int(x) for x in args.batch_steps.split(",")):
            bg.DS_SUM_BLOCK_B = steps
            ms = median_cuda_ms(lambda: bg.batch_sum(ds, wrap), args.iters)
            print(f"| whole | | {steps} | {ms:.4f} | {gb / ms * 1e3:.0f} | |")
        for block in args.blocks.split(","):
            rows, cols = (int(x) for x in block.split("x"))
            for steps in (int(x) for x in args.batch_steps.split(",")):
                bg.DS_FAR_ROWS, bg.DS_FAR_COLS, bg.DS_FAR_BLOCK_B = rows, cols, steps
                err = region_error(bg.batch_sum(ds, wrap, far), whole, far)
                ms = median_cuda_ms(lambda: bg.batch_sum(ds, wrap, far), args.iters)
                print(f"| far | {rows} x {cols} | {steps} | {ms:.4f} | {gb / ms * 1e3:.0f} | {err:.1e} |")
    finally:
        bg.DS_FAR_ROWS, bg.DS_FAR_COLS, bg.DS_FAR_BLOCK_B, bg.DS_SUM_BLOCK_B = defaults


if __name__ == "__main__":
    main()
