r"""Pre-train T5 v1.1 with T5 span corruption (or UL2, prefix LM: `data.objective`) on DeepSpeed.

    python -m training.launch --num_gpus 8 training/pretrain.py --config training/configs/t5_base_c4.yaml
    deepspeed training/pretrain.py --config training/configs/t5_base_c4.yaml \
        --deepspeed_config ds_configs/zero2.json [key=value ...]
    python training/pretrain.py --config training/configs/tiny_demo.yaml      # one process

`train` reads top to bottom: build everything, resume if the run directory holds a checkpoint,
then train with periodic logging, evaluation and checkpoints until the step count or the time
budget is reached, or a stop signal asks for a checkpoint and a requeue.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (`deepspeed training/pretrain.py`): import the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.cli_errors import run_main
from training.config import RunConfig
from training.stop_signals import stop_request
from training.trainer_args import PRETRAIN_CONFIG, preflight

if __name__ == "__main__":
    # Before the imports below (torch, DeepSpeed, the model: seconds): --help, a bad option and a bad
    # run config are answered at once, and a stop signal that arrives meanwhile waits for the first
    # step boundary.
    preflight(sys.argv[1:], doc=__doc__, default_config=PRETRAIN_CONFIG, root=RunConfig)
    stop_request()

import logging
import time

import torch

from training.budget import Horizon, TimeBudget
from training.cli_errors import expected_errors
from training.compile_settings import log_first_step
from training.config import RunConfig, eval_batch_size_per_rank, micro_batch_size
from training.data import PretrainBatches, WeightedCorpus, has_split, validation_batches
from training.data.mixture import mixture_errors
from training.data.objectives import build_objective
from training.distributed import DistInfo, all_reduce_max, all_reduce_sum
from training.ds_config import resolve_ds_config
from training.evaluation import evaluate_mixture, evaluate_sets
from training.metrics import RemainingTime, train_line
from training.model.config import T5Config
from training.model.flops import samples_flops_per_step
from training.nonfinite_watch import NonfiniteWatch, checkpoint_refusal
from training.optim import weight_l2_norm
from training.resume_policy import plan_resume
from training.run_setup import (
    begin_run,
    build_model,
    build_optimizer_and_schedule,
    capture_rng_state,
    launch,
    matmul_peak_tflops,
    open_run_outputs,
    replicated_grad_l2,
    restore_rng_state,
    setup_complete,
    start_engine,
)
from training.stop_signals import EXIT_NONFINITE, EXIT_REQUEUE
from training.vocabulary import RunVocabulary, run_vocabulary

logger = logging.getLogger("t5ds.pretrain")


@expected_errors("data.dir", ValueError, FileNotFoundError)  # the shards do not fit the run config
def objective_data(cfg: RunConfig, model_cfg: T5Config, vocab: RunVocabulary, dist_info: DistInfo,
                   train_objective) -> tuple[PretrainBatches, dict[str, list[dict]] | dict[str, dict[str, list[dict]]] | None]:
    """This rank's training batches (a resumable stream) and validation sets (named fixed lists of
    batches, `objectives.evaluation_sets`; None when the dataset has no validation split) of the
    objective `train_objective` (`build_objective`), with the run's tokenizer, over the shards in
    `data.dir`, or over the mixture `data.sources` (then the validation sets by corpus name)."""
    rank, world_size = dist_info.rank, dist_info.world_size
    objective = {
        "input_length": cfg.data.input_length, "noise_density": cfg.data.noise_density,
        "mean_noise_span_length": cfg.data.mean_noise_span_length,
        "expected_tokenizer_sha256": vocab.tokenizer.sha256, "vocab_size": model_cfg.vocab_size,
        "sentinel_start_id": vocab.sentinel_start_id,
    }
    corpora = [WeightedCorpus(s.name, s.dir, s.weight) for s in cfg.data.sources]
    train_batches = PretrainBatches(
        corpora or cfg.data.dir, "train", rank=rank, world_size=world_size, micro_batch_size=micro_batch_size(cfg, world_size),
        grad_acc=cfg.optim.grad_acc, seed=cfg.seed, num_workers=cfg.data.num_workers,
        # Pinned host memory makes the copy to the GPU asynchronous; a pageable copy would block
        # the host until the GPU has finished the previous step, so no kernels could be queued ahead.
        pin_memory=dist_info.device.type == "cuda", objective=train_objective,
        target_buckets=cfg.data.target_buckets or None, **objective,
    )
    if cfg.data.target_buckets and cfg.optim.grad_acc == 1 and rank == 0:
        logger.warning("data.target_buckets groups the micro-batches of a step, and optim.grad_acc=1 makes one: "
                       "nearly every step keeps the full target length (raise optim.grad_acc to group)")
    if corpora:
        return train_batches, mixture_validation(cfg, corpora, dist_info, train_objective, objective)
    if not has_split(cfg.data.dir, "validation"):
        if rank == 0:
            logger.warning("%s has no validation split: evaluation is off for this run (shard one with "
                           "data_prep.shard --validation-input to evaluate)", cfg.data.dir)
        return train_batches, None
    return train_batches, validation_sets(cfg, cfg.data.dir, dist_info, train_objective, objective)


def validation_sets(cfg: RunConfig, data_dir: str, dist_info: DistInfo, train_objective,
                    objective: dict) -> dict[str, list[dict]]:
    """This rank's validation batches of `data_dir`, for each set of `train_objective.evaluation_sets()`."""
    return {name: list(validation_batches(
        data_dir, rank=dist_info.rank, world_size=dist_info.world_size,
        batch_size=eval_batch_size_per_rank(cfg, dist_info.world_size), max_samples=cfg.eval.max_samples or None,
        seed=cfg.seed, objective=set_objective, **objective,
    )) for name, set_objective in train_objective.evaluation_sets().items()}


