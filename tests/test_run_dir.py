"""training/run_dir.py: the layout of a run directory, writing and reading its files back in the
formats existing runs have, and that the modules reading or writing a run go through it."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import yaml

from training.checkpoint import CheckpointManager
from training.checkpoint_weights import load_run_model, newest_checkpoint
from training.config import RunConfig
from training.config_loader import load_run_config
from training.finetune_config import FinetuneConfig
from training.metrics import MetricsLogger, read_metrics
from training.model import T5ForConditionalGeneration
from training.model.config import T5Config
from training.plot_metrics import run_series
from training.run_dir import RunDir, step_dirname

REPO = Path(__file__).resolve().parents[1]


def test_layout_names_every_file_of_a_run(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.path == tmp_path / "run" and str(run) == str(tmp_path / "run") and Path(run) == run.path
    assert run.config_file == tmp_path / "run" / "config.yaml"
    assert run.ds_config_file == tmp_path / "run" / "ds_config.json"
    assert run.model_config_file == tmp_path / "run" / "model_config.json"
    assert run.metrics_file == tmp_path / "run" / "metrics.jsonl"
    assert run.checkpoints == tmp_path / "run" / "checkpoints"
    assert run.sni_eval_dir(24) == tmp_path / "run" / "sni_eval" / "step_00000024"
    assert run.compile_cache == tmp_path / "run" / "compile_cache"
    assert RunDir(run) == run and RunDir(str(run.path)) == run and RunDir(tmp_path) != run
    assert step_dirname(5000) == "step_00005000" and step_dirname(123456789) == "step_123456789"
    with pytest.raises(ValueError, match="step must be >= 0"):
        step_dirname(-1)
    assert not run.path.exists()  # naming a run directory creates nothing


def test_run_config_round_trips_through_config_yaml(tmp_path):
    """config.yaml is what load_run_config reads back to the same config, for pre-training and
    fine-tuning alike; read_config gives it as a plain dict."""
    run = RunDir(tmp_path / "run")
    cfg = load_run_config(REPO / "training/configs/tiny_demo.yaml", ["optim.base_lr=1e-2", "seed=5"])
    run.create()
    run.write_config(cfg)
    assert load_run_config(run.config_file) == cfg
    assert run.read_config() == cfg.to_dict() and run.read_config()["data"]["tokenizer"] == cfg.data.tokenizer
    finetune = load_run_config(REPO / "training/configs/sni_tiny.yaml", ["init=random"], root=FinetuneConfig)
    run.write_config(finetune)
    assert load_run_config(run.config_file, root=FinetuneConfig) == finetune
    assert not list(run.path.glob("*.tmp"))  # written through a temporary file and a rename


def test_model_config_is_written_as_existing_runs_hold_it_and_marks_a_run(tmp_path):
    """model_config.json is the T5Config's fields as sorted, indented JSON (the format every existing
    run directory has, byte for byte), reads back to the same T5Config, and is what tells one of our
    run directories from any other directory."""
    run = RunDir(tmp_path)
    model_config = T5Config.from_preset("tiny", dropout_rate=0.1)
    assert not run.is_run()
    run.write_model_config(model_config)
    assert run.is_run()
    assert run.model_config_file.read_text() == json.dumps(asdict(model_config), indent=2, sort_keys=True)
    assert run.read_model_config() == model_config

    ds_config = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    run.write_ds_config(ds_config)
    assert run.ds_config_file.read_text() == json.dumps(ds_config, indent=2)


def test_reading_a_directory_that_is_no_run_says_so(tmp_path):
    run = RunDir(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        run.read_model_config()
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        run.read_config()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint under .*checkpoints"):
        load_run_model(run)
    assert newest_checkpoint(run) is None


def test_copy_definition_takes_the_configs_and_nothing_else(tmp_path):
    source, target = RunDir(tmp_path / "a"), RunDir(tmp_path / "b")
    source.create()
    source.write_config(RunConfig())
    source.write_model_config(T5Config.from_preset("tiny"))
    source.write_ds_config({"train_batch_size": 8})
    source.metrics_file.write_text("{}\n")
    source.checkpoints.mkdir()
    source.copy_definition_to(target)
    assert sorted(p.name for p in target.path.iterdir()) == ["config.yaml", "model_config.json"]
    assert target.read_model_config() == source.read_model_config()
    assert target.config_file.read_text() == source.config_file.read_text()


def test_checkpoints_metrics_and_plots_use_the_run_directory(tmp_path):
    """The checkpoint manager, the metrics logger and the loss plot find their files through RunDir."""
    run = RunDir(tmp_path / "run")
    manager = CheckpointManager(run, keep_last=1, rank=0, world_size=1, barrier=lambda: None)
    assert manager.root == run.checkpoints
    assert CheckpointManager(run.path, keep_last=1, rank=0, world_size=1).root == run.checkpoints
    metrics = MetricsLogger(run, rank=0)
    assert metrics.path == run.metrics_file and run.path.is_dir()
    metrics.log("train", {"step": 1, "loss": 5.0})
    metrics.log("train", {"step": 2, "loss": float("nan")})  # a non-finite figure becomes null
    metrics.log("eval", {"step": 2, "eval_loss": 4.5})
    metrics.close()
    assert [r["loss"] for r in read_metrics(run.metrics_file, "train")] == [5.0, None]
    assert run_series(run) == {("train", "loss"): ([1], [5.0]), ("eval", "eval_loss"): ([2], [4.5])}
    MetricsLogger(RunDir(tmp_path / "other"), rank=1).log("train", {"step": 1})  # rank 1 writes nothing
    assert not (tmp_path / "other").exists()


def test_a_run_model_comes_from_its_newest_complete_checkpoint(tmp_path):
    """load_run_model builds the run's model from model_config.json and takes the weights of the
    newest complete checkpoint under checkpoints/ (a ZeRO 0 module file, as DeepSpeed writes it)."""
    run = RunDir(tmp_path)
    model_config = T5Config.from_preset("tiny")
    run.write_model_config(model_config)
    manager = CheckpointManager(run, keep_last=2, rank=0, world_size=1, barrier=lambda: None)

    class Engine:
        """What CheckpointManager.save asks of a DeepSpeed engine at ZeRO 0: the module's state."""

        def __init__(self, seed: int):
            torch.manual_seed(seed)
            self.module = T5ForConditionalGeneration(model_config).state_dict()

        def save_checkpoint(self, save_dir, tag, save_latest, client_state):
            (Path(save_dir) / tag).mkdir(parents=True)
            torch.save({"module": self.module}, Path(save_dir) / tag / "mp_rank_00_model_states.pt")

    engines = {step: Engine(seed=step) for step in (1, 2)}
    for step, engine in engines.items():
        manager.save(engine, step, {"data": None})
    model, checkpoint = load_run_model(run)
    assert checkpoint == run.checkpoints / "step_00000002" == newest_checkpoint(run)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in engines[2].module.items())
    older, _ = load_run_model(run, run.checkpoints / "step_00000001")
    assert all(torch.equal(older.state_dict()[k], v) for k, v in engines[1].module.items())
    assert not all(torch.equal(older.state_dict()[k], v) for k, v in engines[2].module.items())


