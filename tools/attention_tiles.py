"""Tile sweep of the fused attention kernels (training/model/triton_attention.py) on one GPU.

One attention of T5 base as the model runs it (`--shape`: the cases of tools/attention_backends.py),
with the bias's gradient where there is a bias. Each kernel is swept alone, the others at their
tiles: the forward (`fwd`) and the backward's kernels for this attention. Where the queries fit one
block (at most triton_attention.SHORT_QUERIES, as T5's 114 targets) that is the one-block kernel
(`oneblock`); else the dK/dV kernel (`dkdv`) and, with a bias, the kernel that computes dQ = dS K
from the stored dS (`dqds`), without one the kernel that recomputes the scores for dQ (`dq`). With
`--bias-layout row` (the bias as its relative row, as the model hands it from 4096 x 4096 query x key
pairs on) the backward is `dq` and the row's dK/dV kernel (`dkdvrow`, square tiles only).

Each setting (BLOCK_M, BLOCK_N, warps, stages) goes into the attention's entry of the kernel's table
in triton_attention.TILE_TABLES (the entry of triton_attention.tile_class) while the forward or the
whole backward is timed (the profiler's device time per call over `--iters` calls); the entry is put
back after. Prints the settings best first with their TFLOP/s, the current one marked, and the best
as the table entry to write into training/model/triton_attention.py.

    python tools/attention_tiles.py                            # encoder, batch 128: fwd, dkdv, dqds
    python tools/attention_tiles.py --shape dec                # 114 queries: fwd, oneblock
    python tools/attention_tiles.py --shape cross --kernels fwd
    python tools/attention_tiles.py --shape dec --lengths 512,512 --kernels dkdv
    python tools/attention_tiles.py --lengths 4096,4096 --batch-size 16 --bias-layout row
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_ms  # noqa: E402
from tools.attention_backends import SHAPES, Case  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402

SWEEPS = {  # kernel -> (its key in triton_attention.TILE_TABLES, BLOCK_M, BLOCK_N, warps, stages values)
    "fwd": ("FWD", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    "dkdv": ("DKDV", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    "dq": ("DQ", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    "dqds": ("DQDS", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    "dkdvrow": ("DKDV_ROW", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),  # square tiles of these
    # BLOCK_M of the one-block kernel is the most query rows it takes
    "oneblock": ("ONEBLOCK", (ta.SHORT_QUERIES,), (16, 32, 64, 128), (4, 8), (1, 2, 3)),
}


def backward_kernels(causal: bool, has_bias: bool, queries: int, row: bool = False) -> list[str]:
    """The kernels (SWEEPS keys) that the backward of such an attention runs (row: with the bias as
    its relative row)."""
    if row and has_bias:
        return ["dq", "dkdvrow"]
    if ta.one_block_applies(ta.tile_class(causal, has_bias, queries), queries):
        return ["oneblock"]
    return ["dkdv", "dqds" if has_bias else "dq"]


def timed_call(kernel: str, case: Case):
    """(call, attention FLOPs per call): the forward alone for `fwd`, else the whole backward (the
    other kernels at their tiles are the same in every row), through the model's
    `t5_flash_attention_packed`."""
    q_src = case.q_src.detach().requires_grad_()
    kv_src = case.kv_src.detach().requires_grad_() if case.kv_src.numel() else None
    bias = case.bias.detach().requires_grad_() if case.bias.numel() else None
    leaves = [t for t in (q_src, kv_src, bias) if t is not None]

    def attend():
        return ta.t5_flash_attention_packed(q_src, kv_src, case.h, bias, None, case.causal, case.far)

    if kernel == "fwd":

        def call():
            with torch.no_grad():
                attend()

        return call, case.flops()
    out = attend()

    def call():  # the backward alone, from the forward's saved tensors
        torch.autograd.grad(out, leaves, case.dout, retain_graph=True)

    return call, 2.5 * case.flops()  # the backward counted as 2.5x the forward, as FlashAttention does


def sweep(kernel: str, case: Case, args: argparse.Namespace) -> list[tuple[float, ta.Tiles]]:
    """Every setting of SWEEPS[kernel] in the attention's table entry, timed; the entry restored."""
    name, block_ms, block_ns, warps_list, stages_list = SWEEPS[kernel]
    call, flops = timed_call(kernel, case)
    table, key = ta.TILE_TABLES[name], ta.tile_class(case.causal, case.bias.numel() > 0, case.sq)
    current = table[key]
    rows = []
    settings = itertools.starmap(ta.Tiles, itertools.product(block_ms, block_ns, warps_list, stages_list))
    if name == "DKDV_ROW":  # the row's band of dS tiles lines up per diagonal only with square tiles
        settings = [tiles for tiles in settings if tiles.block_m == tiles.block_n]
    try:
        for tiles in settings:
            table[key] = tiles
            try:
                ms = kernel_ms(call, args.iters)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
                print(f"  {kernel} {tuple(tiles)}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append((ms, tiles))
    finally:
        table[key] = current
    rows.sort()
    what = "forward" if kernel == "fwd" else "whole backward"
    bias = {0: "no", 2: "row"}.get(case.bias.dim() if case.bias.numel() else 0, "dense")
    print(f"\n## {kernel} ({what}): {args.shape} b{case.b} {case.sq} x {case.sk} h{case.h} d{case.d}, "
          f"causal={'yes' if case.causal else 'no'}, bias={bias}, "
          f"TILE_TABLES[{name!r}][{key!r}]")  # fmt: skip
    print("| BLOCK_M | BLOCK_N | warps | stages | ms | TFLOP/s |\n|---|---|---|---|---|---|")
    shown = rows[: args.top] + [row for row in rows[args.top :] if row[1] == current]
    for ms, tiles in shown:
        mark = " (current)" if tiles == current else ""
        print(f"| {' | '.join(map(str, tiles))} | {ms:.4f}{mark} | {flops / ms / 1e9:.0f} |")
    if rows:
        print(f"best: TILE_TABLES[{name!r}][{key!r}] = {rows[0][1]!r}", flush=True)
    return rows


def parse_lengths(text: str, shape: str) -> tuple[int, int] | None:
    """"512,512" -> (512, 512): queries and keys instead of the shape's (equal for self-attention)."""
    if not text:
        return None
    try:
        lengths = tuple(int(n) for n in text.split(","))
    except ValueError:
        lengths = ()
    if len(lengths) != 2 or min(lengths) < 1:
        raise SystemExit(f"--lengths {text}: give two positive integers, QUERIES,KEYS (e.g. 512,512)")
    if shape != "cross" and lengths[0] != lengths[1]:
        raise SystemExit(f"--lengths {text}: {shape} is a self-attention, so queries and keys are one "
                         f"sequence: give equal lengths, or --shape cross")  # fmt: skip
    return lengths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="enc", choices=list(SHAPES),
                        help="the encoder's self-attention, the decoder's, or the cross-attention")  # fmt: skip
    parser.add_argument("--lengths", default="",
                        help="QUERIES,KEYS instead of the shape's lengths (equal for enc and dec), e.g. 512,512")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-kv", type=int, default=64)
    parser.add_argument("--kernels", default="",
                        help=f"comma list of {', '.join(SWEEPS)} (default: the forward and the backward's kernels)")
    parser.add_argument("--bias-layout", default="dense", choices=("dense", "row"),
                        help="T5's bias as (heads, queries, keys), or as its relative row (long inputs)")  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=6, help="rows printed per kernel")
    args = parser.parse_args(argv)
    lengths = parse_lengths(args.lengths, args.shape)
    queries, _, causal, has_bias = SHAPES[args.shape]
    queries = lengths[0] if lengths else queries
    runs = ["fwd", *backward_kernels(causal, has_bias, queries, args.bias_layout == "row")]
    kernels = [k.strip() for k in args.kernels.split(",")] if args.kernels else runs
    for kernel in kernels:
        if kernel not in runs:
            raise SystemExit(f"--kernels {kernel}: the {args.shape} attention with {queries} queries runs the "
                             f"kernels {', '.join(runs)}")  # fmt: skip
    if not ta.available():
        raise SystemExit("tools/attention_tiles.py needs triton and a CUDA GPU")
    case = Case(args.shape, args.batch_size, args.heads, args.d_kv, lengths=lengths, bias_layout=args.bias_layout)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    for kernel in kernels:
        sweep(kernel, case, args)


if __name__ == "__main__":
    main()
