"""Which original model tensor each element of a DeepSpeed flat fp32 partition belongs to.

DeepSpeed 0.19.8 does not hand a client optimizer the model's tensors. It flattens each parameter
group into one 1-D buffer, cuts that buffer into equal pieces, one per data-parallel rank, and puts
the rank's fp32 piece into `param_group["params"]` instead of the model's tensors:

- ZeRO-1/2 (`runtime/zero/stage_1_and_2.py`, `DeepSpeedZeroOptimizer`): per group i the tensors of
  `round_robin_bit16_groups[i]` sit at `round_robin_bit16_offsets[i]` in `bit16_groups_flat[i]`
  (with alignment padding between tensors and at the end); rank r owns
  `parallel_partitioned_bit16_groups[i][r]` and steps `single_partition_of_fp32_groups[i]`.
- bf16 optimizer (`runtime/bf16_optimizer.py`, `BF16_Optimizer`; in 0.19.8 chosen for bf16 with ZeRO-1
  and fp32 gradient accumulation, or with pipeline parallelism): the tensors of
  `bf16_groups[i]` back to back in `bf16_groups_flat[i]` (padding at the end); rank r owns
  `[r * size, (r + 1) * size)` and steps `fp32_groups_flat_partition[i]`.
- ZeRO-3 (`runtime/zero/stage3.py`, `DeepSpeedZeroOptimizer_Stage3`): every tensor is split on its
  own; rank r holds elements `[r * pn, (r + 1) * pn)` of each (padded) tensor in `param.ds_tensor`;
  sub-group s steps `fp32_partitioned_groups_flat[s]`, the concatenation of the `ds_tensor`s of
  `fp16_groups[s]`, one sub-group per `optimizer.step()` call.

A `FlatLayout` records, for one such flat partition, a run-length list of segments (length and the
index of the original tensor, or -1 for padding) plus every tensor's full numel, the same on all
ranks. An optimizer can then reduce per-tensor statistics with one `segment_reduce` on its local
piece and one all-reduce of a small vector over the partition's process group.

bf16 at ZeRO 0 uses `FP16_UnfusedOptimizer` in 0.19.8: per-tensor fp32 master copies with the model's
shapes, which need no layout (the optimizer recognises them by their shapes).

`bind_zero_layout(engine)` builds the layouts from the DeepSpeed wrapper and hands them to the
client optimizer; call it once, right after `deepspeed.initialize`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PADDING = -1  # tensor index of a segment that belongs to no model tensor (alignment padding)


@dataclass
class FlatLayout:
    """Map from the elements of one flat 1-D partition to the original model tensors."""

    lengths: list[int]  # element count of each segment, in storage order; sums to the partition numel
    tensor_index: list[int]  # per segment: index into `tensor_numels`, or PADDING (-1)
    tensor_numels: list[int]  # full element count of every original tensor of the group (all ranks)
    tensor_names: list[str]  # name (or shape) of each original tensor, for messages and docs
    process_group: Any = None  # ranks holding the other pieces; None: this partition is the whole group
    group_world_size: int = 1  # size of process_group (1: not partitioned, no all-reduce needed)
    flat_param: torch.Tensor | None = field(default=None, repr=False)  # the partition itself
    _device_cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.tensor_index):
            raise ValueError("FlatLayout: lengths and tensor_index must have one entry per segment")
        n = len(self.tensor_numels)
        bad = [t for t in self.tensor_index if t != PADDING and not 0 <= t < n]
        if bad:
            raise ValueError(f"FlatLayout: tensor indices {bad[:5]} are outside 0..{n - 1}")
        if any(length < 0 for length in self.lengths):
            raise ValueError("FlatLayout: segment lengths must be >= 0")

    @property
    def numel(self) -> int:
        return sum(self.lengths)

    @property
    def partitioned(self) -> bool:
        return self.group_world_size > 1

    def device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(segment lengths int64, segment -> tensor index int64 with padding mapped to the last
        slot n, tensor numels float32 [n]) on `device`, built once and cached."""
        key = str(device)
        if key not in self._device_cache:
            n = len(self.tensor_numels)
            lengths = torch.tensor(self.lengths, dtype=torch.int64, device=device)
            index = torch.tensor([n if t == PADDING else t for t in self.tensor_index], dtype=torch.int64)
            numels = torch.tensor(self.tensor_numels, dtype=torch.float32, device=device)
            self._device_cache[key] = (lengths, index.to(device), numels)
        return self._device_cache[key]


