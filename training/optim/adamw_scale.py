"""AdamWScale: nanoT5's AdamW whose step for each weight tensor is scaled by that tensor's RMS.

Reference: nanoT5 `nanoT5/utils/copied_utils.py`, class `AdamWScale` (PiotrNawrot/nanoT5, commit
73b2e63). Per parameter tensor p, in this order:

    exp_avg    = beta1 * exp_avg    + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    denom      = sqrt(exp_avg_sq) + eps
    step_size  = lr * sqrt(1 - beta2**t) / (1 - beta1**t)        (correct_bias=True)
    step_size *= max(1e-3, rms(p)),  rms(p) = ||p||_2 / sqrt(numel(p))   (p BEFORE this update)
    p         -= step_size * exp_avg / denom
    p         += -lr * weight_decay * p                           (after the update; plain lr)

Two execution paths, both without a per-tensor Python loop on the arithmetic:

- model tensors (plain PyTorch, DeepSpeed ZeRO 0 in fp32/torch_autocast): `_foreach_norm` for the
  RMS, then either one Triton kernel launch over all the group's tensors (`fused=True`,
  training/optim/triton_adamw_scale.py: every element read and written once) or `torch._foreach_*`
  kernels, the per-tensor step sizes as device tensors;
- DeepSpeed flat partitions with a bound `FlatLayout` (ZeRO 1/2/3, bf16 optimizer): per-segment sums
  of squares with one `segment_reduce`, one all-reduce of the per-tensor sums over the partition
  group, then a per-element step size with `repeat_interleave` over the segments.

Gradient clipping can run inside the step (`max_grad_norm > 0`, model tensors only: ZeRO 0, where
training/grad_clip.py hands it over): the global L2 norm of all gradients is read once, its
finiteness is the guard's flag (a sum of squares is inf or nan when any entry is, so no second read
for the guard), and the clipping factor min(1, max_grad_norm / (norm + 1e-6)), torch's and
DeepSpeed's, scales the gradients in the same pass as the moment updates (in the fused kernel)
instead of a separate read and write of every gradient before the step. A norm whose
squares overflow float32 (an entry above ~1e19) counts as non-finite: the step is skipped.

Neither path reads a value on the host, so the step never waits for the GPU: the non-finite guard
is the mixin's deferred one. Its flag `ok` (1.0 or 0.0, on the device) zeroes the gradients of a
skipped step (non-finite entries included), keeps the moments as they were (decay factors of 1), and
multiplies the step sizes and the weight decay away; the host learns the outcome at the next step,
which is also when the step counts of the bias correction advance (only for applied updates). The
gradients are modified in place: a skipped step leaves them zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from training.optim import triton_adamw_scale
from training.optim.partition_aware import PartitionAwareMixin, collective_device
from training.optim.zero_layout import FlatLayout

RMS_FLOOR = 1e-3  # nanoT5: step_size * max(1e-3, rms(p))


class AdamWScale(PartitionAwareMixin, torch.optim.Optimizer):
    """nanoT5's AdamWScale, vectorised, correct on DeepSpeed flat partitions once a layout is bound.

    unbound_flat_params: "error" (default) raises when DeepSpeed handed flat partitions and
    `bind_zero_layout` was not called; "treat_as_tensor" takes each flat partition as one tensor
    (the naive, WRONG behaviour; exists only so tests can show the layout matters).
    fused: run the model-tensor path (moments, update, decay) as one Triton kernel launch per dtype
    combination where `triton_adamw_scale.supports` the tensors (CUDA, contiguous), else the foreach
    kernels; the same arithmetic in fp32, rounded once per stored value.
    max_grad_norm: clip the gradients to this global L2 norm inside the step (0: no clipping); see
    the module docstring. The norm before clipping of the last step is `last_grad_norm` (a device
    tensor). Model tensors only: with DeepSpeed's flat partitions (ZeRO 1-3) DeepSpeed clips.
    """

    needs_tensor_layout = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        *,
        skip_nonfinite: bool = True,
        guard_group: Any = None,
        unbound_flat_params: str = "error",
        fused: bool = False,
        max_grad_norm: float = 0.0,
    ):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr} - should be >= 0.0")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas {betas}: each must be in [0.0, 1.0)")
        if eps < 0.0:
            raise ValueError(f"Invalid epsilon value: {eps} - should be >= 0.0")
        if not max_grad_norm >= 0.0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be >= 0 (0: no clipping in the step)")
        if unbound_flat_params not in ("error", "treat_as_tensor"):
            raise ValueError("unbound_flat_params must be 'error' or 'treat_as_tensor'")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias)
        super().__init__(params, defaults)
        self._init_partition_aware(skip_nonfinite, guard_group)
        self._numel_cache: dict[tuple, torch.Tensor] = {}  # (param ids, device) -> element counts
        self.needs_tensor_layout = unbound_flat_params == "error"
        # fused: the model-tensor path as one kernel (the foreach path reads the optimizer state in
        # ~10 passes); flat partitions stay on torch's kernels.
        self.fused = fused
        self._tables = triton_adamw_scale.TensorTables()
        self.max_grad_norm = float(max_grad_norm)
        self.last_grad_norm: torch.Tensor | None = None  # the global norm before clipping, last step

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with_grads = []  # (group, params) of the groups with gradients
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("AdamWScale does not support sparse gradients")
            with_grads.append((group, params))
        layouts = [self._group_layouts(group, params) for group, params in with_grads]
        if self.max_grad_norm > 0.0 and any(lay is not None for group_layouts in layouts for lay in group_layouts):
            raise RuntimeError(
                "AdamWScale(max_grad_norm > 0) clips model tensors; DeepSpeed handed it flat "
                "partitions (ZeRO 1-3), where DeepSpeed clips: set max_grad_norm=0 and leave "
                "clipping to DeepSpeed's gradient_clipping."
            )
        groups = [(group, params, [self._state_for(p) for p in params]) for group, params in with_grads]
        states = [s for _, _, group_states in groups for s in group_states]
        grads = [p.grad for _, params, _ in groups for p in params]
        ok = None  # None: no guard, the update is applied
        clip_scale = None  # None: no clipping in the step, else a 0-d device tensor
        if self.max_grad_norm > 0.0:
            norm = global_grad_norm(grads)  # every gradient read once; inf or nan when one entry is
            self.last_grad_norm = norm
            clip_scale = (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)  # torch's and DeepSpeed's
            if self.skip_nonfinite:  # the norm's finiteness is the guard's flag: no second read
                ok = self._agreed_flag(norm.isfinite().float())  # a collective: every rank calls it
                clip_scale = torch.where(ok > 0, clip_scale, 1.0)  # a skipped step zeroes the gradients
        elif self.skip_nonfinite:
            ok = self._finite_flag(grads)  # a collective: every rank calls it, with gradients or not
        self._settle_before(states)  # an earlier outcome for these tensors: exact step counts now
        if not groups:
            if ok is not None:
                self._defer_outcome(ok, [])
            return loss
        # Pass 1: the flat partitions' moments and per-tensor RMS inputs (their sums of squares are
        # collected so that one all-reduce per process group serves all of them); the model tensors
        # are done whole, group by group, in pass 2.
        tensor_jobs, flat_jobs = [], []
        for (group, params, group_states), layouts_of_group in zip(groups, layouts):
            beta1, beta2 = group["betas"]
            base = []
            for s in group_states:  # python floats: bias correction per tensor (steps may differ)
                t = s["step"] + 1  # s["step"] counts the applied updates before this one
                size = group["lr"]
                if group["correct_bias"]:
                    size = size * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
                base.append(size)
            plain = [i for i, lay in enumerate(layouts_of_group) if lay is None]
            if plain:
                tensor_jobs.append((group, [params[i] for i in plain], [group_states[i] for i in plain],
                                    [base[i] for i in plain]))  # fmt: skip
            flat = [i for i, lay in enumerate(layouts_of_group) if lay is not None]
            if flat:  # the decay factors once per group (device tensors under the guard)
                b1, b2 = _decay_factors(beta1, beta2, ok)
                skip = None if ok is None else ok == 0
            for i in flat:
                p, state, lay = params[i], group_states[i], layouts_of_group[i]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if skip is not None:
                    p.grad.masked_fill_(skip, 0.0)
                exp_avg.mul_(b1).add_(p.grad, alpha=1.0 - beta1)
                exp_avg_sq.mul_(b2).addcmul_(p.grad, p.grad, value=1.0 - beta2)
                flat_jobs.append([group, p, exp_avg, exp_avg_sq, base[i], lay, _segment_sums(p, lay)])

        _allreduce_segment_sums(flat_jobs)

        # Pass 2: the updates.
        for group, params, group_states, base in tensor_jobs:
            self._update_tensors(group, params, group_states, base, ok, clip_scale)
        for group, p, exp_avg, exp_avg_sq, base, lay, sums in flat_jobs:
            self._update_flat(group, p, exp_avg, exp_avg_sq, base, lay, sums, ok)

        if ok is None:
            for s in states:
                s["step"] += 1
        else:
            self._defer_outcome(ok, states)
        return loss

    def _numels(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """float32 element counts of `params` on `device`, built once per parameter list (building
        a CUDA tensor from a Python list waits for the GPU)."""
        key = (tuple(id(p) for p in params), device)
        if key not in self._numel_cache:
            self._numel_cache[key] = torch.tensor([float(p.numel()) for p in params], device=device)
        return self._numel_cache[key]

    def _update_tensors(self, group: dict, params, group_states, base: list[float], ok, clip_scale) -> None:
        device = params[0].device
        decay = -group["lr"] * group["weight_decay"]
        beta1, beta2 = group["betas"]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in group_states], [s["exp_avg_sq"] for s in group_states]
        if self.fused and triton_adamw_scale.supports(params + grads + exp_avgs + exp_avg_sqs):
            triton_adamw_scale.fused_update(
                self._tables, params, grads, exp_avgs, exp_avg_sqs, _tensor_norms(params), _as_device_tensor(base, device), decay,
                ok, clip_scale, beta1=beta1, beta2=beta2, eps=group["eps"], has_decay=group["weight_decay"] > 0.0,
                rms_floor=RMS_FLOOR,
            )  # fmt: skip
            return
        _plain_update(
            params, grads, exp_avgs, exp_avg_sqs, self._numels(params, device), _as_factor(base, device), decay, ok,
            clip_scale, beta1=beta1, beta2=beta2, eps=group["eps"], has_decay=group["weight_decay"] > 0.0,
        )  # fmt: skip

    @staticmethod
    def _update_flat(group: dict, p, exp_avg, exp_avg_sq, base: float, lay: FlatLayout, sums, ok) -> None:
        lengths, seg_to_tensor, numels = lay.device_tensors(p.device)
        rms = (sums / numels).sqrt()
        # padding elements (index n) get step size 0: their grads are 0 anyway, keep them at 0
        scale = torch.cat([rms.clamp_min(RMS_FLOOR) * base, rms.new_zeros(1)])
        if ok is not None:
            scale = scale * ok  # a skipped step moves nothing
        per_element = torch.repeat_interleave(scale[seg_to_tensor], lengths, output_size=p.numel())
        update = exp_avg_sq.sqrt().add_(group["eps"])
        torch.div(exp_avg, update, out=update)
        update.mul_(per_element.to(update.dtype))
        p.sub_(update)
        if group["weight_decay"] > 0.0:
            decay = -group["lr"] * group["weight_decay"]
            if ok is None:
                p.add_(p, alpha=decay)
            else:
                p.addcmul_(p, (ok * decay).to(p.dtype))


def _decay_factors(beta1: float, beta2: float, ok: torch.Tensor | None) -> tuple:
    """The moments' decay factors: the betas, or 1 (device tensors) when the step is skipped."""
    if ok is None:
        return beta1, beta2
    skip = ok == 0
    return torch.where(skip, 1.0, beta1), torch.where(skip, 1.0, beta2)


