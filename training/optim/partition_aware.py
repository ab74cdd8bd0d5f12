"""What every optimizer of the registry shares: a non-finite gradient guard and ZeRO flat layouts.

`PartitionAwareMixin` goes in front of a `torch.optim.Optimizer` subclass. It

- remembers which tensors it was built with (the model's), so that it can tell when DeepSpeed has
  swapped them for flattened fp32 partitions, and holds the `FlatLayout`s `bind_zero_layout` gives
  it for those partitions;
- skips the whole update when any gradient on any rank is non-finite, keeping the counters
  `skipped_steps` and `consecutive_skips` for the training loop. Two ways: `_guard_allows_step`
  reads the flag on the host before the update (one device synchronisation per step: adamw,
  adafactor); the deferred guard (adamwscale) keeps the flag on the device, turns a skipped update
  into a zero-size one there, and learns the outcome on the host one step later (`settle`), so the
  step never waits for the GPU;
- computes the global L2 norm of the weights it steps (`weight_l2_norm`), all-reducing over the
  partition groups where the parameters are partitioned and not where they are replicated.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from training.optim.zero_layout import FlatLayout

logger = logging.getLogger(__name__)


def collective_device(group: Any = None) -> torch.device:
    """Device a tensor must live on for a collective over `group` (NCCL needs CUDA)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed_world(group: Any = None) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