def mixture_validation(cfg: RunConfig, corpora: list[WeightedCorpus], dist_info: DistInfo, train_objective,
                       objective: dict) -> dict[str, dict[str, list[dict]]] | None:
    """`validation_sets` of each corpus of a mixture that has a validation split, by name (None: none has)."""
    sets = {}
    for k, corpus in enumerate(corpora):
        if not has_split(corpus.dir, "validation"):
            if dist_info.rank == 0:
                logger.warning("data.sources[%d] (%s) has no validation split: its held-out loss is not measured",
                               k, corpus.name)
            continue
        with mixture_errors(corpora, k):
            sets[corpus.name] = validation_sets(cfg, corpus.dir, dist_info, train_objective, objective)
    return sets or None


class LogWindow:
    """What the loop sums up between two log lines."""

    def __init__(self, device: torch.device, target_length: int) -> None:
        self.target_length = target_length  # label positions per sample of an ungrouped micro-batch
        self.loss = torch.zeros((), device=device)  # on the device: adding a step's loss never syncs
        self.last_step_loss = torch.zeros((), device=device)  # the newest step's (read before a checkpoint)
        self.reset()

    def reset(self) -> None:
        self.loss.zero_()
        self.steps = 0
        self.tokens = 0  # real (unpadded) input + target tokens of this rank's micro-batches
        self.flops = 0.0  # their model FLOPs (training.model.flops)
        self.targets = 0  # real target tokens, and label positions (padding included), of the micro-batches
        self.target_positions = 0
        self.data_wait = 0.0  # seconds spent waiting in next(train_batches)
        self.start = time.perf_counter()

    def count(self, batch: dict, model_cfg: T5Config) -> float:
        """Add a micro-batch's real tokens and FLOPs; return the factor of its mean token loss that makes
        it the sum of its token losses over its label positions. Targets of varying length (denoising
        objectives) need that constant denominator for every split of the global batch over ranks and
        micro-steps to give the same gradient (a mean per micro-batch weights tokens unevenly); the label
        positions are those of the ungrouped micro-batch, also where length groups trim the labels."""
        mask = batch.get("attention_mask")  # padded inputs (denoising objectives)
        input_lengths = torch.full((len(batch["input_ids"]),), batch["input_ids"].shape[1]) if mask is None \
            else mask.sum(1)
        target_lengths = (batch["labels"] != -100).sum(1)
        targets, positions = int(target_lengths.sum()), len(batch["labels"]) * self.target_length
        self.tokens += int(input_lengths.sum()) + targets
        self.flops += samples_flops_per_step(model_cfg, input_lengths.numpy(), target_lengths.numpy())
        self.targets += targets
        self.target_positions += positions
        return 1.0 if mask is None else targets / positions