def _plain_update(
    params, grads, exp_avgs, exp_avg_sqs, numels, base, decay, ok, clip_scale, *, beta1, beta2, eps, has_decay
) -> None:
    """One AdamWScale step of plain tensors (one parameter group), in place, nothing read on the host.

    base: the per-tensor step sizes before the RMS factor (a float, or a device tensor per tensor);
    decay: -lr * weight_decay; ok: the finite flag (None: no guard);
    clip_scale: the gradient clipping factor (0-d device tensor, finite; None: no clipping), applied
    to the gradients in place as `clip_grad_norm_` does. It runs as torch's foreach kernels;
    `AdamWScale(fused=True)` runs the same arithmetic as one Triton kernel instead.
    """
    if ok is not None:  # a skipped step: zero gradients (non-finite entries included)
        skip = ok == 0
        for g in grads:  # one kernel per tensor eagerly; torch has no multi-tensor masked fill
            g.masked_fill_(skip, 0.0)
    if clip_scale is not None:
        torch._foreach_mul_(grads, clip_scale)
    b1, b2 = _decay_factors(beta1, beta2, ok)  # moments *= beta, or *= 1 when skipped
    torch._foreach_mul_(exp_avgs, b1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denoms, eps)
    rms = _tensor_norms(params) / numels.sqrt()
    sizes = rms.clamp_min(RMS_FLOOR) * base
    if ok is not None:
        sizes = sizes * ok  # a skipped step moves nothing
    # p -= size * m / denom, as p += -1 * m / (denom / size): a zero size makes the quotient
    # infinite and the change 0 (m is finite: the guard keeps non-finite values out of it).
    torch._foreach_div_(denoms, list(sizes.unbind()))
    torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-1.0)
    if has_decay:
        if ok is None:
            torch._foreach_add_(params, params, alpha=decay)
        else:  # p += (decay * ok) * p, the factor a device scalar (1 + decay would round it)
            torch._foreach_addcmul_(params, params, [ok * decay] * len(params))


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all `grads` together as a 0-d device tensor (no host read), computed as
    `torch.nn.utils.clip_grad_norm_` does: per-tensor norms, then the norm of those. 0 for none."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)