class PartitionAwareMixin:
    """Mixin for `torch.optim.Optimizer` subclasses; call `_init_partition_aware` after `__init__`."""

    # class-level flags a subclass may override
    needs_tensor_layout = False  # per-tensor math: flat partitions need a bound layout
    supports_flat_layout = True  # False: refuse flat partitions even with a layout (Adafactor)

    def _init_partition_aware(self, skip_nonfinite: bool = True, guard_group: Any = None) -> None:
        self.skip_nonfinite = skip_nonfinite  # check grads for inf/nan before each update
        self.guard_group = guard_group  # process group for the flag all-reduce (None: world)
        self._skipped_steps = 0  # updates skipped because of a non-finite gradient, since construction
        self._consecutive_skips = 0  # skipped updates since the last applied one
        # deferred guard, oldest first: (flag on the host or a pinned copy on its way, CUDA event or
        # None, the states whose step count the update advances when it was applied)
        self._pending: list[tuple[torch.Tensor, Any, list[dict]]] = []
        self.flat_layouts: dict[int, FlatLayout] = {}  # id(flat partition) -> layout (bind_zero_layout)
        self._original_ids: set[int] = set()  # id() of the tensors the optimizer was built with
        self._original_shapes: dict[int, list[tuple]] = {}  # id(param group dict) -> original shapes
        for group in self.param_groups:
            self._record_group(group)

    # ---- parameters: model tensors or bound flat partitions -----------------------------------
    def bind_flat_layouts(self, layouts: list[FlatLayout]) -> None:
        """Register the layouts of the flat partitions DeepSpeed will hand this optimizer."""
        if not self.supports_flat_layout:
            raise RuntimeError(self._flat_refusal_message())
        for layout in layouts:
            if layout.flat_param is None:
                raise ValueError("FlatLayout.flat_param must be the flat partition tensor")
            if layout.numel != layout.flat_param.numel():
                raise ValueError(
                    f"layout covers {layout.numel} elements, partition has {layout.flat_param.numel()}"
                )
            self.flat_layouts[id(layout.flat_param)] = layout

    def _flat_refusal_message(self) -> str:
        return (
            f"{type(self).__name__} works on whole weight matrices and cannot run on DeepSpeed's "
            "flattened partitions (ZeRO 1/2/3 or the bf16 optimizer). Use ZeRO stage 0 with fp32 or "
            "torch_autocast precision, or another optimizer (adamwscale, adamw)."
        )

    def _group_layouts(self, group: dict, params: list[torch.Tensor]) -> list[FlatLayout | None]:
        """Per param of `group`: None (a whole model tensor) or the bound layout of a flat partition.

        Tensors the optimizer was not built with are accepted as whole tensors only when the group
        still has the original count and shapes (DeepSpeed's per-tensor fp32 master copies, e.g. the
        bf16 ZeRO-0 `FP16_UnfusedOptimizer`, which steps once inside `deepspeed.initialize`).
        """
        out: list[FlatLayout | None] = []
        unknown = False
        for p in params:
            if id(p) in self._original_ids:
                out.append(None)
            elif id(p) in self.flat_layouts:
                if not self.supports_flat_layout:
                    raise RuntimeError(self._flat_refusal_message())
                out.append(self.flat_layouts[id(p)])
            else:
                out.append(None)
                unknown = True
        if unknown and [tuple(p.shape) for p in group["params"]] != self._original_shapes.get(id(group)):
            if not self.supports_flat_layout:
                raise RuntimeError(self._flat_refusal_message())
            if self.needs_tensor_layout:
                raise RuntimeError(
                    f"{type(self).__name__} received parameters it was not built with (shapes "
                    f"{[tuple(p.shape) for p in params][:3]}): DeepSpeed replaced the model tensors by flat "
                    "partitions, and the per-tensor RMS would be computed over the wrong elements. Call "
                    "training.optim.bind_zero_layout(engine) right after deepspeed.initialize(...)."
                )
            # element-wise optimizer (or the deliberately naive mode): a partition is just a tensor
        return out

    def _is_unbound_flat(self, p: torch.Tensor) -> bool:
        if id(p) in self._original_ids or id(p) in self.flat_layouts:
            return False
        return not any(
            p is q
            for g in self.param_groups
            for q in g["params"]
            if [tuple(t.shape) for t in g["params"]] == self._original_shapes.get(id(g))
        )

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        if hasattr(self, "_original_ids"):
            self._record_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict) -> None:
        """torch rebuilds the group dicts on load: carry the recorded original shapes over."""
        self.settle()  # a pending outcome belongs to the state being replaced
        shapes = [self._original_shapes.get(id(g)) for g in self.param_groups]
        super().load_state_dict(state_dict)  # type: ignore[misc]
        for group, recorded in zip(self.param_groups, shapes):
            if recorded is not None:
                self._original_shapes[id(group)] = recorded

    def _record_group(self, group: dict) -> None:
        self._original_ids.update(id(p) for p in group["params"])
        self._original_shapes[id(group)] = [tuple(p.shape) for p in group["params"]]

    # ---- non-finite guard --------------------------------------------------------------------
    def _finite_flag(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """float32 0-d tensor: 1.0 when every gradient on every rank of the guard group is finite,
        else 0.0. On the gradients' device; one all-reduce when several ranks. No host read."""
        home = grads[0].device if grads else torch.device("cpu")
        ok = torch.ones((), dtype=torch.float32, device=home)
        if grads:
            maxabs = torch._foreach_norm(grads, ord=math.inf)  # inf for inf, nan for nan
            ok = torch.stack([m.float() for m in maxabs]).isfinite().all().float()
        return self._agreed_flag(ok)

    def _agreed_flag(self, ok: torch.Tensor) -> torch.Tensor:
        """This rank's 0-d float32 flag `ok` (1.0 or 0.0) made the minimum over the guard group:
        one all-reduce when several ranks (a collective: every rank calls it), none on one."""
        if distributed_world(self.guard_group) == 1:
            return ok
        home = ok.device
        agreed = ok.to(collective_device(self.guard_group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.guard_group)
        return agreed.to(home)

    def _grads_finite_everywhere(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return bool(self._finite_flag(grads).item())

    def _guard_allows_step(self) -> bool:
        """The synchronous guard: True when the update may run (reads the flag on the host)."""
        if not self.skip_nonfinite:
            return True
        applied = self._grads_finite_everywhere()
        self._record_outcome(applied)
        return applied

    def _record_outcome(self, applied: bool) -> None:
        if applied:
            self._consecutive_skips = 0
            return
        self._skipped_steps += 1
        self._consecutive_skips += 1
        logger.warning(
            "%s: non-finite gradient on some rank, update skipped (%d skipped in total, %d in a row)",
            type(self).__name__,
            self._skipped_steps,
            self._consecutive_skips,
        )

    def _defer_outcome(self, ok: torch.Tensor, states: list[dict]) -> None:
        """The deferred guard: remember this step's flag; `settle` reads it later. On CUDA the flag
        is copied to pinned host memory behind an event, so reading it does not stall the stream."""
        if ok.device.type == "cuda":
            host = torch.empty((), dtype=torch.float32, pin_memory=True)
            host.copy_(ok, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((host, event, states))
        else:
            self._pending.append((ok, None, states))

    def _settle_before(self, states: list[dict]) -> None:
        """Settle when a pending update covers one of `states` (their step counts must be exact
        before the next bias correction). DeepSpeed ZeRO 1-3 call `step()` once per parameter group
        in a row: a group's call does not wait for the flag of the group just before it."""
        ids = {id(s) for s in states}
        if any(id(s) in ids for _, _, pending_states in self._pending for s in pending_states):
            self.settle()

    def settle(self) -> None:
        """Fold the pending outcomes into the counters and step counts (waits for those flags only;
        by the next training step the GPU has long finished computing them)."""
        pending, self._pending = self._pending, []
        for flag, event, states in pending:
            if event is not None:
                event.synchronize()
            applied = bool(flag.item())
            if applied:
                for state in states:
                    state["step"] += 1
            self._record_outcome(applied)

    @property
    def skipped_steps(self) -> int:
        """Updates skipped for a non-finite gradient since construction (settles the last step)."""
        self.settle()
        return self._skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Skipped updates since the last applied one (settles the last step)."""
        self.settle()
        return self._consecutive_skips

    def skip_counters(self, wait: bool = True) -> tuple[int, int]:
        """(skipped_steps, consecutive_skips). wait=False does not wait for the last step's flag: with
        the deferred guard the counters then cover the steps before it (what a training loop reads
        every step without synchronising with the GPU)."""
        if wait:
            self.settle()
        return self._skipped_steps, self._consecutive_skips

    def state_dict(self) -> dict:
        self.settle()  # the step counts of a pending update belong in the saved state
        return super().state_dict()  # type: ignore[misc]

    # ---- weight norm for logging -------------------------------------------------------------
    @torch.no_grad()
    def weight_l2_norm(self) -> float:
        """Global L2 norm of all weights this optimizer steps, the same value on every rank.

        Model tensors are replicated (ZeRO 0): summed locally. Bound flat partitions are disjoint
        pieces: their sums of squares are all-reduced over each partition's group. A collective:
        call it on every rank.
        """
        local = 0.0
        by_group: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        seen: set[int] = set()
        params = [p for g in self.param_groups for p in g["params"]]
        params += [layout.flat_param for layout in self.flat_layouts.values()]  # ZeRO-3 empties param_groups
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            layout = self.flat_layouts.get(id(p))
            if layout is None and self._is_unbound_flat(p):
                raise RuntimeError(
                    "weight_l2_norm: parameters are flat partitions but no layout was bound; "
                    "call training.optim.bind_zero_layout(engine) after deepspeed.initialize"
                )
            sq = p.detach().float().pow(2).sum()
            if layout is not None and layout.partitioned:
                key = id(layout.process_group)
                by_group.setdefault(key, (layout.process_group, []))[1].append(sq)
            else:
                local += float(sq)
        total = local
        for group, sums in by_group.values():
            vec = torch.stack(sums).sum().reshape(1).to(collective_device(group))
            dist.all_reduce(vec, group=group)
            total += float(vec)
        return math.sqrt(total)
