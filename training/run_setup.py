"""Building blocks of a training run that the entry points (pretrain, finetune) share: the run's
start (signal handler, output directory, seed, determinism), the model from the run config and how
it is compiled, the optimizer and its schedule, RNG state capture, file hashes and the GPU's
measured matmul ceiling (for MFU).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from training.budget import Horizon

logger = logging.getLogger(__name__)


def tokenizer_hash(path: str | Path) -> str:
    """The tokenizer hash data_prep recorded in the manifest (a .model file or an HF directory)."""
    from data_prep.tokenizer import tokenizer_sha256

    if not Path(path).exists():
        raise FileNotFoundError(f"tokenizer {path} not found: set data.tokenizer to the tokenizer the shards were "
                                "made with (assets/t5/spiece.model for T5)")
    return tokenizer_sha256(path)


def build_model(model_section, device: torch.device, init: str | None = None):
    """The model to train, on `device`, with fp32 master weights.

    `init` picks the starting weights: None or "random" gives a fresh `model_section.preset`; a
    directory holding model_config.json is one of our runs (its newest complete checkpoint); any
    other path is a Hugging Face T5 directory or a nanoT5 state dict (shaped as the preset).
    Dropout, the attention backend, the residual dtype and the FFN kernel always come from
    `model_section`.
    """
    from dataclasses import replace

    from training.model import T5Config, T5ForConditionalGeneration

    overrides = {
        "dropout_rate": model_section.dropout_rate,
        "attention_backend": model_section.attention_backend,
        "residual_dtype": model_section.residual_dtype,
        "ffn_kernel": model_section.ffn_kernel,
    }
    if model_section.ffn_kernel == "quack":
        from training.model import quack_ffn

        quack_ffn.load()  # here, so that a run asking for it on a machine that lacks it stops at once
    if init in (None, "", "random"):
        # Built and initialised on the training device: an 11B model's random init on the host
        # takes minutes per rank and its fp32 copy 45 GB of host memory per rank.
        with torch.device(device):
            model = T5ForConditionalGeneration(T5Config.from_preset(model_section.preset, **overrides))
    elif (Path(init) / "model_config.json").is_file():
        from training.export import load_run_model

        trained, checkpoint = load_run_model(init)
        model = T5ForConditionalGeneration(replace(trained.config, **overrides))
        model.load_state_dict(trained.state_dict())
        logger.info("initialised from our run %s (%s)", init, checkpoint.name)
    elif Path(init).exists():
        from training.model.hf_compat import load_pretrained

        model = load_pretrained(init, preset=model_section.preset, **overrides)
        logger.info("initialised from %s", init)
    else:
        raise FileNotFoundError(f"init={init!r} is neither `random` nor an existing run directory, Hugging Face "
                                "directory or state-dict file")
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model %s: %.1fM parameters", init or model_section.preset, n_params / 1e6)
    return model.to(device), model.config


def build_optimizer_and_schedule(cfg, model: torch.nn.Module, horizon: Horizon):
    """The run's optimizer (by name) and a LambdaLR whose horizon can be re-fitted to a time budget."""
    from training.optim import build_optimizer, lr_at

    o = cfg.optim
    kw = {}
    if o.name == "adamwscale":  # its compiled update pays on a GPU; on CPU inductor costs more than it saves
        kw["compiled"] = o.compile and next(model.parameters()).device.type == "cuda"
    optimizer = build_optimizer(o.name, model, lr=o.base_lr, weight_decay=o.weight_decay, betas=tuple(o.betas),
                                eps=o.eps, **kw)

    def lr_factor(step: int) -> float:
        lr = lr_at(o.lr_scheduler, step, base_lr=o.base_lr, warmup_steps=o.warmup_steps,
                   total_steps=horizon.total_steps, final_lr=o.final_cosine)
        return lr / o.base_lr

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    return optimizer, scheduler


def replicated_grad_l2(model: torch.nn.Module) -> float:
    """L2 norm of all gradients of a model whose gradients are whole on every rank (ZeRO 0)."""
    from training.optim import global_grad_norm

    return float(global_grad_norm([p.grad for p in model.parameters() if p.grad is not None]))


