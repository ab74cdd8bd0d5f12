"""Tile sweep of the fused T5 attention kernels (training/model/triton_attention.py) on one GPU.

One encoder self-attention of T5 base as the model runs it: a packed (batch, seq, 3 * heads * d_kv)
bf16 projection output, the (heads, seq, seq) fp32 bias with its gradient. Each kernel is swept
alone, the others at their defaults: the forward, the dK/dV kernel and the dQ kernel (which also
writes dS for the bias gradient), or with `--dq-path stored` the dK/dV kernel writing dS and the
kernel that computes dQ = dS K from it (`dqds`). Prints ms per call (median of `--iters`, CUDA
events) and the attention TFLOP/s of each configuration, best first, and the winners as environment
variables.

    python benchmarks/attention_tiles.py                    # batch 128, seq 512, the full sweep
    python benchmarks/attention_tiles.py --kernels dkdv --no-bias
    python benchmarks/attention_tiles.py --kernels dkdv,dq --dq-path recompute
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import median_cuda_ms  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402

SWEEPS = {  # kernel -> (module attribute prefix, BLOCK_M, BLOCK_N, warps, stages values)
    "fwd": ("FWD", (64, 128), (64, 128), (4, 8), (3,)),  # swept wider in the fourth session
    "dkdv": ("DKDV", (32, 64), (64, 128), (4, 8), (2, 3, 4)),
    "dq": ("DQ", (64, 128), (32, 64), (4, 8), (2, 3, 4)),
    "dqds": ("DQDS", (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)),  # dQ = dS K (DQ_PATH "stored")
}


def sweep(kernel: str, args: argparse.Namespace) -> list[tuple[float, tuple]]:
    prefix, block_ms, block_ns, warps_list, stages_list = SWEEPS[kernel]
    device = torch.device("cuda")
    b, s, h, d = args.batch_size, args.seq, args.heads, args.d_kv
    qkv = torch.randn(b, s, 3 * h * d, device=device, dtype=torch.bfloat16)
    bias = torch.randn(h, s, s, device=device) if args.bias else qkv.new_empty((0,), dtype=torch.float32)
    mask = qkv.new_empty((0,), dtype=torch.uint8)
    empty = qkv.new_empty((0,))
    out, lse = ta._launch_fwd(qkv, empty, bias, mask, False, h)
    dout = torch.randn_like(out)
    # model FLOPs of attention: forward QK^T + PV; the backward counted as 2.5x (as FlashAttention does)
    flops = 4 * b * h * s * s * d * (1.0 if kernel == "fwd" else 2.5)
    if kernel == "fwd":

        def call():
            ta._launch_fwd(qkv, empty, bias, mask, False, h)
    else:  # the whole backward: the other kernel at its default tiles is constant between rows

        def call():
            ta._launch_bwd(qkv, empty, bias, mask, out, lse, dout, False, h)

    saved = {n: getattr(ta, f"{prefix}_{n}") for n in ("BLOCK_M", "BLOCK_N", "WARPS", "STAGES")}
    rows = []
    for bm, bn, warps, stages in itertools.product(block_ms, block_ns, warps_list, stages_list):
        for name, value in zip(("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"), (bm, bn, warps, stages)):
            setattr(ta, f"{prefix}_{name}", value)
        try:
            ms = median_cuda_ms(call, args.iters)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
            print(f"  {kernel} bm{bm} bn{bn} w{warps} s{stages}: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows.append((ms, (bm, bn, warps, stages)))
    for name, value in saved.items():
        setattr(ta, f"{prefix}_{name}", value)
    rows.sort()
    what = "forward" if kernel == "fwd" else f"whole backward (dQ + dK/dV + dbias sum; dQ {ta.DQ_PATH})"
    print(f"\n## {kernel}: {what}, b{b} s{s} h{h} d{d}, bias={'yes' if args.bias else 'no'}")
    print("| BLOCK_M | BLOCK_N | warps | stages | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    default = tuple(saved.values())
    for ms, cfg in rows[: args.top]:
        mark = " (default)" if cfg == default else ""
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {ms:.3f}{mark} | {flops / ms / 1e9:.0f} |")
    for ms, cfg in rows:
        if cfg == default and cfg not in [c for _, c in rows[: args.top]]:
            print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {ms:.3f} (default) | |")
    if rows:
        bm, bn, w, st = rows[0][1]
        env = f"T5DS_ATTN_{prefix}_BM={bm} T5DS_ATTN_{prefix}_BN={bn} T5DS_ATTN_{prefix}_WARPS={w} "
        print(f"best: {env}T5DS_ATTN_{prefix}_STAGES={st}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-kv", type=int, default=64)
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--kernels", default="",
                        help="comma list of fwd, dkdv, dq, dqds (default: the forward and the backward's kernels)")
    parser.add_argument("--dq-path", default=ta.DQ_PATH, choices=ta.DQ_PATHS,
                        help="the backward's dQ path (triton_attention.DQ_PATH); dqds needs stored or stored_bias")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=6, help="rows printed per kernel")
    args = parser.parse_args()
    # the kernel that computes dQ with these settings: from the stored dS, or the recomputing dQ kernel
    dq_kernel = "dqds" if args.dq_path == "stored" or (args.dq_path == "stored_bias" and args.bias) else "dq"
    kernels = [k.strip() for k in (args.kernels or f"fwd,dkdv,{dq_kernel}").split(",")]
    other = {"dq": "dqds", "dqds": "dq"}[dq_kernel]
    if other in kernels:
        raise SystemExit(f"--kernels {other}: with --dq-path {args.dq_path} and {'a' if args.bias else 'no'} bias "
                         f"the backward runs {dq_kernel}, not {other} (dqds needs --dq-path stored, or stored_bias "
                         f"with --bias; dq needs recompute)")  # fmt: skip
    if not ta.available():
        raise SystemExit("benchmarks/attention_tiles.py needs triton and a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | DQ_PATH {args.dq_path}")
    ta.DQ_PATH = args.dq_path
    for kernel in kernels:
        sweep(kernel, args)


if __name__ == "__main__":
    main()
