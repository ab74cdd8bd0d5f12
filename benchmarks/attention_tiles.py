"""Tile sweep of the fused T5 attention kernels (training/model/triton_attention.py) on one GPU.

One attention of T5 base as the model runs it (`--shape`, the shapes of
benchmarks/attention_backends.py): the encoder's self-attention (512 x 512, T5's bias), the
decoder's (114 x 114, causal, bias) or the cross-attention (114 x 512, no bias), from packed bf16
projection outputs, the bias's gradient included where there is one. Each kernel is swept alone,
the others at their defaults: the forward, the dK/dV kernel and the dQ kernel, or, where the
backward takes dQ from the dS that the dK/dV kernel stores, the kernel that computes dQ = dS K
(`dqds`); where the queries fit one block (the decoder's and the cross-attention's 114), the
one-block kernel that computes the whole backward (`oneblock`). Prints the GPU time per call (the
profiler's device time of every kernel of the call, averaged over `--iters` calls, so launch gaps
at the small shapes do not count) and the attention TFLOP/s of each configuration, best first, and the winner as environment variables. The swept
entry, and the default it is compared with, is the tiles of the shape's class
(triton_attention.tile_class: the kind of attention, and whether its queries are short).

    python benchmarks/attention_tiles.py                    # encoder, batch 128, the full sweep
    python benchmarks/attention_tiles.py --shape dec --kernels oneblock    # 114 queries: the one-block backward
    python benchmarks/attention_tiles.py --shape dec --no-one-block --kernels dkdv,dqds
    python benchmarks/attention_tiles.py --shape cross --kernels fwd
    python benchmarks/attention_tiles.py --shape dec --lengths 512,512 --kernels dkdv
    python benchmarks/attention_tiles.py --kernels dkdv,dq --dq-path recompute
    python benchmarks/attention_tiles.py --kernels fwd,dkdv,dqds --maxnreg 96,128,168

`--maxnreg` times each kernel at its default tiles with each cap on the registers a thread may use
(Triton's `maxnreg` launch option) instead of sweeping tiles, and prints the registers and spills
the compiler reports for each.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_backends import SHAPES, Case  # noqa: E402
from benchmarks.cuda_timing import kernel_ms  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402

SWEEPS = {  # kernel -> (its key in triton_attention.TILE_TABLES, BLOCK_M, BLOCK_N, warps, stages values)
    "fwd": ("FWD", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    "dkdv": ("DKDV", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    "dq": ("DQ", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    "dqds": ("DQDS", (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),  # dQ = dS K (DQ_PATH "stored")
    # the one-block backward of short queries (ONE_BLOCK_BWD): BLOCK_M is the most query rows it takes
    "oneblock": ("ONEBLOCK", (ta.SHORT_QUERIES,), (16, 32, 64, 128), (4, 8), (1, 2, 3)),
}


KERNEL_FUNCTIONS = {"fwd": "_fwd_kernel", "dkdv": "_bwd_dkdv_kernel", "dq": "_bwd_dq_kernel",
                    "dqds": "_bwd_dq_from_ds_kernel", "oneblock": "_bwd_one_block_kernel"}  # fmt: skip


def timed_call(kernel: str, case: Case):
    """(call, model FLOPs per call): the forward alone for `fwd`, else the whole backward (the
    other kernels at their default tiles are constant between rows)."""
    mask = case.q_src.new_empty((0,), dtype=torch.uint8)
    out, lse = ta._launch_fwd(case.q_src, case.kv_src, case.bias, mask, case.causal, case.h, case.far)
    # model FLOPs of attention: forward QK^T + PV; the backward counted as 2.5x (as FlashAttention does)
    flops = case.flops() * (1.0 if kernel == "fwd" else 2.5)
    if kernel == "fwd":

        def call():
            ta._launch_fwd(case.q_src, case.kv_src, case.bias, mask, case.causal, case.h, case.far)
    else:  # the whole backward: the other kernels at their default tiles are constant between rows

        def call():
            ta._launch_bwd(case.q_src, case.kv_src, case.bias, mask, out, lse, case.dout, case.causal, case.h,
                           case.far)  # fmt: skip

    return call, flops


def sweep(kernel: str, case: Case, args: argparse.Namespace) -> list[tuple[float, tuple]]:
    prefix, block_ms, block_ns, warps_list, stages_list = SWEEPS[kernel]
    call, flops = timed_call(kernel, case)
    table, key = ta.TILE_TABLES[prefix], ta.tile_class(case.causal, case.bias.numel() > 0, case.sq)
    default = table[key]
    rows = []
    for tiles in itertools.starmap(ta.Tiles, itertools.product(block_ms, block_ns, warps_list, stages_list)):
        table[key] = tiles
        try:
            ms = kernel_ms(call, args.iters)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this tile
            print(f"  {kernel} {tiles}: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows.append((ms, tiles))
    table[key] = default
    rows.sort()
    what = "forward" if kernel == "fwd" else f"whole backward (dQ + dK/dV + dbias sum; dQ {ta.DQ_PATH})"
    what = "whole backward (the one-block kernel + dbias sum)" if kernel == "oneblock" else what
    print(f"\n## {kernel}: {what}, {args.shape} b{case.b} {case.sq} x {case.sk} h{case.h} d{case.d}, "
          f"causal={'yes' if case.causal else 'no'}, bias={'yes' if case.bias.numel() else 'no'}, "
          f"tiles of class {key!r}")  # fmt: skip
    print("| BLOCK_M | BLOCK_N | warps | stages | ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for ms, cfg in rows[: args.top]:
        mark = " (default)" if cfg == default else ""
        print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {ms:.4f}{mark} | {flops / ms / 1e9:.0f} |")
    for ms, cfg in rows:
        if cfg == default and cfg not in [c for _, c in rows[: args.top]]:
            print(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {cfg[3]} | {ms:.4f} (default) | |")
    if rows:
        bm, bn, w, st = rows[0][1]
        env = f"T5DS_ATTN_{prefix}_BM={bm} T5DS_ATTN_{prefix}_BN={bn} T5DS_ATTN_{prefix}_WARPS={w} "
        print(f"best: {env}T5DS_ATTN_{prefix}_STAGES={st} (the variables set every class)", flush=True)
    return rows


@contextmanager
def register_cap(kernel: str, cap: int | None):
    """Launches of `kernel`'s Triton function ask the compiler for at most `cap` registers a thread
    (the `maxnreg` launch option; None: no cap) inside the block."""
    fn = getattr(ta, KERNEL_FUNCTIONS[kernel])
    if cap is not None:  # an instance attribute: `fn[grid](...)` calls self.run
        fn.run = functools.partial(type(fn).run, fn, maxnreg=cap)
    try:
        yield
    finally:
        fn.__dict__.pop("run", None)


def last_compiled_registers(kernel: str) -> str:
    """"registers / spills" of the variant of `kernel` compiled last (Triton's kernel cache keeps
    them in insertion order), or "?" where this Triton version keeps them elsewhere."""
    try:
        caches = next(iter(getattr(ta, KERNEL_FUNCTIONS[kernel]).device_caches.values()))
        compiled = list(caches[0].values())[-1]
        return f"{compiled.n_regs} / {compiled.n_spills}"
    except (AttributeError, IndexError, StopIteration, TypeError):
        return "?"


def sweep_registers(kernel: str, case: Case, args: argparse.Namespace) -> None:
    """The kernel's default tiles, uncapped and with each cap of --maxnreg."""
    call, flops = timed_call(kernel, case)
    key = ta.tile_class(case.causal, case.bias.numel() > 0, case.sq)
    tiles = ta.TILE_TABLES[SWEEPS[kernel][0]][key]
    print(f"\n## {kernel}: register caps, {args.shape} b{case.b} {case.sq} x {case.sk}, tiles {tuple(tiles)} "
          f"of class {key!r}")  # fmt: skip
    print("| maxnreg | registers / spills a thread | ms | TFLOP/s |")
    print("|---|---|---|---|")
    for cap in (None, *args.maxnreg):
        with register_cap(kernel, cap):
            try:
                ms = kernel_ms(call, args.iters)
            except Exception as e:  # noqa: BLE001 - a cap the compiler refuses is a result too
                print(f"| {cap} | {type(e).__name__}: {str(e)[:120]} | | |")
                continue
        print(f"| {cap or 'none'} | {last_compiled_registers(kernel)} | {ms:.4f} | {flops / ms / 1e9:.0f} |",
              flush=True)  # fmt: skip


