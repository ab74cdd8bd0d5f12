"""dQ accumulated by atomic adds in the encoder's dK/dV kernel, as FlashAttention-3 does it, against
the model's dQ from the stored dS: what do the atomics cost in Triton on Hopper?

The model's encoder backward stores dS (B, H, 512, 512) in bf16 from `_bwd_dkdv_kernel` (805 MB a
layer at batch 128) and reads it back twice: `_bwd_dq_from_ds_kernel` computes dQ = dS K, and the
bias gradient's batch sum reads about half of it. FlashAttention-3 and -4 store no dS: their one
backward kernel adds each tile's dS K into an fp32 dQ buffer with atomic adds (TMA bulk reductions),
zeroed before and converted to bf16 after. For T5 the bias gradient still needs dS summed over the
batch per bias value, which the dK/dV kernel could only do without a store by reducing each tile per
bucket in registers (not written here). This script measures the half of that design that is
plain engineering, the atomics, on T5 base's encoder self-attention (batch 128, 512 x 512, 12 heads,
d_kv 64, bias), each row the dK/dV kernel plus what it needs to give dQ:

- `model`: `_bwd_dkdv_kernel` storing dS, then `_bwd_dq_from_ds_kernel` (the model's path; the batch
  sum that also reads dS is left out of every row);
- `red+ds` / `red`: the dK/dV kernel adding dS K into an fp32 dQ with per-element atomic adds
  (`tl.atomic_add`, relaxed), with or without the dS store; plus zeroing that buffer and converting
  it to bf16;
- `tma+ds` / `tma`: the same with each tile's dS K added by a TMA bulk reduction
  (`tensor_descriptor.atomic_add`);
- `nodq`: the dK/dV kernel with neither the dS store nor dQ: what is left of the loop when dQ and
  the dS round trip cost nothing.

Each variant's dK and dV must equal the model kernel's bit for bit, and its dQ (the same bf16 dS
tiles times K, summed in fp32 in another order, rounded to bf16) the model's to 2e-2 of its largest
element (checked; a row says why it failed otherwise; 3e-3 on an H100). Times are CUDA events over
--iters calls, each variant timed --rounds times, interleaved.

    python benchmarks/dq_atomics.py [--batch 128] [--warps 4,8] [--iters 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_tma import checked_times, encoder_inputs, run_model_kernel  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402

if ta.available():
    import triton
    import triton.language as tl

    from training.model import triton_attention_kernels as K

VARIANTS = {  # name: (dQ mode, dS stored); dQ mode 0 = none, 1 = per-element atomics, 2 = TMA reduction
    "red+ds": (1, True),
    "red": (1, False),
    "tma+ds": (2, True),
    "tma": (2, False),
    "nodq": (0, False),
}


if ta.available():
    # fmt: off
    @triton.jit
    def _dkdv_dq_atomic_kernel(Q, KV, BIAS, DO, LSE, DELTA, DKV, DS, DQ32, dq_desc,
                               sqb, sqs, skb, sks, sdob, sdos, sdkb, sdks, K_OFF, V_OFF, H, SQ, SK, LSE_STRIDE,
                               DQ_MODE: tl.constexpr, STORE_DS: tl.constexpr, D: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """`_bwd_dkdv_kernel` for whole tiles, a bias, no mask, not causal (the encoder's), which also
        adds each tile's dS K into DQ32, an fp32 (B, SQ, H * D) buffer (DQ_MODE 1: atomics per
        element; 2: through dq_desc, a TMA descriptor of it)."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        kt = K._load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, True)
        vt = K._load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, True)
        k = tl.trans(kt)
        dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        tl.assume(SQ > 0)  # as the model's kernel: else ptxas serializes the wgmma
        for sm in range(0, SQ, BLOCK_M):
            offs_m = sm + tl.arange(0, BLOCK_M)
            q = K._load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, True)
            do = K._load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, True)
            bias = K._bias_tile(BIAS, h, sm, n0, offs_m, offs_n, SQ, SK, 0, True, False, True)
            p, ds = K._probs_and_dscores(q, kt, vt, do, bias, BIAS, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                         0, LSE_STRIDE, True, False, False, True, False)
            ds_low = ds.to(q.dtype)
            if STORE_DS:
                K._store_ds_tile(DS, ds_low, bh, offs_m, offs_n, SQ, SK, True)
            if DQ_MODE == 1:
                rows = DQ32 + (b * SQ + offs_m[:, None]).to(tl.int64) * (H * D) + h * D + offs_d[None, :]
                tl.atomic_add(rows, tl.dot(ds_low, k), sem="relaxed")
            elif DQ_MODE == 2:
                dq_desc.atomic_add([b * SQ + sm, h * D], tl.dot(ds_low, k))
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dk += tl.dot(tl.trans(ds_low), q)
        K._store_rows(DKV + K_OFF, dk, b, h, offs_n, sdkb, sdks, SK, D)
        K._store_rows(DKV + V_OFF, dv, b, h, offs_n, sdkb, sdks, SK, D)
    # fmt: on