def _tensor_norms(params: list[torch.Tensor]) -> torch.Tensor:
    """float32 [n]: the L2 norm of each of `params` (the RMS factor's input)."""
    return torch.stack([n.float() for n in torch._foreach_norm(params)])


def _as_device_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """float32 tensor on `device`, copied from pinned memory without waiting for the GPU."""
    return triton_adamw_scale.to_device(torch.tensor(values, dtype=torch.float32), device)


def _as_factor(values: list[float], device: torch.device) -> float | torch.Tensor:
    """A Python scalar when all `values` are equal (the usual case: one step count per group), else
    a tensor on `device` (`_as_device_tensor`)."""
    if all(v == values[0] for v in values):
        return values[0]
    return _as_device_tensor(values, device)


def _segment_sums(p: torch.Tensor, lay: FlatLayout) -> torch.Tensor:
    """Local sum of squares of every original tensor of the layout (float32 [n_tensors])."""
    lengths, seg_to_tensor, numels = lay.device_tensors(p.device)
    flat = p.detach().reshape(-1).float()
    per_segment = torch.segment_reduce(flat * flat, "sum", lengths=lengths, unsafe=True)
    sums = torch.zeros(len(lay.tensor_numels) + 1, dtype=torch.float32, device=p.device)
    sums.index_add_(0, seg_to_tensor, per_segment)
    return sums[:-1]  # drop the padding slot


def _allreduce_segment_sums(flat_jobs: list[list]) -> None:
    """Sum the per-tensor sums of squares over each partitioned layout's process group: one
    all-reduce per group (in job order, identical on all ranks). Replaces job[6] in place."""
    by_group: dict[int, list[list]] = {}
    for job in flat_jobs:
        lay: FlatLayout = job[5]
        if lay.partitioned:
            by_group.setdefault(id(lay.process_group), []).append(job)
    for jobs in by_group.values():
        group = jobs[0][5].process_group
        vec = torch.cat([job[6] for job in jobs])
        device = collective_device(group)
        reduced = vec.to(device)
        dist.all_reduce(reduced, group=group)
        reduced = reduced.to(vec.device)
        offset = 0
        for job in jobs:
            n = job[6].numel()
            job[6] = reduced[offset : offset + n]
            offset += n
