"""Building blocks of a training run that the entry points (pretrain, finetune) share: the command
line, the run's start (signal handler, run directory, seed, determinism), the model from the run
config, the optimizer and its schedule, the DeepSpeed engine (with the model compiled as the config
says, training/compile_settings.py), the run directory's records, RNG state capture and the GPU's
measured matmul ceiling (for MFU).
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from training.budget import Horizon
from training.checkpoint import CheckpointManager
from training.checkpoint_weights import load_run_model
from training.cli_errors import ExpectedError, ReportedByAnotherRank, expected_errors
from training.compile_settings import compile_model, use_compile_cache
from training.determinism import set_deterministic
from training.distributed import control_group, init_distributed, shutdown_distributed
from training.ds_config import zero_stage
from training.grad_clip import loop_clip
from training.metrics import MetricsLogger, setup_logging
from training.model import T5Config, T5ForConditionalGeneration, quack_ffn
from training.model.flops import measure_matmul_tflops
from training.model.hf_compat import load_pretrained
from training.optim import bind_zero_layout, build_optimizer, global_grad_norm, lr_at
from training.run_dir import RunDir
from training.stop_signals import stop_request
from training.trainer_args import load_trainer_config, parse_trainer_args
from training.vocabulary import RunVocabulary, check_init_vocabulary
from training.zero3_compile import prepare_for_zero3

logger = logging.getLogger(__name__)


def build_model(model_section, device: torch.device, init: str | None = None, vocab: RunVocabulary | None = None):
    """The model to train, on `device`, with fp32 master weights.

    `init` picks the starting weights: None or "random" gives a fresh `model_section.preset` (with
    `vocab`'s size, else T5's 32128); a directory holding model_config.json is one of our runs (its
    newest complete checkpoint); any other path is a Hugging Face T5 directory or a nanoT5 state dict
    (shaped as the preset). Starting weights of another vocabulary size than `vocab`'s are refused.
    Dropout, the attention backend, the residual dtype, the FFN kernel and activation checkpointing
    always come from `model_section`.
    """
    overrides = {
        "dropout_rate": model_section.dropout_rate,
        "attention_backend": model_section.attention_backend,
        "residual_dtype": model_section.residual_dtype,
        "ffn_kernel": model_section.ffn_kernel,
        "activation_checkpointing": model_section.activation_checkpointing,
        "attention_bias_layout": model_section.attention_bias_layout,
    }
    if model_section.ffn_kernel == "quack":
        quack_ffn.load()  # here, so that a run asking for it on a machine that lacks it stops at once
    if init in (None, "", "random"):
        # Built and initialised on the training device: an 11B model's random init on the host
        # takes minutes per rank and its fp32 copy 45 GB of host memory per rank.
        if vocab is not None:
            overrides["vocab_size"] = vocab.model_vocab_size
        with torch.device(device):
            model = T5ForConditionalGeneration(T5Config.from_preset(model_section.preset, **overrides))
    elif RunDir(init).is_run():
        trained, checkpoint = load_run_model(init)
        model = T5ForConditionalGeneration(replace(trained.config, **overrides))
        model.load_state_dict(trained.state_dict())
        logger.info("initialised from our run %s (%s)", init, checkpoint.name)
    elif Path(init).exists():
        with expected_errors(f"init={init}", ValueError):  # not a T5 state dict of this preset
            model = load_pretrained(init, preset=model_section.preset, **overrides)
        logger.info("initialised from %s", init)
    else:
        raise ExpectedError(f"init={init!r} is neither `random` nor an existing run directory, Hugging Face "
                            "directory or state-dict file")
    if vocab is not None and init not in (None, "", "random"):
        check_init_vocabulary(init, model.config.vocab_size, vocab)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model %s: %.1fM parameters", init or model_section.preset, n_params / 1e6)
    return model.to(device), model.config


def build_optimizer_and_schedule(cfg, model: torch.nn.Module, horizon: Horizon):
    """The run's optimizer (by name) and a LambdaLR whose horizon can be re-fitted to a time budget."""
    o = cfg.optim
    kw = {}
    if o.name == "adamwscale":  # its fused update is a Triton kernel: CUDA tensors only
        kw["fused"] = o.compile and next(model.parameters()).device.type == "cuda"
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
    return float(global_grad_norm([p.grad for p in model.parameters() if p.grad is not None]))


