"""T5 attention on cuDNN's fused attention kernels, through cudnn-frontend's graph API.

cuDNN's fused SDPA takes an additive bias of shape (1, H, SQ, SK) and its backward returns the
bias gradient dBias already summed over the batch: T5's relative bias, shared by the batch, is
exactly that case. The model reaches it through `attention_backend="cudnn"` (opt-in: "auto" is
the Triton kernel). Measured on an H100 at T5 base's shapes (`benchmarks/attention_backends.py`,
docs/model_speed.md), cuDNN 9.19's kernels lose to ours in the compiled step (encoder self-attention
2.55 against 2.10 ms forward + backward; 3-5 ms a step); eager, where our launchers' torch glue
runs unfused, they win by a little. The sources are read in place, as the Triton backend reads
them: self-attention q_src (B, S, 3 H D) = [q | k | v], cross-attention q_src (B, SQ, H D) and
kv_src (B, SK, 2 H D) = [k | v]; the backward writes each source's gradient as one buffer.

What differs from the Triton backend (`triton_attention.py`):
- The bias enters in the inputs' dtype (bf16 under autocast; cuDNN adds it to fp32 scores) and its
  gradient leaves in that dtype, before autograd widens it to the fp32 bias table. HF's T5 under
  autocast rounds as much: it adds the bias in place into its bf16 scores. (Declared fp32, the
  bias gave NaN with cuDNN 9.19, which read it in the inputs' dtype.)
- bf16 / fp16 inputs only and no key padding mask (cuDNN masks padding through per-row lengths,
  right padding only): `attention._choose_backend` sends those cases to the Triton kernel, and
  attention with dropout to sdpa.
- Needs the `nvidia-cudnn-frontend` package (`pip install .[cudnn]`) and cuDNN 9, which torch's
  CUDA wheels bring.

One forward and one backward graph is built per (shapes, strides, dtype, causal, bias) and cached.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

_HAS_FRONTEND = importlib.util.find_spec("cudnn") is not None


@torch.compiler.assume_constant_result  # torch.compile reads the answer, it does not trace the probe
def available() -> bool:
    """True when cuDNN's fused attention can run here: cudnn-frontend installed, a CUDA GPU of compute
    capability 8.0 or newer, and the cuDNN library loadable."""
    return _probe()


@functools.cache
def _probe() -> bool:
    if not (_HAS_FRONTEND and torch.cuda.is_available()) or torch.cuda.get_device_capability() < (8, 0):
        return False
    try:
        torch.backends.cudnn.version()  # loads torch's libcudnn, which the frontend then finds
        import cudnn

        return cudnn.backend_version() >= 90000
    except Exception:  # noqa: BLE001 - no usable cuDNN library: the backend is unavailable
        return False


def supports(dtype: torch.dtype, d_kv: int) -> bool:
    """Whether cuDNN's fused attention takes this input dtype and head size."""
    return dtype in (torch.bfloat16, torch.float16) and d_kv % 8 == 0 and d_kv <= 128


def _heads_view(src: torch.Tensor, column: int, heads: int, d_kv: int) -> torch.Tensor:
    """(B, H, S, D) view of the columns column.. column + H * D of a (B, S, width) source (no copy)."""
    return src[..., column : column + heads * d_kv].unflatten(-1, (heads, d_kv)).transpose(1, 2)


def head_views(q_src: torch.Tensor, kv_src: torch.Tensor, heads: int):
    """(B, H, S, D) views of q, k, v in packed sources: kv_src empty = self-attention [q | k | v]."""
    if kv_src.numel() == 0:
        hd = q_src.shape[-1] // 3
        d = hd // heads
        return (
            _heads_view(q_src, 0, heads, d),
            _heads_view(q_src, hd, heads, d),
            _heads_view(q_src, 2 * hd, heads, d),
        )
    hd = q_src.shape[-1]
    d = hd // heads
    return (
        _heads_view(q_src, 0, heads, d),
        _heads_view(kv_src, 0, heads, d),
        _heads_view(kv_src, hd, heads, d),
    )


class _Graph:
    """A built cuDNN graph, its tensors by name, and its workspace size."""

    def __init__(self, graph, tensors: dict):
        import cudnn

        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        self.graph, self.tensors, self.workspace = graph, tensors, graph.get_workspace_size()

    def __call__(self, handle, **data: torch.Tensor) -> None:
        import cudnn

        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        workspace = torch.empty(self.workspace, device=data["q"].device, dtype=torch.uint8)
        self.graph.execute({self.tensors[name]: t for name, t in data.items()}, workspace, handle=handle)