RUN_FILE_NAMES = ("config.yaml", "ds_config.json", "model_config.json", "metrics.jsonl", "checkpoints", "sni_eval")


def test_only_run_dir_names_the_files_of_a_run_directory():
    """The product modules (training/, data_prep/) reach the files of a run directory through
    training/run_dir.py: no other module spells their names in code (docstrings and help texts may)."""
    offenders = []
    for path in sorted([*REPO.glob("training/**/*.py"), *REPO.glob("data_prep/**/*.py")]):
        if path.name == "run_dir.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}  # fmt: skip
        helps = {id(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                 for kw in node.keywords if kw.arg == "help"}  # fmt: skip
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and id(node) not in helps and node.value in RUN_FILE_NAMES):  # fmt: skip
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert offenders == []


def test_config_yaml_of_a_run_is_plain_yaml(tmp_path):
    """Other tools (the convergence benchmark, a person) read config.yaml as plain YAML."""
    run = RunDir(tmp_path)
    run.write_config(RunConfig())
    data = yaml.safe_load(run.config_file.read_text())
    assert data["optim"]["betas"] == [0.9, 0.999] and data["model"]["preset"] == "base"


@pytest.mark.parametrize("setting", ["user", "run", "shared", None])
def test_the_compile_cache_is_the_one_the_config_names(tmp_path, monkeypatch, setting):
    """model.compile_cache points inductor's and Triton's caches at the user's cache, the run
    directory or a shared directory, or (null) leaves torch's own choice alone."""
    from training.compile_settings import use_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    run = RunDir(tmp_path / "run")
    chosen = use_compile_cache(str(tmp_path / setting) if setting == "shared" else setting, run.compile_cache)
    expected = {"user": tmp_path / "xdg" / "t5ds" / "compile", "run": run.compile_cache,
                "shared": tmp_path / "shared", None: None}[setting]
    assert chosen == expected
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(expected or "/elsewhere")
    assert os.environ.get("TRITON_CACHE_DIR") == (None if expected is None else str(expected / "triton"))