# Inductor settings the compiled model runs with, on top of those of torch.compile's mode.
# reorder_for_peak_memory: with the model's own Triton ops in the graph (training/model/
# triton_add_norm.py), inductor's memory-aware reordering moved the weights' bf16 casts (about 130
# small kernels) ahead of the forward's first GEMM; after each synchronisation the GPU then waited
# ~6 ms for the host to launch them. Without it they stay next to their GEMMs, and peak memory was
# the same (T5 base on an H100, docs/model_speed.md).
MODEL_INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False}


# Programmatic dependent launch (PDL) of inductor's Triton kernels: on Hopper and newer GPUs each of
# them is launched while the kernel ahead of it is still running, and waits on the GPU (griddepcontrol)
# before it touches what that kernel wrote. That hides part of the ~1.5 us the GPU idles at each of a
# step's ~1870 kernel boundaries. Inductor emits it only for CUDA devices of compute capability 9 or
# more; elsewhere the setting changes nothing. T5 base on three H100s: 0.5-0.8 ms a step less by the host
# clock, the same bits (docs/model_speed.md, rows 121-130).
INDUCTOR_PDL_OPTION = "triton.enable_pdl"


def compile_options(mode: str = "default", pdl: bool = True) -> dict:
    """torch.compile `options` for the model: those of `mode` plus MODEL_INDUCTOR_OPTIONS (torch.compile
    takes a mode or options, not both), and PDL (INDUCTOR_PDL_OPTION) where this torch has it (torch
    2.11 has it; torch.compile refuses options it does not know) unless `pdl` is False."""
    import torch._inductor

    options = {**torch._inductor.list_mode_options(mode), **MODEL_INDUCTOR_OPTIONS}  # "default": {}
    if _inductor_has(INDUCTOR_PDL_OPTION):
        options[INDUCTOR_PDL_OPTION] = pdl
    return options


def _inductor_has(option: str) -> bool:
    """Whether this torch's inductor has the setting `option` (a dotted name, as torch.compile takes it)."""
    import torch._inductor.config

    return option in torch._inductor.config.get_config_copy()


def compile_forward(model: torch.nn.Module, mode: str = "default") -> None:
    """Compile the model's forward only, as one graph (fullgraph: a graph break is an error, not a
    slowdown), in torch.compile's `mode` (with `compile_options`); DeepSpeed's module hooks stay
    outside it. Parameter names are unchanged."""
    model.forward = torch.compile(model.forward, fullgraph=True, options=compile_options(mode))


def compile_cache_outcomes() -> dict[str, int]:
    """How often AOTAutograd's compile cache hit, missed or stepped aside ("bypass") in this process so
    far, nonzero counts only: {} where nothing was compiled (CPU runs, `model.compile=false`)."""
    from torch._dynamo.utils import counters

    cache = counters["aot_autograd"]
    return {k: cache[f"autograd_cache_{k}"] for k in ("hit", "miss", "bypass") if cache[f"autograd_cache_{k}"]}


def log_first_step(metrics, step: int, seconds: float) -> None:
    """Records how long this process's first training step took to launch, torch.compile included,
    and what the compile cache did for it: an "event" record `first_step` and one log line (the
    first logging window's seconds/step averages it away)."""
    outcomes = compile_cache_outcomes()
    metrics.log("event", {"step": step, "event": "first_step", "seconds": seconds, "compile_cache": outcomes})
    if not outcomes:
        logger.info("first step launched in %.1f s", seconds)
        return
    cache = ", ".join(f"{k} {n}" for k, n in outcomes.items())
    hint = ""
    if "bypass" in outcomes:  # e.g. an autograd.Function in a changed model
        hint = (" The cache stepped aside for part of it, so every run compiles that part again "
                "(docs/model_speed.md, \"The compile cache\").")  # fmt: skip
    elif "hit" not in outcomes:  # compiled from scratch
        hint = (" A later run of the same code, model and shapes on this machine loads it from "
                "TORCHINDUCTOR_CACHE_DIR instead (docs/configuration.md, model.compile).")  # fmt: skip
    logger.info("first step launched in %.1f s, torch.compile included (compile cache: %s).%s", seconds, cache, hint)