def start_engine(cfg, model: torch.nn.Module, optimizer, scheduler, ds_config: dict, run_dir: RunDir, *, rank: int,
                 world_size: int, device: torch.device):
    """The DeepSpeed engine of a run and where it resumes from: (engine, checkpoint manager, newest
    complete checkpoint or None, the loop's `GradClip` or None: with ZeRO 0 the loop clips the
    gradients itself, see training/grad_clip.py). Compiles the model when `model.compile` asks for it
    on a GPU (under ZeRO 3 as `model.zero3_compile` says: its parameter gathering does not trace),
    loads universal checkpoints (training/checkpoint_universal.py) as such, binds the optimizer's ZeRO
    layout.
    Loading the checkpoint itself is left to the caller (it restores its own per-rank state)."""
    import deepspeed  # here: it takes seconds to import, which importing this module (`--help`, tests) skips

    stage = zero_stage(ds_config)
    if cfg.model.compile and stage == 3 and cfg.model.compile_mode != "default":
        raise ValueError(f"model.compile_mode={cfg.model.compile_mode} compiles the whole forward, which ZeRO 3 "
                         "cannot (model.zero3_compile says what is compiled there): set model.compile_mode=default")
    if cfg.model.compile and device.type == "cuda":
        use_compile_cache(cfg.model.compile_cache, run_dir.compile_cache)
        if stage < 3:
            compile_model(model, cfg.model.compile_scope, cfg.model.compile_mode)
        else:
            # ZeRO 3 gathers parameters in module hooks that a whole compiled forward would skip:
            # compile block by block, or only the element-wise parts (training/zero3_compile.py).
            prepare_for_zero3(model, cfg.model.zero3_compile, ds_config)
    ckpt = CheckpointManager(run_dir, keep_last=cfg.checkpoint.keep_last, rank=rank, world_size=world_size,
                             run_config=cfg.to_dict())
    resume_from = ckpt.find_resumable()
    if resume_from is not None:
        check_resumable_layout(ckpt.read_meta(resume_from), resume_from, run_dir, stage, world_size, rank=rank)
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
    if stage == 0 and world_size == 1:
        # One rank has nothing to reduce; DeepSpeed would still flatten, "all-reduce" and copy back
        # every gradient each step.
        engine.enable_backward_allreduce = False
    advice = zero_stage_advice(ds_config, world_size, device.type)
    if advice is not None:
        logger.log(*advice)
    return engine, ckpt, resume_from, clip


def check_resumable_layout(meta: dict, checkpoint: Path, run_dir: RunDir, stage: int, world_size: int, *,
                           rank: int) -> None:
    """Refuse, before DeepSpeed tries, a checkpoint whose partitioned state this engine cannot load:
    one written under another ZeRO stage (ZeRO 1 and 2 share their layout), or a ZeRO >= 1 checkpoint
    of another world size; a universal checkpoint loads anywhere. Every rank sees the same checkpoint,
    so rank 0 reports and the others stop with it."""
    saved_stage, saved_world = int(meta.get("zero_stage", 0)), int(meta.get("world_size", world_size))
    if meta.get("universal"):
        return
    same_layout = saved_stage == stage or {saved_stage, stage} == {1, 2}
    if same_layout and (saved_world == world_size or stage == 0):
        return
    written = f"ZeRO {saved_stage} on {saved_world} rank{'s' if saved_world > 1 else ''}"
    now = f"ZeRO {stage} on {world_size} rank{'s' if world_size > 1 else ''}"
    message = (f"{checkpoint} was written by {written}, and this run has {now}: DeepSpeed cannot load its "
               f"{'optimizer partitions' if same_layout else 'state under another stage'}. Resume with the same "
               f"DeepSpeed config and GPU count, or convert it and resume from the copy: python -m "
               f"training.checkpoint_universal {run_dir} NEW_RUN_DIR, then start this run with output_dir=NEW_RUN_DIR")
    raise ExpectedError(message) if rank == 0 else ReportedByAnotherRank(message)


def zero_stage_advice(ds_config: dict, world_size: int, device_type: str = "cuda") -> tuple[int, str] | None:
    """What the run's log says about its ZeRO stage at this world size, from the measured step times of
    T5 base: (logging level, message), or None. Only on GPUs: those times say nothing about a CPU run
    (tests, the demo, the tiny recipes).

    - ZeRO 1 or 2 on one rank without optimizer offload partitions nothing: DeepSpeed still copies
      the gradients into its flat fp32 partition and the update back every step, 30-45 ms a step for
      T5 base on an H100 (25-30%). A warning, pointing at zero0.json.
    - ZeRO 0 on several ranks: its all-reduce after the backward is not overlapped, and it is still
      the fastest stage for T5 base on one node (2 H100s: 20% ahead of ZeRO 1/2). An info line saying
      so, and when to take ZeRO 1/2 instead."""
    if device_type != "cuda":
        return None
    stage = zero_stage(ds_config)
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if stage in (1, 2) and world_size == 1 and offload in (None, "none"):
        return logging.WARNING, (
            f"ZeRO {stage} on one GPU partitions nothing, and DeepSpeed still copies every gradient into its flat "
            f"fp32 partition and the update back, each step: 30-45 ms a step for T5 base on an H100 "
            f"(docs/zero_and_slurm.md). Use ds_configs/zero0.json on one GPU")
    if stage == 0 and world_size > 1:
        return logging.INFO, (
            f"ZeRO 0 on {world_size} ranks all-reduces the gradients after the backward, without overlap: the "
            f"fastest stage for T5 base on one node, 20% ahead of ZeRO 1/2 on 2 H100s (docs/zero_and_slurm.md). "
            f"ds_configs/zero1.json or zero2.json partition the optimizer state when memory is short, and "
            f"overlap the reduction, which may pay across nodes")
    return None


