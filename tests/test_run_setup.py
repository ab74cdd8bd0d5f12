"""training/compile_settings.py and training/run_setup.py: how the forward is compiled
(`model.compile_mode`) and where that is refused, the first step's compile report, the start of a
run and the ZeRO stage advice."""

from __future__ import annotations

import logging

import pytest
import torch

import training.compile_settings as compile_settings
from training.compile_settings import (
    INDUCTOR_PDL_OPTION,
    MODEL_INDUCTOR_OPTIONS,
    compile_cache_outcomes,
    compile_forward,
    compile_options,
)
from training.config import ConfigError
from training.config_loader import load_run_config
from training.ds_config import load_ds_config
from training.run_dir import RunDir
from training.run_setup import begin_run, start_engine, zero_stage_advice


@pytest.mark.parametrize("mode, expected", [("default", {}), ("reduce-overhead", {"triton.cudagraphs": True}),
                                            ("max-autotune-no-cudagraphs", {"max_autotune": True})])  # fmt: skip
def test_compile_forward_passes_the_mode_and_the_model_inductor_options(monkeypatch, mode, expected):
    """The mode's inductor options (torch.compile takes a mode or options, not both) plus the model's
    own, every one an inductor setting this torch knows (torch.compile would refuse another)."""
    import torch._inductor.config as inductor_config

    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = torch.nn.Linear(2, 2)
    compile_forward(model, mode)
    assert len(calls) == 1 and calls[0]["fullgraph"] is True and "mode" not in calls[0]
    options = calls[0]["options"]
    assert options.items() >= expected.items() and options.items() >= MODEL_INDUCTOR_OPTIONS.items()
    assert MODEL_INDUCTOR_OPTIONS["reorder_for_peak_memory"] is False
    known = inductor_config.get_config_copy()
    assert all(key in known for key in options), sorted(set(options) - set(known))
    # PDL on where this torch has the setting (inductor emits it on Hopper or newer only)
    assert options.get(INDUCTOR_PDL_OPTION, True) is True
    assert (INDUCTOR_PDL_OPTION in options) == (INDUCTOR_PDL_OPTION in known)


def test_compile_options_leave_pdl_out_where_torch_lacks_it_and_off_when_asked(monkeypatch):
    """`compile_options(pdl=False)` turns inductor's PDL off (the benchmark's `nopdl`); a torch whose
    inductor has no such setting gets no key at all, since torch.compile refuses unknown options."""
    monkeypatch.setattr(compile_settings, "_inductor_has", lambda option: True)
    assert compile_options()[INDUCTOR_PDL_OPTION] is True
    assert compile_options("default", pdl=False)[INDUCTOR_PDL_OPTION] is False
    monkeypatch.setattr(compile_settings, "_inductor_has", lambda option: option != INDUCTOR_PDL_OPTION)
    assert INDUCTOR_PDL_OPTION not in compile_options() and INDUCTOR_PDL_OPTION not in compile_options(pdl=False)


