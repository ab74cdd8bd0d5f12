"""NonfiniteWatch: skipped-step counting with the deferred (one step late) guard and a sync one."""

import torch
from torch import nn

from training.nonfinite_watch import NonfiniteWatch
from training.optim import build_optimizer


class FakeEngine:
    skipped_steps = 0


def _step(model, opt, bad: bool) -> None:
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    if bad:
        model.weight.grad[0, 0] = float("nan")
    opt.step()


def test_deferred_guard_is_counted_one_step_late_and_in_a_row_resets():
    model = nn.Linear(3, 2)
    opt = build_optimizer("adamwscale", model, lr=1e-2)
    watch = NonfiniteWatch(opt, FakeEngine(), skipped_before=5)
    seen = []
    for bad in [False, True, True, False, False]:
        _step(model, opt, bad)
        watch.update()
        seen.append((watch.skipped, watch.in_a_row))
    # step 2's skip shows after step 3, step 3's after step 4; step 4 applied shows after step 5
    assert seen == [(5, 0), (5, 0), (6, 1), (7, 2), (7, 0)]


def test_wait_settles_the_last_step_without_resetting_the_run_of_skips():
    model = nn.Linear(3, 2)
    opt = build_optimizer("adamwscale", model, lr=1e-2)
    watch = NonfiniteWatch(opt)
    _step(model, opt, bad=True)
    assert watch.update(wait=True) == 1  # a checkpoint reads the last step now
    _step(model, opt, bad=True)
    watch.update()  # nothing new is known about this step: the run of skips must not reset
    assert (watch.skipped, watch.in_a_row) == (1, 1)
    _step(model, opt, bad=False)
    watch.update()
    assert (watch.skipped, watch.in_a_row) == (2, 2)
    _step(model, opt, bad=False)
    watch.update()
    assert (watch.skipped, watch.in_a_row) == (2, 0)


def test_sync_guard_and_engine_skips_are_counted_at_once():
    model = nn.Linear(3, 2)
    opt = build_optimizer("adamw", model, lr=1e-2)
    engine = FakeEngine()
    watch = NonfiniteWatch(opt, engine)
    _step(model, opt, bad=True)
    assert watch.update() == 1
    engine.skipped_steps += 1  # DeepSpeed's bf16/fp16 wrapper skipped the next one itself
    assert watch.update() == 1
    assert (watch.skipped, watch.in_a_row) == (2, 2)
    _step(model, opt, bad=False)
    watch.update()
    assert watch.in_a_row == 0


def test_checkpoint_refusal_names_each_reason():
    from training.nonfinite_watch import checkpoint_refusal

    assert checkpoint_refusal(0, 2.5, 100.0) is None
    assert "skipped for a non-finite loss or gradient (2 in a row)" in checkpoint_refusal(2, 2.5, 100.0)
    assert "its loss is nan" in checkpoint_refusal(0, float("nan"), 100.0)
    assert "the weights' L2 norm is inf" in checkpoint_refusal(0, 2.5, float("inf"))
