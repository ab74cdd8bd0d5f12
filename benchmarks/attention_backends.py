"""Our fused T5 attention against the attention kernels that ship for the GPU, at T5 base's shapes.

The three attentions of a T5 base step at batch 128 (inputs 512, targets 114, 12 heads, d_kv 64,
bf16): the encoder's self-attention (512 x 512, T5's relative bias, bidirectional), the decoder's
(114 x 114, causal, bias) and the cross-attention (114 x 512, no bias). Each runs as the model runs
it: packed projection outputs in, the gradients of the bias included where there is one. Backends:

- `triton`: ours (training/model/triton_attention.py), with the model's defaults.
- `triton-rel`: ours given T5's relative bias row (heads, Sq + Sk - 1) instead of the dense bias,
  summing its gradient per key - query offset in the dQ kernel (`triton_attention.RELATIVE_BIAS`).
- `triton-nobias`: ours with the same inputs but no bias (the encoder and the decoder; the
  cross-attention has none): what T5's bias and its gradient cost the row above, without
  FlashAttention-4 installed (`benchmarks/attention_fa4.py` has the same row beside FA4's).
- `triton-split`: ours with the backward of short queries (the decoder's, the cross-attention's)
  as the dK/dV and dQ kernels of long queries instead of the one-block kernel
  (`triton_attention.ONE_BLOCK_BWD` off).
- `cudnn`: cuDNN's fused attention through the cudnn-frontend Python graph API, as the model's
  `cudnn` backend runs it (training/model/cudnn_attention.py; needs `nvidia-cudnn-frontend`): the
  bias as a (1, H, Sq, Sk) tensor and its gradient dBias, which cuDNN sums over the batch itself,
  in the inputs' dtype (bf16; ours reads it in fp32: given an fp32 bias, cuDNN 9.19 returned NaN).
- `sdpa-cudnn`, `sdpa-efficient`, `sdpa-flash`: torch's `scaled_dot_product_attention` with one
  backend forced. torch's cuDNN backend has no bias gradient (its bias is a constant there, so the
  row shows what the kernel costs without dBias); the memory-efficient one computes it; flash takes
  no bias (cross-attention only).

`triton` and `cudnn` run through the model's `packed_attention` under torch.compile, as in the
training step (`--no-compile`: eager, where the launchers' torch glue runs unfused); the sdpa rows
are eager. Prints per shape and backend: the first call's wall seconds (compiles included), forward ms (no grad) and backward ms (forward + backward
less the forward) of GPU time per call (the profiler's device time of every kernel, averaged over
`--iters` calls: launch gaps do not count, as in a training step where the host runs ahead), their
sum, attention TFLOP/s (backward counted as 2.5x the forward, as FlashAttention does), and the
relative error of each output against ours (norm of the difference / norm of ours; a dense bias
gradient is first summed per key - query offset, the gradient of T5's relative row).

    python benchmarks/attention_backends.py
    python benchmarks/attention_backends.py --shapes enc --backends triton,cudnn
    python benchmarks/attention_backends.py --shapes enc --backends triton,triton-rel --kernels

`--kernels` also prints, under each row, the GPU ms per call of every kernel of forward + backward.
`--far-tiles fwd` (or `fwd,dkdv`, ...; default: the model's, none) sets which of our kernels skip the
bias loads of tiles beyond T5's saturation distance. `--ds-sum far` (or `kernel`, `torch`; default:
the model's) sets who sums the stored dS over the batch for the bias gradient.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_ms, kernel_table  # noqa: E402
from benchmarks.options import comma_choices  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402
from training.model.attention import (  # noqa: E402
    bias_saturation_distance,
    dense_bias,
    packed_attention,
    relative_position_bucket,
)
from training.model.cudnn_attention import head_views  # noqa: E402
from training.model.triton_bias_grad import diagonal_sums  # noqa: E402

BACKENDS = ("triton", "triton-rel", "triton-nobias", "triton-split", "cudnn", "sdpa-cudnn", "sdpa-efficient", "sdpa-flash")
SHAPES = {  # name -> (query length, key length, causal, has a bias)
    "enc": (512, 512, False, True),
    "dec": (114, 114, True, True),
    "cross": (114, 512, False, False),
}


class Case:
    """Inputs of one attention as the model holds them: packed sources, a T5 bias, an output gradient."""

    def __init__(self, shape: str, batch: int, heads: int, d_kv: int, seed: int = 0, lengths=None):
        """lengths: (query length, key length) instead of the shape's (equal for self-attention)."""
        sq, sk, self.causal, has_bias = SHAPES[shape]
        sq, sk = lengths or (sq, sk)
        self.b, self.h, self.d, self.sq, self.sk = batch, heads, d_kv, sq, sk
        gen = torch.Generator(device="cuda").manual_seed(seed)
        hd = heads * d_kv
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        if shape == "cross":
            self.q_src = torch.randn(batch, sq, hd, generator=gen, **bf16)
            self.kv_src = torch.randn(batch, sk, 2 * hd, generator=gen, **bf16)
        else:
            self.q_src = torch.randn(batch, sq, 3 * hd, generator=gen, **bf16)
            self.kv_src = self.q_src.new_empty((0,))
        self.bias = self.rel = torch.empty((0,), device="cuda")
        self.far = 0
        if has_bias:  # T5's bias: a learned value per (head, bucket) of key - query
            table = torch.randn(heads, 32, generator=gen, device="cuda")
            relative = torch.arange(-(sq - 1), sk, device="cuda")
            buckets = relative_position_bucket(relative, bidirectional=not self.causal)
            self.rel = table[:, buckets].contiguous()  # (heads, sq + sk - 1)
            self.bias = dense_bias(self.rel, sq, sk).contiguous()
            self.far = bias_saturation_distance(not self.causal)
        self.dout = torch.randn(batch, sq, hd, generator=gen, **bf16)

    def flops(self) -> float:
        pairs = self.sq * self.sk if not self.causal else self.sq * (self.sq + 1) / 2
        return 4 * self.b * self.h * pairs * self.d