def run_model(x: dict, dkv: torch.Tensor, ds: torch.Tensor, dq: torch.Tensor, tiles) -> None:
    """The model's encoder path: the dK/dV kernel storing dS, then dQ = dS K from it (into the packed
    gradient's q columns, as `_launch_bwd` writes it)."""
    run_model_kernel(x, dkv, ds, tiles)
    qkv, H, D = x["qkv"], x["heads"], x["d_kv"]
    B, S = qkv.shape[:2]
    t = ta.DQDS_TILES["enc"]
    empty = torch.empty((0,), dtype=torch.float32, device="cuda")
    K._bwd_dq_from_ds_kernel[(triton.cdiv(S, t.block_m), B * H)](
        ds, qkv, dq, empty, *qkv.stride()[:2], *dq.stride()[:2], H * D, H, S, S, 0, 0,
        CAUSAL=False, IEEE=False, REL_GRAD=False, D=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        num_warps=t.warps, num_stages=t.stages, EVEN_M=True, EVEN_N=True,
    )  # fmt: skip


def run_atomic(x: dict, dkv: torch.Tensor, ds: torch.Tensor, dq: torch.Tensor, dq32: torch.Tensor, tiles,
               dq_mode: int, store_ds: bool) -> None:
    """The variant kernel with dQ32 zeroed before and converted into dq's q columns after (mode 0
    leaves dq alone)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    qkv, dout, H, D = x["qkv"], x["dout"], x["heads"], x["d_kv"]
    B, S = qkv.shape[:2]
    if dq_mode:
        dq32.zero_()
    desc = TensorDescriptor(dq32, [B * S, H * D], [H * D, 1], [tiles.block_m, D])
    _dkdv_dq_atomic_kernel[(triton.cdiv(S, tiles.block_n), B * H)](
        qkv, qkv, x["kbias"], dout, x["lse"], x["delta"], dkv, ds, dq32, desc,
        *qkv.stride()[:2], *qkv.stride()[:2], *dout.stride()[:2], *dkv.stride()[:2], H * D, 2 * H * D,
        H, S, S, B * H * S, DQ_MODE=dq_mode, STORE_DS=store_ds, D=D, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    if dq_mode:
        dq[..., : H * D].copy_(dq32.view(B, S, H * D))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--warps", default="4,8", help="comma list: the variants' warps per program")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2, help="each variant timed this many times, interleaved")
    args = parser.parse_args(argv)
    if not (ta.available() and torch.cuda.get_device_capability() >= (9, 0)):
        raise SystemExit("benchmarks/dq_atomics.py needs triton and an sm_90 (Hopper) GPU or newer")
    tiles = ta.DKDV_TILES["enc"]
    x = encoder_inputs(args.batch)
    B, S, H, D = args.batch, 512, x["heads"], x["d_kv"]
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"encoder backward, batch {B}, {S} x {S}, {H} heads, d_kv {D}, dK/dV tiles {tuple(tiles)}")  # fmt: skip
    ref_dkv, ref_ds = torch.zeros_like(x["qkv"]), torch.empty((B, H, S, S), dtype=torch.bfloat16, device="cuda")
    ref_dq = torch.zeros_like(x["qkv"])
    run_model(x, ref_dkv, ref_ds, ref_dq, tiles)
    kv_cols, q_cols = slice(H * D, 3 * H * D), slice(0, H * D)
    dq32 = torch.empty((B * S, H * D), dtype=torch.float32, device="cuda")
    runs = {"model": lambda dkv, ds, dq: run_model(x, dkv, ds, dq, tiles)}
    for warps in (int(w) for w in args.warps.split(",")):
        t = tiles._replace(warps=warps)
        for name, (mode, store) in VARIANTS.items():
            runs[f"{name}, {warps} warps"] = lambda dkv, ds, dq, t=t, m=mode, s=store: run_atomic(
                x, dkv, ds, dq, dq32, t, m, s
            )
    scale = float(ref_dq[..., q_cols].float().abs().max())
    errors: dict[str, float] = {}

    def check(name: str, outs: tuple) -> str | None:
        dkv, _, dq = outs
        if not torch.equal(dkv[..., kv_cols], ref_dkv[..., kv_cols]):
            return "dK or dV differ from the model kernel's"
        if name != "model" and "nodq" not in name:
            errors[name] = float((dq[..., q_cols].float() - ref_dq[..., q_cols].float()).abs().max()) / scale
            if errors[name] > 2e-2:  # bf16 rounding of dS K summed in another order: ~1e-2 at most
                return f"dQ differs from the model's by {errors[name]:.2e} of its largest element"
        return None

    outputs = lambda: (torch.zeros_like(ref_dkv), torch.zeros_like(ref_ds), torch.zeros_like(ref_dq))  # noqa: E731
    times, failed = checked_times(runs, outputs, check, args.rounds, args.iters)
    base = statistics.median(times["model"])
    print("| variant | ms per call (each round) | vs model | dQ error |")
    print("|---|---|---|---|")
    for name in runs:
        if name in failed:
            print(f"| {name} | failed: {failed[name]} | | |")
            continue
        ts = times[name]
        ms = statistics.median(ts)
        err = f"{errors[name]:.1e}" if name in errors else ""
        print(f"| {name} | {ms:.4f} ({', '.join(f'{t:.4f}' for t in ts)}) | {ms - base:+.4f} ms | {err} |")


if __name__ == "__main__":
    main()
