"""Text-to-text fine-tuning end to end on CPU: the tiny model, DeepSpeed (gloo), the GLUE recipe on
the tiny samples of tests/assets/glue. The training.glue command, best-checkpoint selection (the
run ends with the best validation weights), resume (bit-exact continuation with the selection
state), early stopping, and bad input refused with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_pretrain import REPO, _env
from training.checkpoint_weights import load_run_model
from training.metrics import read_metrics

ASSETS = REPO / "tests/assets/glue"
# 16 training rows, batch 8: 2 steps per epoch, 3 epochs = 6 steps, the validation split after each,
# stopping after 2 evaluations in a row without a better accuracy
TINY = ["eval.patience=2", "model.preset=tiny", "model.dropout_rate=0.0", "precision=fp32", "device=cpu", "optim.base_lr=1e-3",
        "optim.batch_size=8", "data.epochs=3", "eval.every_steps=1", "eval.batch_size=8", "logging.every_steps=1",
        "logging.wandb=disabled", "deterministic=true"]


def finetune(out: Path, *overrides: str, expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "training/finetune.py", "--config", "training/configs/glue_rte.yaml",
                           f"output_dir={out}", f"data.dir={ASSETS / 'rte'}", *TINY, *overrides], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == expect, proc.stderr[-5000:]
    return proc


def validation_records(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl", "eval") if r["split"] == "validation"]


@pytest.fixture(scope="module")
def glue_runs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("glue")
    proc = subprocess.run([sys.executable, "-m", "training.glue", "--checkpoint", "random", "--tasks",
                           f"rte={ASSETS / 'rte'},sst2={ASSETS / 'sst2'}", "--out", str(out), *TINY], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out, proc


def early_stop(records: list[dict], patience: int = 2) -> int:
    """The step the rule stops at: `patience` evaluations in a row that do not raise the best accuracy."""
    best, without = None, 0
    for r in records:
        better = best is None or r["accuracy"] > best
        best, without = (r["accuracy"], 0) if better else (best, without + 1)
        if without == patience:
            return r["step"]
    return 6


def test_glue_command_prints_and_writes_the_table(glue_runs):
    out, proc = glue_runs
    results = json.loads((out / "glue_results.json").read_text())["results"]
    assert [r["task"] for r in results] == ["rte", "sst2"]
    for row in results:
        records = validation_records(out / row["task"])
        last = early_stop(records)
        assert [r["step"] for r in records] == list(range(1, last + 1))
        assert max(r["step"] for r in read_metrics(out / row["task"] / "metrics.jsonl", "train")) == last
        best = max(r["accuracy"] for r in records)
        assert row["accuracy"] == best and row["step"] == next(r["step"] for r in records if r["accuracy"] == best)
        assert row["n_examples"] == 8
        table_row = [x.split() for x in proc.stdout.splitlines() if x.split()[:2] == [row["task"], "accuracy"]]
        assert table_row == [[row["task"], "accuracy", f"{row['accuracy']:.2f}", "8", str(row["step"])]]
        predictions = (out / row["task"] / "eval" / "validation" / f"step_{row['step']:08d}" / "predictions.jsonl")
        assert len(predictions.read_text().splitlines()) == 8
    first = json.loads((out / "sst2/eval/validation/step_00000001/predictions.jsonl").read_text().splitlines()[0])
    assert first["input"].startswith("sst2 sentence: ") and first["references"][0] in ("negative", "positive")


def test_the_run_ends_with_the_best_validation_weights(glue_runs):
    run = glue_runs[0] / "rte"
    best_step = json.loads((glue_runs[0] / "glue_results.json").read_text())["results"][0]["step"]
    final, path = load_run_model(run)
    assert path.name == f"step_{early_stop(validation_records(run)):08d}" != f"step_{best_step:08d}"
    best, _ = load_run_model(run, run / "checkpoints" / f"step_{best_step:08d}")  # kept beyond keep_last=1
    assert all(torch.equal(v, best.state_dict()[k]) for k, v in final.state_dict().items())


def test_resume_continues_exactly_with_the_selection_state(glue_runs, tmp_path):
    """Steps 1-2 with a checkpoint each, then a resume: the same validation results, early stop, best
    step and final weights as the uninterrupted run of the glue command."""
    run = tmp_path / "rte"
    finetune(run, "optim.total_steps=2", "checkpoint.every_steps=1", "checkpoint.at_end=false")
    proc = finetune(run)
    assert "resume" in [e["event"] for e in read_metrics(run / "metrics.jsonl", "event")]
    whole = glue_runs[0] / "rte"
    # (a step evaluated before the stop and again after the resume is logged twice, with one value)
    assert {r["step"]: r["accuracy"] for r in validation_records(run)} == \
        {r["step"]: r["accuracy"] for r in validation_records(whole)}
    losses = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl", "train")}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in read_metrics(whole / "metrics.jsonl", "train")})
    resumed, _ = load_run_model(run)
    uninterrupted, _ = load_run_model(whole)
    assert all(torch.allclose(v, uninterrupted.state_dict()[k]) for k, v in resumed.state_dict().items())
    assert proc.stdout.strip().splitlines()[-1].startswith("rte validation: accuracy ")
    again = finetune(run)  # a finished run started again: nothing trains, the same result
    assert again.stdout.strip().splitlines()[-1] == proc.stdout.strip().splitlines()[-1]
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl", "train")) == max(losses)


@pytest.mark.parametrize("overrides, message", [
    (["task.validation_split=dev"], "no dev split in .*rte: expected dev.jsonl"),
    (["task.metrics=[accuracy, matthews]"], "unknown metric 'matthews': task.metrics takes a list of"),
])
def test_bad_task_input_is_one_line_and_exit_2(tmp_path, overrides, message):
    import re

    proc = finetune(tmp_path / "bad", *overrides, expect=2)
    lines = proc.stderr.strip().splitlines()
    assert re.search(message, lines[-1]), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
