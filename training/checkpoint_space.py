"""Telling a full disk from other failed writes of a checkpoint, and how much space a checkpoint needs.

torch's zip writer reports a failed write as "[enforce fail at inline_container.cc:...] . unexpected
pos ..." without an errno; Python's own writes raise OSError with ENOSPC (or EDQUOT for a quota).
training/checkpoint.py turns either into one message that names the directory, the space needed
(the previous checkpoint's size, else the size of the model and optimizer state) and what is free.
"""

from __future__ import annotations

import errno
from typing import Any

import torch

_TORCH_WRITE_FAILED = ("inline_container", "PytorchStreamWriter", "unexpected pos")


def _exception_chain(exc: BaseException | None) -> list[BaseException]:
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def ran_out_of_space(exc: BaseException, free_bytes: int, needed_bytes: int) -> bool:
    """Whether a failed write is a full device or quota: an OSError with ENOSPC or EDQUOT anywhere in
    the exception's chain, or torch's zip writer failing while less than the checkpoint's size is free."""
    for e in _exception_chain(exc):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
    text = " ".join(str(e) for e in _exception_chain(exc))
    return any(marker in text for marker in _TORCH_WRITE_FAILED) and free_bytes < needed_bytes


def state_bytes(engine: Any, zero_stage: int, world_size: int) -> int:
    """What a checkpoint of a DeepSpeed engine holds, roughly: the fp32 weights, the optimizer's state
    (over all ranks when ZeRO partitions it) and, under ZeRO >= 1, the fp32 partitions of the weights."""
    weights = sum(getattr(p, "ds_numel", p.numel()) * 4 for p in engine.module.parameters())
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = getattr(inner, "state", None) or {}
    moments = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))
    if zero_stage >= 1:
        return weights + moments * world_size + weights
    return weights + moments


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB"