def without_bias(case: Case) -> Case:
    """The case with no bias (a shallow copy sharing its tensors)."""
    plain = copy.copy(case)
    plain.bias = plain.rel = case.bias.new_empty((0,))
    plain.far = 0
    return plain


def run_model_path(case: Case, backend: str, compiled: bool):
    """(forward call, forward + backward call, outputs) of the model's `packed_attention` with this
    backend, compiled as in the training step (inductor fuses the launchers' torch glue: the
    backward's rowsum(dO * O), the bias gradient's batch sum, the bias's cast for cuDNN) or eager.
    `triton-rel` takes the relative row, the others the dense bias; `triton-split` runs without
    the one-block backward. Outputs: out, dq_src, dkv_src,
    and the gradient of the bias leaf (the row's for `triton-rel`)."""
    q_src = case.q_src.detach().requires_grad_()
    kv_src = case.kv_src.detach().requires_grad_() if case.kv_src.numel() else None
    relative = backend == "triton-rel" and case.rel.numel() > 0
    ta.RELATIVE_BIAS = backend == "triton-rel"  # read when packed_attention is traced or called
    ta.ONE_BLOCK_BWD = backend != "triton-split"
    bias = (case.rel if relative else case.bias).detach().requires_grad_() if case.bias.numel() else None
    leaves = [t for t in (q_src, kv_src, bias) if t is not None]
    backend = backend.removesuffix("-rel").removesuffix("-split")

    def attend():
        dense, rel = (dense_bias(bias, case.sq, case.sk), bias) if relative else (bias, None)
        return packed_attention(q_src, kv_src, case.h, dense, None, case.causal, backend, bias_far=case.far,
                                bias_rel=rel)  # fmt: skip

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


