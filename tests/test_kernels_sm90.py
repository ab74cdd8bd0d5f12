"""The attention kernels compiled offline for Hopper (sm_90a), as the launchers launch them for T5
base's attentions: ptxas must not serialize their wgmma instructions.

ptxas serializes every wgmma of a kernel (warning C7515, "wgmma.mma_async instructions are serialized
due to non wgmma instructions defining accumulator registers") when it cannot prove that no other
instruction writes an accumulator while a wgmma is in flight. A loop over key or query blocks whose
trip count may be zero does that: the zero-trip path writes the accumulators with moves. Each
kernel then states its loop runs at least once (`tl.assume`); serialized, the encoder layer's
attention runs 8% slower on an H100.

No GPU is needed: the launchers run on meta tensors with a `wrap` that records each launch instead
of running it, and triton compiles each recorded launch for sm_90a with its bundled ptxas.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs the triton package (pip install triton)"
)

B, HEADS, D_KV = 128, 12, 64  # T5 base at batch 128
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int8: "*i8",
    torch.bool: "*i1",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


class _Recorder:
    """A launcher's `wrap`: `wrap(kernel)[grid](*args, **kwargs)` records (kernel, args, kwargs)."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def __call__(self, kernel):
        launches = self.launches

        class _Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append((kernel, args, kwargs))

        return _Grid()


def _attention_launches(
    sq: int, sk: int, causal: bool, has_bias: bool, key_mask: bool, row: bool = False
) -> list[tuple]:
    """Every kernel launch of one attention's forward and backward, as the model's step makes them
    (bf16 packed sources; T5's far distance with a bias, which the encoder's bias gradient and the
    row's kernels use). With a bias it is a self-attention (sq == sk), without one a
    cross-attention. row: the bias is given as its (H, SQ + SK - 1) row, as at long inputs."""
    import training.model.triton_attention as ta
    from training.model.attention import bias_saturation_distance

    meta = dict(device="meta", dtype=torch.bfloat16)
    hd = HEADS * D_KV
    if has_bias:  # T5's self-attention (every layer gets the bias): [q | k | v] in one buffer
        q_src, kv_src = torch.empty(B, sq, 3 * hd, **meta), torch.empty(0, **meta)
    else:  # its cross-attention: q and [k | v]
        q_src, kv_src = torch.empty(B, sq, hd, **meta), torch.empty(B, sk, 2 * hd, **meta)
    bias_shape = ((HEADS, sq + sk - 1) if row else (HEADS, sq, sk)) if has_bias else (0,)
    bias = torch.empty(bias_shape, device="meta")
    mask = torch.empty(B, sk, device="meta", dtype=torch.bool) if key_mask else torch.empty(0, device="meta")
    far = bias_saturation_distance(not causal) if has_bias else 0
    record = _Recorder()
    out, lse = ta._launch_fwd(q_src, kv_src, bias, mask, causal, HEADS, wrap=record)
    dout = torch.empty(B, sq, hd, **meta)
    ta._launch_bwd(q_src, kv_src, bias, mask, out, lse, dout, causal, HEADS, far, wrap=record)
    return record.launches


def _compile_for_sm90(kernel, args: tuple, kwargs: dict) -> tuple[str, str]:
    """(PTX, ptxas's -v log) of one launch compiled for sm_90a, with the specialisation triton's
    runtime would give it: tensors as 16-byte aligned pointers, integers divisible by 16 marked so,
    integers equal to 1 as constants."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args), **kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name]
        if param.is_constexpr or (isinstance(value, int) and not isinstance(value, bool) and value == 1):
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name], attrs[(i,)] = POINTER_TYPES[value.dtype], [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        ptxas = get_ptxas(90).path
        run = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
        )
    assert run.returncode == 0, run.stderr
    return ptx, run.stderr


# T5 base's attentions in pre-training (inputs 512, targets 114) and longer ones (fine-tuning's
# targets past 128 queries, which take the two-kernel backward), with and without padding masks; a
# long input's encoder, whose bias comes as its row.
ATTENTIONS = {
    "encoder 512": (512, 512, False, True, False),
    "encoder 512, padded": (512, 512, False, True, True),
    "decoder 114": (114, 114, True, True, False),
    "cross 114 x 512, padded": (114, 512, False, False, True),
    "decoder 200": (200, 200, True, True, False),
    "cross 200 x 512, padded": (200, 512, False, False, True),
    "encoder 4096, bias as its row": (4096, 4096, False, True, False, True),
}


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_attention_kernels_compile_for_hopper_without_serialized_wgmma(attention):
    launches = _attention_launches(*ATTENTIONS[attention])
    with_wgmma, serialized = [], []
    for kernel, args, kwargs in launches:
        ptx, log = _compile_for_sm90(kernel, args, kwargs)
        if "wgmma.mma_async" in ptx:
            with_wgmma.append(kernel.fn.__name__)
            if "C7515" in log:
                serialized.append(kernel.fn.__name__)
    # the forward and at least one backward kernel are tensor-core GEMM loops: without them the
    # check below would pass for want of anything to check
    assert "_fwd_kernel" in with_wgmma and len(with_wgmma) >= 2, with_wgmma
    assert not serialized, f"ptxas serialized the wgmma of {serialized} ({attention})"


@pytest.mark.parametrize("sq, sk, causal", [(0, 16, False), (0, None, False), (17, 16, True)])
def test_launchers_refuse_lengths_that_break_the_loops_assumption(sq, sk, causal):
    """The kernels assume each loop runs at least once; the launchers refuse, with a way out, the
    lengths where it would not (no query or key, or causal queries past the keys), before any
    launch. sk None: a self-attention (its keys are its queries)."""
    import training.model.triton_attention as ta

    meta = dict(device="meta", dtype=torch.bfloat16)
    if sk is None:
        q_src, kv_src = torch.empty(2, sq, 3 * 64, **meta), torch.empty(0, **meta)
    else:
        q_src, kv_src = torch.empty(2, sq, 64, **meta), torch.empty(2, sk, 2 * 64, **meta)
    none = torch.empty(0, device="meta")
    record = _Recorder()
    with pytest.raises(ValueError, match="use the math attention backend"):
        ta._launch_fwd(q_src, kv_src, none, none, causal, 1, wrap=record)
    out, lse = torch.empty(2, max(sq, 1), 64, **meta), torch.empty(2, 2, 1, max(sq, 1), device="meta")
    with pytest.raises(ValueError, match="no more queries than keys" if causal else "at least one of each"):
        ta._launch_bwd(q_src, kv_src, none, none, out, lse, out, causal, 1, wrap=record)
    assert record.launches == []
