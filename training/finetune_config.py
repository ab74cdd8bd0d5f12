"""Run config of fine-tuning (`training/finetune.py`): the pre-training sections where they mean
the same thing (model, optim, checkpoint, logging), plus the task, data and evaluation sections.
`task.kind` picks SNI (the Tk-Instruct protocol) or a generic text-to-text dataset.

Loaded with the same YAML + `key=value` machinery as pre-training (training/config_loader.py):
`load_run_config(path, overrides, root=FinetuneConfig)`. Defaults are nanoT5's fine-tuning
(AdamW, lr 5e-5, batch 8, 2 epochs, constant schedule, no clipping, Tk-Instruct encoding).
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass, field
from typing import Any

from training.config import (
    DEVICES,
    PRECISIONS,
    CheckpointConfig,
    ConfigError,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    _check,
    _check_choice,
    _to_plain,
)
from training.text2text.metrics import check_metric_names

TASK_KINDS = ("sni", "text2text")
BEST_MODES = ("max", "min")


@dataclass
class TaskConfig:
    kind: str = "sni"
    """sni (Super-Natural-Instructions, Tk-Instruct encoding, Rouge-L) | text2text (any dataset of
    data.dir: the fields below say how a row becomes input and target; docs/finetuning.md)."""
    name: str = ""
    """text2text: the task's name in logs and tables (e.g. rte)."""
    input: str = ""
    """text2text: the input template over a row's fields, e.g. "rte sentence1: {sentence1} sentence2: {sentence2}"."""
    target: str = "{label}"
    """text2text: the target template; one field holding a list of strings gives several references."""
    label_field: str = "label"
    """text2text: the field that label_words maps."""
    label_words: tuple[str, ...] = ()
    """text2text: integer label i -> label_words[i] (e.g. [entailment, not_entailment]); empty = as is."""
    metrics: tuple[str, ...] = ()
    """text2text: exact_match | f1 | accuracy | rouge1 | rouge2 | rougeL | bleu | mcc | class_f1
    (training/text2text/metrics.py; mcc and class_f1 score the generated labels of task.label_words)."""
    train_split: str = "train"
    validation_split: str | None = "validation"
    """text2text: evaluated every eval.every_steps and at the end (best-checkpoint selection); null = none."""
    test_split: str | None = "test"
    """text2text: evaluated once at the end (with the selected weights); null = none."""

    def __post_init__(self) -> None:
        _check_choice("task.kind", self.kind, TASK_KINDS)
        if self.kind != "text2text":
            return
        _check(bool(self.input.strip()), 'task.input must be a template over the row fields, e.g. "{sentence}"')
        _check(bool(self.target.strip()), 'task.target must be a template over the row fields, e.g. "{label}"')
        for key, template in (("task.input", self.input), ("task.target", self.target)):
            try:
                list(string.Formatter().parse(template))
            except ValueError as exc:
                raise ConfigError(f"{key}={template!r} is not a format template ({exc}): write fields as "
                                  "{name}, literal braces as {{ and }}") from None
        try:
            check_metric_names(self.metrics, self.label_words)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check(bool(self.validation_split or self.test_split),
               "task.validation_split and task.test_split are both null: name at least one split to evaluate")


@dataclass
class SNIDataConfig:
    dir: str = "data/sni"
    """SNI data: the compact form (train/test .jsonl.gz) or a natural-instructions checkout root;
    text2text: the task directory (per-split jsonl / json / csv / parquet files, or save_to_disk)."""
    tokenizer: str | None = None
    """SentencePiece model (or tokenizer directory holding spiece.model) of the pre-trained model; null:
    the init run's data.tokenizer, T5's (assets/t5/spiece.model) for any other init."""
    epochs: int = 2
    """Passes over the training instances; with optim.total_steps the smaller of the two ends the run."""
    max_instances_per_task: int = 100
    """Training instances per task (Tk-Instruct / nanoT5: 100)."""
    max_source_length: int = 1024
    """Encoder input tokens, EOS included (Tk-Instruct: 1024)."""
    max_target_length: int = 128
    """Target tokens, EOS included (Tk-Instruct: 128). Longer inputs and targets are truncated (counted
    in a warning line for text2text)."""
    num_pos_examples: int = 2
    """Positive demonstrations in each prompt (Tk-Instruct default encoding: 2)."""
    max_train_tasks: int | None = None
    """Use only the first N training tasks (quick experiments, tests); None = all."""

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, f"data.epochs={self.epochs} must be >= 1")
        _check(self.max_instances_per_task >= 1, "data.max_instances_per_task must be >= 1 (nanoT5: 100)")
        _check(self.max_source_length >= 2 and self.max_target_length >= 2,
               "data.max_source_length / max_target_length must be >= 2 (Tk-Instruct: 1024 / 128)")
        _check(self.max_train_tasks is None or self.max_train_tasks >= 1,
               "data.max_train_tasks must be >= 1, or null for all tasks")


