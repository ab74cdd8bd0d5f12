"""End-to-end tests of `training/pretrain.py` on CPU: real bundled C4 shards, the tiny model,
DeepSpeed with gloo, 1 and 2 ranks. Resume exactness, SIGTERM, non-finite stop, export, plot; resume with
a changed config, past a damaged checkpoint, into non-finite steps; a dataset without validation split."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from training.checkpoint_weights import checkpoint_state_dict
from training.metrics import read_metrics
from training.run_dir import LOCK_NAME
from training.stop_signals import EXIT_NONFINITE, EXIT_REQUEUE

REPO = Path(__file__).resolve().parents[1]
STEPS = 10
# Log every step, checkpoint at 5 and 10, no periodic evaluation (the final one still runs).
BASE = [
    f"optim.total_steps={STEPS}", "optim.warmup_steps=2", "optim.batch_size=8", "logging.every_steps=1",
    "eval.every_steps=0", "eval.max_samples=16", "eval.batch_size=8", "checkpoint.every_steps=5",
    "checkpoint.keep_last=5", "data.input_length=64", "data.num_workers=1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(out: Path, shards: Path, extra: list[str], nproc: int, ds_config: str) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                     str(_free_port())]
    return [*launcher, "training/pretrain.py", "--config", "training/configs/tiny_demo.yaml",
            "--deepspeed_config", ds_config, f"output_dir={out}", f"data.dir={shards}", *BASE, *extra]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Other tests set rendezvous variables in this process; a child must pick its own.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def train(out: Path, shards: Path, *extra: str, nproc: int = 1, ds_config: str = "ds_configs/zero0.json",
          expect: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(_command(out, shards, list(extra), nproc, ds_config), cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}\n{proc.stdout[-3000:]}\n" \
                                      f"{proc.stderr[-6000:]}"
    return proc


def losses(run: Path) -> dict[int, float]:
    """Training loss per step; a step logged twice (resumed run) keeps its last record."""
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl", "train")}


def final_weights(run: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return checkpoint_state_dict(run / "checkpoints" / f"step_{step:08d}")


def assert_weights_close(a: dict, b: dict, rtol: float) -> None:
    """Every tensor within `rtol` of the other, relative to the tensor's norm.

    Element-wise comparisons across world sizes or ZeRO stages are too strict here: after 10 steps
    at lr 2e-2, Adam turns last-bit differences of near-zero gradients into update differences of a
    few 1e-4 on single elements (plain torch AdamW shows the same); the optimizer-level parity at
    1e-5 element-wise is tests/test_optim_zero.py.
    """
    assert a.keys() == b.keys()
    for name in a:
        diff = torch.linalg.vector_norm(a[name] - b[name]) / torch.linalg.vector_norm(b[name])
        assert diff <= rtol, (name, float(diff))


def copy_run_until(src: Path, dst: Path, step: int) -> None:
    """A copy of a run directory as it was right after the checkpoint at `step`."""
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / f"step_{step:08d}", dst / "checkpoints" / f"step_{step:08d}")
    (dst / "checkpoints" / "latest").write_text(f"step_{step:08d}")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "c4"
    subprocess.run([sys.executable, "-m", "data_prep.shard", "--input", "assets/c4/en/c4-*.json.gz",
                    "--tokenizer", "assets/t5/spiece.model", "--output", str(out), "--input-length", "64",
                    "--rows-per-shard", "1024", "--workers", "1"], cwd=REPO, env=_env(), check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def reference_run(shards, tmp_path_factory) -> Path:
    """10 uninterrupted steps on one rank (ZeRO 0), checkpoints at 5 and 10, W&B offline."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    train(out, shards, "logging.wandb=offline")
    return out


