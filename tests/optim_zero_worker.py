"""One rank of the multi-process optimizer tests (run by tests/test_optim_zero.py; not a test file).

    python tests/optim_zero_worker.py OUT_DIR  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Runs DeepSpeed on CPU/gloo with a tiny T5 and `adamwscale` for each case, and saves, per case, the
final full weights, the optimizer's `weight_l2_norm()` and layout facts to OUT_DIR/<case>.rank<r>.pt.
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

STEPS = 5
GLOBAL_BATCH = 4
LR = 1e-2
RESUME_AT = 2  # the *_resume cases checkpoint before this step and continue in a new engine
# The *_blocks cases with T5Config.activation_checkpointing: the backward runs each leaf block again.
ACTIVATION_CHECKPOINTING = {"zero3_blocks_ckpt": "block", "zero3_blocks_selective": "selective"}
GRAPH_CALLS = [0]  # runs of the graphs that counting_aot_eager compiled, over the cases of this process


def make_model() -> tuple[torch.nn.Module, str]:
    """Tiny T5 from training.model (small vocab), or a stand-in with very different tensor RMS."""
    torch.manual_seed(1234)
    try:
        from training.model import T5Config, T5ForConditionalGeneration

        model = T5ForConditionalGeneration(
            T5Config.from_preset("tiny", vocab_size=300, attention_backend="sdpa")
        )
        return model, "t5-tiny"
    except Exception:  # noqa: BLE001 - the model package is optional for these tests
        model = StandIn()
        return model, "stand-in"


def counting_aot_eager(gm, example_inputs):
    """torch.compile's aot_eager backend (eager numerics), counting the runs of the graphs it compiles."""
    import functools

    from torch._dynamo.backends.debugging import aot_eager

    compiled = aot_eager(gm, example_inputs)

    @functools.wraps(compiled)  # keeps its calling convention (`_boxed_call`)
    def run(*args):
        GRAPH_CALLS[0] += 1
        return compiled(*args)

    return run


class StandIn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(300, 48)  # RMS ~1
        self.proj = torch.nn.Linear(48, 96, bias=True)  # RMS ~0.08
        self.layer_norm = torch.nn.LayerNorm(96)
        self.out = torch.nn.Linear(96, 300, bias=False)
        with torch.no_grad():
            self.out.weight.mul_(0.01)  # RMS ~6e-4: below the 1e-3 floor

    def forward(self, input_ids, labels):
        h = self.layer_norm(torch.relu(self.proj(self.emb(input_ids))))
        logits = self.out(h)[:, : labels.shape[1]]  # one prediction per label position
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), labels.reshape(-1))
        return type("Out", (), {"loss": loss})()


def batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    micro = GLOBAL_BATCH // world
    out = []
    for _ in range(STEPS):
        inputs = torch.randint(2, 300, (GLOBAL_BATCH, 12), generator=g)
        labels = torch.randint(2, 300, (GLOBAL_BATCH, 7), generator=g)
        out.append((inputs[rank * micro : (rank + 1) * micro], labels[rank * micro : (rank + 1) * micro]))
    return out


def ds_config(stage: int, world: int, bf16: str | bool) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if stage in (1, 2):  # small buckets so that reduce-scatter splits mid-tensor paths are exercised
        cfg["zero_optimization"].update(reduce_bucket_size=5000, allgather_bucket_size=5000)
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, reduce_bucket_size=5000)
    if bf16 == "round_robin":  # fp32, but ZeRO-2 reorders tensors before flattening
        cfg["zero_optimization"]["round_robin_gradients"] = True
    elif bf16:
        cfg["bf16"] = {"enabled": True}
    if bf16 == "bf16_fp32acc":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def reconstruct_from_layouts(opt, layouts) -> dict[int, list[torch.Tensor]]:
    """Every tensor of every layout rebuilt from the fp32 partitions of all ranks (gloo gather)."""
    import torch.distributed as dist

    local = []
    for lay in layouts:
        flat = lay.flat_param.detach().float().cpu()
        offset, pieces = 0, {}
        for length, t in zip(lay.lengths, lay.tensor_index):
            if t >= 0 and length > 0:
                pieces.setdefault(t, []).append(flat[offset : offset + length].clone())
            offset += length
        local.append(pieces)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    rebuilt = {}
    for li, lay in enumerate(layouts):
        tensors = []
        for t in range(len(lay.tensor_numels)):
            parts = [p for rank_pieces in gathered for p in rank_pieces[li].get(t, [])]
            tensors.append(torch.cat(parts) if parts else torch.zeros(0))
        rebuilt[li] = tensors
    return rebuilt


