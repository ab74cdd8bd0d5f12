"""The chunked fused lm_head + cross-entropy (`training/model/cross_entropy.py`) on CPU: loss and
gradients against torch's, its logits gradient bit for bit, bf16 autocast, and its buffers."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.model.cross_entropy import fused_linear_cross_entropy


def test_fused_cross_entropy_matches_reference_loss_and_grads():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(1000, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (37,))
    labels[::5] = -100
    loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=8)
    (2.0 * loss).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h2 @ w2.t(), labels, ignore_index=-100)
    (2.0 * ref).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_fused_cross_entropy_gradient_is_softmax_minus_one_hot_bit_for_bit():
    """The logits' gradient is formed element-wise (a comparison with the vocabulary's indices, so
    that inductor can fuse it): exactly the values of the in-place scatter it replaced,
    (exp(logits - lse) with -1 added at the target) / n_valid, rows of ignored labels 0."""
    from training.model.cross_entropy import _loss_and_grads

    torch.manual_seed(0)
    hidden, weight = torch.randn(37, 16), torch.randn(1000, 16)
    labels = torch.randint(0, 1000, (37,))
    labels[::5] = -100
    _, grad_h, grad_w = _loss_and_grads(hidden, weight, labels, chunk_rows=8)
    scale = (labels != -100).float() * (1.0 / (labels != -100).sum().float())
    want_w = torch.zeros_like(weight)
    for start in range(0, 37, 8):  # chunk by chunk, as the function forms the products
        rows = slice(start, start + 8)
        logits = hidden[rows] @ weight.t()
        grad = torch.exp(logits - torch.logsumexp(logits, dim=-1)[:, None])
        grad.scatter_add_(1, labels[rows].clamp(min=0)[:, None], -torch.ones(grad.shape[0], 1))
        grad = grad * scale[rows, None]
        assert torch.equal(grad_h[rows], grad @ weight)
        want_w += grad.t() @ hidden[rows]
        assert not grad[labels[rows] == -100].any()
    assert torch.equal(grad_w, want_w)


def test_fused_cross_entropy_forms_each_chunks_gradient_in_its_logits_buffer():
    """Run eagerly (CPU, no compile), a chunk's logits, softmax and gradient share one fp32 buffer:
    no other tensor of the chunk's (rows, vocab) size and a float dtype is made (the one-hot is a
    bool comparison). The out-of-place version before it counted 5 here (freed buffers may be reused
    at the same address, so this counts distinct addresses, a lower bound on the tensors made)."""
    from training.model.cross_entropy import _loss_and_grads

    class ChunkSized(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.shape == (8, 1000) and t.dtype.is_floating_point:
                    self.storages.add(t.untyped_storage().data_ptr())
            return out

    torch.manual_seed(0)
    hidden, weight = torch.randn(8, 16), torch.randn(1000, 16)
    labels = torch.randint(0, 1000, (8,))
    with ChunkSized() as mode:
        loss, grad_h, _ = _loss_and_grads(hidden, weight, labels, chunk_rows=8)
    assert len(mode.storages) == 1
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(hidden @ weight.t(), labels))


def test_fused_cross_entropy_under_bf16_autocast_matches_the_bf16_head():
    """Under autocast the fused loss runs the head's matmuls in bf16 like nn.Linear would, and its
    gradients reach the fp32 hidden states and weight in fp32 (what the casts' backward gives)."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(1000, 16, requires_grad=True)
    labels = torch.randint(0, 1000, (37,))
    labels[::5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=8)
    (3.0 * loss).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = (h2.bfloat16() @ w2.bfloat16().t()).float()
    ref = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    (3.0 * ref).backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)
    # both round d(logits) to bf16 before the two matmuls (ulp-level differences only)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=2e-2, atol=1e-2 * float(h2.grad.abs().max()))
    torch.testing.assert_close(weight.grad, w2.grad, rtol=2e-2, atol=1e-2 * float(w2.grad.abs().max()))