def begin_run(cfg, *, rank: int):
    """The first steps of a run (pre-training or fine-tuning), in this order: the stop-signal handler
    and launcher watch (a preemption signal during start-up is then honoured at the first step), the
    output directory and its trainer lock (rank 0 creates and locks it before anything is written;
    RunDirInUse when another trainer holds it), the seed, and deterministic algorithms when
    `cfg.deterministic` asks (before the first matmul and the first compile). Returns (the
    StopRequest, the RunDir)."""
    stop = stop_request()
    run_dir = RunDir(cfg.output_dir)
    if rank == 0:
        run_dir.lock_for_training()
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        set_deterministic(True)
    return stop, run_dir


def open_run_outputs(cfg, ds_config: dict, model_config: T5Config, run_dir: RunDir, *, rank: int) -> MetricsLogger:
    """Record the resolved run config, DeepSpeed config and model shape in the run directory (rank 0)
    and return the run's MetricsLogger."""
    if rank == 0:
        run_dir.write_config(cfg)
        run_dir.write_ds_config(ds_config)
        run_dir.write_model_config(model_config)
    return MetricsLogger(run_dir, rank=rank, wandb_mode=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project,
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
    return measure_matmul_tflops(device, iters=10)


class _SetupState:
    completed = False


def _first_failed_rank(dist_info, failed: bool) -> int | None:
    """The lowest rank that failed its set-up, or None (a collective on the CPU control group)."""
    if dist_info.world_size == 1:
        return dist_info.rank if failed else None
    t = torch.tensor([dist_info.rank if failed else dist_info.world_size], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control_group())
    first = int(t.item())
    return None if first == dist_info.world_size else first


def setup_complete(dist_info) -> None:
    """Every rank calls this at the end of its set-up, before the engine's first collective: if a rank
    failed before (its launch() joins this collective from its error path), every rank stops here,
    and only the lowest failed rank prints its error."""
    _SetupState.completed = True
    first = _first_failed_rank(dist_info, failed=False)
    if first is not None:
        raise ReportedByAnotherRank(f"rank {first} failed during set-up")


def launch(entry, argv: list[str] | None, *, doc: str, default_config: str, root: type) -> int:
    """Shared command line of the training entry points (pretrain, finetune): `--config` YAML,
    `--deepspeed_config` (default: the config's ds_config), `--local_rank` (set by the deepspeed
    launcher), then `key=value` overrides (training/trainer_args.py). Installs the stop-signal
    handlers, initialises the process group and the logger, then returns `entry(cfg, ds_config_path,
    dist_info)`, the process exit code.

    Errors the user can fix reach the caller (training/cli_errors.run_main) printed by one rank: a
    config error by rank 0 (every rank has it), a set-up error by the lowest rank that has it
    (`setup_complete`), a later one by the rank that meets it.
    """
    args = parse_trainer_args(argv, doc=doc, default_config=default_config)
    stop_request()  # before anything slow: a stop signal during start-up waits for the first step
    cfg = load_trainer_config(args, root)
    owns_process_group = not dist.is_initialized()
    dist_info = init_distributed(cfg.device)
    setup_logging(dist_info.rank)
    _SetupState.completed = False
    try:
        exit_code = entry(cfg, args.deepspeed_config, dist_info)
    except Exception as exc:
        reports = _SetupState.completed or _first_failed_rank(dist_info, failed=True) == dist_info.rank
        if owns_process_group and dist_info.device.type == "cpu":
            # A gloo group left to the interpreter's exit can abort it (shutdown_distributed says why);
            # an NCCL group after an error is left to the exit: its shutdown can wait on a failed peer.
            shutdown_distributed()
        if not reports:
            raise ReportedByAnotherRank("another rank failed during set-up") from exc
        raise
    if owns_process_group:
        shutdown_distributed()
    return exit_code