def run_case(
    name: str, stage: int, bf16: str | bool, bind: bool, out_dir: str, rank: int, world: int
) -> None:
    import deepspeed

    from training.optim import bind_zero_layout, build_optimizer

    model, model_kind = make_model()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = ds_config(stage, world, bf16)
    torch._dynamo.utils.counters.clear()  # cases run one after another in this process
    graph_calls_before = GRAPH_CALLS[0]
    if "_blocks" in name:  # ZeRO 3 with leaf T5 blocks, each compiled (aot_eager: eager numerics)
        from training.zero3_compile import prepare_for_zero3

        model.config.activation_checkpointing = ACTIVATION_CHECKPOINTING.get(name, "none")
        prepare_for_zero3(model, "blocks", config, backend=counting_aot_eager)
    opt = build_optimizer(
        "adamwscale",
        model,
        lr=LR,
        weight_decay=0.01,
        eps=1e-6,
        unbound_flat_params="error" if bind else "treat_as_tensor",
    )
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    linear_replaced = torch.nn.functional.linear.__name__ == "zero3_linear_wrap"
    n_bound = bind_zero_layout(engine) if bind else 0
    layouts = list(opt.flat_layouts.values())
    split_mid_tensor = False
    for lay in layouts:  # does some tensor have fewer elements here than its full numel?
        here = {}
        for length, t in zip(lay.lengths, lay.tensor_index):
            if t >= 0:
                here[t] = here.get(t, 0) + length
        split_mid_tensor |= any(0 < v < lay.tensor_numels[t] for t, v in here.items())

    mapping_error = 0.0
    mapping_detail = []  # per tensor that did not map back: enough to tell which copy was wrong
    if bind and layouts:  # the layout must put every element back where it came from
        rebuilt = reconstruct_from_layouts(opt, layouts)
        names = dict(engine.module.named_parameters())
        ctx = deepspeed.zero.GatheredParameters(list(names.values())) if stage == 3 else _null()
        with ctx:
            by_name = {n: p.detach().clone().reshape(-1) for n, p in names.items()}
        for li, lay in enumerate(layouts):
            for t, tname in enumerate(lay.tensor_names):
                ref = by_name[tname]
                got = rebuilt[li][t].to(ref.dtype).float()
                ref = ref.float()
                assert got.numel() == ref.numel(), (tname, got.numel(), ref.numel())
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
                if not math.isfinite(err):  # max() would silently drop a NaN
                    err = math.inf
                mapping_error = max(mapping_error, err)
                if err > 0.0:
                    # every rank built the same seeded model: both copies must still equal it
                    init = w0[tname].reshape(-1).to(by_name[tname].dtype).float()
                    diff = (got != ref).nonzero().flatten()
                    mapping_detail.append(
                        dict(
                            layout=li,
                            tensor=tname,
                            error=err,
                            numel=ref.numel(),
                            n_diff=int(diff.numel()),
                            first_diff=int(diff[0]) if diff.numel() else -1,
                            zeros_rebuilt=int((got == 0).sum()),
                            zeros_gathered=int((ref == 0).sum()),
                            rebuilt_equals_w0=bool(torch.equal(got, init)),
                            gathered_equals_w0=bool(torch.equal(ref, init)),
                        )
                    )
        if mapping_detail:
            print(f"{name} rank {rank}: mapping_error {mapping_error}: {mapping_detail[:8]}", flush=True)

    resume = name.endswith("_resume")
    for step, (input_ids, labels) in enumerate(batches(rank, world)):
        if resume and step == RESUME_AT:  # save, then continue in a fresh engine from the checkpoint
            ckpt = os.path.join(out_dir, f"ckpt_{name}")
            engine.save_checkpoint(ckpt, tag="t")
            model, _ = make_model()
            opt = build_optimizer("adamwscale", model, lr=LR, weight_decay=0.01, eps=1e-6)
            config = ds_config(stage, world, bf16)
            engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
            bind_zero_layout(engine)
            engine.load_checkpoint(ckpt, tag="t")
        loss = engine(input_ids=input_ids, labels=labels).loss
        engine.backward(loss)
        engine.step()

    norm = opt.weight_l2_norm() if (bind or stage == 0) else float("nan")
    params = list(engine.module.named_parameters())
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if stage == 3 else _null()
    with ctx:
        weights = {n: p.detach().float().clone() for n, p in params}
    torch.save(
        dict(
            wrapper=type(engine.optimizer).__name__,
            weights=weights,
            w0=w0,
            weight_l2_norm=norm,
            n_bound=n_bound,
            model_kind=model_kind,
            split_mid_tensor=split_mid_tensor,
            mapping_error=mapping_error,
            mapping_detail=mapping_detail,
            skipped=opt.skipped_steps,
            engine_skipped=engine.skipped_steps,
            linear_replaced=linear_replaced,
            compiled_graphs=int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
            graph_calls_per_step=(GRAPH_CALLS[0] - graph_calls_before) / STEPS,
        ),
        os.path.join(out_dir, f"{name}.rank{rank}.pt"),
    )


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_guard(out_dir: str, rank: int, world: int) -> None:
    """Replicated model (ZeRO-0 style) per rank; rank 1 gets an inf gradient: nobody may update."""
    from training.optim import build_optimizer

    results = {}
    for name in ("adamwscale", "adamw", "adafactor"):
        torch.manual_seed(0)
        model = StandIn()
        opt = build_optimizer(name, model, lr=1e-2, weight_decay=0.01)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        input_ids, labels = batches(rank, world)[0]
        model(input_ids, labels).loss.backward()
        if rank == 1:
            model.proj.weight.grad[3, 5] = float("inf")
        opt.step()
        unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        counters_after_bad = (opt.skipped_steps, opt.consecutive_skips)
        opt.zero_grad()
        model(input_ids, labels).loss.backward()
        opt.step()  # finite everywhere: applied
        changed = not all(torch.equal(before[n], p) for n, p in model.named_parameters())
        results[name] = dict(
            unchanged_after_bad=unchanged,
            counters_after_bad=counters_after_bad,
            changed_after_good=changed,
            counters_after_good=(opt.skipped_steps, opt.consecutive_skips),
        )
    torch.save(results, os.path.join(out_dir, f"guard.rank{rank}.pt"))


