"""The benchmark scripts (benchmarks/): wave planning, scaling arithmetic, real CPU runs of
benchmarks/scaling.py (tiny model, gloo, 1 and 2 processes; the losses must agree),
reshard_resume.py and convergence.py, the SNI generation and sharding benchmarks, and the GPU-only
scripts' message on a CPU machine."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.scaling import add_scaling, loss_spread, plan_waves
from tests.test_pretrain import _env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The bundled C4 sample sharded for 64-token inputs (train and validation)."""
    out = tmp_path_factory.mktemp("shards") / "c4"
    subprocess.run([sys.executable, "-m", "data_prep.shard", "--input", "assets/c4/en/c4-train.00000-of-01024.json.gz",
                    "--validation-input", "assets/c4/en/c4-validation.00000-of-00008.json.gz",
                    "--tokenizer", "assets/t5/spiece.model", "--output", str(out), "--input-length", "64",
                    "--workers", "1"], cwd=REPO, env=_env(), check=True, capture_output=True)
    return out


def test_plan_waves_packs_disjoint_gpus():
    waves = plan_waves([1, 2, 4], ["zero0", "zero1", "zero2", "zero3"], total_gpus=4, parallel=True)
    assert [len(w) for w in waves] == [4, 2, 2, 1, 1, 1, 1]
    for wave in waves:
        ids = [g for run in wave for g in run["gpu_ids"]]
        assert len(ids) == len(set(ids)) and max(ids) < 4  # disjoint, on the machine
        assert all(len(run["gpu_ids"]) == run["gpus"] for run in wave)
    runs = [(r["gpus"], r["config"]) for w in waves for r in w]
    assert sorted(runs) == sorted((n, c) for n in (1, 2, 4) for c in ("zero0", "zero1", "zero2", "zero3"))
    sequential = plan_waves([1, 2], ["zero0", "zero1"], total_gpus=4, parallel=False)
    assert [len(w) for w in sequential] == [1, 1, 1, 1]
    with pytest.raises(SystemExit, match="4 GPUs but 2"):
        plan_waves([4], ["zero0"], total_gpus=2, parallel=False)


def test_scaling_efficiency_and_loss_spread():
    rows = [
        {"config": "zero1", "gpus": 1, "tokens_per_gpu": 400.0, "last_loss": 10.0},
        {"config": "zero1", "gpus": 4, "tokens_per_gpu": 360.0, "last_loss": 9.0},
        {"config": "zero2", "gpus": 4, "tokens_per_gpu": 380.0, "last_loss": 9.09},
        {"config": "zero3", "gpus": 4, "error": "exit 1"},
    ]
    add_scaling(rows)
    assert rows[0]["scaling_eff"] == 1.0 and rows[1]["scaling_eff"] == pytest.approx(0.9)
    assert "scaling_eff" not in rows[2]  # no 1-GPU zero2 run to compare with
    assert loss_spread(rows) == {4: pytest.approx(0.01)}
    # an earlier invocation's 1-GPU rows fill in the missing baselines; this one's own win
    earlier = [{"config": "zero2", "gpus": 1, "tokens_per_gpu": 400.0},
               {"config": "zero1", "gpus": 1, "tokens_per_gpu": 100.0}]
    add_scaling(rows, earlier)
    assert rows[2]["scaling_eff"] == pytest.approx(0.95) and rows[1]["scaling_eff"] == pytest.approx(0.9)