def run_sdpa(case: Case, backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
              "sdpa-flash": SDPBackend.FLASH_ATTENTION}[backend]  # fmt: skip
    q_src = case.q_src.detach().requires_grad_()
    kv_src = case.kv_src.detach().requires_grad_() if case.kv_src.numel() else case.kv_src
    bias = None
    if case.bias.numel():
        if backend == "sdpa-flash":
            raise RuntimeError("flash attention takes no bias")
        # bf16 like the inputs (the efficient kernel refuses another dtype); a gradient where it has one
        bias = case.bias.to(torch.bfloat16)[None].requires_grad_(backend == "sdpa-efficient")
    leaves = [t for t in (q_src, kv_src, bias) if t is not None and t.requires_grad]

    def forward():
        q, k, v = head_views(q_src, kv_src, case.h)
        with sdpa_kernel(chosen):
            causal = case.causal and bias is None
            mask = bias
            if case.causal and bias is not None:  # causal and a bias: the mask carries both
                keep = torch.ones(case.sq, case.sk, device="cuda", dtype=torch.bool).tril()
                mask = bias.masked_fill(~keep, float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=1.0)
        return out.transpose(1, 2).flatten(2)

    out = forward()
    grads = torch.autograd.grad(out, leaves, case.dout)

    def fwd():
        with torch.no_grad():
            forward()

    def fwd_bwd():
        torch.autograd.grad(forward(), leaves, case.dout)

    named = dict(zip([id(t) for t in leaves], grads))
    dbias = named.get(id(bias))
    outputs = (out.detach(), named[id(q_src)], named.get(id(kv_src)), None if dbias is None else dbias[0])
    return fwd, fwd_bwd, outputs


def rel_err(x, ref) -> str:
    if x is None or ref is None or ref.numel() == 0:
        return "-"
    if x.dim() != ref.dim():  # a dense bias gradient and a relative row's: the dense one summed per offset
        x, ref = (diagonal_sums(t.float()) if t.dim() == 3 else t for t in (x, ref))
    return f"{(x.float() - ref.float()).norm().item() / max(ref.float().norm().item(), 1e-30):.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_case_options(parser)
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="triton and cudnn through torch.compile, as the training step runs them")  # fmt: skip
    parser.add_argument("--far-tiles", default=",".join(ta.FAR_TILES) or "none",
                        help=f"the triton kernels that skip far tiles' bias loads (triton_attention.FAR_TILES): "
                             f"a comma list of {', '.join(ta.FAR_TILE_KERNELS)}, or none")  # fmt: skip
    parser.add_argument("--ds-sum", default=ta.DS_SUM, choices=ta.DS_SUMS,
                        help="who sums the stored dS over the batch for the bias gradient (triton_attention.DS_SUM)")  # fmt: skip
    args = parser.parse_args()
    shapes = comma_choices(args.shapes, list(SHAPES), "--shapes", "shape")
    backends = comma_choices(args.backends, BACKENDS, "--backends", "backend")
    far_tiles = () if args.far_tiles == "none" else tuple(
        comma_choices(args.far_tiles, ta.FAR_TILE_KERNELS, "--far-tiles", "kernel")
    )
    if not ta.available():
        raise SystemExit("benchmarks/attention_backends.py needs triton and a CUDA GPU")
    cudnn_version = torch.backends.cudnn.version()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | cuDNN {cudnn_version} | "
          f"batch {args.batch_size}, {args.heads} heads, d_kv {args.d_kv}, bf16, "
          f"far tiles in {'+'.join(far_tiles) or 'no kernel'}, dS summed by {args.ds_sum}")  # fmt: skip
    print(TABLE_HEAD)
    defaults = ta.RELATIVE_BIAS, ta.ONE_BLOCK_BWD, ta.FAR_TILES, ta.DS_SUM  # run_model_path sets the first two per row
    ta.FAR_TILES, ta.DS_SUM = far_tiles, args.ds_sum
    try:
        run_table(args, shapes, backends)
    finally:
        ta.RELATIVE_BIAS, ta.ONE_BLOCK_BWD, ta.FAR_TILES, ta.DS_SUM = defaults