def train_step(engine, model, batches, cfg: RunConfig, device: torch.device, clip, window: LogWindow,
               want_grad_norm: bool, model_cfg: T5Config):
    """One optimizer step over `optim.grad_acc` micro-batches; adds its loss to `window`. Returns the
    gradient norm before clipping where the loop has it (None: the engine's, or none)."""
    grad_l2 = None
    window.last_step_loss.zero_()
    for micro in range(cfg.optim.grad_acc):
        wait_start = time.perf_counter()
        batch = next(batches)
        window.data_wait += time.perf_counter() - wait_start
        scale = window.count(batch, model_cfg)
        mask = batch.get("attention_mask")  # padded inputs (denoising objectives)
        out = engine(input_ids=batch["input_ids"].to(device, non_blocking=True),
                     labels=batch["labels"].to(device, non_blocking=True), return_logits=False,
                     attention_mask=None if mask is None else mask.to(device, non_blocking=True))
        loss = out.loss if scale == 1.0 else out.loss * scale
        engine.backward(loss)
        last_micro = micro == cfg.optim.grad_acc - 1
        if last_micro and engine.zero_optimization_stage() == 0:
            # ZeRO 1-3 clip inside DeepSpeed and record the pre-clipping norm; with ZeRO 0 the loop
            # clips (training/grad_clip.py), after the gradients were all-reduced and before the
            # update, or adamwscale clips inside its step; the norm is read after the update.
            if clip is not None:
                clip()
            elif want_grad_norm:
                grad_l2 = replicated_grad_l2(model)
        engine.step()  # DeepSpeed applies the update only at the gradient-accumulation boundary
        if clip is not None and last_micro:
            grad_l2 = clip.last_norm()
        window.loss += loss.detach().float() / cfg.optim.grad_acc
        window.last_step_loss += loss.detach().float() / cfg.optim.grad_acc
    return grad_l2


