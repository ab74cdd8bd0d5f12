"""Held-out loss and token accuracy of the pre-training objective on the validation shards: T5 span
corruption's, for a mixture of denoisers each denoiser's (`evaluate_sets`), and for a mixture of
corpora each corpus's (`evaluate_mixture`)."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def evaluate_batches(engine, batches: list[dict], device: torch.device) -> dict:
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
        input_mask = batch.get("attention_mask")  # padded inputs (denoising objectives)
        out = engine(input_ids=batch["input_ids"].to(device, non_blocking=True), labels=labels, return_logits=True,
                     attention_mask=None if input_mask is None else input_mask.to(device, non_blocking=True))
        targets = labels != -100
        tokens = targets.sum()
        correct = ((out.logits.argmax(dim=-1) == labels) & targets).sum()
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


def evaluate_sets(engine, sets: dict[str, list[dict]], device: torch.device) -> dict:
    """`evaluate_batches` on each named set of `objectives.evaluation_sets()`: the set "" gives
    eval_loss, eval_accuracy and eval_tokens; a denoiser NAME gives eval_loss/NAME and eval_accuracy/NAME."""
    result = {}
    for name, batches in sets.items():
        figures = evaluate_batches(engine, batches, device)
        result.update({f"{key}/{name}" if name else key: value for key, value in figures.items()
                       if name == "" or key != "eval_tokens"})
    return result


def evaluate_mixture(engine, sets_by_source: dict[str, dict[str, list[dict]]], shares: dict[str, float],
                     device: torch.device) -> dict:
    """`evaluate_sets` on each corpus of a mixture that has a validation split: its eval_loss,
    eval_accuracy and eval_tokens as eval_loss/<name>, ...; eval_loss, eval_accuracy (and each
    denoiser's eval_loss/NAME, eval_accuracy/NAME) are their means weighted by the corpora's shares of
    the training samples (renormalised over the corpora evaluated): the held-out loss of data drawn as
    the training data is, whatever the split sizes."""
    per_source = {name: evaluate_sets(engine, sets, device) for name, sets in sets_by_source.items()}
    total = sum(shares[name] for name in per_source)
    result: dict = {}
    for name, figures in per_source.items():
        result.update({f"{key}/{name}": figures[key] for key in ("eval_loss", "eval_accuracy", "eval_tokens")})
    for key in next(iter(per_source.values())):
        if key != "eval_tokens":
            result[key] = sum(shares[name] * figures[key] for name, figures in per_source.items()) / total
    result["eval_tokens"] = sum(figures["eval_tokens"] for figures in per_source.values())
    return result
