"""Generation-based SNI evaluation: greedy decoding over the test instances, split across ranks,
gathered without duplicates or losses, scored with the official metric, written to disk.

    eval_set = build_eval_set("/work/shared/data/sni", tokenizer)          # once
    metrics = evaluate_sni(model, eval_set, tokenizer, out_dir=run_dir.sni_eval_dir(step),
                           batch_size=32, rank=rank, world_size=world_size)  # every rank calls it

Every rank generates for its share (instances sorted by prompt length, rank r takes every
world_size-th, batches of similar length), predictions are gathered with
`torch.distributed.all_gather_object`, rank 0 scores them and writes `predictions.jsonl` and
`metrics.json`, and every rank returns the same metrics dict.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from training.distributed import all_reduce_sum
from training.metrics import progress
from training.sni.encoding import EOS_ID, EncodedExample, SNITokenizer, TemplateConfig, collate, encode_tasks
from training.sni.rouge import Reference, sni_metrics
from training.sni.tasks import load_references, load_sni

logger = logging.getLogger(__name__)


@dataclass
class EvalSet:
    """Encoded test instances and the references to score them against."""

    examples: list[EncodedExample]  # the instances to generate for
    expected: list[Reference]  # references of those instances, plus (when evaluating every
    # instance of the requested tasks) official references the data lacks, reported as missing
    references: dict[str, Reference]  # by id, for the instances in `examples`


def build_eval_set(
    data_path: str | os.PathLike,
    tokenizer: SNITokenizer,
    tasks: Sequence[str] | None = None,
    max_instances_per_task: int | None = None,
    seed: int = 0,
    template: TemplateConfig | None = None,
) -> EvalSet:
    """Test instances of the default split (all, or a seeded subset per task) with their references.

    References are the instance outputs (identical to the official ones for every instance present);
    categories come from the official test_references file next to the data when there is one, else
    from the task's first category. With max_instances_per_task=None, official reference ids of the
    requested tasks that the data lacks (16 partial tasks in the compact copy) are added to
    `expected` so that the metrics list them as missing.
    """
    loaded = load_sni(
        data_path, "test", tasks=tasks, max_instances_per_task=max_instances_per_task, seed=seed
    )
    official = load_references(data_path)
    examples = encode_tasks(loaded, tokenizer, template)
    references: dict[str, Reference] = {}
    for task in loaded:
        for inst in task.instances:
            ref = official.get(inst.id) if official else None
            category = ref.category if ref is not None else task.category
            track = ref.track if ref is not None else "default"
            references[inst.id] = Reference(inst.id, task.name, category, tuple(inst.outputs), track)
    expected = list(references.values())
    if official is not None and max_instances_per_task is None:
        wanted = {t.name for t in loaded}
        expected += [
            Reference(r.id, r.task, r.category, r.references, r.track)
            for r in official.values()
            if r.task in wanted and r.id not in references
        ]
    return EvalSet(examples, expected, references)


def rank_batches(
    examples: Sequence[EncodedExample], batch_size: int, rank: int = 0, world_size: int = 1
) -> list[list[int]]:
    """This rank's generation batches: examples sorted by length (longest first, ties by id), rank r
    takes every world_size-th, cut into batches. Ranks are disjoint and together cover every example;
    their batch counts differ by at most one."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    order = sorted(range(len(examples)), key=lambda i: (-examples[i].length, examples[i].id))
    mine = order[rank::world_size]
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def decode_generated(row: Sequence[int], tokenizer: SNITokenizer) -> str:
    """Text of one generated row (decoder start first): up to the first EOS, pad/sentinels dropped."""
    ids = [int(t) for t in row[1:]]
    if EOS_ID in ids:
        ids = ids[: ids.index(EOS_ID)]
    return tokenizer.decode(ids).strip()


def generated_length(row: Sequence[int]) -> int:
    """Tokens one generated row (decoder start first) holds up to its first EOS, EOS included."""
    ids = [int(t) for t in row[1:]]
    return ids.index(EOS_ID) + 1 if EOS_ID in ids else len(ids)


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


def beam_settings(num_beams: int, length_penalty: float) -> dict:
    """The beam-search arguments of `generate`: none for greedy decoding (num_beams 1), so that a
    model whose generate lacks them still evaluates greedily."""
    return {"num_beams": num_beams, "length_penalty": length_penalty} if num_beams > 1 else {}


