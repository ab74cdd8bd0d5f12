"""Per-layer micro-benchmark of the model's attention backends at T5 base's three attentions.

The attentions of a T5 base step at batch 128 (12 heads, d_kv 64, bf16): the encoder's
self-attention (`enc`: 512 x 512, T5's bias), the decoder's (`dec`: 114 x 114, causal, bias) and the
cross-attention (`cross`: 114 x 512, no bias), each through the model's `packed_attention`: packed
projection outputs in, the gradients of the sources and of the bias out. Rows (`--backends`):
`triton` (the fused kernels, the default on CUDA), `triton-nobias` (the same inputs without the
bias: what T5's bias and its gradient cost), `sdpa` (torch's scaled_dot_product_attention, for
dropout and cached decoding) and `math` (plain torch ops, the reference).

Rows run under torch.compile as in the training step (`--no-compile`: eager). Prints the first
call's wall seconds (compiles included), the GPU ms per call of the forward and of the backward
(forward + backward less the forward; the profiler's device time over `--iters` calls, so launch
gaps do not count, as in a step where the host runs ahead), attention TFLOP/s (the backward counted
as 2.5x the forward) and each output's relative error against the shape's first row that keeps the
bias. `--kernels` adds each kernel's ms under its row.

    python tools/attention_backends.py
    python tools/attention_backends.py --shapes enc --backends triton,triton-nobias --kernels
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_ms, kernel_table  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402
from training.model.attention import (  # noqa: E402
    bias_saturation_distance,
    packed_attention,
    relative_position_bucket,
)

BACKENDS = ("triton", "triton-nobias", "sdpa", "math")
SHAPES = {  # name -> (query length, key length, causal, has a bias)
    "enc": (512, 512, False, True),
    "dec": (114, 114, True, True),
    "cross": (114, 512, False, False),
}
OUTPUTS = ("out", "dq_src", "dkv_src", "dbias")


class Case:
    """Inputs of one attention as the model holds them: packed sources, T5's bias in fp32 (dense:
    (heads, sq, sk); row: its (heads, sq + sk - 1) relative row, as long inputs hand it), an output
    gradient."""

    def __init__(self, shape: str, batch: int, heads: int, d_kv: int, seed: int = 0, lengths=None,
                 device: str = "cuda", bias_layout: str = "dense"):  # fmt: skip
        """lengths: (query length, key length) instead of the shape's (equal for self-attention)."""
        sq, sk, self.causal, has_bias = SHAPES[shape]
        sq, sk = lengths or (sq, sk)
        self.b, self.h, self.d, self.sq, self.sk = batch, heads, d_kv, sq, sk
        gen = torch.Generator(device=device).manual_seed(seed)
        hd = heads * d_kv
        bf16 = dict(device=device, dtype=torch.bfloat16)
        if shape == "cross":
            self.q_src = torch.randn(batch, sq, hd, generator=gen, **bf16)
            self.kv_src = torch.randn(batch, sk, 2 * hd, generator=gen, **bf16)
        else:
            self.q_src = torch.randn(batch, sq, 3 * hd, generator=gen, **bf16)
            self.kv_src = self.q_src.new_empty((0,))
        self.bias = torch.empty((0,), device=device)
        self.far = 0
        if has_bias:  # T5's bias: a learned value per (head, bucket of key - query)
            table = torch.randn(heads, 32, generator=gen, device=device)
            if bias_layout == "row":  # row[h, k - q + sq - 1] = bias[h, q, k]
                relative = torch.arange(-(sq - 1), sk, device=device)
            else:
                relative = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
            self.bias = table[:, relative_position_bucket(relative, bidirectional=not self.causal)].contiguous()
            self.far = bias_saturation_distance(not self.causal)
        self.dout = torch.randn(batch, sq, hd, generator=gen, **bf16)

    def flops(self) -> float:
        pairs = self.sq * self.sk if not self.causal else self.sq * (self.sq + 1) / 2
        return 4 * self.b * self.h * pairs * self.d


def without_bias(case: Case) -> Case:
    """The case with no bias (a shallow copy sharing its tensors)."""
    plain = copy.copy(case)
    plain.bias, plain.far = case.bias.new_empty((0,)), 0
    return plain


