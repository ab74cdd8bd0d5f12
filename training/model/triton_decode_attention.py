"""Decoding's self-attention in one Triton kernel: one new query per row over a fixed-size cache.

`generation` decodes into fixed-size caches (`t5._write_cache_slot`): per decoder block, key and
value buffers of (rows, length, heads, d_kv), slot s written at step s, the step a 0-dim device
tensor `position`. Beam search adds a (rows, length) table of flat indices (row' x length + s) that
says where slot s of the sequence now in row r is. Without this kernel each step gathers both
buffers through that table (a copy of every slot) and then runs SDPA over the copy with a float
mask built from the bias and the slots not yet written. The kernel reads each visible slot's key
and value where they are, through the table, and stops at `position`:

    out[r, h] = softmax_s(q[r, h] . k[src(r, s), h] + bias[h, s]) v[src(r, s), h],  s <= position

src(r, s) = history[r, s] (beam search) or r x length + s (greedy). One program per (row, head),
fp32 accumulation, exp2 online softmax. T5 has no 1/sqrt(d) scaling. Only for inference: there is
no backward. `generation` replays it inside a CUDA graph: it reads `position` on the device, so a
graph captured once serves every step.
"""

from __future__ import annotations

import importlib.util

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None

if _HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attention_kernel(Q, K, V, HISTORY, BIAS, POSITION, OUT, sq_row, so_row, H, L,
                                 HAS_HISTORY: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        row, h = pid // H, pid % H
        offs_d = tl.arange(0, D)
        q = tl.load(Q + row * sq_row + h * D + offs_d).to(tl.float32)
        last = tl.load(POSITION)  # the slot this step wrote; later slots are not written yet
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)  # running max, base 2
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)  # running sum of exp2(s - m_i)
        acc = tl.zeros([D], tl.float32)
        for start in range(0, last + 1, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            visible = offs_n <= last
            if HAS_HISTORY:
                src = tl.load(HISTORY + row * L + offs_n, mask=visible, other=0)
            else:
                src = row * L + offs_n
            # (BLOCK_N, D): slot rows of the (rows x length, heads, D) buffers, head h
            at = src.to(tl.int64)[:, None] * (H * D) + h * D + offs_d[None, :]
            k = tl.load(K + at, mask=visible[:, None], other=0.0).to(tl.float32)
            bias = tl.load(BIAS + h * L + offs_n, mask=visible, other=0.0)
            s = (tl.sum(k * q[None, :], 1) + bias) * 1.4426950408889634
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)  # slot 0 is always visible: m_new is finite
            p = tl.exp2(s - m_new)
            v = tl.load(V + at, mask=visible[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        tl.store(OUT + row * so_row + h * D + offs_d, (acc / l_i).to(OUT.dtype.element_ty))


# Slots per step of the loop. Decoding reads every visible slot once, so the kernel is bound by
# memory, not by this choice (docs/performance.md has the measured step).
BLOCK_N = 32


def supports(d_kv: int) -> bool:
    """Whether the kernel takes this head size (a power of two, as tl.arange needs)."""
    return _HAS_TRITON and d_kv >= 16 and d_kv & (d_kv - 1) == 0


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    history: torch.Tensor | None,
    bias: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """(rows, 1, heads * d_kv) attention output of one new query per row, in q's dtype.

    q: (rows, 1, heads, d_kv), any strides within a row's heads (a view of the fused projection's
    output). k_cache / v_cache: (rows, length, heads, d_kv) contiguous buffers, slot `position`
    already written. history: (rows, length) int64 flat indices into the buffers viewed as
    (rows x length) slots, or None (row r's own slots). bias: (heads, 1, length) or (heads, length),
    the bias of this query against each slot. position: 0-dim integer device tensor."""
    rows, _, heads, d_kv = q.shape
    length = k_cache.shape[1]
    if k_cache.shape != (rows, length, heads, d_kv) or v_cache.shape != k_cache.shape:
        raise ValueError(f"caches of shape {tuple(k_cache.shape)} / {tuple(v_cache.shape)} for queries "
                         f"{tuple(q.shape)}: expected ({rows}, length, {heads}, {d_kv}) each")  # fmt: skip
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_attention reads the cache buffers as allocated: pass them contiguous")
    if q.stride(-1) != 1 or q.stride(-2) != d_kv:
        raise ValueError("decode_attention needs each query row's heads side by side (stride d_kv)")
    if history is not None and history.shape != (rows, length):
        raise ValueError(f"history of shape {tuple(history.shape)}: expected ({rows}, {length})")
    bias = bias.reshape(heads, length).float().contiguous()
    out = torch.empty((rows, 1, heads * d_kv), dtype=q.dtype, device=q.device)
    hist = history.contiguous() if history is not None else position.new_empty((0,))
    _decode_attention_kernel[(rows * heads,)](
        q, k_cache, v_cache, hist, bias, position, out, q.stride(0), out.stride(0), heads, length,
        HAS_HISTORY=history is not None, D=d_kv, BLOCK_N=BLOCK_N, num_warps=2,
    )  # fmt: skip
    return out