def test_reference_run_logs_and_learns(reference_run):
    train_records = read_metrics(reference_run / "metrics.jsonl", "train")
    assert [r["step"] for r in train_records] == list(range(1, STEPS + 1))
    for r in train_records:
        for key in ("loss", "lr", "grad_l2", "tokens_per_s", "weights_l2", "seconds_per_step"):
            assert r[key] is not None and r[key] == r[key], (key, r)
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    first = [e for e in read_metrics(reference_run / "metrics.jsonl", "event") if e["event"] == "first_step"]
    # one record, for step 1; nothing compiled on CPU, so no compile-cache outcome
    assert [(e["step"], e["compile_cache"]) for e in first] == [(1, {})] and first[0]["seconds"] > 0
    evals = read_metrics(reference_run / "metrics.jsonl", "eval")
    assert evals and evals[-1]["step"] == STEPS and 0 <= evals[-1]["eval_accuracy"] <= 1
    assert (reference_run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    assert (reference_run / "config.yaml").is_file() and (reference_run / "model_config.json").is_file()
    # W&B ran offline (no account, no network) and wrote its run files into the run directory
    assert list((reference_run / "wandb").glob("offline-run-*"))


def test_time_budget_stops_evaluates_checkpoints_and_fits_the_schedule(shards, tmp_path):
    run = tmp_path / "budget"
    train(run, shards, "budget.hours=0.003", "optim.total_steps=100000", "eval.every_steps=0",
          "checkpoint.every_steps=0")
    records = read_metrics(run / "metrics.jsonl", "train")
    last = records[-1]["step"]
    assert 5 < last < 100000
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"
    assert read_metrics(run / "metrics.jsonl", "eval")[-1]["step"] == last
    # the cosine ran over the fitted horizon, not over 100000 steps: the lr is well into its decay
    peak = max(r["lr"] for r in records)
    assert records[-1]["lr"] < 0.5 * peak


def test_resume_continues_exactly(reference_run, shards, tmp_path):
    """5 steps, stop, resume, 5 steps == 10 straight steps: same losses, same weights."""
    resumed = tmp_path / "resumed"
    copy_run_until(reference_run, resumed, 5)
    train(resumed, shards)
    ref, got = losses(reference_run), losses(resumed)
    assert sorted(got) == list(range(6, STEPS + 1))
    assert [e["step"] for e in read_metrics(resumed / "metrics.jsonl", "event") if e["event"] == "first_step"] == [6]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-6), step
    assert_weights_close(final_weights(resumed), final_weights(reference_run), rtol=1e-6)


def test_deterministic_run_matches_the_reference(reference_run, shards, tmp_path):
    """`deterministic=true` reaches torch (logged in the start event) and changes no result on CPU,
    whose kernels are deterministic anyway (on a GPU it is what makes two runs bit-identical)."""
    run = tmp_path / "deterministic"
    train(run, shards, "deterministic=true", "checkpoint.every_steps=0", "eval.every_steps=0")
    assert read_metrics(run / "metrics.jsonl", "event")[0]["deterministic"]
    assert not read_metrics(reference_run / "metrics.jsonl", "event")[0]["deterministic"]
    ref, got = losses(reference_run), losses(run)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-6), step


def test_two_ranks_match_one_and_resume_on_one(reference_run, shards, tmp_path):
    """2 gloo ranks see the same global batches as 1 rank; a 2-rank checkpoint resumes on 1 rank."""
    two = tmp_path / "two_ranks"
    train(two, shards, nproc=2)
    ref, got = losses(reference_run), losses(two)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    resumed = tmp_path / "resumed_on_one"
    copy_run_until(two, resumed, 5)
    train(resumed, shards, nproc=1)
    got_resumed = losses(resumed)
    for step in range(6, STEPS + 1):
        assert got_resumed[step] == pytest.approx(got[step], rel=1e-4), step
    assert_weights_close(final_weights(resumed), final_weights(two), rtol=1e-4)


@pytest.mark.parametrize("ds_config", ["ds_configs/zero1.json", "ds_configs/zero2.json"])
def test_zero_stages_on_two_ranks_match_zero0(reference_run, shards, tmp_path, ds_config):
    run = tmp_path / Path(ds_config).stem
    train(run, shards, nproc=2, ds_config=ds_config)
    ref, got = losses(reference_run), losses(run)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    assert_weights_close(final_weights(run), final_weights(reference_run), rtol=1e-4)