def run_model_path(case: Case, backend: str, compiled: bool):
    """(forward call, forward + backward call, outputs) of the model's `packed_attention` with this
    backend, compiled as in the training step or eager. Outputs: out, dq_src, dkv_src (None for
    self-attention) and the bias's gradient (None without a bias)."""
    q_src = case.q_src.detach().requires_grad_()
    kv_src = case.kv_src.detach().requires_grad_() if case.kv_src.numel() else None
    bias = case.bias.detach().requires_grad_() if case.bias.numel() else None
    leaves = [t for t in (q_src, kv_src, bias) if t is not None]

    def attend():
        return packed_attention(q_src, kv_src, case.h, bias, None, case.causal, backend, bias_far=case.far)

    if compiled:
        torch._dynamo.reset()  # each case compiles afresh (the recompile limit counts per function)
        attend = torch.compile(attend, fullgraph=True)

    def fwd():
        with torch.no_grad():
            attend()

    def fwd_bwd():
        torch.autograd.grad(attend(), leaves, case.dout)

    out = attend()
    named = dict(zip(map(id, leaves), torch.autograd.grad(out, leaves, case.dout)))
    return fwd, fwd_bwd, (out.detach(), named[id(q_src)], named.get(id(kv_src)), named.get(id(bias)))


def rel_err(x, ref) -> str:
    if x is None or ref is None:
        return "-"
    return f"{(x.float() - ref.float()).norm().item() / max(ref.float().norm().item(), 1e-30):.1e}"


TABLE_HEAD = (
    "| shape | backend | 1st call s | fwd ms | bwd ms | sum ms | fwd TFLOP/s | bwd TFLOP/s | "
    + " | ".join(f"err {name}" for name in OUTPUTS)
    + " |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def timed_row(name: str, label: str, build, case: Case, ref, iters: int, kernels: bool):
    """One table row: `build()` gives (forward call, forward + backward call, outputs). Returns the
    outputs, or None if building or timing raised: the error is then the row (a backend that refuses
    a shape is a result too)."""
    try:
        start = time.perf_counter()
        fwd, fwd_bwd, outputs = build()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        first = time.perf_counter() - start
        f_ms, total_ms = (kernel_ms(f, iters) for f in (fwd, fwd_bwd))
    except Exception as e:  # noqa: BLE001
        print(f"| {name} | {label} | {type(e).__name__}: {str(e)[:300]!r} |", flush=True)
        return None
    b_ms = total_ms - f_ms
    errs = [rel_err(x, r) for x, r in zip(outputs, ref)] if ref is not None else ["-"] * len(OUTPUTS)
    fl = case.flops()
    print(f"| {name} | {label} | {first:.1f} | {f_ms:.3f} | {b_ms:.3f} | {total_ms:.3f} | {fl / f_ms / 1e9:.0f} | "
          f"{2.5 * fl / b_ms / 1e9:.0f} | {' | '.join(errs)} |", flush=True)  # fmt: skip
    if kernels:
        for kernel, ms in kernel_table(fwd_bwd, iters).items():
            print(f"|   | {kernel[:100]} | | | {ms:.3f} | | | | | | | |")
    return outputs


def run_table(args: argparse.Namespace, shapes: list[str], backends: list[str], device: str = "cuda") -> None:
    """One row per (shape, backend), in that order; `triton-nobias` only where the shape has a bias.
    The errors are against the first row of the shape that keeps the bias (triton by default);
    `triton-nobias` has none."""
    for name in shapes:
        case = Case(name, args.batch_size, args.heads, args.d_kv, device=device)
        ref = None
        for label in backends:
            nobias = label == "triton-nobias"
            if nobias and not case.bias.numel():
                continue
            build = partial(run_model_path, without_bias(case) if nobias else case, label.removesuffix("-nobias"),
                            args.compile)  # fmt: skip
            outputs = timed_row(name, label, build, case, None if nobias else ref, args.iters, args.kernels)
            if ref is None and not nobias:
                ref = outputs
            del build, outputs
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def comma_choices(text: str, allowed, option: str, what: str) -> list[str]:
    """The items of a comma list such as "enc,dec", each checked against `allowed`; an unknown item
    stops the script with a message naming the option and the choices."""
    items = [item.strip() for item in text.split(",")]
    for item in items:
        if item not in allowed:
            raise SystemExit(f"{option}: unknown {what} {item!r}; choose among {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-kv", type=int, default=64)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="run through torch.compile, as the training step does")  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kernels", action="store_true", help="print each kernel's ms per forward + backward")
    args = parser.parse_args(argv)
    shapes = comma_choices(args.shapes, list(SHAPES), "--shapes", "shape")
    backends = comma_choices(args.backends, BACKENDS, "--backends", "backend")
    if not ta.available():
        raise SystemExit("tools/attention_backends.py needs triton and a CUDA GPU")
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | batch {args.batch_size}, "
          f"{args.heads} heads, d_kv {args.d_kv}, bf16, {'compiled' if args.compile else 'eager'}")  # fmt: skip
    print(TABLE_HEAD)
    run_table(args, shapes, backends)


if __name__ == "__main__":
    main()