def train(cfg: RunConfig, ds_config_path: str | None, dist_info: DistInfo) -> int:
    """Run (or resume) pre-training; returns the process exit code."""
    rank, world_size, device = dist_info.rank, dist_info.world_size, dist_info.device
    stop, run_dir = begin_run(cfg, rank=rank)  # first: signal handler, run directory, seed

    # --- model, data, optimizer, DeepSpeed engine -------------------------------------------
    ds_config = resolve_ds_config(ds_config_path or cfg.ds_config, cfg, world_size, device_type=device.type)
    vocab = run_vocabulary(cfg.data.tokenizer, cfg.model.vocab_size)
    tokenizer = vocab.tokenizer  # the objective first: its refusals (sentinels, denoisers) come before the model
    train_objective = build_objective(cfg.data, sentinel_start_id=tokenizer.sentinel_start_id,
                                      num_sentinels=tokenizer.num_sentinels, eos_id=tokenizer.eos_id,
                                      pad_id=tokenizer.pad_id)
    model, model_cfg = build_model(cfg.model, device, init=cfg.model.init_from, vocab=vocab)
    train_batches, val_sets = objective_data(cfg, model_cfg, vocab, dist_info, train_objective)
    horizon = Horizon(total_steps=cfg.optim.total_steps)
    optimizer, scheduler = build_optimizer_and_schedule(cfg, model, horizon)
    setup_complete(dist_info)  # every rank is set up, or every rank stops here and one prints the error
    engine, ckpt, resume_from, clip = start_engine(cfg, model, optimizer, scheduler, ds_config, run_dir, rank=rank,
                                                   world_size=world_size, device=device)

    # --- resume -----------------------------------------------------------------------------
    step, elapsed_before, skipped_before = 0, 0.0, 0
    if resume_from is not None:
        resume = plan_resume(cfg, ckpt, resume_from, run_dir, rank=rank)  # refuses changes that cannot apply
        with resume.keeping_settings(optimizer, scheduler):
            step, rank_state = ckpt.load(engine, resume_from)
        train_batches.load_state_dict(rank_state["data"])
        restore_rng_state(rank_state.get("rng"), same_world=rank_state.get("world_size") == world_size)
        elapsed_before = rank_state.get("elapsed_s", 0.0)
        horizon.total_steps = resume.horizon(rank_state.get("horizon_steps", horizon.total_steps), cfg.optim.total_steps)
        skipped_before = rank_state.get("skipped_steps", 0)
    start_step = step
    budget = TimeBudget(cfg.budget.hours, elapsed_before_s=elapsed_before)

    metrics = open_run_outputs(cfg, ds_config, model_cfg, run_dir, rank=rank)
    mixture = train_batches.mixture_proportions(horizon.total_steps * cfg.optim.batch_size)
    for source in mixture if mixture and rank == 0 else ():  # the effective proportions of a mixture
        logger.info("mixture: %s gets %.2f%% of the samples; %d rows, %.3g epochs of them in %d steps",
                    source["name"], 100 * source["share"], source["rows"], source["epochs"], horizon.total_steps)
    metrics.log("event", {"step": step, "event": "resume" if resume_from else "start", "world_size": world_size,
                          "parameters": sum(p.numel() for p in model.parameters()),
                          **({"mixture": mixture} if mixture else {}),
                          "deterministic": torch.are_deterministic_algorithms_enabled(),
                          **({"config_changes": resume.changes} if resume_from else {})})

    def run_eval() -> dict | None:
        if val_sets is None:  # no validation split
            return None
        result = (evaluate_mixture(engine, val_sets, {s["name"]: s["share"] for s in mixture}, device)
                  if mixture else evaluate_sets(engine, val_sets, device))
        metrics.log("eval", {"step": step, "objective": cfg.data.objective, **result})
        logger.info("[eval] Step %d | Loss --> %.4f | Accuracy --> %.4f | Tokens --> %d%s", step,
                    result["eval_loss"], result["eval_accuracy"], result["eval_tokens"],
                    "".join(f" | {k[len('eval_loss/'):]} --> {v:.4f}" for k, v in result.items()
                            if k.startswith("eval_loss/")))
        return result

    def save_checkpoint() -> None:
        skips.update(wait=True)  # the last step's outcome belongs in the checkpoint
        refusal = checkpoint_refusal(skips.in_a_row, all_reduce_sum([window.last_step_loss.item()], device)[0]
                                     / world_size, weight_l2_norm(optimizer))
        if refusal:
            logger.warning("step %d is not written as a checkpoint: %s", step, refusal)
            metrics.log("event", {"step": step, "event": "checkpoint_refused", "reason": refusal})
            return
        rank_state = {"data": train_batches.state_dict(), "rng": capture_rng_state(), "world_size": world_size,
                      "elapsed_s": budget.elapsed_s(), "horizon_steps": horizon.total_steps,
                      "skipped_steps": skips.skipped}
        path = ckpt.save(engine, step, rank_state)
        metrics.log("event", {"step": step, "event": "checkpoint", "path": str(path)})

    # --- the loop ---------------------------------------------------------------------------
    peak_tflops = matmul_peak_tflops(device)  # None on CPU: MFU is reported on GPUs only
    exit_code = 0
    skips = NonfiniteWatch(optimizer, engine, skipped_before=skipped_before)
    window = LogWindow(device, train_batches.target_length)
    remaining = RemainingTime()
    first_step = step
    engine.train()
    while step < horizon.total_steps:
        log_now = (step + 1) % cfg.logging.every_steps == 0 or step + 1 == horizon.total_steps
        grad_l2 = train_step(engine, model, train_batches, cfg, device, clip, window, want_grad_norm=log_now,
                             model_cfg=model_cfg)
        step += 1
        window.steps += 1
        budget.mark_step(step)
        if step == first_step + 1:
            log_first_step(metrics, step, time.perf_counter() - window.start)  # no window logged yet
            remaining.start(step)

        # Non-finite loss or gradient: the update was skipped (by our optimizer or by DeepSpeed's
        # bf16/fp16 wrappers). adamwscale reports it a step late, which keeps the GPU from waiting.
        if skips.update():
            logger.warning("step %d: non-finite loss or gradient, update skipped (%d in a row, %d in all)", step,
                           skips.in_a_row, skips.skipped)
        if skips.in_a_row >= cfg.optim.max_nonfinite_steps:
            logger.error("%d updates in a row had a non-finite loss or gradient (%d skipped in all): stopping. "
                         "Lower optim.base_lr, check the data, or resume from an earlier checkpoint.",
                         skips.in_a_row, skips.skipped)
            metrics.log("event", {"step": step, "event": "nonfinite_stop", "skipped_steps": skips.skipped})
            exit_code = EXIT_NONFINITE
            break

        if log_now:
            loss, tokens, flops, targets, positions = all_reduce_sum(
                [window.loss.item(), window.tokens, window.flops, window.targets, window.target_positions], device)
            loss /= world_size * window.steps
            if targets != positions:  # padded targets: the mean per real target token
                loss *= positions / targets
            seconds_per_step = (time.perf_counter() - window.start) / window.steps
            if grad_l2 is None:
                grad_l2 = engine.get_global_grad_norm()
            record = {
                "step": step, "objective": cfg.data.objective, "loss": loss, "lr": scheduler.get_last_lr()[0],
                "grad_l2": None if grad_l2 is None else float(grad_l2),
                "weights_l2": weight_l2_norm(optimizer),
                "seconds_per_step": seconds_per_step, "tokens_per_s": tokens / window.steps / seconds_per_step,
                "mfu": None if peak_tflops is None
                else flops / window.steps / seconds_per_step / (peak_tflops * 1e12 * world_size),
                "skipped_steps": skips.skipped, "elapsed_s": budget.elapsed_s(),
                # seconds per step this rank waited for the loader (0 when it keeps ahead of the GPU)
                "data_wait_s": window.data_wait / window.steps,
                "eta_s": remaining.seconds(step, horizon.total_steps),
            }
            if device.type == "cuda":  # the most any rank has held (ZeRO 3 partitions are uneven)
                record["peak_mem_gib"] = all_reduce_max(torch.cuda.max_memory_allocated(device) / 2**30, device)
            metrics.log("train", record)
            logger.info(train_line(record, horizon.total_steps))
            window.reset()

        if cfg.budget.hours is not None and budget.check(step, cfg.optim.total_steps, horizon):
            logger.info("time budget of %.2f h spent at step %d", cfg.budget.hours, step)
            break
        if stop.agreed():
            save_checkpoint()
            exit_code = EXIT_REQUEUE
            break
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < horizon.total_steps:
            run_eval()
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < horizon.total_steps:
            save_checkpoint()
    train_batches.close()  # its loader's worker stops now, not at the interpreter's exit

    if exit_code == 0:
        result = run_eval()
        # a finished run restarted has nothing new to save
        if cfg.checkpoint.at_end and (step != start_step or resume_from is None):
            save_checkpoint()
        if rank == 0 and result is None:
            print(f"trained {step} steps (no validation split: no held-out loss); run directory {run_dir}", flush=True)
        elif rank == 0:
            print(f"held-out loss {result['eval_loss']:.4f} (token accuracy {result['eval_accuracy']:.4f}, "
                  f"{result['eval_tokens']} target tokens) after {step} steps; run directory {run_dir}", flush=True)
    metrics.log("event", {"step": step, "event": "exit", "exit_code": exit_code})
    metrics.close()
    stop.restore()
    return exit_code


def main(argv: list[str] | None = None) -> int:
    return launch(train, argv, doc=__doc__, default_config=PRETRAIN_CONFIG, root=RunConfig)


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
