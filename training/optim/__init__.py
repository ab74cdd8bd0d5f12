"""Optimizers (adamwscale, adamw, adafactor), LR schedules and the DeepSpeed ZeRO layout binding.

Typical use::

    opt = build_optimizer("adamwscale", model, lr=2e-2, weight_decay=0.0)
    sched = build_scheduler("cosine", opt, base_lr=2e-2, warmup_steps=10_000, total_steps=65_536)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=...)
    bind_zero_layout(engine)        # every rank, right after initialize; no-op at ZeRO 0 fp32
    ...
    weights_l2 = opt.weight_l2_norm()   # collective: every rank
    opt.skipped_steps, opt.consecutive_skips
"""

from training.optim.adamw_scale import AdamWScale, global_grad_norm
from training.optim.partition_aware import PartitionAwareMixin
from training.optim.registry import NO_DECAY_SUBSTRINGS, OPTIMIZERS, build_optimizer, param_groups_no_decay
from training.optim.schedules import SCHEDULES, build_scheduler, lr_at
from training.optim.zero_layout import FlatLayout, bind_zero_layout, build_zero_layouts


def weight_l2_norm(optimizer) -> float:
    """Global L2 norm of the weights `optimizer` steps (a collective under ZeRO: call on every rank)."""
    if not isinstance(optimizer, PartitionAwareMixin):
        raise TypeError("weight_l2_norm needs an optimizer from training.optim.build_optimizer")
    return optimizer.weight_l2_norm()


__all__ = [
    "AdamWScale",
    "FlatLayout",
    "NO_DECAY_SUBSTRINGS",
    "OPTIMIZERS",
    "PartitionAwareMixin",
    "SCHEDULES",
    "bind_zero_layout",
    "build_optimizer",
    "build_scheduler",
    "build_zero_layouts",
    "global_grad_norm",
    "lr_at",
    "param_groups_no_decay",
    "weight_l2_norm",
]
