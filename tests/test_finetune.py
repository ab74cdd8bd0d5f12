"""SNI fine-tuning end to end on CPU: the tiny model, real bundled SNI tasks, DeepSpeed (gloo).
The three init modes (random, one of our pre-training runs, a Hugging Face directory)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_pretrain import REPO, _env
from training.metrics import read_metrics
from training.sni.tasks import load_sni


def finetune(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "training/finetune.py", "--config", "training/configs/sni_tiny.yaml",
                           f"output_dir={out}", *overrides], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def random_init_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sni") / "random"
    finetune(out)
    return out


def test_finetune_lowers_loss_and_predicts_every_test_id(random_init_run):
    train = read_metrics(random_init_run / "metrics.jsonl", "train")
    assert len(train) == 24  # 24 instances / batch 8 = 3 steps per epoch, 8 epochs
    events = read_metrics(random_init_run / "metrics.jsonl", "event")
    assert [e["step"] for e in events if e["event"] == "first_step"] == [1]
    first, last = train[:3], train[-3:]
    assert sum(r["loss"] for r in last) < 0.7 * sum(r["loss"] for r in first)
    out = random_init_run / "sni_eval" / "step_00000024"
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    test_ids = {inst.id for task in load_sni(REPO / "tests/assets/sni", "test") for inst in task.instances}
    assert {p["id"] for p in predictions} == test_ids
    assert len(predictions) == len(test_ids)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["n_instances"] == len(test_ids) and "per_category" in metrics
    evals = read_metrics(random_init_run / "metrics.jsonl", "eval")
    assert evals[-1]["step"] == 24 and evals[-1]["rougeL"] == pytest.approx(metrics["rougeL"])


def test_finetune_from_our_pretraining_run_and_from_hf(random_init_run, tmp_path):
    """init= one of our runs (newest checkpoint), and init= an HF directory exported from it."""
    from_run = tmp_path / "from_run"
    finetune(from_run, f"init={random_init_run}", "data.epochs=1", "deterministic=true")
    events = read_metrics(from_run / "metrics.jsonl", "event")
    assert events[0]["init"] == str(random_init_run)
    # the run config's `deterministic` reached torch (the random-init run ran without it)
    assert events[0]["deterministic"] and not read_metrics(random_init_run / "metrics.jsonl", "event")[0]["deterministic"]
    # starting from a trained model, the first loss is far below the random-init first loss
    start_loss = read_metrics(from_run / "metrics.jsonl", "train")[0]["loss"]
    random_start = read_metrics(random_init_run / "metrics.jsonl", "train")[0]["loss"]
    assert start_loss < 0.7 * random_start

    hf_dir = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "training.export", str(random_init_run), str(hf_dir)], cwd=REPO,
                   env=_env(), check=True, capture_output=True)
    from_hf = tmp_path / "from_hf"
    finetune(from_hf, f"init={hf_dir}", "data.epochs=1", "checkpoint.at_end=false")
    hf_start = read_metrics(from_hf / "metrics.jsonl", "train")[0]["loss"]
    assert hf_start == pytest.approx(start_loss, rel=1e-4)
    # checkpoint.at_end: the default saves the finished run, false leaves no checkpoint
    assert (from_run / "checkpoints" / "latest").is_file()
    assert not list(from_hf.glob("checkpoints/step_*"))


def test_finetune_refuses_zero3_and_bad_init(tmp_path):
    from training.config import ConfigError
    from training.config_loader import load_run_config
    from training.finetune_config import FinetuneConfig

    with pytest.raises(ConfigError, match="zero0.json, zero1.json or zero2.json"):
        load_run_config(REPO / "training/configs/sni.yaml", ["ds_config=ds_configs/zero3.json"], root=FinetuneConfig)
    proc = subprocess.run([sys.executable, "training/finetune.py", "--config", "training/configs/sni_tiny.yaml",
                           f"output_dir={tmp_path / 'x'}", "init=/no/such/model"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "neither `random` nor an existing" in proc.stderr


def test_evaluate_sni_cli_on_our_run_directory(random_init_run, tmp_path):
    """`python -m training.evaluate_sni CHECKPOINT` accepts one of our run directories."""
    out = tmp_path / "eval"
    subprocess.run([sys.executable, "-m", "training.evaluate_sni", str(random_init_run), "--data",
                    "tests/assets/sni", "--out", str(out), "--max-new-tokens", "16", "--batch-size", "8"],
                   cwd=REPO, env=_env(), check=True, capture_output=True, timeout=600)
    metrics = json.loads((out / "metrics.json").read_text())
    # the same weights and decoding as the fine-tuning run's own final evaluation
    final = json.loads((random_init_run / "sni_eval" / "step_00000024" / "metrics.json").read_text())
    assert metrics["n_instances"] == final["n_instances"]
    assert metrics["rougeL"] == pytest.approx(final["rougeL"], abs=1e-6)
