"""What a resumed run may change in its run config, and how a change takes effect.

A run resumes when it starts on a run directory that holds a checkpoint. Its config (the YAML with
the overrides of this start) is compared with the config the checkpoint was written under (recorded
in the checkpoint's meta.json; for checkpoints of an older version, the run directory's config.yaml).
Each key is in `RESUME_RULES`: either it may change, and the change applies from the resume step on
(one log line lists what changed, and config.yaml then records the values the run uses), or it may
not, because the checkpoint or the data cursor depends on it, and the run stops with one line naming
the keys and what to do.

How the changes apply: the run builds its model, optimizer, schedule and loop from the new config;
`ResumePlan.keeping_settings` then puts the new optimizer hyper-parameters and the new base
learning rate back after DeepSpeed has restored the saved ones (with the moments); `ResumePlan.horizon`
gives the schedule the new `optim.total_steps` in place of the saved horizon. docs/pretraining.md has
the table.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from training.config import ConfigError
from training.run_dir import RunDir

logger = logging.getLogger(__name__)

# key -> (may it change on resume, what a change does / why it cannot). Pre-training and fine-tuning keys
# together (tests/test_resume_policy.py checks that every field of both configs is here).
APPLIES, REFUSED = True, False
RESUME_RULES: dict[str, tuple[bool, str]] = {
    "output_dir": (APPLIES, "a moved or copied run directory"),
    "seed": (REFUSED, "it fixes the data order and the span-corruption noise that the data cursor continues"),
    "deterministic": (APPLIES, "from the resume step on"),
    "device": (APPLIES, "weights and optimizer state load onto any device"),
    "precision": (APPLIES, "weights and optimizer state are fp32 under both"),
    "ds_config": (APPLIES, "another ZeRO stage or GPU count needs a universal checkpoint (the load says so)"),
    "init": (REFUSED, "a resumed run continues from its checkpoint; other starting weights need a new output_dir"),
    "model.preset": (REFUSED, "the model's shape is the checkpoint's"),
    "model.init_from": (REFUSED, "a resumed run continues from its checkpoint; other starting weights need a new "
                                 "output_dir"),
    "model.vocab_size": (REFUSED, "the model's shape is the checkpoint's"),
    "model.dropout_rate": (APPLIES, "from the resume step on"),
    "model.attention_backend": (APPLIES, "the same weights, computed by other kernels"),
    "model.residual_dtype": (APPLIES, "the same weights, computed in another precision"),
    "model.ffn_kernel": (APPLIES, "the same weights, computed by other kernels"),
    "model.activation_checkpointing": (APPLIES, "the same computation, with less memory kept for the backward"),
    "model.attention_bias_layout": (APPLIES, "the same attention, with the bias read from its row or expanded"),
    "model.compile": (APPLIES, "how the same model is run"),
    "model.compile_mode": (APPLIES, "how the same model is run"),
    "model.compile_scope": (APPLIES, "how the same model is run"),
    "model.zero3_compile": (APPLIES, "how the same model is run"),
    "model.compile_cache": (APPLIES, "where compiled code is kept; a new place compiles again"),
    "task.kind": (REFUSED, "the examples whose order the step count indexes are the task's"),
    "task.name": (APPLIES, "a name in logs and tables"),
    "task.input": (REFUSED, "it changes the encoded examples whose order the step count indexes"),
    "task.target": (REFUSED, "it changes the encoded examples whose order the step count indexes"),
    "task.label_field": (REFUSED, "it changes the encoded examples whose order the step count indexes"),
    "task.label_words": (REFUSED, "it changes the encoded examples whose order the step count indexes"),
    "task.metrics": (APPLIES, "the evaluations from the resume step on"),
    "task.train_split": (REFUSED, "it selects the training examples whose order the step count indexes"),
    "task.validation_split": (APPLIES, "the evaluations from the resume step on"),
    "task.test_split": (APPLIES, "the final evaluation"),
    "data.dir": (APPLIES, "a moved copy of the same dataset (the loader refuses one of another size)"),
    "data.sources": (APPLIES, "moved copies of the same corpora (the loader refuses other sizes or weights)"),
    "data.tokenizer": (APPLIES, "a moved copy of the same tokenizer (its hash is checked against the data)"),
    "data.input_length": (REFUSED, "the objective and the row length of the shards the cursor counts in"),
    "data.noise_density": (REFUSED, "the objective the run trains"),
    "data.mean_noise_span_length": (REFUSED, "the objective the run trains"),
    "data.objective": (APPLIES, "from the resume step on: every objective reads the rows the cursor counts"),
    "data.denoisers": (APPLIES, "from the resume step on: every objective reads the rows the cursor counts"),
    "data.target_buckets": (APPLIES, "from the resume step on: the same samples per step, grouped otherwise"),
    "data.num_workers": (APPLIES, "loader processes only"),
    "data.epochs": (APPLIES, "the run's length; the schedule's horizon follows"),
    "data.max_instances_per_task": (REFUSED, "it selects the training examples whose order the step count indexes"),
    "data.max_source_length": (REFUSED, "it changes the encoded examples whose order the step count indexes"),
    "data.max_target_length": (REFUSED, "it changes the encoded examples whose order the step count indexes"),
    "data.num_pos_examples": (REFUSED, "it changes the encoded examples whose order the step count indexes"),
    "data.max_train_tasks": (REFUSED, "it selects the training examples whose order the step count indexes"),
    "optim.name": (REFUSED, "the optimizer state in the checkpoint is this optimizer's"),
    "optim.base_lr": (APPLIES, "the learning rate from the resume step on (the schedule keeps its shape)"),
    "optim.batch_size": (REFUSED, "the global batch is what the data cursor and the step count are counted in"),
    "optim.grad_acc": (APPLIES, "the global batch stays optim.batch_size; only its split into micro-batches changes"),
    "optim.total_steps": (APPLIES, "the run's length; the schedule's horizon re-fits to it"),
    "optim.warmup_steps": (APPLIES, "the schedule from the resume step on"),
    "optim.lr_scheduler": (APPLIES, "the schedule from the resume step on"),
    "optim.final_cosine": (APPLIES, "the schedule from the resume step on"),
    "optim.weight_decay": (APPLIES, "from the resume step on"),
    "optim.grad_clip": (APPLIES, "from the resume step on"),
    "optim.betas": (APPLIES, "from the resume step on (the moments are kept)"),
    "optim.eps": (APPLIES, "from the resume step on"),
    "optim.max_nonfinite_steps": (APPLIES, "from the resume step on"),
    "optim.compile": (APPLIES, "the same update, one kernel or foreach"),
    "budget.hours": (APPLIES, "the time already spent counts against it"),
}
_ALWAYS_APPLIES = ("eval.", "checkpoint.", "logging.")  # every key of these sections applies at once


class ResumeConfigError(ConfigError):
    """The run config changes a key that a resumed run cannot change; the message names the keys."""


def rule(key: str) -> tuple[bool, str]:
    """(whether `key` may change on resume, what a change does or why it cannot)."""
    if key in RESUME_RULES:
        return RESUME_RULES[key]
    if key.startswith(_ALWAYS_APPLIES):
        return APPLIES, "from the resume step on"
    return REFUSED, "this version does not know whether it can change on resume"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim.base_lr": 0.02, ...} of a nested run-config dict (tuples as lists)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (saved value, current value) of every key whose value differs (keys one side lacks, from
    another version of the config, are left out)."""
    old, new = flatten(saved), flatten(current)
    return {k: (old[k], new[k]) for k in new if k in old and old[k] != new[k]}


