"""The loop's ZeRO 0 gradient clipping (training/grad_clip.py) against DeepSpeed's own, and when the
loop takes clipping over from DeepSpeed."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_checkpoint import dist1  # noqa: F401  (fixture: a world-size-1 gloo group)
from training.grad_clip import GradClip, loop_clip
from training.model import T5Config, T5ForConditionalGeneration


def _model_with_grads(scale: float) -> torch.nn.Module:
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny"))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * scale
    return model


@pytest.mark.parametrize("scale", [1.0, 1e-4])  # clipped, and below the threshold (left as is)
def test_grad_clip_equals_deepspeeds_clip(dist1, scale):  # noqa: F811
    from deepspeed.runtime.utils import clip_grad_norm_ as deepspeed_clip

    ours, theirs = _model_with_grads(scale), _model_with_grads(scale)
    before = [p.grad.clone() for p in ours.parameters()]
    norm = GradClip(ours.parameters(), 1.0)()
    their_norm = deepspeed_clip(list(theirs.parameters()), max_norm=1.0)
    assert float(norm) == pytest.approx(float(their_norm), rel=1e-6)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
    assert float(norm) == pytest.approx(float(total), rel=1e-6)  # the norm BEFORE clipping
    for a, b, g in zip(ours.parameters(), theirs.parameters(), before):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
        if scale < 1e-3:
            assert torch.equal(a.grad, g)  # under the threshold nothing changes
    if scale == 1.0:
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ours.parameters()]))
        assert float(clipped) == pytest.approx(1.0, rel=1e-5)


def _ds(stage: int = 0, clip: float = 1.0, mode: str = "torch_autocast") -> dict:
    return {"gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "torch_autocast": {"enabled": mode == "torch_autocast"}, "bf16": {"enabled": mode == "bf16"}}


def test_loop_clips_only_where_deepspeed_would_loop():
    model = torch.nn.Linear(3, 3)
    for ds in (_ds(), _ds(mode="fp32")):
        untouched = copy.deepcopy(ds)
        clip = loop_clip(ds, model)
        assert isinstance(clip, GradClip) and clip.max_norm == 1.0
        assert ds == untouched  # the run's config keeps its value; start_engine hands DeepSpeed a copy
    for ds in (_ds(stage=1), _ds(stage=3), _ds(clip=0.0), _ds(mode="bf16"),
               {**_ds(mode="fp32"), "fp16": {"enabled": True}}):
        untouched = copy.deepcopy(ds)
        assert loop_clip(ds, model) is None and ds == untouched
    with pytest.raises(ValueError, match="must be > 0"):
        GradClip(model.parameters(), 0.0)


def test_clipping_handed_to_an_optimizer_that_clips_in_its_step():
    """With adamwscale the loop's clip only arms the optimizer (`max_grad_norm`): `clip()` leaves the
    gradients alone, the step clips them, and `last_norm()` is the norm before clipping; the
    weights equal those of clipping before the step. torch's AdamW keeps the clip before the step."""
    from training.optim import build_optimizer

    def run(in_step: bool):
        model = _model_with_grads(3.0)
        opt = build_optimizer("adamwscale", model, lr=1e-2)
        clip = loop_clip(_ds(), model, opt if in_step else None)
        assert clip.in_step == in_step and opt.max_grad_norm == (1.0 if in_step else 0.0)
        before = [p.grad.clone() for p in model.parameters()]
        returned = clip()
        if in_step:
            assert returned is None and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
        opt.step()
        return [p.detach().clone() for p in model.parameters()], float(clip.last_norm()), before

    (w_in, norm_in, grads), (w_before, norm_before, _) = run(True), run(False)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert norm_in == norm_before == pytest.approx(float(total), rel=1e-6) and norm_in > 1.0
    assert all(torch.equal(a, b) for a, b in zip(w_in, w_before))

    model = _model_with_grads(3.0)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clip = loop_clip(_ds(), model, adamw)
    assert not clip.in_step and float(clip()) > 1.0 and clip.last_norm() is not None
