"""The tasks training/finetune.py fine-tunes on (`task.kind`): their training examples and their
evaluations, behind one interface so that the loop is the same for both.

* `SNIFinetuneTask`: Super-Natural-Instructions with the Tk-Instruct encoding; every evaluation is
  Rouge-L on the test tasks (there is no validation split), under `<run>/sni_eval/`.
* `Text2TextFinetuneTask`: a dataset of data.dir read by training/text2text/data.py; the
  validation split is evaluated every eval.every_steps and at the end (best-checkpoint selection
  watches it), the test split once at the end, under `<run>/eval/<split>/`.

`evaluate` returns the record the loop logs as "eval" (its step, metrics, counts and timing).
"""

from __future__ import annotations

import logging

from training.finetune_config import FinetuneConfig
from training.run_dir import RunDir
from training.sni.encoding import SNITokenizer, TemplateConfig, encode_tasks
from training.sni.evaluate import build_eval_set, evaluate_sni
from training.sni.tasks import load_sni
from training.text2text.data import TextFormat, load_split
from training.text2text.evaluate import evaluate_text2text, generation_length

logger = logging.getLogger("t5ds.finetune")


class SNIFinetuneTask:
    validation_split = None
    final_split = "test"

    def __init__(self, cfg: FinetuneConfig, tokenizer: SNITokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.template = TemplateConfig(num_pos_examples=cfg.data.num_pos_examples,
                                       max_source_length=cfg.data.max_source_length,
                                       max_target_length=cfg.data.max_target_length)
        tasks = load_sni(cfg.data.dir, "train", max_instances_per_task=cfg.data.max_instances_per_task, seed=cfg.seed)
        tasks = tasks[: cfg.data.max_train_tasks] if cfg.data.max_train_tasks else tasks
        self.examples = encode_tasks(tasks, tokenizer, self.template)
        self.description = f"{len(self.examples)} training instances of {len(tasks)} tasks"
        test_tasks = None
        if cfg.eval.max_tasks:
            test_tasks = [t.name for t in load_sni(cfg.data.dir, "test", max_instances_per_task=1)][: cfg.eval.max_tasks]
        self.eval_set = build_eval_set(cfg.data.dir, tokenizer, tasks=test_tasks, seed=cfg.seed,
                                       template=self.template, max_instances_per_task=cfg.eval.max_instances_per_task)

    def evaluate(self, model, split: str, step: int, run_dir: RunDir, *, rank: int, world_size: int, device) -> dict:
        e = self.cfg.eval
        result = evaluate_sni(model, self.eval_set, self.tokenizer, out_dir=run_dir.sni_eval_dir(step),
                              batch_size=e.batch_size, rank=rank, world_size=world_size,
                              max_new_tokens=e.max_new_tokens, device=device,
                              num_beams=e.num_beams, length_penalty=e.length_penalty)
        record = {"step": step, "rougeL": result["rougeL"], "exact_match": result["exact_match"],
                  "n_instances": result["n_instances"], "eval_seconds": result.get("eval_seconds"),
                  "generated_tokens": result.get("generated_tokens")}
        record.update({f"rougeL/{cat}": v["rougeL"] for cat, v in result["per_category"].items()})
        logger.info("[eval] Step %d | Rouge-L --> %.2f | Exact match --> %.2f | Instances --> %d", step,
                    result["rougeL"], result["exact_match"], result["n_instances"])
        return record

    def summary(self, record: dict, run_dir: RunDir) -> str:
        step = record["step"]
        return (f"SNI test Rouge-L {record['rougeL']:.2f} (exact match {record['exact_match']:.2f}, "
                f"{record['n_instances']} instances) after {step} steps; predictions and metrics in "
                f"{run_dir.sni_eval_dir(step)}")


class Text2TextFinetuneTask:
    def __init__(self, cfg: FinetuneConfig, tokenizer: SNITokenizer) -> None:
        self.cfg, self.tokenizer, t = cfg, tokenizer, cfg.task
        self.name = t.name or "text2text"
        fmt = TextFormat(t.input, t.target, t.label_field, t.label_words, cfg.data.max_source_length,
                         cfg.data.max_target_length)
        self.examples = load_split(cfg.data.dir, t.train_split, fmt, tokenizer, self.name).examples
        self.splits = {s: load_split(cfg.data.dir, s, fmt, tokenizer, self.name)
                       for s in (t.validation_split, t.test_split) if s}
        self.validation_split, self.final_split = t.validation_split, t.test_split
        self.description = f"{len(self.examples)} {t.train_split} examples of {self.name}"

    def evaluate(self, model, split: str, step: int, run_dir: RunDir, *, rank: int, world_size: int, device) -> dict:
        e, data = self.cfg.eval, self.splits[split]
        max_new = e.max_new_tokens or generation_length(data, self.cfg.data.max_target_length)
        result = evaluate_text2text(model, data, self.tokenizer, self.cfg.task.metrics,
                                    out_dir=run_dir.eval_dir(split, step), batch_size=e.batch_size, rank=rank,
                                    world_size=world_size, max_new_tokens=max_new, device=device,
                                    num_beams=e.num_beams, length_penalty=e.length_penalty,
                                    labels=self.cfg.task.label_words)
        record = {"step": step, **{k: v for k, v in result.items() if k != "decoding"}}
        logger.info("[eval] Step %d | %s %s | %d examples", step, split,
                    " | ".join(f"{m} --> {result[m]:.2f}" for m in self.cfg.task.metrics), result["n_examples"])
        return record

    def summary(self, record: dict, run_dir: RunDir) -> str:
        scores = ", ".join(f"{m} {record[m]:.2f}" for m in self.cfg.task.metrics)
        return (f"{self.name} {record['split']}: {scores} ({record['n_examples']} examples) after {record['step']} "
                f"steps; predictions and metrics in {run_dir.eval_dir(record['split'], record['step'])}")


def load_task(cfg: FinetuneConfig, tokenizer: SNITokenizer) -> SNIFinetuneTask | Text2TextFinetuneTask:
    """The task of cfg.task.kind, its data read and encoded (ValueError / FileNotFoundError on bad data)."""
    return SNIFinetuneTask(cfg, tokenizer) if cfg.task.kind == "sni" else Text2TextFinetuneTask(cfg, tokenizer)
