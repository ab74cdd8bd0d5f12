"""How the model is compiled: torch.compile's options for it, the compile of ZeRO 0-2 (the whole
forward, or block by block), and what AOTAutograd's compile cache did for the first step.

training/run_setup.py compiles the model with `compile_model` (as `model.compile_scope` says);
training/zero3_compile.py compiles the T5 blocks under ZeRO 3 with the same `compile_options` (less
PDL); the step benchmark (`python -m training.benchmark`) uses them too, so that it measures what
training runs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters
from torch._inductor import list_mode_options

from training.metrics import compile_cache_text
from training.model import triton_access_cache

logger = logging.getLogger(__name__)

# Inductor settings the compiled model runs with, on top of those of torch.compile's mode.
# reorder_for_peak_memory: with the model's own Triton ops in the graph (training/model/
# triton_add_norm.py), inductor's memory-aware reordering moves the weights' bf16 casts (about 130
# small kernels) ahead of the forward's first GEMM; after each synchronisation the GPU then waits
# ~6 ms for the host to launch them. Without it they stay next to their GEMMs, at the same peak
# memory (T5 base on an H100).
MODEL_INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False}

# Programmatic dependent launch (PDL) of inductor's Triton kernels: on Hopper and newer GPUs each of
# them is launched while the kernel ahead of it is still running, and waits on the GPU (griddepcontrol)
# before it touches what that kernel wrote. That hides part of the ~1.5 us the GPU idles at each of a
# step's ~1870 kernel boundaries. Inductor emits it only for CUDA devices of compute capability 9 or
# more; elsewhere the setting changes nothing. T5 base, measured on three H100s: 0.5-0.8 ms a step less
# by the host clock, the same bits.
INDUCTOR_PDL_OPTION = "triton.enable_pdl"


def compile_options(mode: str = "default", pdl: bool = True) -> dict:
    """torch.compile `options` for the model: those of `mode` plus MODEL_INDUCTOR_OPTIONS (torch.compile
    takes a mode or options, not both), and PDL (INDUCTOR_PDL_OPTION) where this torch has it (torch
    2.11 has it; torch.compile refuses options it does not know) unless `pdl` is False. Every compile of
    the model takes its options from here, so this is also where torch's analysis of the model's
    Triton kernels is memoised for the compile (training/model/triton_access_cache.py)."""
    triton_access_cache.install()
    options = {**list_mode_options(mode), **MODEL_INDUCTOR_OPTIONS}  # "default": {}
    if _inductor_has(INDUCTOR_PDL_OPTION):
        options[INDUCTOR_PDL_OPTION] = pdl
    return options


def _inductor_has(option: str) -> bool:
    """Whether this torch's inductor has the setting `option` (a dotted name, as torch.compile takes it)."""
    return option in inductor_config.get_config_copy()


def compile_forward(model: torch.nn.Module, mode: str = "default") -> None:
    """Compile the model's forward only, as one graph (fullgraph: a graph break is an error, not a
    slowdown), in torch.compile's `mode` (with `compile_options`); DeepSpeed's module hooks stay
    outside it. Parameter names are unchanged."""
    model.forward = torch.compile(model.forward, fullgraph=True, options=compile_options(mode))


def block_compile_options(backend: str = "inductor", mode: str = "default") -> dict | None:
    """torch.compile `options` for the model compiled block by block (`compile_blocks`, at ZeRO 0-2
    and under ZeRO 3): `compile_options(mode)` less PDL, whose gain is measured on the whole-model
    graph only (under ZeRO 3 DeepSpeed's gathers run between the blocks on their own streams). Other
    backends (tests use "aot_eager") take none."""
    return compile_options(mode, pdl=False) if backend == "inductor" else None


def compile_model(model: torch.nn.Module, scope: str = "model", mode: str = "default") -> None:
    """Compile `model` (a T5ForConditionalGeneration) for ZeRO 0-2 as `model.compile_scope` says: its
    whole forward (`compile_forward`), or each block, the final norms and the loss on their own
    (`compile_blocks`, with `block_compile_options`; docs/performance.md)."""
    if scope == "blocks":
        model.compile_blocks(options=block_compile_options(mode=mode))
    else:
        compile_forward(model, mode)


def compile_cache_dir(setting: str | None, run_cache: Path) -> Path | None:
    """The directory `model.compile_cache` names: "user" the user's cache ($XDG_CACHE_HOME/t5ds/compile,
    by default ~/.cache/t5ds/compile), "run" `run_cache` (the run directory's), else that directory;
    None for torch's own."""
    if setting is None:
        return None
    if setting == "user":
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "t5ds" / "compile"
    return (run_cache if setting == "run" else Path(setting).expanduser()).resolve()


def use_compile_cache(setting: str | None, run_cache: Path) -> Path | None:
    """Point torch.compile's caches at `compile_cache_dir(setting, run_cache)` before anything compiles:
    inductor's (FX graphs, AOTAutograd, autotuning) through TORCHINDUCTOR_CACHE_DIR, and Triton's kernel
    binaries, the model's own kernels included, through TRITON_CACHE_DIR. The caches write each entry
    atomically, so ranks on one or many nodes can share one. Returns the directory (None: unchanged)."""
    path = compile_cache_dir(setting, run_cache)
    if path is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
        os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


def compile_cache_outcomes() -> dict[str, int]:
    """How often AOTAutograd's compile cache hit, missed or stepped aside ("bypass") in this process so
    far, nonzero counts only: {} where nothing was compiled (CPU runs, `model.compile=false`)."""
    cache = counters["aot_autograd"]
    return {k: cache[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass") if cache[f"autograd_cache_{k}"]}


def log_first_step(metrics, step: int, seconds: float) -> None:
    """Records how long this process's first training step took to launch, torch.compile included,
    and what the compile cache did for it: an "event" record `first_step` in `metrics` (a
    MetricsLogger) and one log line (the first logging window's seconds/step averages it away)."""
    outcomes = compile_cache_outcomes()
    metrics.log("event", {"step": step, "event": "first_step", "seconds": seconds, "compile_cache": outcomes})
    if not outcomes:
        logger.info("first step launched in %.1f s", seconds)
        return
    cache = compile_cache_text(outcomes)
    hint = ""
    if "bypass" in outcomes:  # e.g. an autograd.Function or an autocast context inside the graph
        hint = (" The cache stepped aside for part of it, so every run compiles that part again "
                "(an autograd.Function or an autocast context inside the compiled graph does that).")  # fmt: skip
    elif "hit" not in outcomes:  # compiled from scratch
        hint = (" A later run of the same code, model and shapes loads it from the compile cache "
                f"instead ({os.environ.get('TORCHINDUCTOR_CACHE_DIR', '/tmp/torchinductor_$USER')}; "
                "model.compile_cache).")  # fmt: skip
    logger.info("first step launched in %.1f s, torch.compile included (compile cache: %s).%s", seconds, cache, hint)
