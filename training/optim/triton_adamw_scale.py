"""AdamWScale's update of many tensors as one Triton kernel launch (a multi-tensor kernel).

Why our own kernel: the update is elementwise, and torch.compile of the foreach version
(`training/optim/adamw_scale.py`, `_plain_update`) fuses it into a few kernels, but compiling that
graph over T5 base's 282 tensors takes 49-56 s of a cold start on an H100 (inductor's combo-kernel
code generation), the largest single item of the time to the first step. This kernel is built by
Triton in 0.5 s (then cached on disk), reads and writes every element once, and updates T5 base in
5.8 ms against the compiled graph's 8.5 (`benchmarks/optimizer_step.py --size base`, one H100).

One launch covers all tensors of one dtype combination: each program takes BLOCK elements of one
tensor, found through device tables of the tensors' addresses (rebuilt only when an address
changes), of each program's tensor, of each tensor's first program and of its element count. Per
element, in fp32 (the storage dtypes are loaded and stored as they are):

    g  = 0 if the step is skipped (ok == 0) else g * clip_scale     (written back, as the foreach path)
    m  = b1 * m + (1 - beta1) * g ;  v = b2 * v + (1 - beta2) * g * g   (b1, b2: 1 when skipped)
    size = max(norm / sqrt(numel), 1e-3) * base * ok                 (per tensor; norm: of p before)
    p  = p - m / ((sqrt(v) + eps) / size)                            (the foreach path's rounding)
    p  = p + p * (decay * ok)                                        (decay = -lr * weight_decay)

`fused_update` takes the same arguments as `_plain_update` plus the tensors' L2 norms. The
interpreter (TRITON_INTERPRET=1) runs it on CPU tensors, which is how the tests check it against the
foreach path without a GPU.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
BLOCK = 2048  # elements per program; 8 warps, so 8 elements per thread
NUM_WARPS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _adamw_scale_kernel(
        param_ptrs, grad_ptrs, exp_avg_ptrs, exp_avg_sq_ptrs,  # int64 [n]: the tensors' addresses
        block_tensor,  # int32 [programs]: the tensor of each program
        first_block, numels, norms, base,  # [n]: first program, elements, L2 norm of p, step size
        ok_ptr, clip_ptr,  # 0-d float32: the finite flag, the clipping factor (read if HAS_OK / HAS_CLIP)
        beta1, beta2, eps, decay, rms_floor,
        one_minus_beta1, one_minus_beta2,  # from the host in float64: 1 - 0.999 in fp32 is 1.3e-5 off
        P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
        HAS_OK: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        n = tl.load(numels + t)
        offs = (pid - tl.load(first_block + t)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p_ptr = tl.load(param_ptrs + t).to(tl.pointer_type(P_DTYPE))
        g_ptr = tl.load(grad_ptrs + t).to(tl.pointer_type(G_DTYPE))
        m_ptr = tl.load(exp_avg_ptrs + t).to(tl.pointer_type(S_DTYPE))
        v_ptr = tl.load(exp_avg_sq_ptrs + t).to(tl.pointer_type(S_DTYPE))
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        rms = tl.div_rn(tl.load(norms + t), tl.sqrt_rn(n.to(tl.float32)))
        size = tl.maximum(rms, rms_floor) * tl.load(base + t)
        b1 = beta1
        b2 = beta2
        factor = decay
        if HAS_OK:
            ok = tl.load(ok_ptr)
            g = tl.where(ok == 0.0, 0.0, g)  # non-finite entries too
            b1 = tl.where(ok == 0.0, 1.0, beta1)
            b2 = tl.where(ok == 0.0, 1.0, beta2)
            size = size * ok
            factor = decay * ok
        if HAS_CLIP:
            g = g * tl.load(clip_ptr)
        if HAS_OK or HAS_CLIP:
            tl.store(g_ptr + offs, g.to(G_DTYPE), mask=mask)
        m = m * b1 + g * one_minus_beta1
        v = v * b2 + g * g * one_minus_beta2
        # a zero size makes the divisor infinite and the change 0 (m is finite under the guard)
        p = p - tl.div_rn(m, tl.div_rn(tl.sqrt_rn(v) + eps, size))
        if HAS_DECAY:
            p = p + p * factor
        tl.store(m_ptr + offs, m.to(S_DTYPE), mask=mask)
        tl.store(v_ptr + offs, v.to(S_DTYPE), mask=mask)
        tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def supports(tensors: list[torch.Tensor]) -> bool:
    """Whether `fused_update` can take these tensors: Triton installed, all on one CUDA device (any
    device under the interpreter), contiguous, of float32, bfloat16 or float16."""
    if not HAS_TRITON or not tensors:
        return False
    device = tensors[0].device
    if device.type != "cuda" and not _interpreted():
        return False
    return all(t.device == device and t.is_contiguous() and t.dtype in _TL_DTYPES for t in tensors)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TensorTables:
    """The device tables one launch reads, kept between steps: addresses are rebuilt only when one of
    them changes (a gradient freed and allocated again), the block tables once per tensor list."""

    def __init__(self) -> None:
        self._addresses: dict[tuple, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._blocks: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def addresses(self, key: tuple, lists: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
        ptrs = tuple(t.data_ptr() for ts in lists for t in ts)
        cached = self._addresses.get(key)
        if cached is None or cached[0] != ptrs:
            host = torch.tensor(ptrs, dtype=torch.int64).view(len(lists), -1)
            self._addresses[key] = cached = (ptrs, to_device(host, device))
        return cached[1]

    def blocks(self, key: tuple, params: list[torch.Tensor], index: list[int], device: torch.device):
        """(tensor of each program as int32, first program of each tensor, element counts, the tensors'
        positions in the group: int64 for norms and step sizes) on `device`."""
        if key not in self._blocks:
            numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
            programs = (numels + BLOCK - 1) // BLOCK
            firsts = torch.cumsum(programs, 0) - programs
            owner = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32), programs)
            self._blocks[key] = tuple(to_device(t, device) for t in (owner, firsts, numels, torch.tensor(index)))
        return self._blocks[key]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`; to a GPU through pinned memory, so the host does not wait for the GPU."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def fused_update(
    tables: TensorTables, params, grads, exp_avgs, exp_avg_sqs, norms: torch.Tensor, base: torch.Tensor,
    decay: float, ok: torch.Tensor | None, clip_scale: torch.Tensor | None, *, beta1: float, beta2: float,
    eps: float, has_decay: bool, rms_floor: float,
) -> None:  # fmt: skip
    """One AdamWScale step of `params` in place (see the module docstring), one launch per dtype
    combination. norms: float32 [n] L2 norms of the params before the step; base: float32 [n] step
    sizes before the RMS factor; decay: -lr * weight_decay; ok, clip_scale: 0-d float32 or None."""
    device = params[0].device
    combos: dict[tuple, list[int]] = {}
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if m.dtype != v.dtype:
            raise TypeError(f"exp_avg ({m.dtype}) and exp_avg_sq ({v.dtype}) must share a dtype")
        combos.setdefault((p.dtype, g.dtype, m.dtype), []).append(i)
    dummy = norms  # a valid pointer for the flags a launch does not read
    for (p_dtype, g_dtype, s_dtype), idx in combos.items():
        lists = [[ts[i] for i in idx] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
        key = tuple(id(p) for p in lists[0])
        addresses = tables.addresses(key, lists, device)
        block_tensor, first_block, numels, index = tables.blocks(key, lists[0], idx, device)
        sel = slice(None) if len(idx) == len(params) else index
        _adamw_scale_kernel[(block_tensor.numel(),)](
            addresses[0], addresses[1], addresses[2], addresses[3], block_tensor, first_block, numels,
            norms[sel].contiguous(), base[sel].contiguous(), dummy if ok is None else ok,
            dummy if clip_scale is None else clip_scale, beta1, beta2, eps, decay, rms_floor,
            1.0 - beta1, 1.0 - beta2,
            P_DTYPE=_TL_DTYPES[p_dtype], G_DTYPE=_TL_DTYPES[g_dtype], S_DTYPE=_TL_DTYPES[s_dtype],
            HAS_OK=ok is not None, HAS_CLIP=clip_scale is not None, HAS_DECAY=has_decay, BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )  # fmt: skip