def parse_caps(text: str) -> list[int]:
    """"96,128" -> [96, 128]: register caps a thread, each within what a CUDA thread can hold (16-255)."""
    try:
        caps = [int(c) for c in text.split(",")] if text else []
    except ValueError:
        caps = [0]
    if any(not 16 <= c <= 255 for c in caps):
        raise SystemExit(f"--maxnreg {text}: give a comma list of register counts between 16 and 255, e.g. 96,128,168")
    return caps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="enc", choices=list(SHAPES),
                        help="the encoder's self-attention, the decoder's, or the cross-attention")  # fmt: skip
    parser.add_argument("--lengths", default="",
                        help="QUERIES,KEYS instead of the shape's lengths (equal for enc and dec), e.g. 512,512")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-kv", type=int, default=64)
    parser.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                        help="--no-bias drops the shape's bias (default: the shape's own, none for cross)")  # fmt: skip
    parser.add_argument("--kernels", default="",
                        help="comma list of fwd, dkdv, dq, dqds, oneblock (default: the forward and the backward's "
                             "kernels)")  # fmt: skip
    parser.add_argument("--dq-path", default=ta.DQ_PATH, choices=ta.DQ_PATHS,
                        help="the backward's dQ path (triton_attention.DQ_PATH); dqds needs stored or stored_bias")
    parser.add_argument("--one-block", action=argparse.BooleanOptionalAction, default=ta.ONE_BLOCK_BWD,
                        help="the one-block backward where the queries are short (triton_attention.ONE_BLOCK_BWD); "
                             "--no-one-block sweeps the dK/dV and dQ kernels there")  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=6, help="rows printed per kernel")
    parser.add_argument("--maxnreg", default="",
                        help="comma list of register caps a thread (e.g. 96,128,168): time each kernel's default "
                             "tiles with each cap instead of sweeping tiles")  # fmt: skip
    args = parser.parse_args()
    args.maxnreg = parse_caps(args.maxnreg)
    has_bias = SHAPES[args.shape][3]
    lengths = None
    if args.lengths:
        try:
            lengths = tuple(int(n) for n in args.lengths.split(","))
        except ValueError:
            lengths = ()
        if len(lengths) != 2 or min(lengths) < 1:
            raise SystemExit(f"--lengths {args.lengths}: give two positive integers, QUERIES,KEYS (e.g. 512,512)")
        if args.shape != "cross" and lengths[0] != lengths[1]:
            raise SystemExit(f"--lengths {args.lengths}: {args.shape} is a self-attention, so queries and keys "
                             f"are one sequence: give equal lengths, or --shape cross")  # fmt: skip
    if args.bias and not has_bias:
        raise SystemExit(f"--bias: the {args.shape} attention has no bias in T5; leave the option out")
    has_bias = has_bias and args.bias is not False
    # the kernel that computes dQ with these settings: from the stored dS, or the recomputing dQ kernel
    dq_kernel = "dqds" if args.dq_path == "stored" or (args.dq_path == "stored_bias" and has_bias) else "dq"
    ta.ONE_BLOCK_BWD = args.one_block
    queries = lengths[0] if lengths else SHAPES[args.shape][0]
    key = ta.tile_class(SHAPES[args.shape][2], has_bias, queries)
    one_block = ta.one_block_applies(key, queries, has_bias)
    default_kernels = "fwd,oneblock" if one_block else f"fwd,dkdv,{dq_kernel}"
    kernels = [k.strip() for k in (args.kernels or default_kernels).split(",")]
    other = {"dq": "dqds", "dqds": "dq"}[dq_kernel]
    if one_block and set(kernels) & {"dkdv", "dq", "dqds"}:
        raise SystemExit(f"--kernels {args.kernels}: {queries} queries fit one block, so the backward runs the "
                         f"one-block kernel (oneblock): add --no-one-block to sweep the dK/dV and dQ kernels")  # fmt: skip
    if not one_block and "oneblock" in kernels:
        raise SystemExit(f"--kernels oneblock: the backward runs the one-block kernel only with at most "
                         f"{ta.SHORT_QUERIES} queries (--shape dec or cross) and without --no-one-block")  # fmt: skip
    if other in kernels:
        raise SystemExit(f"--kernels {other}: with --dq-path {args.dq_path} and {'a' if has_bias else 'no'} bias "
                         f"the backward runs {dq_kernel}, not {other} (dqds needs --dq-path stored, or stored_bias "
                         f"with a bias; dq needs recompute)")  # fmt: skip
    if not ta.available():
        raise SystemExit("benchmarks/attention_tiles.py needs triton and a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | DQ_PATH {args.dq_path}")
    ta.DQ_PATH = args.dq_path
    case = Case(args.shape, args.batch_size, args.heads, args.d_kv, lengths=lengths)
    if not has_bias:
        case.bias, case.far = case.bias.new_empty((0,)), 0
    for kernel in kernels:
        (sweep_registers if args.maxnreg else sweep)(kernel, case, args)


if __name__ == "__main__":
    main()