def segments_for_partition(
    spans: list[tuple[int, int, int]], partition_start: int, partition_numel: int
) -> tuple[list[int], list[int]]:
    """Cut a flat buffer's tensor spans down to one partition.

    spans: (tensor_index, offset_in_flat_buffer, numel) for every tensor of the buffer.
    Returns (lengths, tensor_index) covering [partition_start, partition_start + partition_numel)
    exactly, gaps (alignment padding, or the buffer's tail) as PADDING segments.
    """
    end = partition_start + partition_numel
    lengths: list[int] = []
    index: list[int] = []
    cursor = partition_start
    for tensor_idx, offset, numel in sorted(spans, key=lambda s: s[1]):
        lo, hi = max(offset, partition_start), min(offset + numel, end)
        if lo >= hi:
            continue
        if lo < cursor:
            raise ValueError(
                f"tensor spans overlap at flat offset {lo}: the flat buffer layout is not understood"
            )
        if lo > cursor:
            lengths.append(lo - cursor)
            index.append(PADDING)
        lengths.append(hi - lo)
        index.append(tensor_idx)
        cursor = hi
    if cursor < end:
        lengths.append(end - cursor)
        index.append(PADDING)
    return lengths, index


def _group_rank_and_size(group: Any) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=group), dist.get_world_size(group=group)


def _param_name(names: dict[int, str], p: torch.Tensor) -> str:
    return names.get(id(p), f"<{tuple(getattr(p, 'ds_shape', p.shape))}>")


def _check_offsets_against_storage(flat: torch.Tensor, params: list, offsets: list[int]) -> None:
    """The model's low-precision params are views into the flat buffer: their storage offsets must
    match DeepSpeed's bookkeeping, else the layout (or DeepSpeed's internals) changed."""
    elem = flat.element_size()
    for p, offset in zip(params, offsets):
        if p.data.numel() == 0 or p.data.device != flat.device:
            continue  # temporarily offloaded; nothing to compare against
        if p.data.data_ptr() != flat.data_ptr() + offset * elem:
            raise RuntimeError(
                "DeepSpeed flat-buffer offsets do not match the model parameters' storage; this "
                "DeepSpeed version lays out parameters differently from 0.19.8. Update "
                "training/optim/zero_layout.py before training with adamwscale under ZeRO."
            )


def layouts_zero12(ds_opt: Any, names: dict[int, str]) -> list[FlatLayout]:
    """ZeRO-1/2: one layout per parameter group."""
    layouts = []
    for i, flat in enumerate(ds_opt.bit16_groups_flat):
        params = ds_opt.round_robin_bit16_groups[i]
        offsets = list(ds_opt.round_robin_bit16_offsets[i])
        _check_offsets_against_storage(flat, params, offsets)
        group = ds_opt.real_dp_process_group[i]
        rank, world = _group_rank_and_size(group)
        partitions = ds_opt.parallel_partitioned_bit16_groups[i]
        start = sum(int(t.numel()) for t in partitions[:rank])
        size = int(partitions[rank].numel())
        fp32 = ds_opt.single_partition_of_fp32_groups[i]
        if fp32.numel() != size:
            raise RuntimeError(f"ZeRO group {i}: fp32 partition has {fp32.numel()} elements, expected {size}")
        spans = [
            (j, off, int(meta.numel()))
            for j, (off, meta) in enumerate(zip(offsets, ds_opt.round_robin_bit16_meta[i]))
        ]
        lengths, index = segments_for_partition(spans, start, size)
        layouts.append(
            FlatLayout(
                lengths,
                index,
                [s[2] for s in spans],
                [_param_name(names, p) for p in params],
                group,
                world,
                fp32,
            )
        )
    return layouts