def test_sigterm_checkpoints_requeues_and_resumes(reference_run, shards, tmp_path):
    run = tmp_path / "preempted"
    proc = subprocess.Popen(_command(run, shards, ["checkpoint.every_steps=0"], 1, "ds_configs/zero0.json"),
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").is_file() and losses(run) and max(losses(run)) >= 3:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_REQUEUE, output[-3000:]
    stopped_at = int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 3 <= stopped_at < STEPS
    train(run, shards, "checkpoint.every_steps=0")
    ref, got = losses(reference_run), losses(run)
    for step in range(stopped_at + 1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-6), step
    assert_weights_close(final_weights(run), final_weights(reference_run), rtol=1e-6)
    events = [r["event"] for r in read_metrics(run / "metrics.jsonl", "event")]
    assert "resume" in events


def test_nonfinite_updates_are_skipped_then_stop_the_run(shards, tmp_path):
    run = tmp_path / "diverged"
    proc = train(run, shards, "optim.name=adamw", "optim.base_lr=1e30", "optim.grad_clip=0",
                 "optim.max_nonfinite_steps=3", "optim.warmup_steps=0", expect=EXIT_NONFINITE)
    assert "non-finite" in proc.stderr
    events = read_metrics(run / "metrics.jsonl", "event")
    assert any(e["event"] == "nonfinite_stop" and e["skipped_steps"] >= 3 for e in events)


def test_export_loads_in_transformers(reference_run, tmp_path):
    from transformers import T5ForConditionalGeneration as HFT5

    from training.checkpoint_weights import load_run_model

    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "training.export", str(reference_run), str(out), "--max-shard-size", "5MB"],
                   cwd=REPO, env=_env(), check=True, capture_output=True)
    assert (out / "model.safetensors.index.json").is_file() and (out / "generation_config.json").is_file()
    ours, _ = load_run_model(reference_run)
    hf = HFT5.from_pretrained(out)  # T5 v1.1's untied head loads as it is (docs/model.md)
    assert not torch.equal(hf.lm_head.weight, hf.shared.weight)
    gen = torch.Generator().manual_seed(0)  # fixed inputs: the comparison does not depend on test order
    ids = torch.randint(2, 32000, (2, 12), generator=gen)
    labels = torch.randint(2, 32000, (2, 5), generator=gen)
    with torch.no_grad():
        theirs, mine = hf(input_ids=ids, labels=labels).logits, ours(input_ids=ids, labels=labels).logits
    # 1e-5 relative to the logits' scale: float32 rounding of logits in the tens reaches ~1e-5 absolute
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5 * float(mine.abs().max()))
    # a second export into the same, now non-empty, directory refuses and writes nothing
    proc = subprocess.run([sys.executable, "-m", "training.export", str(reference_run), str(out)], cwd=REPO,
                          env=_env(), capture_output=True, text=True)
    assert proc.returncode == 2 and "not empty" in proc.stderr


def test_plot_metrics_writes_an_image(reference_run, tmp_path):
    pytest.importorskip("matplotlib")
    from training.plot_metrics import main, run_series

    series = run_series(reference_run)
    assert series[("train", "loss")][0] == list(range(1, STEPS + 1)) and series[("eval", "eval_loss")][0] == [STEPS]
    image = tmp_path / "loss.png"
    assert main([str(reference_run), "--out", str(image)]) == 0
    assert image.stat().st_size > 1000
    assert json.loads((reference_run / "model_config.json").read_text())["d_model"] > 0