@dataclass
class SNIEvalConfig:
    every_steps: int = 0
    """Evaluate Rouge-L on the test tasks every N optimizer steps; 0 = only at the end."""
    max_instances_per_task: int | None = None
    """Test instances per task; None = all (the official protocol)."""
    max_tasks: int | None = None
    """Only the first N test tasks (quick checks); None = all 119."""
    batch_size: int = 128
    """Generation batch per rank (sequences); larger is faster on a GPU, up to its memory."""
    max_new_tokens: int | None = 128
    """Decoding length limit in tokens (Tk-Instruct: 128); text2text: null follows the targets (the
    evaluated split's longest reference + 8, at most data.max_target_length)."""
    num_beams: int = 1
    """1 = greedy decoding (Tk-Instruct's protocol); k > 1 = beam search with k beams, as transformers'
    `generate(num_beams=k)` decodes (k times the generation batch's decoder work and cache)."""
    length_penalty: float = 1.0
    """Beam search only: a finished beam scores its summed log-probability / length ** length_penalty
    (transformers' default 1.0; > 1 favours longer outputs, 0 ranks by summed log-probability)."""

    best_metric: str | None = None
    """text2text: keep the weights of the best validation evaluation on this metric (one of
    task.metrics); the final checkpoint and the test evaluation use them. null = the last weights."""
    best_mode: str = "max"
    """max | min: whether a higher or a lower best_metric is better."""
    patience: int = 0
    """Stop after this many validation evaluations without improvement of best_metric; 0 = never early."""

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, f"eval.every_steps={self.every_steps} must be >= 0 (0 = only at the end)")
        _check(self.batch_size >= 1 and (self.max_new_tokens is None or self.max_new_tokens >= 1),
               "eval.batch_size and max_new_tokens must be >= 1")
        _check_choice("eval.best_mode", self.best_mode, BEST_MODES)
        _check(self.patience >= 0, f"eval.patience={self.patience} must be >= 0 (0 = no early stopping)")
        _check(self.patience == 0 or self.best_metric is not None,
               "eval.patience needs eval.best_metric (the validation metric to watch)")
        _check(self.num_beams >= 1, f"eval.num_beams={self.num_beams} must be >= 1 (1 = greedy decoding)")


def _nanot5_finetune_optim() -> OptimConfig:
    return OptimConfig(name="adamw", base_lr=5e-5, batch_size=8, grad_acc=1, total_steps=1_000_000_000,
                       warmup_steps=0, lr_scheduler="constant", grad_clip=0.0, eps=1e-8)


@dataclass
class FinetuneConfig:
    output_dir: str = "runs/sni"
    """The run directory (checkpoints, metrics.jsonl, sni_eval/ or eval/)."""
    seed: int = 2137
    """Seeds initialisation, task shuffles, label choice and batch order."""
    deterministic: bool = False
    """Bit-identical GPU runs from the same seed (training/determinism.py; slower steps, as in
    pre-training)."""
    device: str = "auto"
    """auto | cuda | cpu."""
    precision: str = "bf16"
    """bf16 (autocast compute, fp32 weights) | fp32."""
    ds_config: str = "ds_configs/zero0.json"
    """DeepSpeed config (ZeRO 0-2; evaluation generates on each rank's full model, so not ZeRO 3)."""
    init: str = "random"
    """Start from: `random` (model.preset), one of our pre-training run directories (its newest
    complete checkpoint), a Hugging Face T5 directory, or a nanoT5 state dict (with model.preset)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=lambda: ModelConfig(dropout_rate=0.0, compile=False))
    data: SNIDataConfig = field(default_factory=SNIDataConfig)
    optim: OptimConfig = field(default_factory=_nanot5_finetune_optim)
    eval: SNIEvalConfig = field(default_factory=SNIEvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_steps=0, keep_last=1))
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check(bool(self.output_dir), "output_dir must name the run directory, e.g. runs/sni")
        _check_choice("device", self.device, DEVICES)
        _check_choice("precision", self.precision, PRECISIONS)
        _check(bool(self.init), "init must be `random` or a path (run directory, HF directory, state dict)")
        _check("zero3" not in self.ds_config,
               "fine-tuning evaluates by generating on each rank's whole model: use ds_configs/zero0.json, "
               "zero1.json or zero2.json (T5 v1.1 base fine-tunes comfortably on one GPU)")
        if self.task.kind == "sni":
            _check(self.eval.best_metric is None, "eval.best_metric needs a validation split: SNI has none "
                   "(task.kind=text2text selects on task.validation_split)")
            _check(self.eval.max_new_tokens is not None, "eval.max_new_tokens must be a number for SNI (Tk-Instruct: 128)")
            return
        _check(self.eval.best_metric is None or self.eval.best_metric in self.task.metrics,
               f"eval.best_metric={self.eval.best_metric!r} must be one of task.metrics {list(self.task.metrics)}")
        _check(self.eval.best_metric is None or self.task.validation_split is not None,
               "eval.best_metric selects on the validation split: set task.validation_split")

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))