def test_scaling_script_runs_on_cpu(shards, tmp_path):
    out, results = tmp_path / "scaling", tmp_path / "rows.jsonl"
    cmd = [sys.executable, "benchmarks/scaling.py", "--data", str(shards), "--config", "training/configs/tiny_demo.yaml",
           "--configs", "zero0,zero2", "--gpus", "1,2", "--total-gpus", "2", "--parallel", "--per-gpu-batch", "4",
           "--steps", "4", "--log-every", "1", "--out", str(out), "--json", str(results),
           "data.input_length=64", "data.num_workers=0", "eval.batch_size=8", "eval.max_samples=16"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted((r["config"], r["gpus"]) for r in rows) == [("zero0", 1), ("zero0", 2), ("zero2", 1), ("zero2", 2)]
    for r in rows:
        assert r["global_batch"] == 4 * r["gpus"] and r["last_step"] == 4 and r["tokens_per_s"] > 0
        assert r["scaling_eff"] > 0
        assert r["first_step_s"] > 0 and r["compile_cache"] == {}  # CPU: nothing compiled
    # same global batch, same seed: ZeRO 0 and ZeRO 2 end at the same loss on the same GPU count
    for n in (1, 2):
        a, b = (r["last_loss"] for r in rows if r["gpus"] == n)
        assert abs(a - b) / a < 1e-3, rows
    assert "last losses of zero0, zero2 within" in proc.stdout
    # benchmark runs keep no checkpoint (checkpoint.at_end=false)
    assert not list(out.glob("*/checkpoints/step_*"))


def test_engine_step_script_prints_the_first_step_on_cpu(shards, tmp_path):
    """`benchmarks/engine_step.py`'s row: the step figures and the first step's launch time with what
    the compile cache did (on CPU nothing is compiled), read back from the run's metrics.jsonl."""
    cmd = [sys.executable, "benchmarks/engine_step.py", "--data", str(shards), "--config",
           "training/configs/tiny_demo.yaml", "--configs", "zero0", "--steps", "3", "--log-every", "1",
           "--out", str(tmp_path / "engine"), "--json", str(tmp_path / "rows.jsonl"), "optim.batch_size=4",
           "data.input_length=64", "data.num_workers=0", "eval.batch_size=8", "eval.max_samples=16"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    header, line = proc.stdout.splitlines()[:2]
    assert "1st step s" in header and line.startswith("zero0") and "(not compiled)" in line, proc.stdout
    (row,) = [json.loads(r) for r in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert row["last_step"] == 3 and 0 < row["first_step_s"] < row["wall_s"] and row["compile_cache"] == {}
    assert f"{row['first_step_s']:.1f} (not compiled)" in line


def test_reshard_resume_script_on_cpu(shards, tmp_path):
    """ZeRO 2 on 2 processes, converted half-way, resumed as ZeRO 3 on 1: the losses go on."""
    cmd = [sys.executable, "benchmarks/reshard_resume.py", "--data", str(shards), "--config",
           "training/configs/tiny_demo.yaml", "--source", "zero2:2", "--target", "zero3:1", "--steps", "6",
           "--batch", "8", "--no-gpu-ids", "--out", str(tmp_path / "reshard"), "data.input_length=64",
           "data.num_workers=0", "eval.batch_size=8", "eval.max_samples=16"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(cols[0]) for cols in lines] == [4, 5, 6]
    gap = float(proc.stdout.split("largest relative gap after the resume: ")[1].split("%")[0])
    assert gap < 0.1  # percent: the resumed run continues the same trajectory


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_only_benchmarks_say_what_they_need():
    for script in ("benchmarks/cross_entropy.py", "benchmarks/decode_steps.py"):
        r = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and f"{script} needs a CUDA GPU" in r.stderr, r.stderr[-500:]


def test_sni_generation_benchmark_runs_on_cpu_greedy_and_beam():
    """`benchmarks/sni_generation.py` prints one JSON row per batch size, for greedy and beam search,
    and greedy with eager steps (the flag reaches `generate`, which refuses nothing on CPU)."""
    for beams, graph in ((1, "--cuda-graph"), (2, "--cuda-graph"), (1, "--no-cuda-graph")):
        r = subprocess.run([sys.executable, "benchmarks/sni_generation.py", "--data", "tests/assets/sni",
                            "--preset", "tiny", "--instances", "6", "--batch-sizes", "3", "6", "--max-new-tokens",
                            "3", "--dtype", "fp32", "--num-beams", str(beams), graph],
                           cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-800:]
        rows = [json.loads(line) for line in r.stdout.splitlines()]
        assert [row["batch_size"] for row in rows] == [3, 6]
        assert all(row["num_beams"] == beams and row["instances"] == 6 and row["seconds"] > 0 for row in rows)
        assert all(row["cuda_graph"] == (graph == "--cuda-graph") for row in rows)


def test_convergence_variants_parse():
    from benchmarks.convergence import parse_variants

    assert parse_variants("default=; quack=model.ffn_kernel=quack seed=3") == {
        "default": [], "quack": ["model.ffn_kernel=quack", "seed=3"]}
    for bad, match in (("default", "NAME=OVERRIDES"), ("a b=x=1", "NAME=OVERRIDES"), ("a=;a=x=1", "twice"),
                       ("a=model.ffn_kernel", "key=value"), (" ; ", "empty")):
        with pytest.raises(SystemExit, match=match):
            parse_variants(bad)


def test_convergence_script_on_cpu(shards, tmp_path):
    """Three variants (b and c the same) x two seeds of a 4-step schedule with evaluations: the same
    seed and variant gives the same held-out losses whichever invocation ran it, the seeds differ,
    a second invocation with the same --out runs nothing again, --table-only prints what --out
    holds, a run cut short runs again with its records kept aside, and a directory holding a run of
    another configuration stops the script before it runs or removes anything."""
    out, results = tmp_path / "conv", tmp_path / "rows.jsonl"
    base = [sys.executable, "benchmarks/convergence.py", "--data", str(shards), "--config",
            "training/configs/tiny_demo.yaml", "--steps", "4", "--warmup", "1", "--eval-every", "2",
            "--eval-samples", "16", "--log-every", "1", "--out", str(out), "data.input_length=64",
            "data.num_workers=0", "eval.batch_size=8", "optim.batch_size=4"]
    first = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.001", "--seeds", "0"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    kept = {name: (out / name).stat().st_mtime_ns for name in ("a_seed0.log", "b_seed0.log")}
    second = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.001;c=optim.base_lr=0.001", "--seeds", "0,1",
                             "--json", str(results)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.count("done:") == 6
    rows = {(r["variant"], r["seed"]): r for r in map(json.loads, results.read_text().splitlines())}
    assert sorted(rows) == [(v, s) for v in "abc" for s in (0, 1)]
    for r in rows.values():
        assert r["eval_steps"] == [2, 4] and r["final_step"] == 4 and 0 <= r["final_eval_accuracy"] < 1
        assert r["eval_losses"][-1] == r["final_eval_loss"] and r["train_loss_end"] > 0
    # b seed 0 ran in the first invocation, c seed 0 in the second: the same run, the same figures
    assert rows[("b", 0)]["eval_losses"] == pytest.approx(rows[("c", 0)]["eval_losses"], rel=1e-5)
    assert rows[("a", 0)]["eval_losses"] != rows[("b", 0)]["eval_losses"]  # the variant's override took effect
    assert rows[("a", 0)]["eval_losses"] != rows[("a", 1)]["eval_losses"]  # so did the seed
    # the first invocation's runs were kept, not run again
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert sorted(p.name for p in out.glob("*.log")) == [f"{v}_seed{s}.log" for v in "abc" for s in (0, 1)]
    table = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.001;c=optim.base_lr=0.001", "--seeds", "0,1",
                            "--table-only"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stdout[-3000:] + table.stderr[-3000:]
    summary = [line for line in table.stdout.splitlines() if "final held-out loss" in line]
    assert [line.split()[0] for line in summary] == ["a", "b", "c"]
    mean_b = statistics.fmean(rows[("b", s)]["final_eval_loss"] for s in (0, 1))
    assert f"b              final held-out loss {mean_b:.4f} over 2 seed(s)" in table.stdout
    assert "gap to a +0.0000" in summary[0]
    # a variant name reused for other overrides: stopped before anything runs, nothing removed
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    clash = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.002", "--seeds", "0"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert clash.returncode != 0 and "holds a run of another configuration (optim.base_lr: 0.001 there, 0.002 here)" \
        in clash.stderr, clash.stdout[-2000:] + clash.stderr[-2000:]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    # a run cut short (its last evaluation missing) runs again; its records are moved aside
    metrics = out / "a_seed1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    last_eval = max(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "eval")
    metrics.write_text("".join(lines[:last_eval]))
    again = subprocess.run([*base, "--variants", "a=", "--seeds", "1"], cwd=REPO, env=_env(), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"done: a seed 1: held-out loss {rows[('a', 1)]['final_eval_loss']:.4f} at step 4" in again.stdout
    assert len(list((out / "a_seed1").glob("metrics.cut_short.*.jsonl"))) == 1


def test_sharding_benchmark_runs_on_cpu():
    """`python -m data_prep.benchmark` on the bundled C4 sample without a pool: one row of positive
    rates for the worker count asked for."""
    r = subprocess.run([sys.executable, "-m", "data_prep.benchmark", "--workers", "0", "--copies", "1",
                        "--repeats", "1"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-800:]
    lines = r.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.split()[:2] == ["workers", "wall"]))
    cells = lines[header + 1].split()
    assert cells[0] == "0" and len(cells) == 11 and all(float(c) > 0 for c in cells[1:6])
