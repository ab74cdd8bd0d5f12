"""DeepSpeed configs: every shipped json resolves against every shipped run config; auto-fill rules."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.test_config import config_class
from training.config import ConfigError, micro_batch_size
from training.config_loader import load_run_config
from training.ds_config import (
    DSConfigError,
    find_ds_config,
    load_ds_config,
    precision_mode,
    resolve_ds_config,
    zero_stage,
)

REPO = Path(__file__).resolve().parents[1]
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
RUN_CONFIGS = sorted((REPO / "training" / "configs").glob("*.yaml"))


def _cfg(*overrides: str):
    return load_run_config(None, list(overrides))


def test_shipped_ds_configs():
    names = {p.stem for p in DS_CONFIGS}
    assert {"zero0", "zero1", "zero2", "zero3", "zero3_offload"} <= names
    for path in DS_CONFIGS:
        ds = json.loads(path.read_text())
        assert ds["zero_allow_untested_optimizer"] is True
        assert ds["wall_clock_breakdown"] is False
        assert ds["steps_per_print"] >= 10**6
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            assert ds[key] == "auto"
        assert ds["gradient_clipping"] == "auto"
        assert "optimizer" not in ds and "scheduler" not in ds
    assert zero_stage(load_ds_config("ds_configs/zero2.json")) == 2
    offload = load_ds_config("ds_configs/zero3_offload.json")
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["zero_force_ds_cpu_optimizer"] is False  # our own optimizer runs on the CPU copy


@pytest.mark.parametrize("ds_path", DS_CONFIGS, ids=lambda p: p.stem)
@pytest.mark.parametrize("run_path", RUN_CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_pair_resolves(ds_path, run_path):
    cfg = load_run_config(str(run_path), [], root=config_class(run_path))
    resolved_any = False
    for world_size in (1, 2, 4):
        if cfg.optim.batch_size % (cfg.optim.grad_acc * world_size):
            with pytest.raises(ConfigError):
                resolve_ds_config(ds_path, cfg, world_size, device_type="cuda")
            continue
        for device_type in ("cuda", "cpu"):
            ds = resolve_ds_config(ds_path, cfg, world_size, device_type=device_type)
            assert ds["train_batch_size"] == cfg.optim.batch_size
            assert ds["gradient_accumulation_steps"] == cfg.optim.grad_acc
            assert (
                ds["train_micro_batch_size_per_gpu"] * cfg.optim.grad_acc * world_size == cfg.optim.batch_size
            )
            assert ds["gradient_clipping"] == cfg.optim.grad_clip
            assert '"auto"' not in json.dumps(ds)
            expected = "torch_autocast" if (cfg.precision == "bf16" and device_type == "cuda") else "fp32"
            assert precision_mode(ds) == expected
            resolved_any = True
    assert resolved_any


@pytest.mark.parametrize("ds_path", DS_CONFIGS, ids=lambda p: p.stem)
def test_deepspeed_accepts_resolved_configs(ds_path):
    """DeepSpeed's own parser (pydantic, extra keys forbidden) and batch checks accept the result."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = _cfg("optim.batch_size=64", "optim.grad_acc=4", "optim.grad_clip=0.5")
    parsed = DeepSpeedConfig(resolve_ds_config(ds_path, cfg, 1, device_type="cuda"))
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu) == (64, 16)
    assert parsed.gradient_accumulation_steps == 4
    assert parsed.gradient_clipping == 0.5
    assert parsed.zero_optimization_stage == zero_stage(load_ds_config(ds_path))
    assert parsed.torch_autocast_enabled is True
    # DeepSpeed's throughput timer would synchronise the device twice per step
    assert parsed.timers_config.enabled is False


def test_throughput_timer_off_unless_asked_for():
    ds = resolve_ds_config({"zero_optimization": {"stage": 0}}, _cfg(), 1, device_type="cuda")
    assert ds["timers"] == {"throughput": {"enabled": False}}
    asked = {"timers": {"throughput": {"enabled": True, "synchronized": False}}}
    ds = resolve_ds_config(asked, _cfg(), 1, device_type="cuda")
    assert ds["timers"]["throughput"] == {"enabled": True, "synchronized": False}


def test_auto_fill_values():
    cfg = _cfg("optim.batch_size=256", "optim.grad_acc=2", "optim.grad_clip=0")
    ds = resolve_ds_config("ds_configs/zero1.json", cfg, 4, device_type="cuda")
    assert ds["train_batch_size"] == 256
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_micro_batch_size_per_gpu"] == 32 == micro_batch_size(cfg, 4)
    assert ds["gradient_clipping"] == 0.0  # 0 disables clipping in DeepSpeed too
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert ds["bf16"]["enabled"] is False


def test_missing_batch_keys_are_filled_and_input_not_modified():
    raw = {"zero_optimization": {"stage": 0}}
    ds = resolve_ds_config(raw, _cfg(), 2, device_type="cpu")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (128, 64)
    assert raw == {"zero_optimization": {"stage": 0}}


