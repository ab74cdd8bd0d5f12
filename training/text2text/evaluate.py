"""Generation-based evaluation of a text-to-text split, as the SNI path evaluates: examples sorted by
input length, rank r generates for every world_size-th (training/sni/evaluate.py's `rank_batches`,
greedy or beam search), the predictions are gathered (each example exactly once), rank 0 scores
them with the named metrics and writes `predictions.jsonl` (id, input, prediction, references,
per-example scores) and `metrics.json`; every rank returns the same metrics dict.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from training.distributed import all_reduce_sum
from training.sni.encoding import SNITokenizer
from training.sni.evaluate import beam_settings, gather_predictions, generate_predictions, write_eval_files
from training.text2text.data import Text2TextSplit
from training.text2text.metrics import score_examples

logger = logging.getLogger(__name__)

# Generation may run this many tokens past the split's longest reference: room to see a model
# that over-generates, while a classification task's decoding stays a few steps long.
NEW_TOKENS_MARGIN = 8


def generation_length(split: Text2TextSplit, max_target_length: int) -> int:
    """max_new_tokens that follows the targets: the split's longest reference (EOS included) plus a
    margin, at most max_target_length."""
    return min(split.max_target_tokens + NEW_TOKENS_MARGIN, max_target_length)


def write_outputs(out_dir: str | os.PathLike, split: Text2TextSplit, predictions: dict[str, str],
                  scores: dict[str, dict[str, float]], metrics: dict) -> None:
    rows = [{"id": ex.id, "input": split.inputs[ex.id], "prediction": predictions[ex.id],
             "references": list(split.references[ex.id]), "scores": scores[ex.id]} for ex in split.examples]
    write_eval_files(out_dir, rows, metrics)


def evaluate_text2text(
    model,
    split: Text2TextSplit,
    tokenizer: SNITokenizer,
    metric_names: Sequence[str],
    out_dir: str | os.PathLike | None = None,
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    max_new_tokens: int = 128,
    device: torch.device | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    labels: Sequence[str] = (),
    gather: Callable[[dict[str, str], int], dict[str, str]] = gather_predictions,
) -> dict:
    """Generate this rank's share, gather, score; rank 0 writes out_dir (if given). Every rank calls
    it. `gather(local, world_size)` merges the ranks' predictions (torch.distributed by default)."""
    start = time.time()
    counts: dict[str, int] = {}
    local = generate_predictions(model, split.examples, tokenizer, batch_size, rank, world_size, max_new_tokens,
                                 device, num_beams=num_beams, length_penalty=length_penalty, counts=counts)
    predictions = gather(local, world_size)
    lost = [ex.id for ex in split.examples if ex.id not in predictions]
    if lost:
        raise RuntimeError(f"{len(lost)} examples got no prediction after gathering, e.g. {lost[:3]}")
    generated = all_reduce_sum([float(counts.get("generated_tokens", 0))], device or torch.device("cpu"))[0]
    seconds = time.time() - start
    metrics = None
    if rank == 0:
        corpus, scores = score_examples(predictions, split.references, metric_names, labels)
        metrics = {**corpus, "split": split.name, "n_examples": len(split.examples),
                   "eval_seconds": round(seconds, 2), "examples_per_s": round(len(split.examples) / seconds, 2),
                   "generated_tokens": int(generated), "generated_tokens_per_s": round(generated / seconds, 1),
                   "decoding": {"max_new_tokens": max_new_tokens, "num_beams": num_beams,
                                **beam_settings(num_beams, length_penalty)}}
        if out_dir is not None:
            write_outputs(out_dir, split, predictions, scores, metrics)
        logger.info("%s eval: %s over %d examples in %.1f s", split.name,
                    " ".join(f"{k} {v:.2f}" for k, v in corpus.items()), len(split.examples), seconds)
    if world_size > 1 and dist.is_initialized():
        box = [metrics]
        dist.broadcast_object_list(box, src=0)
        metrics = box[0]
    return metrics
