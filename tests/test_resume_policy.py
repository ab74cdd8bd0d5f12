"""What a resumed run may change in its run config (training/resume_policy.py), without launching one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.budget import Horizon
from training.config import RunConfig, section_types
from training.config_loader import load_run_config
from training.finetune_config import FinetuneConfig
from training.resume_policy import RESUME_RULES, ResumeConfigError, ResumePlan, rule
from training.run_setup import build_optimizer_and_schedule


def _keys(root: type) -> set[str]:
    sections = section_types(root)
    keys = set()
    for f in dataclasses.fields(root):
        if f.name in sections:
            keys |= {f"{f.name}.{g.name}" for g in dataclasses.fields(sections[f.name])}
        else:
            keys.add(f.name)
    return keys


def test_every_key_of_both_configs_has_a_rule():
    for root in (RunConfig, FinetuneConfig):
        unknown = [k for k in _keys(root) if k not in RESUME_RULES and not k.startswith(("eval.", "checkpoint.",
                                                                                          "logging."))]
        assert unknown == [], f"{root.__name__}: give these keys a rule in RESUME_RULES: {unknown}"
    assert rule("model.preset")[0] is False and rule("optim.base_lr")[0] is True and rule("eval.every_steps")[0]


def _plan(saved: list[str], now: list[str], step: int = 5) -> ResumePlan:
    old = load_run_config("training/configs/tiny_demo.yaml", ["optim.warmup_steps=1", *saved]).to_dict()
    new = load_run_config("training/configs/tiny_demo.yaml", ["optim.warmup_steps=1", *now]).to_dict()
    return ResumePlan(new, old, checkpoint="runs/x/checkpoints/step_00000005", step=step)


def test_changes_that_apply_are_listed_in_one_line():
    plan = _plan(["optim.total_steps=10"], ["optim.total_steps=20", "optim.base_lr=1e-3", "eval.every_steps=7"])
    assert set(plan.changes) == {"optim.total_steps", "optim.base_lr", "eval.every_steps"}
    line = plan.describe()
    assert "\n" not in line and "optim.total_steps 10 -> 20" in line and "optim.base_lr 0.02 -> 0.001" in line
    assert plan.horizon(saved_horizon=10, total_steps=20) == 20
    assert _plan([], []).describe() == "" and _plan([], []).horizon(saved_horizon=8, total_steps=300) == 8


def test_changes_that_cannot_apply_are_refused_naming_every_key():
    with pytest.raises(ResumeConfigError) as info:
        _plan([], ["model.preset=small", "seed=1", "optim.base_lr=1e-3"])
    message = str(info.value)
    assert "\n" not in message and "model.preset ('tiny' -> 'small'" in message and "seed (" in message
    assert "optim.base_lr" not in message and "new output_dir" in message
    with pytest.raises(ResumeConfigError, match="optim.total_steps=3 is below the step"):
        _plan([], ["optim.total_steps=3"], step=5)


def test_an_unknown_saved_config_is_said_once():
    plan = ResumePlan({"seed": 1}, None, checkpoint="c", step=1)
    assert plan.changes == {} and "not compared" in plan.describe()


def test_keeping_settings_puts_the_new_lr_and_hyper_parameters_back_after_a_load():
    saved_cfg = load_run_config("training/configs/tiny_demo.yaml", ["optim.name=adamw", "optim.warmup_steps=2",
                                                                     "optim.total_steps=10"])
    new_cfg = load_run_config("training/configs/tiny_demo.yaml", ["optim.name=adamw", "optim.warmup_steps=2",
                                                                   "optim.total_steps=10", "optim.base_lr=1e-3",
                                                                   "optim.weight_decay=0.5"])
    model = torch.nn.Linear(3, 2)
    old_opt, old_sched = build_optimizer_and_schedule(saved_cfg, model, Horizon(10))
    for _ in range(4):
        model(torch.ones(1, 3)).sum().backward()
        old_opt.step()
        old_sched.step()
    opt_state, sched_state = old_opt.state_dict(), old_sched.state_dict()

    new_opt, new_sched = build_optimizer_and_schedule(new_cfg, model, Horizon(10))
    plan = ResumePlan(new_cfg.to_dict(), saved_cfg.to_dict(), checkpoint="c", step=4)
    with plan.keeping_settings(new_opt, new_sched):
        new_opt.load_state_dict(opt_state)  # what DeepSpeed's load does: the saved groups come back
        new_sched.load_state_dict(sched_state)
        assert new_opt.param_groups[0]["lr"] == pytest.approx(old_opt.param_groups[0]["lr"])
    expected_lr = 1e-3 * new_sched.lr_lambdas[0](4)
    assert [g["lr"] for g in new_opt.param_groups] == pytest.approx([expected_lr] * len(new_opt.param_groups))
    assert new_sched.base_lrs == [1e-3] * len(new_opt.param_groups)
    assert max(g["weight_decay"] for g in new_opt.param_groups) == 0.5
    assert new_opt.state_dict()["state"][0]["exp_avg"].abs().sum() > 0  # the moments are the saved ones
    new_sched.step()
    assert new_opt.param_groups[0]["lr"] == pytest.approx(1e-3 * new_sched.lr_lambdas[0](5))