def main() -> None:
    out_dir = sys.argv[1]
    cases = sys.argv[2].split(",")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from training.distributed import disable_deepspeed_shm_comm

    disable_deepspeed_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo")
    table = {  # name: (stage, bf16, bind)
        "zero0": (0, False, True),
        "zero1": (1, False, True),
        "zero2": (2, False, True),
        "zero3": (3, False, True),
        "zero2_round_robin": (2, "round_robin", True),
        "zero2_resume": (2, False, True),
        "zero3_resume": (3, False, True),
        "zero3_blocks": (3, False, True),
        "zero3_blocks_ckpt": (3, False, True),
        "zero3_blocks_selective": (3, False, True),
        "zero1_naive": (1, False, False),
        "zero2_naive": (2, False, False),
        "zero3_naive": (3, False, False),
        "bf16_zero0": (0, "bf16", True),  # FP16_UnfusedOptimizer: per-tensor fp32 copies
        "bf16_zero1_fp32acc": (1, "bf16_fp32acc", True),  # BF16_Optimizer
        "bf16_zero2": (2, "bf16", True),
        "bf16_zero3": (3, "bf16", True),
    }
    for case in cases:
        try:
            if case == "guard":
                run_guard(out_dir, rank, world)
                continue
            stage, bf16, bind = table[case]
            run_case(case, stage, bf16, bind, out_dir, rank, world)
        except Exception as e:  # noqa: BLE001 - report to the test, keep going with the other cases
            import traceback

            torch.save(
                {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"},
                os.path.join(out_dir, f"{case}.rank{rank}.pt"),
            )


if __name__ == "__main__":
    main()