@pytest.mark.parametrize("ds_config", ["ds_configs/zero1.json", "ds_configs/zero3.json"])
def test_zero2_checkpoint_resumes_on_another_stage_and_world_size(shards, tmp_path, ds_config):
    """ZeRO 2 on 2 ranks, converted to DeepSpeed's universal format, resumes on 1 rank with another
    stage (weights and adamwscale's moments restored): the loss continues where it stopped."""
    from training.checkpoint_universal import convert_to_universal

    source = tmp_path / "zero2_two_ranks"
    train(source, shards, nproc=2, ds_config="ds_configs/zero2.json")
    new_run = tmp_path / "resumed"
    convert_to_universal(source, new_run, source / "checkpoints" / "step_00000005")
    train(new_run, shards, nproc=1, ds_config=ds_config)
    ref, got = losses(source), losses(new_run)
    assert sorted(got) == list(range(6, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    assert_weights_close(final_weights(new_run), final_weights(source), rtol=1e-4)


@pytest.fixture(scope="module")
def five_step_run(shards, tmp_path_factory) -> Path:
    """5 steps on one rank, checkpoints at 2, 4 and 5 (the end): the run that the resume tests continue."""
    out = tmp_path_factory.mktemp("runs") / "five_steps"
    train(out, shards, "optim.total_steps=5", "checkpoint.every_steps=2")
    return out


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_resume_with_a_longer_run_and_a_new_lr_past_a_damaged_checkpoint(five_step_run, shards, tmp_path):
    """optim.total_steps 5 -> 10 trains to 10 and optim.base_lr applies from the resume step on; the newest
    checkpoint, damaged, is skipped by name for the one before it and kept aside when its step is saved again."""
    from training.optim import lr_at

    run = copy_run(five_step_run, tmp_path / "longer")
    model_file = run / "checkpoints" / "step_00000005" / "mp_rank_00_model_states.pt"
    raw = bytearray(model_file.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    model_file.write_bytes(bytes(raw))
    proc = train(run, shards, "optim.total_steps=10", "optim.base_lr=5e-3", "checkpoint.every_steps=1")
    assert "skipping damaged checkpoint" in proc.stderr and "mp_rank_00_model_states.pt: bytes" in proc.stderr
    changed = [line for line in proc.stderr.splitlines() if "with changed settings" in line]
    assert len(changed) == 1 and "resuming at step 4" in changed[0]
    assert "optim.total_steps 5 -> 10" in changed[0] and "optim.base_lr 0.02 -> 0.005" in changed[0]
    records = {r["step"]: r for r in read_metrics(run / "metrics.jsonl", "train")}
    assert sorted(s for s in records if s > 4) == list(range(5, 11))
    cfg = yaml.safe_load((run / "config.yaml").read_text())["optim"]  # what the run really used
    assert cfg["base_lr"] == 5e-3 and cfg["total_steps"] == 10
    for step in range(5, 11):  # the lr after each step, on the new base lr and the 10-step horizon
        expected = lr_at(cfg["lr_scheduler"], step, base_lr=5e-3, warmup_steps=cfg["warmup_steps"], total_steps=10,
                         final_lr=cfg["final_cosine"])
        assert records[step]["lr"] == pytest.approx(expected, rel=1e-9), step
    assert read_metrics(run / "metrics.jsonl", "eval")[-1]["step"] == 10
    resume = [e for e in read_metrics(run / "metrics.jsonl", "event") if e["event"] == "resume"][-1]
    # the copy's output_dir and the checkpoint interval changed too
    assert set(resume["config_changes"]) == {"optim.total_steps", "optim.base_lr", "checkpoint.every_steps",
                                             "output_dir"}
    assert (run / "checkpoints" / "step_00000005.damaged" / "mp_rank_00_model_states.pt").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000010"


def test_resume_with_another_model_shape_is_refused_and_changes_nothing(five_step_run, shards, tmp_path):
    run = copy_run(five_step_run, tmp_path / "reshaped")
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = subprocess.run(_command(run, shards, ["model.preset=small"], 1, "ds_configs/zero0.json"), cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0
    assert "cannot resume from" in proc.stderr and "model.preset ('tiny' -> 'small'" in proc.stderr
    # everything written is unchanged; the lock file names whoever holds the directory last
    changed = [str(path) for path in before if path.name != LOCK_NAME and (run / path).read_bytes() != before[path]]
    assert not changed, changed
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints


def test_a_run_that_goes_nonfinite_writes_no_checkpoint_and_keeps_the_last_finite_one(five_step_run, shards,
                                                                                        tmp_path):
    """Resumed with an absurd learning rate: the weights after step 6 overflow, the following losses are NaN.
    No checkpoint is written from then on, so keep_last=1 cannot rotate out step 5, the one to go back to."""
    run = copy_run(five_step_run, tmp_path / "diverging")
    proc = train(run, shards, "optim.total_steps=10", "optim.base_lr=1e30", "checkpoint.every_steps=1",
                 "checkpoint.keep_last=1", "optim.max_nonfinite_steps=2", expect=EXIT_NONFINITE)
    assert "is not written as a checkpoint" in proc.stderr
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert names == ["step_00000002", "step_00000004", "step_00000005"]
    refused = [e for e in read_metrics(run / "metrics.jsonl", "event") if e["event"] == "checkpoint_refused"]
    # every step from 6 on until the stop (adamwscale learns of a skip a step late, so the stop comes at 8 or 9)
    assert [e["step"] for e in refused] == list(range(6, 6 + len(refused))) and len(refused) >= 2
    assert "weights' L2 norm is inf" in refused[0]["reason"]
    assert all("skipped for a non-finite loss or gradient" in e["reason"] for e in refused[1:])


def test_a_dataset_without_a_validation_split_trains_with_evaluation_off(shards, tmp_path):
    train_only = tmp_path / "train_only"
    subprocess.run([sys.executable, "-m", "data_prep.shard", "--input", "assets/c4/en/c4-train.*.json.gz",
                    "--tokenizer", "assets/t5/spiece.model", "--output", str(train_only), "--input-length", "64",
                    "--rows-per-shard", "1024", "--workers", "1"], cwd=REPO, env=_env(), check=True,
                   capture_output=True)
    run = tmp_path / "no_eval"
    proc = train(run, train_only, "optim.total_steps=3", "eval.every_steps=1")
    assert sum("has no validation split: evaluation is off" in line for line in proc.stderr.splitlines()) == 1
    assert "no validation split: no held-out loss" in proc.stdout
    assert read_metrics(run / "metrics.jsonl", "eval") == []
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
