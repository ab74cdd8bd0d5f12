"""Held-out loss and token accuracy of the span-corruption objective on the validation shards (of
one corpus, or of each corpus of a mixture)."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate_span_corruption(engine, batches: list[dict], device: torch.device) -> dict:
    """Token-weighted mean loss and accuracy over this rank's `batches`, summed over all ranks.

    `batches` comes from `training.data.validation_batches`, which gives every rank the same number
    of batches (ZeRO-3 gathers parameters collectively: a rank with fewer forward passes would hang
    the others), padding the last ones with rows whose labels are all -100.
    """
    was_training = engine.training
    engine.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss*tokens, correct, tokens
    for batch in batches:
        labels = batch["labels"].to(device, non_blocking=True)
        out = engine(input_ids=batch["input_ids"].to(device, non_blocking=True), labels=labels,
                     return_logits=True)
        mask = labels != -100
        tokens = mask.sum()
        correct = ((out.logits.argmax(dim=-1) == labels) & mask).sum()
        # A batch of padding only (validation split shorter than ranks x batch) has a NaN mean loss.
        loss_sum = torch.where(tokens > 0, out.loss.double() * tokens, torch.zeros((), dtype=torch.float64,
                                                                                  device=device))
        sums += torch.stack([loss_sum, correct.double(), tokens.double()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    engine.train(was_training)
    loss_sum, correct, tokens = sums.tolist()
    if tokens == 0:
        raise RuntimeError("validation produced no target tokens: check the validation shards")
    return {"eval_loss": loss_sum / tokens, "eval_accuracy": correct / tokens, "eval_tokens": int(tokens)}


def evaluate_mixture(engine, batches_by_source: dict[str, list[dict]], shares: dict[str, float],
                     device: torch.device) -> dict:
    """`evaluate_span_corruption` on each corpus of a mixture that has a validation split, as
    eval_loss/<name>, eval_accuracy/<name> and eval_tokens/<name>; eval_loss and eval_accuracy are
    their means weighted by the corpora's shares of the training samples (renormalised over the corpora
    evaluated): the held-out loss of data drawn as the training data is, whatever the split sizes."""
    result: dict = {}
    for name, batches in batches_by_source.items():
        one = evaluate_span_corruption(engine, batches, device)
        result.update({f"{key}/{name}": value for key, value in one.items()})
    total = sum(shares[name] for name in batches_by_source)
    for key in ("eval_loss", "eval_accuracy"):
        result[key] = sum(shares[name] * result[f"{key}/{name}"] for name in batches_by_source) / total
    result["eval_tokens"] = sum(result[f"eval_tokens/{name}"] for name in batches_by_source)
    return result
