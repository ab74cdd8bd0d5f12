"""Held-out loss and token accuracy of the span-corruption objective on the validation shards."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _global_max(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@torch.no_grad()
def evaluate_span_corruption(engine, batches: list[dict], device: torch.device) -> dict:
    """Token-weighted mean loss and accuracy over this rank's `batches`, summed over all ranks.

    Every rank runs the same number of forward passes (ZeRO-3 gathers parameters collectively, so a
    rank that stopped early would hang the others): a rank with fewer batches repeats its last one
    with weight 0.
    """
    was_training = engine.training
    engine.eval()
    n_passes = _global_max(len(batches), device)
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss*tokens, correct, tokens
    for i in range(n_passes):
        batch = batches[min(i, len(batches) - 1)] if batches else None
        if batch is None:
            raise RuntimeError("this rank has no validation batch; use fewer ranks or more validation data")
        labels = batch["labels"].to(device, non_blocking=True)
        out = engine(input_ids=batch["input_ids"].to(device, non_blocking=True), labels=labels,
                     return_logits=True)
        if i >= len(batches):
            continue
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
