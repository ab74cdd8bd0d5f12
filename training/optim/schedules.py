"""Learning-rate schedules by name, as pure functions of the optimizer step and as LambdaLR.

`lr_at(name, step, ...)` is the learning rate of optimizer step `step` (0-based: the first update
uses `lr_at(..., 0)`), matching a loop that calls `scheduler.step()` once after every update, as
nanoT5 does (`nanoT5/utils/train_utils.py`, `train`).

- cosine (nanoT5 `get_lr_scheduler`, `nanoT5/utils/model_utils.py`): SequentialLR of
  LinearLR(start_factor=0.5, end_factor=1, total_iters=warmup) and
  CosineAnnealingLR(T_max=total-warmup, eta_min=final_cosine), milestone warmup. Closed form:
      s < W:       base * (0.5 + 0.5 * s / W)        (so warmup starts at HALF the base lr)
      W <= s <= T: final + (base - final) * (1 + cos(pi * (s - W) / (T - W))) / 2
  After T nanoT5's CosineAnnealingLR would rise again; here the lr stays at `final_lr`.
- legacy (nanoT5 "T5 legacy" schedule, independent of base_lr and warmup_steps):
      s < N = ceil(0.9 * T): min(1e-2, 1 / sqrt(s)) (1e-2 at s = 0)
      s >= N:                min(1e-2, 1 / sqrt(N)) * (1 - (s - N) / (T - N)), 0 from T on
- constant: base, with an optional linear warmup base * s / W for s < W (transformers'
  `get_constant_schedule_with_warmup`; nanoT5's "constant" is W = 0).
- linear: the same warmup, then linear from base at W to final_lr at T, final_lr after.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch


def _cosine(step: int, base_lr: float, warmup_steps: int, total_steps: int, final_lr: float) -> float:
    if step < warmup_steps:
        return base_lr * (0.5 + 0.5 * step / warmup_steps)
    progress = min(step - warmup_steps, total_steps - warmup_steps) / (total_steps - warmup_steps)
    return final_lr + (base_lr - final_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0


def _legacy(step: int, base_lr: float, warmup_steps: int, total_steps: int, final_lr: float) -> float:
    decay_start = math.ceil(total_steps * 0.9)
    if step < decay_start:
        return min(1e-2, 1.0 / math.sqrt(step)) if step else 1e-2
    peak = min(1e-2, 1.0 / math.sqrt(decay_start))
    if step >= total_steps:
        return 0.0
    return peak * (1.0 - (step - decay_start) / (total_steps - decay_start))


def _warmup(step: int, base_lr: float, warmup_steps: int) -> float | None:
    return base_lr * step / warmup_steps if step < warmup_steps else None


def _constant(step: int, base_lr: float, warmup_steps: int, total_steps: int, final_lr: float) -> float:
    warm = _warmup(step, base_lr, warmup_steps)
    return base_lr if warm is None else warm


def _linear(step: int, base_lr: float, warmup_steps: int, total_steps: int, final_lr: float) -> float:
    warm = _warmup(step, base_lr, warmup_steps)
    if warm is not None:
        return warm
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return base_lr + (final_lr - base_lr) * progress


SCHEDULES: dict[str, Callable[..., float]] = {
    "cosine": _cosine,
    "legacy": _legacy,
    "constant": _constant,
    "linear": _linear,
}


def _check(name: str, base_lr: float, warmup_steps: int, total_steps: int, final_lr: float) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {name!r}; valid names: {', '.join(sorted(SCHEDULES))}")
    if base_lr <= 0:
        raise ValueError(f"base_lr must be > 0, got {base_lr}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if final_lr < 0:
        raise ValueError(f"final_lr must be >= 0, got {final_lr}")
    if name in ("cosine", "linear") and total_steps <= warmup_steps:
        raise ValueError(f"{name}: total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
    if name == "legacy" and total_steps < 10:
        raise ValueError(
            f"legacy: total_steps must be >= 10 (90% inverse sqrt, 10% linear), got {total_steps}"
        )


def lr_at(
    name: str, step: int, *, base_lr: float, warmup_steps: int, total_steps: int, final_lr: float = 1e-5
) -> float:
    """Learning rate (absolute) of 0-based optimizer step `step` under schedule `name`."""
    _check(name, base_lr, warmup_steps, total_steps, final_lr)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return SCHEDULES[name](step, base_lr, warmup_steps, total_steps, final_lr)


def build_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    *,
    base_lr: float,
    warmup_steps: int,
    total_steps: int,
    final_lr: float = 1e-5,
) -> torch.optim.lr_scheduler.LRScheduler:
    """LambdaLR that sets every param group's lr to `lr_at(name, step, ...)`.

    The optimizer's groups must have been built with lr == base_lr (LambdaLR scales each group's
    initial lr by a factor); pass it to `deepspeed.initialize(lr_scheduler=...)` or step it yourself.
    """
    _check(name, base_lr, warmup_steps, total_steps, final_lr)
    for group in optimizer.param_groups:
        initial = group.get("initial_lr", group["lr"])
        if not math.isclose(initial, base_lr, rel_tol=1e-12):
            raise ValueError(
                f"optimizer group lr {initial} != base_lr {base_lr}: build the optimizer with "
                "lr=base_lr so that the schedule's absolute values come out right"
            )
    fn = partial(
        SCHEDULES[name],
        base_lr=base_lr,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        final_lr=final_lr,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: fn(step) / base_lr)