@torch.no_grad()
def generate_predictions(
    model,
    examples: Sequence[EncodedExample],
    tokenizer: SNITokenizer,
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    max_new_tokens: int = 128,
    device: torch.device | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    counts: dict[str, int] | None = None,
) -> dict[str, str]:
    """Predictions (id -> text) for this rank's share of `examples`: greedy, or beam search with
    `num_beams` > 1. `counts`, when given, gets "generated_tokens" (up to each row's EOS) added.

    `model.generate(input_ids, attention_mask=..., max_new_tokens=...)` must return a LongTensor
    whose rows start with the decoder start token (our T5 and HF's do); with num_beams > 1 it is also
    given `num_beams=` and `length_penalty=` (both models take them)."""
    beam_args = beam_settings(num_beams, length_penalty)
    device = device or _model_device(model)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    predictions: dict[str, str] = {}
    batches = rank_batches(examples, batch_size, rank, world_size)
    try:
        for indices in progress(batches, total=len(batches), desc="SNI generation (batches)", rank=rank):
            batch_examples = [examples[i] for i in indices]
            batch = collate(batch_examples, with_labels=False)
            out = model.generate(
                batch["input_ids"].to(device),
                attention_mask=batch["attention_mask"].to(device),
                max_new_tokens=max_new_tokens,
                **beam_args,
            )
            for example, row in zip(batch_examples, out.tolist()):
                predictions[example.id] = decode_generated(row, tokenizer)
                if counts is not None:
                    counts["generated_tokens"] = counts.get("generated_tokens", 0) + generated_length(row)
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return predictions


def gather_predictions(local: dict[str, str], world_size: int = 1, group=None) -> dict[str, str]:
    """Union of every rank's predictions (on every rank); an id predicted twice raises."""
    if world_size == 1:
        return dict(local)
    if not dist.is_initialized():
        raise RuntimeError(f"world_size={world_size} but torch.distributed is not initialised")
    parts: list = [None] * world_size
    dist.all_gather_object(parts, sorted(local.items()), group=group)
    merged: dict[str, str] = {}
    for part in parts:
        for id_, text in part:
            if id_ in merged:
                raise RuntimeError(f"instance {id_} was predicted by two ranks: the rank split is broken")
            merged[id_] = text
    return merged


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_eval_files(out_dir: str | os.PathLike, rows: Sequence[dict], metrics: dict) -> None:
    """predictions.jsonl (one row a line) and metrics.json of an evaluation, each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(out / "predictions.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    _write_atomic(out / "metrics.json", json.dumps(metrics, indent=2, ensure_ascii=False) + "\n")


def write_outputs(
    out_dir: str | os.PathLike, eval_set: EvalSet, predictions: dict[str, str], metrics: dict
) -> None:
    """predictions.jsonl ({"id", "task", "prediction", "references"}, in eval-set order) and metrics.json."""
    rows = [{"id": ex.id, "task": ex.task, "prediction": predictions[ex.id],
             "references": list(eval_set.references[ex.id].references)} for ex in eval_set.examples]
    write_eval_files(out_dir, rows, metrics)


def evaluate_sni(
    model,
    eval_set: EvalSet,
    tokenizer: SNITokenizer,
    out_dir: str | os.PathLike | None = None,
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    max_new_tokens: int = 128,
    device: torch.device | None = None,
    group=None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
) -> dict:
    """Generate, gather, score; rank 0 writes out_dir (if given). Every rank must call it and gets
    the same metrics dict (see `rouge.sni_metrics`) plus "eval_seconds", "generated_tokens" (all
    ranks', each row up to its EOS) and "decoding" (the
    generation settings, so that greedy and beam-search results on disk say which they are)."""
    start = time.time()
    counts: dict[str, int] = {}
    local = generate_predictions(
        model,
        eval_set.examples,
        tokenizer,
        batch_size,
        rank,
        world_size,
        max_new_tokens,
        device,
        num_beams=num_beams,
        length_penalty=length_penalty,
        counts=counts,
    )
    predictions = gather_predictions(local, world_size, group)
    generated = all_reduce_sum([float(counts.get("generated_tokens", 0))], device or _model_device(model))[0]
    lost = [ex.id for ex in eval_set.examples if ex.id not in predictions]
    if lost:
        raise RuntimeError(f"{len(lost)} instances got no prediction after gathering, e.g. {lost[:3]}")
    metrics = None
    if rank == 0:
        # official references whose instance the data lacks: missing by construction, not lost
        absent = [r.id for r in eval_set.expected if r.id not in eval_set.references]
        metrics = sni_metrics(predictions, eval_set.expected, absent_from_data=absent)
        metrics["eval_seconds"] = round(time.time() - start, 2)
        metrics["generated_tokens"] = int(generated)
        metrics["decoding"] = {"max_new_tokens": max_new_tokens, "num_beams": num_beams,
                               **beam_settings(num_beams, length_penalty)}  # fmt: skip
        if out_dir is not None:
            write_outputs(out_dir, eval_set, predictions, metrics)
        logger.info(
            "SNI eval: rougeL %.2f exact_match %.2f over %d instances of %d tasks in %.0f s%s",
            metrics["rougeL"],
            metrics["exact_match"],
            metrics["n_instances"],
            metrics["n_tasks"],
            metrics["eval_seconds"],
            f" ({metrics['n_absent_from_data']} official references have no instance in the data)"
            if metrics["n_absent_from_data"] else "",
        )
    if world_size > 1:
        box = [metrics]
        dist.broadcast_object_list(box, src=0, group=group)
        metrics = box[0]
    return metrics
