"""The encoder's dK/dV kernel with its bias tile, dS tile and Q / dO tiles moved through Hopper's
tensor memory accelerator (TMA) instead of per-element pointers: does the address and mask
arithmetic matter in a kernel that the element-wise work bounds?

`_bwd_dkdv_kernel` (training/model/triton_attention_kernels.py) computes, for every score, a pointer
for the bias load and for the dS store, and until the twenty-fourth session a bounds mask as well,
even on whole tiles (now only on partial ones). This script times variants of that kernel ("model
kernel": as the model runs it) on T5 base's encoder self-attention (batch 128, 512 x 512, 12 heads,
d_kv 64, bias, dS stored for dQ and the bias gradient) at the default tiles:

- `pointers`: masked pointers for the bias load and the dS store (the model's kernel before the
  twenty-fourth session);
- `unmasked`: the same pointers without the masks (the tiles are whole), as the model's kernel now;
- `tma-bias-ds`: the bias tile loaded and the dS tile stored through TMA descriptors;
- `tma-q-do`: only the Q and dO tiles (the GEMMs' operands) through descriptors;
- `tma-all`: all four.

The variants' loop carries the model kernel's `tl.assume` (twenty-fifth session): without it ptxas
serializes their wgmma, and the comparison would measure that instead of the loads and stores.

Each variant's dK, dV and dS must equal the model's kernel bit for bit (checked). Needs an sm_90
GPU and a Triton with host-side tensor descriptors (`triton.tools.tensor_descriptor`).

    python benchmarks/attention_tma.py [--batch 128] [--iters 50] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.model import triton_attention as ta  # noqa: E402

if ta.available():
    import triton
    import triton.language as tl

    from training.model import triton_attention_kernels as K

VARIANTS = {  # name: (Q/dO mode, bias mode, dS mode); 0 = masked pointers, 1 = pointers, 2 = TMA
    "pointers": (1, 0, 0),
    "unmasked": (1, 1, 1),
    "tma-bias-ds": (1, 2, 2),
    "tma-q-do": (2, 0, 0),
    "tma-all": (2, 2, 2),
}


if ta.available():
    # fmt: off
    @triton.jit
    def _bwd_dkdv_variant_kernel(Q, KV, BIAS, DO, LSE, DELTA, DKV, DS, q_desc, do_desc, bias_desc, ds_desc,
                                 sqb, sqs, skb, sks, sdob, sdos, sdkb, sdks, K_OFF, V_OFF, H, SQ, SK, LSE_STRIDE,
                                 Q_MODE: tl.constexpr, BIAS_MODE: tl.constexpr, DS_MODE: tl.constexpr,
                                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """`_bwd_dkdv_kernel` for whole tiles, a bias, no mask, not causal, dS stored (the encoder's)."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        n0 = pid_n * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kt = K._load_cols(KV + K_OFF, b, h, offs_n, skb, sks, SK, D, True)
        vt = K._load_cols(KV + V_OFF, b, h, offs_n, skb, sks, SK, D, True)
        dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        tl.assume(SQ > 0)  # as the model's kernel: else ptxas serializes the wgmma (triton_attention_kernels)
        for sm in range(0, SQ, BLOCK_M):
            offs_m = sm + tl.arange(0, BLOCK_M)
            if Q_MODE == 2:
                q = q_desc.load([b * SQ + sm, h * D])
                do = do_desc.load([b * SQ + sm, h * D])
            else:
                q = K._load_rows(Q, b, h, offs_m, sqb, sqs, SQ, D, True)
                do = K._load_rows(DO, b, h, offs_m, sdob, sdos, SQ, D, True)
            if BIAS_MODE == 2:
                bias = bias_desc.load([h * SQ + sm, n0])
            elif BIAS_MODE == 1:
                bias = tl.load(BIAS + h * SQ * SK + offs_m[:, None] * SK + offs_n[None, :])
            else:
                bias = K._bias_tile(BIAS, h, sm, n0, offs_m, offs_n, SQ, SK, 0, True, False, False)
            p, ds = K._probs_and_dscores(q, kt, vt, do, bias, BIAS, LSE, DELTA, b, h, H, offs_m, offs_n, SQ, SK,
                                         0, LSE_STRIDE, True, False, False, True, False)
            ds_low = ds.to(q.dtype)
            if DS_MODE == 2:
                ds_desc.store([bh * SQ + sm, n0], ds_low)
            elif DS_MODE == 1:
                tl.store(DS + bh.to(tl.int64) * SQ * SK + offs_m[:, None] * SK + offs_n[None, :], ds_low)
            else:  # masked, as the model's store before the twenty-fourth session
                K._store_ds_tile(DS, ds_low, bh, offs_m, offs_n, SQ, SK, False)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dk += tl.dot(tl.trans(ds_low), q)
        K._store_rows(DKV + K_OFF, dk, b, h, offs_n, sdkb, sdks, SK, D)
        K._store_rows(DKV + V_OFF, dv, b, h, offs_n, sdkb, sdks, SK, D)
    # fmt: on


def encoder_inputs(batch: int, seq: int = 512, heads: int = 12, d_kv: int = 64) -> dict:
    """A packed [q | k | v] source, T5-scaled bias, dO, and the forward's out and row statistics."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hd = heads * d_kv
    qkv = (0.5 * torch.randn(batch, seq, 3 * hd, device="cuda", generator=g)).bfloat16()
    bias = 2.0 * torch.randn(heads, seq, seq, device="cuda", generator=g)
    dout = torch.randn(batch, seq, hd, device="cuda", generator=g).bfloat16()
    empty = qkv.new_empty((0,))
    key_mask = torch.empty((0,), dtype=torch.bool, device="cuda")
    out, lse = ta._launch_fwd(qkv, empty, bias, key_mask, False, heads)
    delta = torch.empty((batch, heads, seq), dtype=torch.float32, device="cuda")
    K._delta_kernel[(triton.cdiv(seq, 64), batch * heads)](
        dout, out, delta, *dout.stride()[:2], *out.stride()[:2], heads, seq, D=d_kv, BLOCK_M=64, EVEN_M=True
    )
    kbias = ta._kernel_bias(bias, seq, seq, qkv.dtype)
    return dict(qkv=qkv, kbias=kbias, dout=dout, lse=lse, delta=delta, heads=heads, d_kv=d_kv)


def run_model_kernel(x: dict, dkv: torch.Tensor, ds: torch.Tensor, tiles) -> None:
    """`_bwd_dkdv_kernel` launched as `triton_attention._launch_bwd` launches it for the encoder."""
    qkv, dout, H, D = x["qkv"], x["dout"], x["heads"], x["d_kv"]
    B, S = qkv.shape[:2]
    key_mask = torch.empty((0,), dtype=torch.bool, device="cuda")
    K._bwd_dkdv_kernel[(triton.cdiv(S, tiles.block_n), B * H)](
        qkv, qkv, x["kbias"], key_mask, dout, x["lse"], x["delta"], dkv, ds,
        *qkv.stride()[:2], *qkv.stride()[:2], *dout.stride()[:2], *dkv.stride()[:2], H * D, 2 * H * D,
        H, S, S, 0, B * H * S, 0, HAS_BIAS=True, FAR_TILES=False, HAS_MASK=False, CAUSAL=False, IEEE=False,
        STORE_DS=True, D=D, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, EVEN_M=True, EVEN_N=True,
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip


def run_variant(x: dict, dkv: torch.Tensor, ds: torch.Tensor, tiles, modes: tuple[int, int, int]) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    qkv, dout, H, D = x["qkv"], x["dout"], x["heads"], x["d_kv"]
    B, S = qkv.shape[:2]
    bm, bn = tiles.block_m, tiles.block_n
    q_desc = TensorDescriptor(qkv, [B * S, 3 * H * D], [3 * H * D, 1], [bm, D])
    do_desc = TensorDescriptor(dout, [B * S, H * D], [H * D, 1], [bm, D])
    bias_desc = TensorDescriptor(x["kbias"], [H * S, S], [S, 1], [bm, bn])
    ds_desc = TensorDescriptor(ds, [B * H * S, S], [S, 1], [bm, bn])
    _bwd_dkdv_variant_kernel[(triton.cdiv(S, bn), B * H)](
        qkv, qkv, x["kbias"], dout, x["lse"], x["delta"], dkv, ds, q_desc, do_desc, bias_desc, ds_desc,
        *qkv.stride()[:2], *qkv.stride()[:2], *dout.stride()[:2], *dkv.stride()[:2], H * D, 2 * H * D,
        H, S, S, B * H * S, Q_MODE=modes[0], BIAS_MODE=modes[1], DS_MODE=modes[2], D=D,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def checked_times(runs: dict, outputs, check, rounds: int, iters: int) -> tuple[dict, dict]:
    """Runs each of `runs` (name: a function that writes into the tensors `outputs()` returns) once
    on fresh outputs and checks them (`check(name, outs)`: None, or why they are wrong), then times
    the ones that ran right: `rounds` rounds of `time_ms`, taking turns within each round so that the
    machine's drift touches them alike. Returns (name: ms per round, name: why it failed); a variant
    that does not compile is a failed row too."""
    failed: dict[str, str] = {}
    for name, fn in runs.items():  # results first
        outs = outputs()
        try:
            fn(*outs)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        if why := check(name, outs):
            failed[name] = why
    outs = outputs()
    times: dict[str, list[float]] = {name: [] for name in runs if name not in failed}
    for _ in range(rounds):
        for name in times:
            times[name].append(time_ms(lambda fn=runs[name]: fn(*outs), iters))
    return times, failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2, help="each variant timed this many times, interleaved")
    args = parser.parse_args(argv)
    if not (ta.available() and torch.cuda.get_device_capability() >= (9, 0)):
        raise SystemExit("benchmarks/attention_tma.py needs triton and an sm_90 (Hopper) GPU or newer")
    tiles = ta.DKDV_TILES["enc"]
    x = encoder_inputs(args.batch)
    B, S, H, D = args.batch, 512, x["heads"], x["d_kv"]
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"encoder dK/dV kernel, batch {B}, {S} x {S}, {H} heads, d_kv {D}, tiles {tuple(tiles)}")  # fmt: skip
    ref_dkv, ref_ds = torch.empty_like(x["qkv"]), torch.empty((B, H, S, S), dtype=torch.bfloat16, device="cuda")
    run_model_kernel(x, ref_dkv, ref_ds, tiles)
    cols = slice(H * D, 3 * H * D)  # the kernel writes dK and dV only
    runs = {"model kernel": lambda dkv, ds: run_model_kernel(x, dkv, ds, tiles)}
    for name, modes in VARIANTS.items():
        runs[name] = lambda dkv, ds, modes=modes: run_variant(x, dkv, ds, tiles, modes)

    def check(name: str, outs: tuple) -> str | None:
        dkv, ds = outs
        if not (torch.equal(dkv[..., cols], ref_dkv[..., cols]) and torch.equal(ds, ref_ds)):
            return "dK, dV or dS differ from the model kernel's"
        return None

    outputs = lambda: (torch.zeros_like(ref_dkv), torch.zeros_like(ref_ds))  # noqa: E731
    times, failed = checked_times(runs, outputs, check, args.rounds, args.iters)
    flops = 4 * 2 * B * H * S * S * D  # four GEMMs per score tile: S, dP, dV, dK
    base = statistics.median(times["model kernel"])
    print("| variant | ms per call (each round) | TFLOP/s | vs the model kernel |")
    print("|---|---|---|---|")
    for name in runs:
        if name in failed:
            print(f"| {name} | failed: {failed[name]} | | |")
            continue
        ts = times[name]
        ms = statistics.median(ts)
        print(f"| {name} | {ms:.4f} ({', '.join(f'{t:.4f}' for t in ts)}) | {flops / ms / 1e9:.0f} | "
              f"{ms / base - 1:+.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
