"""Compiling the model under ZeRO 3, where DeepSpeed gathers each parameter in module hooks.

ZeRO 3 keeps every parameter partitioned across the ranks and gathers it just before the module
that owns it runs (a forward pre-hook), then frees it again. `torch.compile` of the whole forward
cannot work with that: the hooks do not run inside the traced graph, which then sees the empty
partitions ("size mismatch, got input (65536x768), vec (0)", DeepSpeed 0.19.8, torch 2.11).

`model.zero3_compile` picks what is compiled instead:

- "blocks" (default): every `T5Block` becomes a ZeRO 3 *leaf module* (DeepSpeed gathers all of a
  block's parameters in one coalesced all-gather when the block is called, and registers no hooks
  inside it), and each block's forward is compiled as one graph (fullgraph), with the inductor
  settings of the whole-model compile except PDL (`training.compile_settings.block_compile_options`). The hooks
  run around the compiled call, so the graph always sees whole parameters. Everything outside the blocks
  (embeddings, the final RMS norms, the head and its loss) stays eager; the final norms are compiled on
  their own. Incremental decoding (a key/value cache) runs the eager forward.
- "pointwise": only the parameter-free element-wise parts (RMS norm, gated GELU) are compiled, each
  on its own; the rest is eager and DeepSpeed gathers per `nn.Linear`.

Call `prepare_for_zero3` before `deepspeed.initialize`: DeepSpeed reads the leaf flags when it
registers its hooks. For "blocks" it also turns off DeepSpeed's `memory_efficient_linear` (its
replacement of `torch.nn.functional.linear`): that autograd function reads each weight's `ds_id`,
which dynamo guards on as a constant, so with it every block recompiles until the recompile limit (8)
stops the run. Inside a compiled block the weights' bf16 casts are what the backward
keeps, as with the eager autocast.
"""

from __future__ import annotations

import logging

import torch

from training.compile_settings import block_compile_options
from training.model.t5 import T5Block

logger = logging.getLogger(__name__)

ZERO3_COMPILE_MODES = ("blocks", "pointwise")


def prepare_for_zero3(model: torch.nn.Module, mode: str, ds_config: dict, backend: str = "inductor") -> int:
    """Set up `model` (a `training.model.T5ForConditionalGeneration`) and the DeepSpeed config dict it
    will be initialised with for ZeRO 3 as `mode` says; returns the number of blocks compiled.
    `backend` is torch.compile's (tests use "aot_eager")."""
    if mode not in ZERO3_COMPILE_MODES:
        raise ValueError(f"model.zero3_compile={mode!r} must be one of {ZERO3_COMPILE_MODES}")
    if mode == "pointwise":
        model.compile_pointwise()
        return 0

    # deepspeed imports here: it takes seconds, and only a ZeRO 3 run with "blocks" needs it.
    from deepspeed.runtime.zero import register_external_parameter
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses
    from deepspeed.utils import set_z3_leaf_modules

    ds_config.setdefault("zero_optimization", {})["memory_efficient_linear"] = False
    original_linear = getattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original_linear is not None:  # an earlier engine in this process replaced F.linear: undo it
        torch.nn.functional.linear = original_linear
    set_z3_leaf_modules(model, [T5Block])
    for stack in (model.encoder, model.decoder):
        # The stack computes its relative bias from block 0's table before any block runs; block 0 is
        # a leaf now (no hook on the table's own module), so the stack's hook gathers the table.
        register_external_parameter(stack, stack.bias_table.weight)
    compiled = model.compile_blocks(backend=backend, options=block_compile_options(backend), loss=False)
    logger.info("ZeRO 3: %d T5 blocks are leaf modules (one all-gather per block) and compiled one by one",
                compiled)
    return compiled