def test_compiled_training_forward_comes_back_from_the_autograd_cache(compile_caches_on):
    """The training forward as `compile_forward` compiles it (fused cross-entropy, under bf16 autocast
    as DeepSpeed's torch_autocast runs it) compiled a second time, as a new process would: AOTAutograd's
    cache serves it, and it gives the first compile's loss and gradients. With the cross-entropy as an
    autograd.Function, or an autocast context inside the graph, the cache stepped aside
    (`autograd_cache_bypass`) and every training process traced the whole step again."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from training.model.config import T5Config
    from training.model.t5 import T5ForConditionalGeneration

    x = torch.randint(0, 100, (2, 12))
    y = torch.randint(0, 100, (2, 5))
    y[1, 3:] = -100

    def train_forward() -> tuple[dict, torch.Tensor, list[torch.Tensor]]:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math"))
        compile_forward(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=y, return_logits=False).loss
        loss.backward()
        return compile_cache_outcomes(), loss.detach(), [p.grad for p in model.parameters()]

    # One CPU thread: inductor's C++ backward adds scattered gradients (the embedding's, the bias
    # table's) with atomics across OpenMP threads, so with two threads the order of those adds, and
    # the gradients' last bits, vary with the machine's load.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fresh_cache():
            first, second = train_forward(), train_forward()
    finally:
        torch._dynamo.reset()
        torch.set_num_threads(threads)
    assert first[0] == {"miss": 1} and second[0] == {"hit": 1}, (first[0], second[0])
    assert torch.equal(first[1], second[1])
    assert all(torch.equal(a, b) for a, b in zip(first[2], second[2]))


@pytest.mark.parametrize("outcomes, hint", [({}, ""), ({"miss": 2}, "model.compile_cache"),
                                            ({"hit": 1, "miss": 1}, ""), ({"bypass": 1, "miss": 2}, "stepped aside")])  # fmt: skip
def test_first_step_record_and_line_say_what_the_compile_cache_did(monkeypatch, caplog, outcomes, hint):
    """The first step's event record carries the seconds and the cache outcomes; its log line says
    where a later run finds the compiled step when it was compiled from scratch, and that part of it
    cannot be cached when the cache stepped aside."""

    class Metrics:
        def __init__(self):
            self.records = []

        def log(self, kind, record):
            self.records.append((kind, record))

    monkeypatch.setattr(compile_settings, "compile_cache_outcomes", lambda: outcomes)
    metrics = Metrics()
    with caplog.at_level("INFO", logger="training.compile_settings"):
        compile_settings.log_first_step(metrics, 7, 12.5)
    assert metrics.records == [("event", {"step": 7, "event": "first_step", "seconds": 12.5, "compile_cache": outcomes})]
    assert "12.5 s" in caplog.text
    assert ("model.compile_cache" in caplog.text) == (hint == "model.compile_cache")
    assert ("stepped aside" in caplog.text) == (hint == "stepped aside")
    assert ("compile cache" in caplog.text) == bool(outcomes)


@pytest.mark.parametrize("scope", ["zero3", "blocks", "model"])
def test_each_compile_scope_compiles_what_it_says_with_the_model_inductor_options(monkeypatch, scope):
    """ZeRO 3's blocks: each T5 block and the final norms, the loss eager; `model.compile_scope=blocks`
    at ZeRO 0-2: the blocks, the norms and the loss; both with the options of the whole-model compile
    but PDL (its gain is measured on the whole-model graph only); `model`: the whole forward. A
    training call runs the compiled block."""
    from training.compile_settings import block_compile_options, compile_model
    from training.model.config import T5Config
    from training.model.t5 import T5ForConditionalGeneration

    calls = []

    def fake_compile(fn, **kwargs):
        calls.append((getattr(fn, "__name__", ""), kwargs))
        return lambda *args: ("compiled", fn(*args))

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny"))
    if scope == "zero3":
        assert model.compile_blocks(options=block_compile_options("inductor"), loss=False) == 4
        assert block_compile_options("aot_eager") is None
    else:
        compile_model(model, scope)
    names = [name for name, _ in calls]
    if scope == "model":
        assert names == ["forward"] and calls[0][1]["fullgraph"] is True
        return
    assert names.count("forward") == 4 and names.count("rms_norm") == 1
    assert names.count("fused_linear_cross_entropy") == (scope == "blocks")
    for name, kwargs in calls:
        if name == "rms_norm":
            continue
        assert kwargs["fullgraph"] is True and kwargs["options"].items() >= MODEL_INDUCTOR_OPTIONS.items()
        assert not kwargs["options"].get(INDUCTOR_PDL_OPTION, False)
    block = model.encoder.block[1]
    h = torch.randn(2, 5, block.layer[0].SelfAttention.q.in_features)
    assert block(h, None, None)[0] == "compiled"


def test_compile_scope_blocks_takes_the_default_mode_only():
    with pytest.raises(ConfigError, match="model.compile_mode=default"):
        load_run_config(None, ["model.compile_scope=blocks", "model.compile_mode=reduce-overhead"])
    assert load_run_config(None, ["model.compile_scope=blocks"]).model.compile_scope == "blocks"


def test_a_compile_mode_under_zero3_is_refused_before_the_engine_starts(tmp_path):
    cfg = load_run_config(None, ["model.preset=tiny", "model.compile_mode=reduce-overhead"])
    ds_config = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, "train_batch_size": 8}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="model.compile_mode=default"):
        start_engine(cfg, model, None, None, ds_config, RunDir(tmp_path), rank=0, world_size=1,
                     device=torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_begin_run_seeds_makes_the_directory_on_rank_0_and_switches_determinism(tmp_path):
    """The start shared by pretrain.py and finetune.py: rank 0 creates the output directory (other
    ranks only name it), the seed is torch's, `deterministic` turns deterministic algorithms on, and
    the stop-signal handler is installed (restored here)."""
    import os
    import signal

    from training.determinism import set_deterministic

    stops = []
    try:
        cfg = load_run_config(None, ["seed=123", f"output_dir={tmp_path / 'other'}"])
        stop, run_dir = begin_run(cfg, rank=1)
        stops.append(stop)
        assert run_dir == RunDir(tmp_path / "other") and not run_dir.path.exists()
        assert torch.initial_seed() == 123 and not torch.are_deterministic_algorithms_enabled()
        cfg = load_run_config(None, ["seed=7", "deterministic=true", f"output_dir={tmp_path / 'run'}"])
        stop, run_dir = begin_run(cfg, rank=0)
        stops.append(stop)
        assert run_dir.path.is_dir() and torch.initial_seed() == 7 and stop.received is None
        assert torch.are_deterministic_algorithms_enabled()
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler records it instead of the default action
        assert stop.received == signal.SIGUSR1
    finally:
        set_deterministic(False)
        for stop in reversed(stops):
            stop.restore()


@pytest.mark.parametrize("config, world_size, level, says", [
    ("zero1", 1, logging.WARNING, "Use ds_configs/zero0.json on one GPU"),
    ("zero2", 1, logging.WARNING, "ZeRO 2 on one GPU partitions nothing"),
    ("zero0", 2, logging.INFO, "the fastest stage for T5 base on one node"),
    ("zero0", 1, None, None), ("zero1", 4, None, None), ("zero2", 2, None, None),
    ("zero3", 1, None, None), ("zero3_offload", 1, None, None),
])  # fmt: skip
def test_zero_stage_advice_follows_the_measured_costs(config, world_size, level, says):
    """Every shipped ds config: a warning where the stage costs time for nothing (ZeRO 1/2 on one GPU),
    an info line for ZeRO 0 on several ranks, silence elsewhere."""
    advice = zero_stage_advice(load_ds_config(f"ds_configs/{config}.json"), world_size)
    if level is None:
        assert advice is None
    else:
        assert advice[0] == level and says in advice[1], advice


@pytest.mark.parametrize("config, world_size", [("zero1", 1), ("zero2", 1), ("zero0", 2)])
def test_zero_stage_advice_is_for_gpus_only(config, world_size):
    """The advice rests on T5 base's step times on GPUs: a CPU run (a tiny fine-tune on 2 gloo ranks)
    gets none."""
    ds = load_ds_config(f"ds_configs/{config}.json")
    assert zero_stage_advice(ds, world_size, "cuda") is not None
    assert zero_stage_advice(ds, world_size, "cpu") is None


def test_zero_stage_advice_leaves_one_gpu_offload_alone():
    """ZeRO 2 with its optimizer offloaded to the CPU is how one GPU trains a model whose optimizer state
    does not fit: no warning there."""
    ds = load_ds_config("ds_configs/zero2.json")
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert zero_stage_advice(ds, 1) is None


@pytest.mark.parametrize("saved, now, refused", [
    ((0, 2, False), (0, 1), None),  # ZeRO 0 resumes on any world size
    ((2, 2, False), (1, 2), None),  # ZeRO 1 and 2 share their layout
    ((2, 2, True), (3, 1), None),  # a universal checkpoint loads anywhere
    ((2, 2, False), (0, 2), "written by ZeRO 2 on 2 ranks, and this run has ZeRO 0 on 2 ranks"),
    ((0, 1, False), (3, 1), "cannot load its state under another stage"),
    ((1, 4, False), (1, 2), "cannot load its optimizer partitions"),
])
def test_a_checkpoint_of_another_zero_layout_is_refused_with_the_conversion(tmp_path, saved, now, refused):
    from training.cli_errors import ExpectedError, ReportedByAnotherRank
    from training.run_setup import check_resumable_layout

    stage, world, universal = saved
    meta = {"zero_stage": stage, "world_size": world, "universal": universal}
    checkpoint = tmp_path / "checkpoints" / "step_00000005"
    if refused is None:
        check_resumable_layout(meta, checkpoint, RunDir(tmp_path), *now, rank=0)
        return
    with pytest.raises(ExpectedError) as error:
        check_resumable_layout(meta, checkpoint, RunDir(tmp_path), *now, rank=0)
    assert refused in str(error.value) and f"python -m training.checkpoint_universal {tmp_path} NEW_RUN_DIR" in \
        str(error.value) and not isinstance(error.value, ReportedByAnotherRank)
    with pytest.raises(ReportedByAnotherRank):  # the other ranks stop without a second line
        check_resumable_layout(meta, checkpoint, RunDir(tmp_path), *now, rank=1)
