"""cuDNN's fused attention (training/model/cudnn_attention.py) against the math attention on a GPU
(skipped without CUDA, cuDNN 9 and nvidia-cudnn-frontend)."""

import pytest
import torch

from training.model import T5Config, T5ForConditionalGeneration
from training.model import cudnn_attention as ca
from training.model import triton_gated_gelu as tg
from training.model.attention import _math_attention, attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ca.available(), reason="needs CUDA, cuDNN 9 and nvidia-cudnn-frontend"),
]

CASES = [  # (b, sq, sk, bias, causal): encoder self, decoder self, cross-attention, odd sizes
    (4, 512, 512, True, False),
    (4, 114, 114, True, True),
    (4, 114, 512, False, False),
    (3, 77, 77, True, True),
    (5, 200, 200, True, False),
]


def _rel_errors(got, exp):
    return [((g.float() - e.float()).norm() / e.float().norm()).item() for g, e in zip(got, exp)]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_cudnn_matches_math_bf16(case, monkeypatch):
    """Output and the gradients of q, k, v and the bias against fp32 math attention on the same bf16
    inputs; cuDNN reads the bias in bf16 and returns its gradient in bf16."""
    b, sq, sk, with_bias, causal = case
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, 12, 64, device="cuda", generator=g).bfloat16().requires_grad_()
               for s in (sq, sk, sk))  # fmt: skip
    bias = torch.randn(12, sq, sk, device="cuda", generator=g).requires_grad_() if with_bias else None
    calls = []
    launch = ca._launch_fwd
    monkeypatch.setattr(ca, "_launch_fwd", lambda *a: calls.append(1) or launch(*a))
    out = attention(q, k, v, bias, None, causal, "cudnn")
    assert calls, "the cudnn backend did not run cuDNN"
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _math_attention(q32, k32, v32, bias, None, causal, 0.0)
    dout = torch.randn_like(ref)
    leaves = [t for t in (q, k, v, bias) if t is not None]
    got = torch.autograd.grad(out, leaves, dout.bfloat16())
    exp = torch.autograd.grad(ref, [t for t in (q32, k32, v32, bias) if t is not None], dout)
    errors = _rel_errors((*got, out), (*exp, ref))
    assert max(errors) < 2e-2, dict(zip("qkvbo" if with_bias else "qkvo", errors))


def test_cudnn_with_a_padding_mask_runs_the_triton_kernel():
    """cuDNN takes no key mask: attention with one runs on our kernel and still masks."""
    q, k, v = (torch.randn(2, 64, 4, 64, device="cuda").bfloat16() for _ in range(3))
    mask = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    mask[0, 40:] = False
    out = attention(q, k, v, None, mask, False, "cudnn")
    ref = _math_attention(q.float(), k.float(), v.float(), None, mask, False, 0.0)
    assert _rel_errors([out], [ref])[0] < 1e-2


def test_model_cudnn_backend_matches_math_under_autocast_and_compiles_without_graph_breaks():
    """The tiny model under bf16 autocast (cuDNN takes no fp32), no padding: loss and every gradient
    of the cudnn backend, eager and compiled with fullgraph=True, against the math backend."""
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", num_layers=3)).cuda()
    ids = torch.randint(2, 32128, (4, 128), device="cuda")
    labels = torch.randint(2, 32128, (4, 40), device="cuda")

    def run(backend, compiled=False):
        for m in model.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        tg.ENABLED = backend != "math"  # the reference runs torch's gated GELU
        model.zero_grad()

        def fn():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(ids, labels=labels).loss

        loss = torch.compile(fn, fullgraph=True)() if compiled else fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    try:
        ref_loss, ref_grads = run("math")
        results = [run("cudnn", compiled) for compiled in (False, True)]
    finally:
        tg.ENABLED = True
    for loss, grads in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
        errors = {n: _rel_errors([g], [ref_grads[n]])[0] for n, g in grads.items()}
        assert max(errors.values()) < 5e-2, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