def saved_run_config(meta: dict[str, Any], run_dir: RunDir) -> dict[str, Any] | None:
    """The config a checkpoint was written under: its meta.json's, else the run directory's config.yaml
    (an older version's checkpoint), else None."""
    if isinstance(meta.get("run_config"), dict):
        return meta["run_config"]
    if run_dir.config_file.is_file():
        return run_dir.read_config()
    return None


class ResumePlan:
    """The config changes of one resume: checked on construction, applied by the run."""

    def __init__(self, current: dict[str, Any], saved: dict[str, Any] | None, *, checkpoint: Path, step: int) -> None:
        self.checkpoint, self.step = Path(checkpoint), step
        self.changes = {} if saved is None else config_changes(saved, current)
        self.compared = saved is not None
        refused = {k: v for k, v in self.changes.items() if not rule(k)[0]}
        if refused:
            listed = "; ".join(f"{k} ({a!r} -> {b!r}: {rule(k)[1]})" for k, (a, b) in refused.items())
            raise ResumeConfigError(
                f"cannot resume from {self.checkpoint} with a changed {listed}. Drop these overrides (the "
                f"saved values are in {self.checkpoint / 'meta.json'}) to continue the run, or use a new output_dir "
                "to start another one")
        total = self.changes.get("optim.total_steps", (None, None))[1]
        if total is not None and total < step:
            raise ResumeConfigError(
                f"optim.total_steps={total} is below the step of {self.checkpoint} ({step}): set it to {step} or more")

    def describe(self) -> str:
        """One line: what changed and how it takes effect ("" when nothing did)."""
        if not self.compared:
            return (f"{self.checkpoint} records no run config and the run directory has no config.yaml: the run "
                    "config of this start is not compared with the saved one")
        if not self.changes:
            return ""
        parts = [f"{k} {a!r} -> {b!r} ({rule(k)[1]})" for k, (a, b) in self.changes.items()]
        return f"resuming at step {self.step} with changed settings: " + "; ".join(parts)

    def log(self) -> None:
        line = self.describe()
        if line:
            (logger.warning if not self.compared else logger.info)(line)

    def horizon(self, saved_horizon: int, total_steps: int) -> int:
        """The schedule's horizon after the resume: the saved one (a time budget may have fitted it),
        or the new optim.total_steps when that changed."""
        return total_steps if "optim.total_steps" in self.changes else saved_horizon

    @contextlib.contextmanager
    def keeping_settings(self, optimizer: Any, scheduler: Any) -> Iterator[None]:
        """Around the checkpoint's load: afterwards the optimizer's hyper-parameters (betas, eps, weight
        decay, ...) and the schedule's base learning rates are the new config's again, with the saved
        moments and step count, and the current learning rate follows from them."""
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in optimizer.param_groups]
        base_lrs = list(scheduler.base_lrs)
        yield
        for group, settings in zip(optimizer.param_groups, groups):
            group.update(settings)
        scheduler.base_lrs = base_lrs
        lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr


def plan_resume(cfg: Any, ckpt: Any, checkpoint: Path, run_dir: Any, *, rank: int) -> ResumePlan:
    """The ResumePlan of a run (`cfg`, a RunConfig or FinetuneConfig) resuming from `checkpoint` of its
    CheckpointManager `ckpt`; rank 0 logs what changed. ResumeConfigError when a change cannot apply."""
    meta = ckpt.read_meta(checkpoint)
    plan = ResumePlan(cfg.to_dict(), saved_run_config(meta, RunDir(run_dir)), checkpoint=checkpoint,
                      step=int(meta["step"]))
    if rank == 0:
        plan.log()
    return plan
