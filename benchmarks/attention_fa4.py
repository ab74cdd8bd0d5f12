"""FlashAttention-4's Hopper kernels (CuTe DSL) at T5 base's attention shapes, against ours.

Whether Hopper-specific kernels (wgmma, TMA, warp specialisation) would take the encoder's attention,
most of the gap to 0.12 s/step, where our FlashAttention-2-style Triton kernels cannot.
FlashAttention-4 (`pip install flash-attn-4`, which pulls nvidia-cutlass-dsl) ships such kernels for
sm90, forward and backward, and takes a user `score_mod` / `score_mod_bwd` written in CuTe DSL.
Results: docs/model_speed.md, "FlashAttention-4's Hopper kernels". This script measures, for the
three attentions of a T5 base step (`attention_backends.SHAPES`), as the model runs them (packed
projection outputs in, gradients of the packed sources out):

- `triton`: ours through the model's `packed_attention`, compiled (the reference of the errors of
  the rows with the bias).
- `triton-nobias`: ours without the bias, the like-for-like row of `fa4` and the reference of its
  errors (in the cross-attention, which has no bias, `triton` is).
- `fa4`: FA4 without T5's bias (its kernels' own speed at this shape; causal for the decoder).
- `fa4-bias`: T5's bias added by a `score_mod` that reads the dense (heads, q, k) fp32 bias the
  model holds; the backward passes the score gradient through and computes no bias gradient.
- `fa4-rel`: as `fa4-bias`, the bias read from T5's relative row (heads, q + k - 1) instead: 1023
  values per head for the encoder, against the dense bias's 12 MiB.
- `fa4-bias-grad`: also the bias gradient: the `score_mod_bwd` stores each score gradient dS in a
  (batch, heads, q, k) bf16 buffer, which torch sums over the batch (what our kernels do with
  theirs). This is the row that does all the model needs (in the decoder its bias gradient came
  out wrong; docs/model_speed.md).

Prints forward and backward GPU ms per call (profiler device time, as `attention_backends.py`), the
first call's wall time (CuTe DSL compiles then), and errors against ours. GPU only (sm90):

    python benchmarks/attention_fa4.py
    python benchmarks/attention_fa4.py --shapes enc --variants fa4,fa4-bias-grad --kernels
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_backends import (  # noqa: E402
    SHAPES,
    TABLE_HEAD,
    Case,
    add_case_options,
    run_model_path,
    run_rows,
    without_bias,
)
from benchmarks.options import comma_choices  # noqa: E402
from training.model.cudnn_attention import head_views  # noqa: E402

VARIANTS = ("triton", "triton-nobias", "fa4", "fa4-bias", "fa4-rel", "fa4-bias-grad")


def score_mods():
    """(forward score_mod, backward without dS, backward storing dS) in CuTe DSL. aux_tensors[0] is
    the dense (heads, q, k) bias, aux_tensors[1] the (batch, heads, q, k) dS buffer. FA4 calls them
    one score at a time (vec_size 1 when there are aux tensors) with the score's indices."""
    import cutlass
    import cutlass.cute as cute

    def scalar(ssa):
        frag = cute.make_rmem_tensor(1, cutlass.Int32)
        frag.store(ssa)
        return frag[0]

    @cute.jit
    def t5_bias(score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        bias = aux_tensors[0]
        value = cute.make_rmem_tensor(1, bias.element_type)
        value[0] = bias[scalar(head_idx), scalar(q_idx), scalar(kv_idx)]
        return score + value.load().to(cutlass.Float32)

    @cute.jit
    def t5_bias_bwd(grad, score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad  # d(score + bias) / d score = 1

    @cute.jit
    def t5_bias_bwd_store(grad, score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        ds = aux_tensors[1]
        value = cute.make_rmem_tensor(1, ds.element_type)
        value.store(grad.to(ds.element_type))
        ds[scalar(batch_idx), scalar(head_idx), scalar(q_idx), scalar(kv_idx)] = value[0]
        return grad

    @cute.jit
    def t5_rel_bias(score, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        row, last_query = aux_tensors[0], aux_tensors[0].shape[1] // 2  # (heads, 2 * last_query + 1)
        value = cute.make_rmem_tensor(1, row.element_type)
        value[0] = row[scalar(head_idx), scalar(kv_idx) - scalar(q_idx) + last_query]
        return score + value.load().to(cutlass.Float32)

    return t5_bias, t5_rel_bias, t5_bias_bwd, t5_bias_bwd_store


def fa4_views(q_src: torch.Tensor, kv_src: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as FA4 takes them, (batch, seq, heads, d_kv) views of the packed sources (kv_src empty:
    self-attention [q | k | v]): no copies, the sequence stride stays the packed one."""
    return tuple(t.transpose(1, 2) for t in head_views(q_src, kv_src, heads))


def run_fa4(case: Case, variant: str):
    """(forward call, forward + backward call, outputs) of FA4 on the case's packed sources, the
    gradients written straight into packed (batch, seq, width) buffers through head views."""
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    with_bias = variant != "fa4" and case.bias.numel() > 0
    t5_bias, t5_rel_bias, t5_bias_bwd, t5_bias_bwd_store = score_mods()
    q, k, v = fa4_views(case.q_src, case.kv_src, case.h)
    dout = case.dout.view(case.b, case.sq, case.h, case.d)
    ds = None
    mods: dict = {}
    if with_bias:
        aux = [case.rel.float().contiguous() if variant == "fa4-rel" else case.bias.float().contiguous()]
        if variant == "fa4-bias-grad":
            # zeros: the causal kernels skip the tiles above the diagonal, which store no dS
            ds = torch.zeros(case.b, case.h, case.sq, case.sk, device="cuda", dtype=torch.bfloat16)
            aux.append(ds)
        mods = dict(score_mod=t5_rel_bias if variant == "fa4-rel" else t5_bias, aux_tensors=aux)
    bwd_mod = (t5_bias_bwd_store if ds is not None else t5_bias_bwd) if with_bias else None
    common = dict(softmax_scale=1.0, causal=case.causal)  # T5 does not scale its scores

    def forward():
        out, lse, *_ = _flash_attn_fwd(q, k, v, return_lse=True, **common, **mods)
        return out, lse

    d_q_src, d_kv_src = torch.empty_like(case.q_src), torch.empty_like(case.kv_src)  # (d_kv_src empty: self)
    dq, dk, dv = fa4_views(d_q_src, d_kv_src, case.h)

    def backward(out, lse):
        _flash_attn_bwd(q, k, v, out, dout, lse, dq=dq, dk=dk, dv=dv, score_mod_bwd=bwd_mod, **common, **mods)
        return ds.sum(0, dtype=torch.float32) if ds is not None else None

    def fwd():
        forward()

    def fwd_bwd():
        backward(*forward())

    out, lse = forward()
    dbias = backward(out, lse)
    outputs = (out.flatten(2).clone(), d_q_src.clone(), d_kv_src.clone() if d_kv_src.numel() else None, dbias)
    return fwd, fwd_bwd, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_options(parser)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    shapes = comma_choices(args.shapes, list(SHAPES), "--shapes", "shape")
    variants = comma_choices(args.variants, VARIANTS, "--variants", "variant")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("benchmarks/attention_fa4.py needs a Hopper GPU (sm90): FA4's sm90 kernels are measured")
    try:
        from importlib.metadata import version

        fa4_version = version("flash-attn-4")
        import flash_attn.cute  # noqa: F401
    except ImportError as e:  # (PackageNotFoundError is an ImportError)
        raise SystemExit(f"benchmarks/attention_fa4.py needs FlashAttention-4: pip install flash-attn-4 ({e})") from e
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | flash-attn-4 "
          f"{fa4_version} | batch {args.batch_size}, {args.heads} heads, d_kv {args.d_kv}, bf16")  # fmt: skip
    print(TABLE_HEAD.replace("| backend |", "| variant |", 1))

    def builder(case: Case, variant: str):
        if variant in ("fa4-bias", "fa4-rel", "fa4-bias-grad") and not case.bias.numel():
            return None  # the cross-attention has no bias: `fa4` is its row
        if variant == "triton":
            return partial(run_model_path, case, "triton", compiled=True)
        if variant == "triton-nobias":
            return partial(run_model_path, without_bias(case), "triton", compiled=True)
        return partial(run_fa4, case, variant)

    # `fa4` drops the bias: its errors are against `triton-nobias` (the encoder's and the decoder's)
    run_rows(args, shapes, variants, builder, without_bias=("triton-nobias", "fa4"))


if __name__ == "__main__":
    main()