def start_engine(cfg, model: torch.nn.Module, optimizer, scheduler, ds_config: dict, out_dir: Path, *, rank: int,
                 world_size: int, device: torch.device):
    """The DeepSpeed engine of a run and where it resumes from: (engine, checkpoint manager, newest
    complete checkpoint or None, the loop's `GradClip` or None: with ZeRO 0 the loop clips the
    gradients itself, see training/grad_clip.py). Compiles the model when `model.compile` asks for it on a GPU (under
    ZeRO 3 as `model.zero3_compile` says: its parameter gathering does not trace), loads
    universal checkpoints (training/checkpoint_universal.py) as such, binds the optimizer's ZeRO layout.
    Loading the checkpoint itself is left to the caller (it restores its own per-rank state)."""
    import deepspeed

    from training.checkpoint import CheckpointManager
    from training.ds_config import zero_stage as ds_zero_stage
    from training.grad_clip import loop_clip
    from training.optim import bind_zero_layout
    from training.zero3_compile import prepare_for_zero3

    zero_stage = ds_zero_stage(ds_config)
    if cfg.model.compile and zero_stage == 3 and cfg.model.compile_mode != "default":
        raise ValueError(f"model.compile_mode={cfg.model.compile_mode} compiles the whole forward, which ZeRO 3 "
                         "cannot (model.zero3_compile says what is compiled there): set model.compile_mode=default")
    if cfg.model.compile and device.type == "cuda":
        if zero_stage < 3:
            compile_forward(model, cfg.model.compile_mode)
        else:
            # ZeRO 3 gathers parameters in module hooks that a whole compiled forward would skip:
            # compile block by block, or only the element-wise parts (training/zero3_compile.py).
            prepare_for_zero3(model, cfg.model.zero3_compile, ds_config)
    ckpt = CheckpointManager(out_dir, keep_last=cfg.checkpoint.keep_last, rank=rank, world_size=world_size)
    resume_from = ckpt.find_resumable()
    if resume_from is not None and ckpt.is_universal(ckpt.read_meta(resume_from)):
        # Written by training/checkpoint_universal.py: any ZeRO stage and world size can load it.
        ds_config.setdefault("checkpoint", {})["load_universal"] = True
    clip = loop_clip(ds_config, model, optimizer)
    # With the loop clipping, DeepSpeed gets clipping 0; ds_config itself (written to the run
    # directory) keeps the run's value.
    engine_config = ds_config if clip is None else {**ds_config, "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=engine_config, dist_init_required=False)
    bind_zero_layout(engine, optimizer)
    if zero_stage == 0 and world_size == 1:
        # One rank has nothing to reduce; DeepSpeed would still flatten, "all-reduce" and copy back
        # every gradient each step.
        engine.enable_backward_allreduce = False
    advice = zero_stage_advice(ds_config, world_size)
    if advice is not None:
        logger.log(*advice)
    return engine, ckpt, resume_from, clip


def zero_stage_advice(ds_config: dict, world_size: int) -> tuple[int, str] | None:
    """What the run's log says about its ZeRO stage at this world size, from the measurements in
    docs/performance.md ("Which stage on one node"): (logging level, message), or None.

    - ZeRO 1 or 2 on one rank without optimizer offload partitions nothing: DeepSpeed still copies
      the gradients into its flat fp32 partition and the update back every step, 30-45 ms a step for
      T5 base on an H100 (25-30%). A warning, pointing at zero0.json.
    - ZeRO 0 on several ranks: its all-reduce after the backward is not overlapped, and it was still
      the fastest stage for T5 base on one node (2 H100s: 20% ahead of ZeRO 1/2). An info line saying
      so, and when to take ZeRO 1/2 instead."""
    from training.ds_config import zero_stage as ds_zero_stage

    stage = ds_zero_stage(ds_config)
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if stage in (1, 2) and world_size == 1 and offload in (None, "none"):
        return logging.WARNING, (
            f"ZeRO {stage} on one GPU partitions nothing, and DeepSpeed still copies every gradient into its flat "
            f"fp32 partition and the update back, each step: 30-45 ms a step for T5 base on an H100 "
            f"(docs/performance.md, \"Which stage on one node\"). Use ds_configs/zero0.json on one GPU")
    if stage == 0 and world_size > 1:
        return logging.INFO, (
            f"ZeRO 0 on {world_size} ranks all-reduces the gradients after the backward, without overlap: the "
            f"fastest stage for T5 base on one node (docs/performance.md, \"Which stage on one node\"). "
            f"ds_configs/zero1.json or zero2.json partition the optimizer state when memory is short, and "
            f"overlap the reduction, which may pay across nodes")
    return None


def begin_run(cfg, *, rank: int):
    """The first steps of a run (pre-training or fine-tuning), in this order: the stop-signal handler
    (a preemption signal during start-up is then honoured at the first step), the output directory
    (rank 0 creates it), the seed, and deterministic algorithms when `cfg.deterministic` asks (before
    the first matmul and the first compile). Returns (the StopRequest, the output directory)."""
    from training.determinism import set_deterministic
    from training.stop_signals import StopRequest

    stop = StopRequest()
    out_dir = Path(cfg.output_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        set_deterministic(True)
    return stop, out_dir


def open_run_outputs(cfg, ds_config: dict, model_config, out_dir: Path, *, rank: int):
    """Record the resolved run config, DeepSpeed config and model shape in the run directory (rank 0)
    and return the run's MetricsLogger."""
    import json

    from training.config_loader import dump_yaml
    from training.export import write_model_config
    from training.metrics import MetricsLogger

    if rank == 0:
        dump_yaml(cfg, out_dir / "config.yaml")
        (out_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        write_model_config(out_dir, model_config)
    return MetricsLogger(out_dir, rank=rank, wandb_mode=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project,
                         run_name=cfg.logging.run_name, config=cfg.to_dict())


def capture_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict | None, *, same_world: bool) -> None:
    """Restore this rank's RNG streams. After a change of world size a rank may get another rank's
    state; that only affects dropout noise, never the data (its noise is keyed by sample index)."""
    if not state:
        return
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if not same_world:
        logger.info("world size changed since the checkpoint: RNG streams taken from the saved ranks")


def matmul_peak_tflops(device: torch.device) -> float | None:
    """Measured bf16 matmul ceiling of this GPU (TFLOP/s) for MFU; None on CPU."""
    if device.type != "cuda":
        return None
    from training.model.flops import measure_matmul_tflops

    return measure_matmul_tflops(device, iters=10)


def launch(entry, argv: list[str] | None, *, doc: str, default_config: str, root: type) -> int:
    """Shared command line of the training entry points (pretrain, finetune).

    `--config` YAML, `--deepspeed_config` (default: the config's ds_config), `--local_rank` (set by
    the deepspeed launcher), then `key=value` overrides. Initialises the process group and the
    logger, then returns `entry(cfg, ds_config_path, dist_info)`, the process exit code.
    """
    import argparse

    import torch.distributed as dist

    from training.config_loader import load_run_config
    from training.distributed import init_distributed, shutdown_distributed
    from training.metrics import setup_logging

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=default_config, help="run config (YAML)")
    parser.add_argument("--deepspeed_config", default=None,
                        help="DeepSpeed config; switch ZeRO stage by switching this file "
                             "(default: the run config's ds_config)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    parser.add_argument("overrides", nargs="*", help="run-config overrides, e.g. optim.base_lr=1e-2")
    args = parser.parse_args(argv)
    cfg = load_run_config(args.config, args.overrides, root=root)
    owns_process_group = not dist.is_initialized()
    dist_info = init_distributed(cfg.device)
    setup_logging(dist_info.rank)
    try:
        exit_code = entry(cfg, args.deepspeed_config, dist_info)
    except Exception:
        # The launcher (deepspeed, torchrun, srun) ends the other ranks when one exits non-zero.
        logger.exception("%s failed on rank %d", entry.__name__, dist_info.rank)
        raise
    if owns_process_group:
        shutdown_distributed()
    return exit_code
