"""Run config of SNI fine-tuning (`training/finetune.py`): the pre-training sections where they mean
the same thing (model, optim, checkpoint, logging), plus the SNI data and evaluation sections.

Loaded with the same YAML + `key=value` machinery as pre-training (training/config_loader.py):
`load_run_config(path, overrides, root=FinetuneConfig)`. Defaults are nanoT5's fine-tuning
(AdamW, lr 5e-5, batch 8, 2 epochs, constant schedule, no clipping, Tk-Instruct encoding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from training.config import (
    DEVICES,
    PRECISIONS,
    CheckpointConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    _check,
    _check_choice,
    _to_plain,
)


@dataclass
class SNIDataConfig:
    dir: str = "data/sni"
    """SNI data: the compact form (train/test .jsonl.gz) or a natural-instructions checkout root."""
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
    """Target tokens, EOS included (Tk-Instruct: 128)."""
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
    max_new_tokens: int = 128
    """Decoding length limit in tokens (Tk-Instruct: 128)."""
    num_beams: int = 1
    """1 = greedy decoding (Tk-Instruct's protocol); k > 1 = beam search with k beams, as transformers'
    `generate(num_beams=k)` decodes (k times the generation batch's decoder work and cache)."""
    length_penalty: float = 1.0
    """Beam search only: a finished beam scores its summed log-probability / length ** length_penalty
    (transformers' default 1.0; > 1 favours longer outputs, 0 ranks by summed log-probability)."""

    def __post_init__(self) -> None:
        _check(self.every_steps >= 0, f"eval.every_steps={self.every_steps} must be >= 0 (0 = only at the end)")
        _check(self.batch_size >= 1 and self.max_new_tokens >= 1, "eval.batch_size and max_new_tokens must be >= 1")
        _check(self.num_beams >= 1, f"eval.num_beams={self.num_beams} must be >= 1 (1 = greedy decoding)")


def _nanot5_finetune_optim() -> OptimConfig:
    return OptimConfig(name="adamw", base_lr=5e-5, batch_size=8, grad_acc=1, total_steps=1_000_000_000,
                       warmup_steps=0, lr_scheduler="constant", grad_clip=0.0, eps=1e-8)


@dataclass
class FinetuneConfig:
    output_dir: str = "runs/sni"
    """The run directory (checkpoints, metrics.jsonl, sni_eval/)."""
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

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))
