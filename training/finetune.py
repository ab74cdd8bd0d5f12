r"""Fine-tune T5 on a task and evaluate it: Super-Natural-Instructions with Rouge-L (the Tk-Instruct
protocol), or any text-to-text dataset (`task.kind: text2text`; docs/finetuning.md).

    python -m training.launch --num_gpus 8 training/finetune.py --config training/configs/sni.yaml init=runs/base
    deepspeed training/finetune.py --config training/configs/glue_rte.yaml \
        --deepspeed_config ds_configs/zero2.json init=runs/base data.dir=/data/glue/rte [key=value ...]

`init` is nanoT5's three modes: one of our pre-training runs (its newest complete checkpoint), a
Hugging Face T5 directory (e.g. a local google/t5-v1_1-base), or `random`. Same engine, ZeRO
configs, checkpoints and logging as pre-training. SNI: Rouge-L on the test tasks every
`eval.every_steps` and at the end, under `<output_dir>/sni_eval/`. Text-to-text: the validation
split every `eval.every_steps` and at the end (with `eval.best_metric`, the best weights are kept
and end the run; `eval.patience` stops early), then the test split, under `<output_dir>/eval/`.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.cli_errors import run_main
from training.finetune_config import FinetuneConfig
from training.stop_signals import stop_request
from training.trainer_args import FINETUNE_CONFIG, preflight

if __name__ == "__main__":
    # Before the imports below (torch, DeepSpeed, the model: seconds): --help, a bad option and a bad
    # run config are answered at once, and a stop signal that arrives meanwhile waits for the first
    # step boundary.
    preflight(sys.argv[1:], doc=__doc__, default_config=FINETUNE_CONFIG, root=FinetuneConfig)
    stop_request()

import contextlib
import logging
import time

import torch

from training.best_checkpoint import BestSelection
from training.budget import Horizon
from training.cli_errors import ExpectedError, expected_errors
from training.compile_settings import log_first_step
from training.config import micro_batch_size
from training.distributed import DistInfo, all_reduce_sum
from training.ds_config import resolve_ds_config
from training.finetune_config import FinetuneConfig
from training.finetune_tasks import load_task
from training.metrics import RemainingTime, train_line
from training.nonfinite_watch import checkpoint_refusal
from training.optim import weight_l2_norm
from training.resume_policy import plan_resume
from training.run_dir import step_dirname
from training.run_setup import (
    begin_run,
    build_model,
    build_optimizer_and_schedule,
    capture_rng_state,
    launch,
    open_run_outputs,
    restore_rng_state,
    setup_complete,
    start_engine,
)
from training.sni.encoding import SNITokenizer, num_train_batches, train_batches
from training.stop_signals import EXIT_REQUEUE
from training.vocabulary import init_tokenizer, run_vocabulary

logger = logging.getLogger("t5ds.finetune")


def finetune(cfg: FinetuneConfig, ds_config_path: str | None, dist_info: DistInfo) -> int:
    """Run (or resume) fine-tuning with its final evaluation; returns the process exit code."""
    rank, world_size, device = dist_info.rank, dist_info.world_size, dist_info.device
    stop, run_dir = begin_run(cfg, rank=rank)  # first: signal handler, run directory, seed
    ds_config = resolve_ds_config(ds_config_path or cfg.ds_config, cfg, world_size, device_type=device.type)

    # --- data: every rank encodes the same instances (a few seconds), then takes its batches ----
    cfg.data.tokenizer = cfg.data.tokenizer or init_tokenizer(cfg.init)
    vocab = run_vocabulary(cfg.data.tokenizer, cfg.model.vocab_size)
    with expected_errors("data", ValueError, FileNotFoundError):  # the task's files or the tokenizer do not fit
        tokenizer = SNITokenizer(Path(cfg.data.tokenizer) / "spiece.model" if Path(cfg.data.tokenizer).is_dir()
                                 else cfg.data.tokenizer)
        task = load_task(cfg, tokenizer)
        examples = task.examples
    micro_bs = micro_batch_size(cfg, world_size)
    steps_per_epoch = num_train_batches(len(examples), micro_bs, world_size) // cfg.optim.grad_acc
    if steps_per_epoch < 1:
        raise ExpectedError(f"{len(examples)} training instances make no full step of batch {cfg.optim.batch_size}: "
                            "lower optim.batch_size or use more tasks")
    total_steps = min(cfg.optim.total_steps, steps_per_epoch * cfg.data.epochs)

    # --- model, optimizer, engine, resume -------------------------------------------------------
    model, model_cfg = build_model(cfg.model, device, init=cfg.init, vocab=vocab)
    horizon = Horizon(total_steps=total_steps)
    optimizer, scheduler = build_optimizer_and_schedule(cfg, model, horizon)
    setup_complete(dist_info)  # every rank is set up, or every rank stops here and one prints the error
    engine, ckpt, resume_from, clip = start_engine(cfg, model, optimizer, scheduler, ds_config, run_dir, rank=rank,
                                                   world_size=world_size, device=device)
    step = 0
    selection = BestSelection(cfg.eval.best_metric, cfg.eval.best_mode, cfg.eval.patience)
    if resume_from is not None:
        resume = plan_resume(cfg, ckpt, resume_from, run_dir, rank=rank)  # refuses changes that cannot apply
        with resume.keeping_settings(optimizer, scheduler):
            step, rank_state = ckpt.load(engine, resume_from)
        restore_rng_state(rank_state.get("rng"), same_world=rank_state.get("world_size") == world_size)
        selection.load_state_dict(rank_state.get("selection"))
    if selection.best_step is not None:
        ckpt.protected = {step_dirname(selection.best_step)}
    start_step = step

    metrics = open_run_outputs(cfg, ds_config, model_cfg, run_dir, rank=rank)
    metrics.log("event", {"step": step, "event": "resume" if resume_from else "start", "init": cfg.init,
                          "train_instances": len(examples), "total_steps": total_steps,
                          "deterministic": torch.are_deterministic_algorithms_enabled()})
    logger.info("%s: %d steps per epoch, %d steps", task.description, steps_per_epoch, total_steps)

    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cfg.precision == "bf16" and device.type == "cuda"
                else contextlib.nullcontext())

    last_eval = {"step": -1}  # the newest periodic evaluation's record

    def run_eval(split: str) -> dict:
        with autocast:
            record = task.evaluate(engine.module, split, step, run_dir, rank=rank, world_size=world_size,
                                   device=device)
        engine.train()
        metrics.log("eval", record)
        return record

    def periodic_eval() -> None:
        """SNI: the test tasks. Text-to-text: the validation split, which best-checkpoint selection watches."""
        nonlocal last_eval
        last_eval = record = run_eval(task.validation_split or task.final_split)
        if selection.active and selection.observe(record[selection.metric], step, record):
            if save_checkpoint():
                ckpt.protected = {step_dirname(step)}
            logger.info("best %s so far: %.4f at step %d", selection.metric, selection.best, step)

    def batches_from(first_step: int):
        """(micro-batch) stream from optimizer step `first_step` on; epochs follow one another."""
        epoch, start = divmod(first_step, steps_per_epoch)
        while True:
            stream = train_batches(examples, micro_bs, cfg.seed, epoch, rank, world_size,
                                   start_batch=start * cfg.optim.grad_acc)
            for _ in range((steps_per_epoch - start) * cfg.optim.grad_acc):
                yield next(stream)
            epoch, start = epoch + 1, 0

    def save_checkpoint() -> bool:
        """A checkpoint of this step, unless its update was skipped or its loss or weights are not finite."""
        loss = all_reduce_sum([step_loss.item()], device)[0] / world_size
        refusal = checkpoint_refusal(optimizer.skip_counters(wait=True)[1], loss, weight_l2_norm(optimizer))
        if refusal:
            logger.warning("step %d is not written as a checkpoint: %s", step, refusal)
            return False
        state = {"rng": capture_rng_state(), "world_size": world_size}
        if selection.active:
            state["selection"] = selection.state_dict()
        ckpt.save(engine, step, state)
        return True

    # --- the loop -------------------------------------------------------------------------------
    exit_code = 0
    step_loss = torch.zeros((), device=device)  # the newest step's, read before a checkpoint
    stream = batches_from(step)
    window_loss = torch.zeros((), device=device)
    window_tokens = torch.zeros((), dtype=torch.int64, device=device)
    window_steps, window_start = 0, time.perf_counter()
    remaining = RemainingTime()
    first_step = step
    engine.train()
    while step < total_steps and not selection.finished:
        grad_l2 = None
        step_loss.zero_()
        for micro in range(cfg.optim.grad_acc):
            batch = {k: v.to(device, non_blocking=True) for k, v in next(stream).items()}
            out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"], return_logits=False)
            engine.backward(out.loss)
            last_micro = micro == cfg.optim.grad_acc - 1
            if clip is not None and last_micro:
                clip()  # ZeRO 0 with clipping: the loop clips, or the optimizer in its step (training/grad_clip.py)
            engine.step()
            if clip is not None and last_micro:
                grad_l2 = clip.last_norm()
            window_loss += out.loss.detach().float() / cfg.optim.grad_acc
            step_loss += out.loss.detach().float() / cfg.optim.grad_acc
            window_tokens += batch["attention_mask"].sum() + (batch["labels"] != -100).sum()
        step += 1
        window_steps += 1
        if step == first_step + 1:
            log_first_step(metrics, step, time.perf_counter() - window_start)  # no window logged yet
            remaining.start(step)
        if step % cfg.logging.every_steps == 0 or step == total_steps:
            loss, tokens = all_reduce_sum([window_loss.item(), float(window_tokens.item())], device)
            seconds = time.perf_counter() - window_start
            record = {"step": step, "loss": loss / (world_size * window_steps), "lr": scheduler.get_last_lr()[0],
                      "grad_l2": float(grad_l2) if grad_l2 is not None else engine.get_global_grad_norm(),
                      "seconds_per_step": seconds / window_steps,
                      "tokens_per_s": tokens / seconds, "epoch": step / steps_per_epoch,
                      "eta_s": remaining.seconds(step, total_steps)}
            metrics.log("train", record)
            logger.info(train_line(record, total_steps))
            window_loss.zero_()
            window_tokens.zero_()
            window_steps, window_start = 0, time.perf_counter()
        if stop.agreed():
            save_checkpoint()
            exit_code = EXIT_REQUEUE
            break
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < total_steps:
            periodic_eval()
            if selection.should_stop:
                logger.info("early stop at step %d: %d evaluations without a better %s than %.4f (step %d)", step,
                            selection.evals_without_improvement, selection.metric, selection.best, selection.best_step)
                break
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < total_steps:
            save_checkpoint()

    if exit_code == 0:
        finished_before = selection.finished  # a finished run restarted: its weights are the selected ones
        if task.validation_split and not finished_before and last_eval["step"] != step:
            periodic_eval()  # the last weights are a candidate too
        best = run_dir.checkpoints / step_dirname(selection.best_step or 0)
        if selection.active and not finished_before and selection.best_step not in (None, step) and best.is_dir():
            logger.info("the best %s (%.4f) is step %d's: its weights end the run", selection.metric,
                        selection.best, selection.best_step)
            ckpt.load(engine, best)
        selection.finished = True
        # without a test split, the result is the validation of the weights the run ends with
        record = run_eval(task.final_split) if task.final_split else selection.best_record or last_eval
        # a finished run restarted has nothing new to save
        if cfg.checkpoint.at_end and (step != start_step or resume_from is None):
            save_checkpoint()
        if rank == 0:
            print(task.summary(record, run_dir), flush=True)
    metrics.log("event", {"step": step, "event": "exit", "exit_code": exit_code})
    metrics.close()
    stop.restore()
    return exit_code


def main(argv: list[str] | None = None) -> int:
    return launch(finetune, argv, doc=__doc__, default_config=FINETUNE_CONFIG, root=FinetuneConfig)


def cli() -> int:
    """The console script: `main` with one-line errors (training/cli_errors.py)."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