@functools.cache
def _handle(device_index: int):
    import cudnn

    with torch.cuda.device(device_index):
        return cudnn.create_handle()


def _new_graph(dtype: torch.dtype, handle):
    import cudnn

    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]
    fp32 = cudnn.data_type.FLOAT
    return cudnn.pygraph(io_data_type=io, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)


def _mask_args(causal: bool) -> dict:
    import cudnn

    # causal: query i sees keys j <= i (SQ == SK here: cached decoding goes to sdpa)
    return (
        dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
        if causal
        else {}
    )


def _set_output(t, like: torch.Tensor, data_type=None):
    t.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride()))
    if data_type is not None:
        t.set_data_type(data_type)


_GRAPHS: dict[tuple, tuple[_Graph, _Graph]] = {}


def _graphs(q, k, v, bias, out, stats, causal: bool) -> tuple[_Graph, _Graph]:
    """The (forward, backward) graphs for these views' shapes and strides; built on first use."""
    key = (q.device.index, q.dtype, causal, bias is not None,
           *(tuple(t.shape) + tuple(t.stride()) for t in (q, k, v, out)))  # fmt: skip
    if key in _GRAPHS:
        return _GRAPHS[key]
    import cudnn

    handle = _handle(q.device.index)
    g = _new_graph(q.dtype, handle)
    t = dict(q=g.tensor_like(q), k=g.tensor_like(k), v=g.tensor_like(v))
    if bias is not None:
        t["bias"] = g.tensor_like(bias)
    t["o"], t["stats"] = g.sdpa(name="t5_attention", q=t["q"], k=t["k"], v=t["v"], generate_stats=True,
                                attn_scale=1.0, bias=t.get("bias"), **_mask_args(causal))  # fmt: skip
    _set_output(t["o"], out)
    _set_output(t["stats"], stats, cudnn.data_type.FLOAT)
    forward = _Graph(g, t)

    g = _new_graph(q.dtype, handle)
    # dO has out's layout: (B, SQ, H * D) contiguous, the backward makes it so
    t = {name: g.tensor_like(x) for name, x in dict(q=q, k=k, v=v, o=out, dO=out, stats=stats).items()}
    extra = {}
    if bias is not None:
        t["bias"], t["dBias"] = g.tensor_like(bias), g.tensor_like(bias)
        extra = dict(bias=t["bias"], dBias=t["dBias"])
    t["dQ"], t["dK"], t["dV"] = g.sdpa_backward(name="t5_attention_backward", q=t["q"], k=t["k"], v=t["v"],
                                                o=t["o"], dO=t["dO"], stats=t["stats"], attn_scale=1.0,
                                                **extra, **_mask_args(causal))  # fmt: skip
    for name, like in (("dQ", q), ("dK", k), ("dV", v)):
        _set_output(t[name], like)
    backward = _Graph(g, t)
    _GRAPHS[key] = forward, backward
    return forward, backward


def _launch_fwd(q_src, kv_src, bias, causal: bool, heads: int):
    """out (B, SQ, H * D) and the softmax statistics (B, H, SQ, 1) fp32 for the backward."""
    # detached: cudnn-frontend reads shapes through DLPack, which refuses tensors that require grad
    q_src, kv_src, bias = q_src.detach(), kv_src.detach(), bias.detach()
    q, k, v = head_views(q_src, kv_src, heads)
    b, h, sq, d = q.shape
    out = torch.empty((b, sq, h * d), dtype=q_src.dtype, device=q_src.device)
    stats = torch.empty((b, h, sq, 1), dtype=torch.float32, device=q_src.device)
    o = _heads_view(out, 0, h, d)
    bias4 = bias[None] if bias.numel() else None
    forward, _ = _graphs(q, k, v, bias4, o, stats, causal)
    data = dict(q=q, k=k, v=v, o=o, stats=stats)
    if bias4 is not None:
        data["bias"] = bias4
    forward(_handle(q.device.index), **data)
    return out, stats


