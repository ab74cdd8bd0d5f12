"""`training.determinism.set_deterministic`: the torch switches it sets and the cuBLAS setting it
needs (CPU), and two compiled GPU training runs that it makes bit-identical (skipped without CUDA;
the base model's runs and the cost are in docs/performance.md)."""

import os

import pytest
import torch

from training.determinism import CUBLAS_WORKSPACE_CONFIGS, set_deterministic


def test_set_deterministic_switches_torch_and_restores_its_defaults(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    set_deterministic(True)
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIGS[0]
    finally:
        set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory


def test_a_users_cublas_setting_is_kept_or_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    set_deterministic(True)
    set_deterministic(False)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="unset it or set it to :4096:8"):
        set_deterministic(True)
    assert not torch.are_deterministic_algorithms_enabled()


def _train_tiny_on_gpu(steps: int = 6, pdl: bool = True) -> list[torch.Tensor]:
    """Parameters after `steps` compiled bf16 training steps of a tiny T5 (fused attention and GELU
    kernels, fused cross-entropy, fused AdamWScale) from seed 0, compiled with the options training
    uses (`compile_options`: PDL unless `pdl` is False)."""
    from training.compile_settings import compile_options
    from training.model import T5Config, T5ForConditionalGeneration
    from training.optim import build_optimizer

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="triton", num_layers=3)).cuda()
    optimizer = build_optimizer("adamwscale", model, lr=1e-2, weight_decay=0.0, fused=True)
    ids = torch.randint(2, 32128, (16, 128), device="cuda")
    labels = torch.randint(2, 32128, (16, 32), device="cuda")
    loss_fn = torch.compile(lambda: model(ids, labels=labels, return_logits=False).loss, fullgraph=True,
                            options=compile_options(pdl=pdl))  # fmt: skip
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_training_runs_are_bit_identical_on_the_gpu():
    set_deterministic(True)
    try:
        first, second = _train_tiny_on_gpu(), _train_tiny_on_gpu()
    finally:
        set_deterministic(False)
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_changes_no_bit_of_deterministic_training():
    """Programmatic dependent launch (`compile_options`, on by default; inductor emits it on Hopper
    or newer) only moves when inductor's kernels start: with deterministic algorithms the parameters
    after training with and without it are bit-identical. A kernel that read its predecessor's output
    before waiting for it would break that."""
    set_deterministic(True)
    try:
        with_pdl, without = _train_tiny_on_gpu(pdl=True), _train_tiny_on_gpu(pdl=False)
    finally:
        set_deterministic(False)
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(with_pdl, without, strict=True))