def test_matching_explicit_numbers_are_accepted():
    raw = {"train_batch_size": 128, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    ds = resolve_ds_config(raw, _cfg(), 1, device_type="cpu")
    assert ds["train_micro_batch_size_per_gpu"] == 128


@pytest.mark.parametrize(
    "raw, fragments",
    [
        ({"train_batch_size": 256}, ["train_batch_size=256", "optim.batch_size", "128", '"auto"']),
        ({"gradient_accumulation_steps": 4}, ["gradient_accumulation_steps=4", "optim.grad_acc"]),
        ({"train_micro_batch_size_per_gpu": 16}, ["train_micro_batch_size_per_gpu=16", "world_size=2"]),
        ({"gradient_clipping": 0.5}, ["gradient_clipping=0.5", "optim.grad_clip"]),
        ({"optimizer": {"type": "AdamW"}}, ["optimizer", "optim.name"]),
        ({"scheduler": {"type": "WarmupLR"}}, ["scheduler", "optim.lr_scheduler"]),
        ({"fp16": {"enabled": True}}, ["fp16", "precision=bf16"]),
        ({"torch_autocast": {"enabled": True}, "bf16": {"enabled": True}}, ["both", "enable one"]),
        ({"torch_autocast": {"enabled": False}, "bf16": {"enabled": False}}, ["no bf16 mechanism"]),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, ["reduce_bucket_size"]),
        ({"zero_optimization": {"stage": 4}}, ["stage=4"]),
    ],
)
def test_contradictions_raise_with_a_fix(raw, fragments):
    with pytest.raises(DSConfigError) as e:
        resolve_ds_config(raw, _cfg(), 2, device_type="cuda")
    for fragment in fragments:
        assert fragment in str(e.value)


def test_batch_not_divisible_by_world_size():
    with pytest.raises(ConfigError, match="optim.grad_acc"):
        resolve_ds_config("ds_configs/zero0.json", _cfg("optim.batch_size=10"), 4, device_type="cuda")


def test_precision_fp32_and_cpu_disable_bf16(caplog):
    with caplog.at_level(logging.INFO, logger="training.ds_config"):
        ds = resolve_ds_config("ds_configs/zero2.json", _cfg("precision=fp32"), 1, device_type="cuda")
    assert precision_mode(ds) == "fp32"
    assert ds["torch_autocast"]["enabled"] is False and ds["bf16"]["enabled"] is False
    assert "precision=fp32" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training.ds_config"):
        ds = resolve_ds_config("ds_configs/zero0.json", _cfg("precision=bf16"), 1, device_type="cpu")
    assert precision_mode(ds) == "fp32"
    assert "device is cpu" in caplog.text
    # cfg.device=cpu is honoured when the caller passes no device_type
    ds = resolve_ds_config("ds_configs/zero0.json", _cfg("device=cpu"), 1)
    assert precision_mode(ds) == "fp32"


def test_explicit_deepspeed_bf16_mode_is_respected():
    raw = {"bf16": {"enabled": True}, "torch_autocast": {"enabled": "auto"}}
    ds = resolve_ds_config(raw, _cfg(), 1, device_type="cuda")
    assert precision_mode(ds) == "bf16"
    assert ds["torch_autocast"]["enabled"] is False
    ds = resolve_ds_config({"bf16": {"enabled": "auto"}}, _cfg(), 1, device_type="cuda")
    assert precision_mode(ds) == "bf16"
    # A json that says nothing about precision gets the default mechanism, torch_autocast.
    ds = resolve_ds_config({"zero_optimization": {"stage": 1}}, _cfg(), 1, device_type="cuda")
    assert precision_mode(ds) == "torch_autocast"


def test_find_ds_config_relative_to_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert find_ds_config("ds_configs/zero1.json") == REPO / "ds_configs" / "zero1.json"
    with pytest.raises(DSConfigError, match="zero0.json"):
        find_ds_config("ds_configs/zero9.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DSConfigError, match="not valid JSON"):
        resolve_ds_config(str(bad), _cfg(), 1)


def test_run_configs_name_shipped_ds_configs():
    for run_path in RUN_CONFIGS:
        cfg = load_run_config(str(run_path), [], root=config_class(run_path))
        assert find_ds_config(cfg.ds_config).is_file()


@pytest.mark.parametrize("ds, says", [
    ({"zero_optimisation": {"stage": 2}}, '"zero_optimisation" is not a DeepSpeed 0.19.8 config key (DeepSpeed '
                                          'ignores it, silently): did you mean "zero_optimization"?'),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, 'did you mean "zero_optimization.overlap_comm"?'),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"devce": "cpu"}}},
     'did you mean "zero_optimization.offload_optimizer.device"?'),
    ({"bf16": {"enabeld": True}}, 'did you mean "bf16.enabled"?'),
    ({"gradient_clippping": 1.0}, 'did you mean "gradient_clipping"?'),
    ({"amp": {"enabled": True}}, "Apex AMP integration has been removed"),  # DeepSpeed's own message
])
def test_unknown_deepspeed_keys_are_errors_with_the_closest_known_key(ds, says):
    with pytest.raises(DSConfigError) as error:
        resolve_ds_config({"train_batch_size": "auto", **ds}, _cfg(), 1, device_type="cpu")
    assert says in str(error.value)


def test_known_keys_come_from_deepspeed_itself():
    """What DeepSpeed reads when it parses a config: every key of every shipped json is among them."""
    from training.ds_config import deepspeed_config_keys

    known = deepspeed_config_keys()
    assert {"train_batch_size", "zero_optimization", "torch_autocast", "timers", "checkpoint"} <= set(known)
    assert {"stage", "overlap_comm", "offload_optimizer"} <= set(known["zero_optimization"])
    assert "device" in known["zero_optimization"]["offload_optimizer"]
    for path in DS_CONFIGS:
        resolve_ds_config(path, _cfg(), 1, device_type="cpu")  # no shipped key is refused