def add_case_options(parser: argparse.ArgumentParser) -> None:
    """The options `run_rows` reads (the cases' sizes and shapes, the timing), shared by the attention
    benchmarks that print through it."""
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--d-kv", type=int, default=64)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kernels", action="store_true", help="print each kernel's ms per forward + backward")


TABLE_HEAD = (
    "| shape | backend | 1st call s | fwd ms | bwd ms | sum ms | fwd TFLOP/s | bwd TFLOP/s | err out | err dq_src | "
    "err dkv_src | err dbias |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def timed_row(name: str, label: str, build, case: Case, ref, iters: int, kernels: bool):
    """One table row: `build()` gives (forward call, forward + backward call, outputs); prints the
    first build's wall seconds (compiles included), the GPU ms per call of the forward and of the
    backward (forward + backward less the forward), their TFLOP/s (the backward counted as 2.5x the
    forward, as FlashAttention does), and the outputs' errors against `ref` (None: dashes); with
    `kernels`, each kernel's ms under the row. Returns the outputs, or None if building or timing
    raised: the error is then the row (a backend that refuses a shape is a result too)."""
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
    errs = [rel_err(x, r) for x, r in zip(outputs, ref)] if ref is not None else ["-"] * 4
    fl = case.flops()
    print(f"| {name} | {label} | {first:.1f} | {f_ms:.3f} | {b_ms:.3f} | {total_ms:.3f} | {fl / f_ms / 1e9:.0f} | "
          f"{2.5 * fl / b_ms / 1e9:.0f} | {' | '.join(errs)} |", flush=True)  # fmt: skip
    if kernels:
        for kernel, ms in kernel_table(fwd_bwd, iters).items():
            print(f"|   | {kernel[:100]} | | | {ms:.3f} | | | | | | | |")
    return outputs


def run_rows(args: argparse.Namespace, shapes: list[str], labels: list[str], builder,
             without_bias: tuple[str, ...] = ("triton-nobias",)) -> None:
    """One `timed_row` per (shape, label) in that order: `builder(case, label)` gives the row's build
    (None: no such row for this shape). Each row's errors are against the reference row that ran the
    same attention: the "triton" row for the rows that apply the case's bias, the "triton-nobias" row
    for those in `without_bias`, which drop it. In a case without a bias (the cross-attention) every
    row runs the same attention and "triton" is the reference of all. A row with no reference before
    it (the references themselves) prints dashes."""
    for name in shapes:
        case = Case(name, args.batch_size, args.heads, args.d_kv)
        refs = {}  # with the case's bias (True) or without (False): the reference row's outputs
        for label in labels:
            build = builder(case, label)
            if build is None:
                continue
            biased = bool(case.bias.numel()) and label not in without_bias
            outputs = timed_row(name, label, build, case, refs.get(biased), args.iters, args.kernels)
            if label in ("triton", "triton-nobias") and biased not in refs:
                refs[biased] = outputs
            del build, outputs
            torch.cuda.empty_cache()


def run_table(args: argparse.Namespace, shapes: list[str], backends: list[str]) -> None:
    """One row per (shape, backend): times, TFLOP/s and errors against the triton row."""

    def builder(case: Case, backend: str):
        if backend == "triton-nobias":
            return partial(run_model_path, without_bias(case), "triton", args.compile) if case.bias.numel() else None
        if backend in ("triton", "triton-rel", "triton-split", "cudnn"):
            return partial(run_model_path, case, backend, args.compile)
        return partial(run_sdpa, case, backend)

    run_rows(args, shapes, backends, builder)


if __name__ == "__main__":
    main()
