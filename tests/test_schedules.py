"""LR schedules: closed forms at key steps, and nanoT5's own torch construction step by step."""

from __future__ import annotations

import math

import pytest
import torch

from training.optim import SCHEDULES, build_scheduler, lr_at

BASE, WARMUP, TOTAL, FINAL = 2e-2, 10, 50, 1e-5


def _opt(lr=BASE):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _run(sched, opt, steps):
    """lr used by each of `steps` optimizer steps, stepping the scheduler after each (nanoT5 loop)."""
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def nanot5_cosine(opt):
    """nanoT5/utils/model_utils.py get_lr_scheduler, 'cosine'."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    s1 = LinearLR(opt, start_factor=0.5, end_factor=1, total_iters=WARMUP, last_epoch=-1)
    s2 = CosineAnnealingLR(opt, T_max=TOTAL - WARMUP, eta_min=FINAL)
    return SequentialLR(opt, schedulers=[s1, s2], milestones=[WARMUP])


def nanot5_legacy(opt, total):
    """nanoT5/utils/model_utils.py get_lr_scheduler, 'legacy'."""
    from torch.optim.lr_scheduler import LambdaLR, LinearLR, SequentialLR

    n1 = math.ceil(total * 0.9)
    s1 = LambdaLR(opt, lambda step: min(1e-2, 1.0 / math.sqrt(step)) / BASE if step else 1e-2 / BASE)
    s2 = LinearLR(
        opt,
        start_factor=min(1e-2, 1.0 / math.sqrt(n1)) / BASE,
        end_factor=0,
        total_iters=total - n1,
        last_epoch=-1,
    )
    return SequentialLR(opt, schedulers=[s1, s2], milestones=[n1])


def kw(**over):
    d = dict(base_lr=BASE, warmup_steps=WARMUP, total_steps=TOTAL, final_lr=FINAL)
    d.update(over)
    return d


def test_cosine_matches_nanot5_sequential_lr():
    opt = _opt()
    expected = _run(nanot5_cosine(opt), opt, TOTAL + 1)
    ours = [lr_at("cosine", s, **kw()) for s in range(TOTAL + 1)]
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-12)
    opt2 = _opt()
    assert _run(build_scheduler("cosine", opt2, **kw()), opt2, TOTAL + 1) == pytest.approx(expected, rel=1e-9)


def test_cosine_key_values():
    assert lr_at("cosine", 0, **kw()) == pytest.approx(0.5 * BASE)  # nanoT5 warmup starts at half
    assert lr_at("cosine", WARMUP // 2, **kw()) == pytest.approx(0.75 * BASE)
    assert lr_at("cosine", WARMUP, **kw()) == pytest.approx(BASE)
    mid = WARMUP + (TOTAL - WARMUP) // 2
    assert lr_at("cosine", mid, **kw()) == pytest.approx((BASE + FINAL) / 2)
    assert lr_at("cosine", TOTAL, **kw()) == pytest.approx(FINAL)
    assert lr_at("cosine", TOTAL + 100, **kw()) == pytest.approx(FINAL)  # held, not rising again


@pytest.mark.parametrize("total", [50, 73])
def test_legacy_matches_nanot5_sequential_lr(total):
    opt = _opt()
    expected = _run(nanot5_legacy(opt, total), opt, total + 1)
    ours = [lr_at("legacy", s, **kw(total_steps=total)) for s in range(total + 1)]
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_legacy_key_values():
    k = kw(total_steps=100_000)
    assert lr_at("legacy", 0, **k) == 1e-2
    assert lr_at("legacy", 10_000, **k) == pytest.approx(1e-2)
    assert lr_at("legacy", 40_000, **k) == pytest.approx(1 / 200)
    assert lr_at("legacy", 90_000, **k) == pytest.approx(1 / math.sqrt(90_000))
    assert lr_at("legacy", 95_000, **k) == pytest.approx(0.5 / math.sqrt(90_000))
    assert lr_at("legacy", 100_000, **k) == 0.0


def test_constant_and_linear():
    assert lr_at("constant", 0, **kw(warmup_steps=0)) == BASE
    assert lr_at("constant", 5, **kw()) == pytest.approx(BASE * 5 / WARMUP)
    assert lr_at("constant", 1000, **kw()) == BASE
    assert lr_at("linear", 5, **kw()) == pytest.approx(BASE * 5 / WARMUP)
    assert lr_at("linear", WARMUP, **kw()) == pytest.approx(BASE)
    assert lr_at("linear", 30, **kw()) == pytest.approx(BASE + (FINAL - BASE) * 0.5)
    assert lr_at("linear", TOTAL, **kw()) == pytest.approx(FINAL)
    assert lr_at("linear", TOTAL + 7, **kw()) == pytest.approx(FINAL)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_build_scheduler_follows_lr_at(name):
    opt = _opt()
    got = _run(build_scheduler(name, opt, **kw()), opt, TOTAL + 5)
    assert got == pytest.approx([lr_at(name, s, **kw()) for s in range(TOTAL + 5)], rel=1e-12, abs=1e-15)


def test_errors():
    with pytest.raises(ValueError, match="constant, cosine, legacy, linear"):
        lr_at("step", 0, **kw())
    with pytest.raises(ValueError, match="must exceed warmup_steps"):
        lr_at("cosine", 0, **kw(total_steps=WARMUP))
    with pytest.raises(ValueError, match="base_lr"):
        build_scheduler("cosine", _opt(lr=1e-3), **kw())
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_at("linear", 0, **kw(warmup_steps=-1))
