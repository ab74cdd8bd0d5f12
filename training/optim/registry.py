"""Optimizers by name: `build_optimizer("adamwscale" | "adamw" | "adafactor", model, lr=...)`.

Parameter groups follow nanoT5 (`nanoT5/utils/model_utils.py`, `get_optimizer`): no weight decay for
any parameter whose name contains one of "bias", "LayerNorm", "layernorm", "layer_norm", "ln" (a
plain substring test, as in nanoT5: T5's `relative_attention_bias` is therefore not decayed either),
`weight_decay` for the rest. Empty groups are dropped (DeepSpeed drops them too, and the ZeRO layout
is indexed by group).

Every optimizer built here skips the update when a gradient is non-finite on any rank and keeps the
counters `skipped_steps` / `consecutive_skips`; see `partition_aware.py`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from training.optim.adamw_scale import AdamWScale
from training.optim.partition_aware import PartitionAwareMixin

logger = logging.getLogger(__name__)

NO_DECAY_SUBSTRINGS = ("bias", "LayerNorm", "layernorm", "layer_norm", "ln")  # nanoT5 get_optimizer


class GuardedAdamW(PartitionAwareMixin, torch.optim.AdamW):
    """torch.optim.AdamW (foreach/fused as torch picks) behind the non-finite guard. Element-wise,
    so DeepSpeed's flat partitions need no layout (bind one anyway for `weight_l2_norm`)."""

    def __init__(self, params, *, skip_nonfinite: bool = True, guard_group: Any = None, **kwargs):
        super().__init__(params, **kwargs)
        self._init_partition_aware(skip_nonfinite, guard_group)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        else:
            loss = None
        for group in self.param_groups:  # reject unusable flat params the same way everywhere
            self._group_layouts(group, group["params"])
        if not self._guard_allows_step():
            return loss
        super().step()
        return loss


@functools.cache
def _adafactor_class() -> type:
    # Built on first use: transformers takes about a second to import, and only adafactor needs it.
    from transformers.optimization import Adafactor

    class GuardedAdafactor(PartitionAwareMixin, Adafactor):
        """transformers' Adafactor behind the non-finite guard.

        Its factored second moments and `scale_parameter` RMS are per weight matrix, which DeepSpeed's
        flat partitions destroy, so it refuses them: run it with ZeRO stage 0 and fp32 or
        torch_autocast precision (the model's own tensors), or use adamwscale under ZeRO.
        """

        supports_flat_layout = False

        def __init__(self, params, *, skip_nonfinite: bool = True, guard_group: Any = None, **kwargs):
            super().__init__(params, **kwargs)
            self._init_partition_aware(skip_nonfinite, guard_group)

        @torch.no_grad()
        def step(self, closure: Callable | None = None):
            loss = closure() if closure is not None else None
            for group in self.param_groups:
                self._group_layouts(group, group["params"])  # raises on a flat partition
            if not self._guard_allows_step():
                return loss
            super().step()
            return loss

    return GuardedAdafactor


def param_groups_no_decay(
    named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float
) -> list[dict]:
    """nanoT5's two groups: decayed weights, then undecayed biases/norms; trainable params only."""
    decay, no_decay = [], []
    for name, p in named_parameters:
        if not p.requires_grad:
            continue
        (no_decay if any(s in name for s in NO_DECAY_SUBSTRINGS) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _build_adamwscale(groups, *, lr, weight_decay, betas, eps, **kw) -> torch.optim.Optimizer:
    return AdamWScale(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)


def _build_adamw(groups, *, lr, weight_decay, betas, eps, **kw) -> torch.optim.Optimizer:
    return GuardedAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kw)


def _build_adafactor(groups, *, lr, weight_decay, betas, eps, **kw) -> torch.optim.Optimizer:
    # nanoT5: Adafactor(lr=base_lr, relative_step=False); scale_parameter defaults to True, beta1 to None.
    # Adafactor's eps is a pair (1e-30, 1e-3); `eps`/`betas` of the Adam family do not apply.
    kw.setdefault("relative_step", False)
    kw.setdefault("scale_parameter", True)
    kw.setdefault("warmup_init", False)
    return _adafactor_class()(groups, lr=lr, weight_decay=weight_decay, **kw)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamwscale": _build_adamwscale,
    "adamw": _build_adamw,
    "adafactor": _build_adafactor,
}


def build_optimizer(
    name: str,
    params: nn.Module | Iterable[tuple[str, nn.Parameter]],
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    **kw: Any,
) -> torch.optim.Optimizer:
    """Build a registered optimizer over a model (or its `named_parameters()`).

    Extra keywords go to the optimizer: `skip_nonfinite`, `guard_group` for all; `correct_bias`,
    `unbound_flat_params` for adamwscale; `fused`/`foreach` for adamw; Adafactor's own for adafactor.
    Under DeepSpeed ZeRO 1/2/3 or bf16, call `bind_zero_layout(engine)` after `deepspeed.initialize`.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid names: {', '.join(sorted(OPTIMIZERS))}")
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    named = params.named_parameters() if isinstance(params, nn.Module) else params
    groups = param_groups_no_decay(named, weight_decay)
    if not groups:
        raise ValueError("build_optimizer: no trainable parameters (all have requires_grad=False?)")
    return OPTIMIZERS[name](groups, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, **kw)