def layouts_bf16(ds_opt: Any, names: dict[int, str]) -> list[FlatLayout]:
    """bf16 optimizer (any stage <= 0 with bf16 enabled): one layout per parameter group."""
    layouts = []
    for i, flat in enumerate(ds_opt.bf16_groups_flat):
        params = ds_opt.bf16_groups[i]
        numels = [int(p.numel()) for p in params]
        offsets = [sum(numels[:j]) for j in range(len(numels))]
        _check_offsets_against_storage(flat, params, offsets)
        group = ds_opt.real_dp_process_group[i]
        rank, world = _group_rank_and_size(group)
        size = flat.numel() // world
        fp32 = ds_opt.fp32_groups_flat_partition[i]
        if fp32.numel() != size:
            raise RuntimeError(f"bf16 group {i}: fp32 partition has {fp32.numel()} elements, expected {size}")
        lengths, index = segments_for_partition(
            list(zip(range(len(params)), offsets, numels)), rank * size, size
        )
        layouts.append(
            FlatLayout(lengths, index, numels, [_param_name(names, p) for p in params], group, world, fp32)
        )
    return layouts


def layouts_zero3(ds_opt: Any, names: dict[int, str]) -> list[FlatLayout]:
    """ZeRO-3: one layout per sub-group; every tensor is split across all ranks of its group."""
    layouts = []
    for s, params in enumerate(ds_opt.fp16_groups):
        group = ds_opt.sub_group_process_groups[s]
        rank, world = _group_rank_and_size(group)
        lengths, index, numels = [], [], []
        for j, p in enumerate(params):
            piece = int(p.partition_numel())  # elements of p held by each rank (incl. padding)
            full = int(p.ds_numel)
            valid = min(max(full - rank * piece, 0), piece)  # the last rank(s) hold padding
            lengths += [valid, piece - valid]
            index += [j, PADDING]
            numels.append(full)
        flat = ds_opt.fp32_partitioned_groups_flat[s]
        if flat.numel() != sum(lengths):
            raise RuntimeError(
                f"ZeRO-3 sub-group {s}: fp32 partition has {flat.numel()} elements, "
                f"expected {sum(lengths)} (ZeRO-Infinity/NVMe offload is not supported)"
            )
        layouts.append(
            FlatLayout(lengths, index, numels, [_param_name(names, p) for p in params], group, world, flat)
        )
    return layouts


def build_zero_layouts(ds_optimizer: Any, named_parameters: dict[int, str] | None = None) -> list[FlatLayout]:
    """Layouts for every flat partition a DeepSpeed optimizer wrapper hands its client optimizer."""
    names = named_parameters or {}
    cls = type(ds_optimizer).__name__
    if hasattr(ds_optimizer, "fp32_partitioned_groups_flat"):
        return layouts_zero3(ds_optimizer, names)
    if hasattr(ds_optimizer, "single_partition_of_fp32_groups"):
        return layouts_zero12(ds_optimizer, names)
    if hasattr(ds_optimizer, "fp32_groups_flat_partition"):
        return layouts_bf16(ds_optimizer, names)
    if cls == "FP16_UnfusedOptimizer":
        return []  # bf16/fp16 at ZeRO 0: per-tensor fp32 master copies, shapes kept, nothing to map
    raise NotImplementedError(
        f"DeepSpeed optimizer wrapper {cls} is not supported by the per-tensor optimizers (fp16 stage 0?). "
        "Use fp32, bf16 or torch_autocast with ZeRO 0-3."
    )


def bind_zero_layout(engine: Any, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Tell the client optimizer how DeepSpeed flattened and partitioned its parameters.

    Call once on every rank right after `deepspeed.initialize(model=..., optimizer=opt, ...)`, with
    the returned engine (or the DeepSpeed optimizer wrapper itself plus `optimizer`). Returns the
    number of flat partitions bound: 0 when DeepSpeed hands the optimizer the model's own tensors
    (ZeRO 0 in fp32 or torch_autocast), where there is nothing to do.
    """
    ds_opt = getattr(engine, "optimizer", engine)
    client = optimizer if optimizer is not None else getattr(engine, "basic_optimizer", None)
    if client is None:
        client = getattr(ds_opt, "optimizer", None)
    if client is None or not hasattr(client, "bind_flat_layouts"):
        raise TypeError(
            "bind_zero_layout needs a client optimizer built by training.optim.build_optimizer "
            f"(got {type(client).__name__})"
        )
    if ds_opt is client:
        return 0  # DeepSpeed steps the client optimizer on the model's own tensors
    module = getattr(engine, "module", None)
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    layouts = build_zero_layouts(ds_opt, names)
    if not layouts:
        return 0
    client.bind_flat_layouts(layouts)
    logger.info(
        "bound %d flat partition layout(s) from %s to %s",
        len(layouts),
        type(ds_opt).__name__,
        type(client).__name__,
    )
    return len(layouts)
