"""Activation checkpointing (`model.activation_checkpointing`): the same loss and gradients bit for
bit as without it (dropout included: the recompute draws the same masks), less memory kept by the
forward for the backward ("block" least), and nothing changed outside training steps. On the GPU,
the same under torch.compile with the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from training.config import ConfigError, ModelConfig
from training.model import T5Config, T5ForConditionalGeneration
from training.run_setup import build_model

POLICIES = ("none", "block", "selective")


def _step(policy: str, device: str = "cpu", backend: str = "math", compile_model: bool = False,
          dropout_rate: float = 0.1):
    """(loss, gradients by name, bytes the forward keeps for the backward: CPU only, else None)."""
    torch.manual_seed(0)
    config = T5Config.from_preset("tiny", dropout_rate=dropout_rate, attention_backend=backend,
                                  activation_checkpointing=policy)
    model = T5ForConditionalGeneration(config).to(device).train()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, 1000, (4, 256), generator=generator).to(device)
    labels = torch.randint(2, 1000, (4, 32), generator=generator).to(device)
    forward = torch.compile(model) if compile_model else model
    torch.manual_seed(2)  # the dropout masks
    kept = None
    if device == "cpu":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = forward(input_ids, labels=labels, return_logits=False).loss
        kept = sum(event.self_cpu_memory_usage for event in prof.events())  # allocated minus freed
    else:
        loss = forward(input_ids, labels=labels, return_logits=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept


def test_same_loss_and_gradients_and_less_memory_kept():
    results = {policy: _step(policy) for policy in POLICIES}
    loss, grads, kept = results["none"]
    for policy in ("block", "selective"):
        assert torch.equal(results[policy][0], loss), policy
        assert all(torch.equal(results[policy][1][n], g) for n, g in grads.items()), policy
    # tiny model, 4 x 256 inputs: about 51 MB kept without checkpointing, 28 selective, 12 per block
    assert results["block"][2] < 0.5 * results["selective"][2] < 0.5 * kept, {p: r[2] for p, r in results.items()}


def test_no_checkpointing_outside_training_steps():
    config = T5Config.from_preset("tiny", attention_backend="math", activation_checkpointing="block")
    model = T5ForConditionalGeneration(config).eval()
    plain = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math")).eval()
    plain.load_state_dict(model.state_dict())
    input_ids = torch.randint(2, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model.generate(input_ids, max_new_tokens=5), plain.generate(input_ids, max_new_tokens=5))


def test_the_run_config_sets_it_and_refuses_unknown_policies():
    model = build_model(ModelConfig(preset="tiny", activation_checkpointing="selective"), torch.device("cpu"))[0]
    assert model.config.activation_checkpointing == "selective"
    with pytest.raises(ConfigError, match="model.activation_checkpointing.*block"):
        ModelConfig(activation_checkpointing="full")
    with pytest.raises(ValueError, match="activation_checkpointing"):
        T5Config(activation_checkpointing="full")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["block", "selective"])
def test_compiled_triton_step_matches_without_checkpointing(policy):
    """Compiled, without dropout: inductor draws dropout masks in its graph's order, which
    checkpointing changes, so compiled runs with dropout differ in their masks (each recompute
    still uses its forward's)."""
    loss, grads, _ = _step("none", "cuda", "triton", compile_model=True, dropout_rate=0.0)
    checkpointed_loss, checkpointed_grads, _ = _step(policy, "cuda", "triton", compile_model=True, dropout_rate=0.0)
    torch.testing.assert_close(checkpointed_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
