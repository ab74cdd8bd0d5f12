"""`python -m training.benchmark`, the training-step benchmark, on a machine without a GPU: its variant
items and the regional compile that its `regional` item runs."""

from __future__ import annotations

import argparse

import pytest
import torch

ARGS = argparse.Namespace(attention="triton", compile=True, fused_ce=True, batch_size=128, compile_mode="",
                          optimizer_fused=True, residual_dtype="float32")  # fmt: skip


def test_variant_items_parse():
    """Every variant item sets what the module docstring says, on top of the command-line defaults;
    the later of two items for one setting wins; every item that changes the step shows in the
    printed row's label; an unknown item (such as a removed one) stops with its name."""
    from training.benchmark import main, parse_variant, variant_label

    v = parse_variant("sdpa,nocompile,nofusedce,bs=256,mode=max-autotune,opteager,bf16residual,clipbefore,"
                      "deterministic,regional,quackffn,objective=ul2,vocab=250112,bias=row,ckpt=block,hf", ARGS)  # fmt: skip
    assert parse_variant("hf", ARGS)["fused_ce"] is False
    assert v == dict(attention="sdpa", compile=False, fused_ce=False, batch_size=256, mode="max-autotune",
                     opt_fused=False, residual_dtype="autocast", clip_in_step=False, deterministic=True,
                     regional=True, quack_ffn=True, objective="ul2", vocab_size=250112, bias_layout="row",
                     checkpointing="block", hf=True)  # fmt: skip
    default = parse_variant("", ARGS)
    assert default == dict(attention="triton", compile=True, fused_ce=True, batch_size=128, mode="",
                           opt_fused=True, residual_dtype="float32", clip_in_step=True, deterministic=False,
                           regional=False, quack_ffn=False, objective="span_corruption", vocab_size=32128,
                           bias_layout="auto", checkpointing="none", hf=False)  # fmt: skip
    assert parse_variant("math", ARGS)["attention"] == "math"
    for pair, field, value in (("nocompile,compile", "compile", True), ("nofusedce,fusedce", "fused_ce", True),
                               ("opteager,optfused", "opt_fused", True),
                               ("bf16residual,fp32residual", "residual_dtype", "float32"),
                               ("clipbefore,clipinstep", "clip_in_step", True),
                               ("regional,wholemodel", "regional", False),
                               ("quackffn,cublasffn", "quack_ffn", False)):  # fmt: skip
        assert parse_variant(pair, ARGS)[field] == value, pair
    labels = {item: variant_label(parse_variant(item, ARGS)) for item in
              ("", "opteager", "bf16residual", "clipbefore", "deterministic", "regional", "quackffn",
               "objective=ul2", "vocab=250112", "bias=dense", "bias=row", "ckpt=block", "ckpt=selective",
               "hf")}  # fmt: skip
    assert len(set(labels.values())) == len(labels), labels
    for item in ("fast", "cudnn", "flex", "nobias", "dbiaskernel", "fartiles", "nopdl", "torchgelu"):
        with pytest.raises(SystemExit, match=item):
            parse_variant(f"triton,{item}", ARGS)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            main([])


def test_hf_variant_builds_transformers_t5_of_the_same_config():
    """`hf` times transformers' T5 of the benchmarked config: the same parameters by name and shape as
    ours (what export writes), the same loss for the same weights, and gradient checkpointing on
    where a `ckpt=` item asks for it."""
    from training.benchmark import hf_model
    from training.model import T5Config, T5ForConditionalGeneration
    from training.model.hf_compat import hf_state_dict

    config = T5Config.from_preset("tiny", attention_backend="math", activation_checkpointing="block")
    ours, theirs = T5ForConditionalGeneration(config), hf_model(config)
    assert theirs.encoder.gradient_checkpointing and theirs.decoder.gradient_checkpointing
    assert not hf_model(T5Config.from_preset("tiny", attention_backend="math")).encoder.gradient_checkpointing
    weights = hf_state_dict(ours)
    assert {k: p.shape for k, p in theirs.named_parameters()} == {k: v.shape for k, v in weights.items()}
    theirs.load_state_dict(weights, strict=False)  # the stacks' embed_tokens are `shared` itself
    x, y = torch.randint(2, 100, (2, 12)), torch.randint(2, 100, (2, 5))
    torch.testing.assert_close(theirs(input_ids=x, labels=y).loss, ours(x, labels=y).loss, rtol=1e-4, atol=1e-5)


def test_objective_variant_times_a_real_batch_of_the_objective():
    """`objective=ul2` times one UL2 batch: inputs at --input-length under an attention mask, targets
    padded to the longest denoiser's (384 at 512), labels -100 where padded."""
    from training.benchmark import objective_batch

    batch = objective_batch("ul2", 64, 512)
    assert batch["input_ids"].shape == (64, 512) and batch["labels"].shape == (64, 384)
    assert ((batch["input_ids"] == 0) == (batch["attention_mask"] == 0)).all()
    assert 0 < (batch["labels"] == -100).mean() < 0.8 and len(set(batch["denoiser"].tolist())) > 3


def test_regional_compile_keeps_loss_and_gradients():
    """`compile_blocks` (the benchmark's `regional` variant and `model.compile_scope=blocks`: each
    block, the final norms and the loss compiled on their own; inductor on CPU here) gives eager's
    loss and gradients, and leaves the model's class as it was."""
    from training.model import T5Config, T5ForConditionalGeneration
    from training.model.cross_entropy import fused_linear_cross_entropy

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math")))
    eager, regional = models
    x, y = torch.randint(0, 100, (2, 12)), torch.randint(0, 100, (2, 5))
    losses = []
    try:
        assert regional.compile_blocks() == 4
        assert all("forward" in vars(block) for block in (*regional.encoder.block, *regional.decoder.block))
        assert "loss_fn" in vars(regional) and T5ForConditionalGeneration.loss_fn is fused_linear_cross_entropy
        assert "cross_kv" in vars(regional.decoder)  # every block's cross-attention projections, one graph
        for model in (eager, regional):
            loss = model(input_ids=x, labels=y, return_logits=False).loss
            loss.backward()
            losses.append(loss.detach())
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, a), b in zip(eager.named_parameters(), regional.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5 * float(a.grad.abs().max()), msg=name)