def _launch_bwd(q_src, kv_src, bias, out, stats, dout, causal: bool, heads: int):
    """Gradients of the sources (each one buffer laid out like its source; an empty kv_src gets an
    empty gradient) and of the (H, SQ, SK) bias, in the bias's dtype."""
    q_src, kv_src, bias, out, stats, dout = (t.detach() for t in (q_src, kv_src, bias, out, stats, dout))
    q, k, v = head_views(q_src, kv_src, heads)
    dq_src, dkv_src = torch.empty_like(q_src), torch.empty_like(kv_src)
    dq, dk, dv = head_views(dq_src, dkv_src, heads)
    o, do = (_heads_view(t, 0, heads, q.shape[-1]) for t in (out, dout))
    bias4 = bias[None] if bias.numel() else None
    _, backward = _graphs(q, k, v, bias4, o, stats, causal)
    dbias = torch.empty_like(bias)
    data = dict(q=q, k=k, v=v, o=o, dO=do, stats=stats, dQ=dq, dK=dk, dV=dv)
    if bias4 is not None:
        data["bias"], data["dBias"] = bias4, dbias[None]
    backward(_handle(q.device.index), **data)
    return dq_src, dkv_src, dbias


@torch.library.custom_op("t5ds::cudnn_attention_fwd", mutates_args=())
def _fwd_op(
    q_src: torch.Tensor, kv_src: torch.Tensor, bias: torch.Tensor, causal: bool, heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_fwd(q_src, kv_src, bias, causal, heads)


@_fwd_op.register_fake
def _(q_src, kv_src, bias, causal, heads):
    b, sq, width = q_src.shape
    hd = width // 3 if kv_src.numel() == 0 else width
    return q_src.new_empty((b, sq, hd)), q_src.new_empty((b, heads, sq, 1), dtype=torch.float32)


@torch.library.custom_op("t5ds::cudnn_attention_bwd", mutates_args=())
def _bwd_op(
    q_src: torch.Tensor,
    kv_src: torch.Tensor,
    bias: torch.Tensor,
    out: torch.Tensor,
    stats: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_bwd(q_src, kv_src, bias, out, stats, dout, causal, heads)


@_bwd_op.register_fake
def _(q_src, kv_src, bias, out, stats, dout, causal, heads):
    return torch.empty_like(q_src), torch.empty_like(kv_src), torch.empty_like(bias)


def _setup_context(ctx, inputs, output):
    q_src, kv_src, bias, causal, heads = inputs
    ctx.save_for_backward(q_src, kv_src, bias, *output)
    ctx.causal, ctx.heads = causal, heads


def _backward(ctx, dout, dstats):
    q_src, kv_src, bias, out, stats = ctx.saved_tensors
    dq_src, dkv_src, dbias = _bwd_op(
        q_src, kv_src, bias, out, stats, dout.contiguous(), ctx.causal, ctx.heads
    )
    return dq_src, dkv_src if kv_src.numel() else None, dbias if bias.numel() else None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def cudnn_attention_packed(
    q_src: torch.Tensor,
    kv_src: torch.Tensor | None,
    heads: int,
    bias: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """cuDNN's fused attention read straight from the projection outputs, (B, SQ, H * D) out.

    Sources as in `triton_attention.t5_flash_attention_packed` (bf16 or fp16, or fp32 under an
    autocast to one of them); the bias (H, SQ, SK) in any float dtype, cast to the inputs' dtype
    here, so its gradient comes back through that cast. No key mask: the caller sends attention with
    padding to another backend.
    """
    if not available():
        raise RuntimeError(
            "attention_backend='cudnn' needs a CUDA GPU (compute capability 8.0+), cuDNN 9 and the "
            "nvidia-cudnn-frontend package (pip install nvidia-cudnn-frontend); or use 'auto' or 'triton'"
        )
    device = q_src.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q_src.dtype
    width = q_src.shape[-1] // (3 if kv_src is None else 1)
    if not supports(dtype, width // heads):
        raise ValueError(
            f"cuDNN's fused attention takes bf16/fp16 inputs with d_kv a multiple of 8 up to 128, got "
            f"{dtype} and d_kv {width // heads}; use attention_backend 'auto' or 'triton'"
        )
    q_src = q_src.to(dtype).contiguous()
    kv_src = q_src.new_empty((0,)) if kv_src is None else kv_src.to(dtype).contiguous()
    bias = q_src.new_empty((0,)) if bias is None else bias.to(dtype).contiguous()
    with torch.autocast(device_type=device, enabled=False):
        out, _ = _fwd_op(q_src, kv_src, bias, causal, heads)
    return out
