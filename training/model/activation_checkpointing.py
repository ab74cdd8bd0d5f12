"""Activation checkpointing of the T5 blocks (`T5Config.activation_checkpointing`): trade compute for
the memory of the activations a training step keeps for its backward.

- "none": every block keeps what its backward needs (the fastest step).
- "block": a block keeps only its inputs; its forward runs again in the backward. The activations of
  a step shrink to one block's worth plus the residual stream at each block boundary, for about one
  more forward (a third more compute). For the largest models and the longest inputs.
- "selective": a block keeps the outputs of its matrix multiplications and of the attention kernel
  and recomputes the rest in the backward (RMS norms, residual adds, the gated GELU, dropout masks):
  much of the memory of "block" at a fraction of its recompute (the element-wise ops are cheap).

Both use torch.utils.checkpoint without re-entrance (what torch.compile traces), preserving the RNG
state so that dropout draws the same masks in the recompute. Decoding (a cache) and evaluation (no
gradients) never checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _saved_ops() -> set:
    """The ops whose outputs "selective" keeps: the GEMMs and the fused attention's forward."""
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_cudnn_attention.default}
    fused = getattr(getattr(torch.ops, "t5ds", None), "flash_attention_fwd", None)
    if fused is not None:  # registered with the Triton kernels (training/model/triton_attention.py)
        ops.add(fused.default)
    return ops


def _policy(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ARG001 (policy signature)
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(functools.partial(_policy, _saved_ops()))


def run_block(policy: str, block: Callable, *args):
    """`block(*args)` under the checkpointing `policy` (T5Config.activation_checkpointing)."""
    if policy == "none" or not torch.is_grad_enabled():
        return block(*args)
    if policy == "block":
        return checkpoint(block, *args, use_reentrant=False)
    return checkpoint(block, *args, use_reentrant=False, context_fn=_selective_contexts)
