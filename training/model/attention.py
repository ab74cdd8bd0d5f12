"""T5 attention: relative position buckets and the attention backends.

T5 attention is softmax(Q K^T + B + M) V with no 1/sqrt(d_kv) scaling, where B is the learned
relative position bias, shared by every sequence in the batch and every layer of a stack, and M
masks padded keys (and future keys in the decoder). Layout used throughout: q (batch, q_len, heads,
d_kv), k/v (batch, k_len, heads, d_kv), i.e. the projection output viewed, never transposed, so the
fused kernel reads it with strides.

T5's bias depends only on key - query: the model looks up one relative row per head,
(heads, q_len + k_len - 1) with B[h, i, j] = rel[h, j - i + q_len - 1] (1023 bucket lookups at
512 x 512 instead of 262,144), and `dense_bias` expands it once per stack to the (heads, q_len,
k_len) bias every backend here reads. (Reading the dense tile is faster in the fused kernel than
gathering from the relative row, and so is a dense gradient per layer, summed by autograd, than
the relative row's gradient summed along dS's diagonals in the kernel: 1.63 against 1.75 ms for an
encoder layer's backward on an H100.) At long inputs the dense bias and the backward's dS
(batch, heads, q_len, k_len) grow as the square of the length: from ROW_BIAS_FROM_SCORES query x
key pairs on (`row_bias_applies`), the stack hands the fused kernel the row itself, which it reads
as whole tiles of a table of the tiles near the diagonal (`triton_attention._row_tiles`), and its
backward keeps dS only in a band around the diagonal
(`triton_attention._launch_bwd`); other backends get it expanded.

Backends (`T5Config.attention_backend`):
- "triton": our fused flash-attention kernel with the shared bias and its gradient
  (`triton_attention.py`; CUDA only);
- "sdpa": `torch.nn.functional.scaled_dot_product_attention` with an additive bias mask; what the
  triton backend falls back to for attention dropout and for decoding with a key/value cache;
- "math": explicit fp32-softmax scores, the numerics of HF's eager T5 (used on CPU, and the
  reference the others are tested against);
- "auto": "triton" on CUDA when triton imports, else "math".
Decoding's self-attention on the triton backend runs `triton_decode_attention` (see `t5.py`).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from training.model import triton_attention


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """Mesh TensorFlow's bucketing of (key_position - query_position) into [0, num_buckets).

    Half of the buckets (per direction when bidirectional) hold exact small distances, the rest
    logarithmically wider bins up to max_distance; larger distances share the last bucket. In the
    decoder (not bidirectional) keys after the query are masked anyway and map to bucket 0.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # Log-spaced buckets; the clamp(min=1) only keeps log() finite where is_small selects the other branch.
    large = (
        max_exact
        + (
            torch.log(distance.clamp(min=1).float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).long()
    )
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


@functools.cache
def bias_saturation_distance(bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> int:
    """The smallest d such that every |key - query| >= d falls in the last bucket of its direction,
    so that T5's bias is one value per head there (91 for T5's encoder, 113 for its decoder; in the
    decoder, keys after the query all share bucket 0 anyway). The fused kernel's bias gradient then
    reads only about half of the encoder's dS (`triton_bias_grad.batch_sum`). 0 (no promise) when
    max_distance does not exceed the exact buckets' range: the log buckets then do not end at
    max_distance."""
    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_distance <= max_exact:
        return 0
    distance = torch.arange(max_distance + 1, device="cpu")  # also under a meta default device
    sides = [distance, -distance] if bidirectional else [-distance]
    far = 0
    for relative in sides:
        buckets = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
        # buckets never decrease with the distance and stay at the last from max_distance on
        below_last = (buckets != buckets[-1]).nonzero()
        far = max(far, int(below_last.max()) + 1 if below_last.numel() else 0)
    return max(far, 1)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn "auto" into a concrete backend for tensors on `device`."""
    if backend != "auto":
        return backend
    if device.type == "cuda" and triton_attention.available():
        return "triton"
    return "math"


# From how many query x key pairs on "auto" hands the fused attention the bias as its row: 2048 x
# 2048. From there on the row's step is the faster one (T5 base, ~64k input tokens a step, one H100:
# 2048 inputs 0.1991-0.1996 s against 0.2055 dense compiled, 0.2522 against 0.2640 uncompiled; 8192
# uncompiled 0.4665 against 0.7952 at 34.5 GiB against 45.0); below, the dense one (1024 inputs,
# uncompiled, one H200, with the row read along each tile's diagonals: 0.2077 against 0.1909), whose
# backward reuses the stored dS where the row's recomputes dQ (docs/performance.md).
ROW_BIAS_FROM_SCORES = 2048 * 2048


def row_bias_applies(layout: str, backend: str, device: torch.device, q_len: int, k_len: int) -> bool:
    """Whether a stack hands its self-attentions the relative bias as its (heads, q_len + k_len - 1)
    row instead of expanded (`T5Config.attention_bias_layout`): only the fused kernel reads rows."""
    if layout == "dense" or resolve_backend(backend, device) != "triton":
        return False
    return layout == "row" or q_len * k_len >= ROW_BIAS_FROM_SCORES


def dense_bias(bias: torch.Tensor, q_len: int, k_len: int) -> torch.Tensor:
    """(heads, q_len, k_len) bias from a relative one, (heads, q_len + k_len - 1): one gather."""
    if bias.shape[-1] != q_len + k_len - 1:
        raise ValueError(f"relative bias of length {bias.shape[-1]} for {q_len} queries x {k_len} keys; "
                         f"expected q_len + k_len - 1 = {q_len + k_len - 1}")  # fmt: skip
    offsets = (
        torch.arange(k_len, device=bias.device)[None, :] - torch.arange(q_len, device=bias.device)[:, None]
    )
    return bias[:, offsets + (q_len - 1)]


def _choose_backend(
    backend: str, device: torch.device, causal: bool, q_len: int, k_len: int, dropout_p: float
) -> str:
    """The backend that actually runs: "auto" resolved, and the fused kernel's fallbacks to SDPA (on
    CPU, math) for attention dropout and to SDPA for cached decoding (causal, fewer queries than
    keys: tiny, not worth a fused kernel)."""
    backend = resolve_backend(backend, device)
    if backend == "triton" and dropout_p > 0.0:
        backend = "sdpa" if device.type == "cuda" else "math"
    if backend == "triton" and causal and q_len != k_len:
        backend = "sdpa"
    return backend


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    causal: bool,
    backend: str,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(q k^T + bias + mask) v for q (b, sq, h, d), k/v (b, sk, h, d) -> (b, sq, h, d).

    bias: (h, sq, sk) float or None (cross-attention). key_mask: (b, sk) bool, True = real token, or
    None (all real). causal: query i sees keys j <= i + (sk - sq) (the offset covers a key/value
    cache). dropout_p applies to the attention probabilities (only the math/sdpa paths support it).
    """
    backend = _choose_backend(backend, q.device, causal, q.shape[1], k.shape[1], dropout_p)
    if backend == "triton":
        return triton_attention.t5_flash_attention(q, k, v, bias, key_mask, causal)
    if backend == "math":
        return _math_attention(q, k, v, bias, key_mask, causal, dropout_p)
    if backend == "sdpa":
        return _sdpa_attention(q, k, v, bias, key_mask, causal, dropout_p)
    raise ValueError(f"unknown attention backend {backend!r}")


def packed_attention(
    q_src: torch.Tensor,
    kv_src: torch.Tensor | None,
    heads: int,
    bias: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    causal: bool,
    backend: str,
    dropout_p: float = 0.0,
    bias_far: int = 0,
) -> torch.Tensor:
    """`attention` on the fused projection outputs, (b, sq, heads * d) out.

    Self-attention: q_src (b, s, 3 * heads * d) = [q | k | v], kv_src None. Cross-attention: q_src
    (b, sq, heads * d), kv_src (b, sk, 2 * heads * d) = [k | v]. The fused kernel reads the sources
    with strides and its backward writes each source's gradient as one tensor; other backends get
    q/k/v views. bias (heads, sq, sk), or a relative one as its (heads, sq + sk - 1) row, which
    backends other than the fused kernel get expanded. bias_far: `bias_saturation_distance` of a T5
    bias (0 for any other bias), which the fused kernel's bias gradient uses to read less of dS.
    """
    b, sq, width = q_src.shape
    if kv_src is None:
        kv_src, hd, k_at = q_src, width // 3, width // 3
    else:
        hd, k_at = width, 0
    sk = kv_src.shape[1]
    chosen = _choose_backend(backend, q_src.device, causal, sq, sk, dropout_p)
    if chosen == "triton":
        kv = None if kv_src is q_src else kv_src
        return triton_attention.t5_flash_attention_packed(q_src, kv, heads, bias, key_mask, causal, bias_far)
    if bias is not None and bias.dim() == 2:
        bias = dense_bias(bias, sq, sk)
    q = q_src[..., :hd].unflatten(-1, (heads, hd // heads))
    k = kv_src[..., k_at : k_at + hd].unflatten(-1, (heads, hd // heads))
    v = kv_src[..., k_at + hd : k_at + 2 * hd].unflatten(-1, (heads, hd // heads))
    return attention(q, k, v, bias, key_mask, causal, chosen, dropout_p).flatten(2)


def _allowed_mask(
    batch: int, sq: int, sk: int, key_mask: torch.Tensor | None, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """Boolean (b or 1, 1, sq or 1, sk) mask of allowed (query, key) pairs, or None if all allowed."""
    allowed = None
    if causal:
        q_pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
        allowed = (torch.arange(sk, device=device)[None, :] <= q_pos)[None, None]
    if key_mask is not None:
        km = key_mask.to(torch.bool)[:, None, None, :]
        allowed = km if allowed is None else allowed & km
    return allowed


def _math_attention(q, k, v, bias, key_mask, causal, dropout_p):
    # (b, h, sq, sk) scores; no sqrt(d) scaling in T5.
    scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1))
    if bias is not None:
        scores = scores + bias.unsqueeze(0)
    allowed = _allowed_mask(q.shape[0], q.shape[1], k.shape[1], key_mask, causal, q.device)
    if allowed is not None:
        # Like HF: masked scores become the dtype's minimum (a fully masked row turns uniform, not NaN).
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores.float(), dim=-1).type_as(scores)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs.to(v.dtype), v.transpose(1, 2))  # (b, h, sq, d)
    return out.transpose(1, 2)


def _sdpa_attention(q, k, v, bias, key_mask, causal, dropout_p):
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    mask = None
    if bias is not None:
        mask = bias.to(q.dtype).unsqueeze(0)
    allowed = _allowed_mask(b, sq, sk, key_mask, causal, q.device)
    if allowed is not None:
        additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        additive = additive.masked_fill(~allowed, torch.finfo(q.dtype).min)
        mask = additive if mask is None else mask + additive
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        dropout_p=dropout_p,
        scale=1.0,
    )
    return out.transpose(1, 2)
