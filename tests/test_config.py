"""Run config: YAML loading, `extends`, typed overrides, validation messages, shipped configs."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from data_prep.shard_format import t5_span_lengths
from training import config as config_module
from training import config_loader
from training.config import ConfigError, RunConfig, eval_batch_size_per_rank, micro_batch_size
from training.config_loader import apply_overrides, dump_yaml, from_dict, load_run_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "training" / "configs").glob("*.yaml"))


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    for required in (
        "t5_base_c4.yaml",
        "t5_small_c4.yaml",
        "t5_large_c4.yaml",
        "t5_xl_c4.yaml",
        "t5_xxl_c4.yaml",
        "tiny_demo.yaml",
        "t5_base_c4_budget_24h.yaml",
        "t5_base_c4_budget_16h.yaml",
    ):
        assert required in names


def config_class(path: Path) -> type:
    """Fine-tuning configs (training/finetune.py) are named sni*.yaml and glue*.yaml; the rest are pre-training."""
    from training.finetune_config import FinetuneConfig

    return FinetuneConfig if path.name.startswith(("sni", "glue")) else RunConfig


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path, tmp_path):
    root = config_class(path)
    cfg = load_run_config(str(path), [], root=root)
    assert isinstance(cfg, root)
    out = tmp_path / "config.yaml"
    dump_yaml(cfg, out)
    assert load_run_config(str(out), [], root=root) == cfg
    assert cfg.output_dir.startswith("runs/")


def test_base_config_is_the_nanot5_recipe(repo_root):
    cfg = load_run_config(str(repo_root / "training/configs/t5_base_c4.yaml"), [])
    assert cfg.model.preset == "base"
    assert cfg.model.dropout_rate == 0.0
    assert cfg.precision == "bf16"
    assert cfg.data.input_length == 512
    assert t5_span_lengths(
        cfg.data.input_length, cfg.data.noise_density, cfg.data.mean_noise_span_length
    ) == (
        568,
        114,
    )
    o = cfg.optim
    assert (o.name, o.base_lr, o.batch_size, o.total_steps, o.warmup_steps) == (
        "adamwscale",
        2e-2,
        128,
        65536,
        10000,
    )
    assert (o.lr_scheduler, o.final_cosine, o.grad_clip) == ("cosine", 1e-5, 1.0)
    assert cfg.budget.hours is None
    # Every key is spelled out in the base file, with the values of the dataclass defaults.
    raw = yaml.safe_load((repo_root / "training/configs/t5_base_c4.yaml").read_text())
    assert from_dict(raw) == cfg
    assert set(raw) == {f.name for f in dataclasses.fields(RunConfig)}


def test_size_variants_and_budgets_inherit_base(repo_root):
    base = load_run_config(str(repo_root / "training/configs/t5_base_c4.yaml"), [])
    for name, preset in (("t5_small_c4", "small"), ("t5_large_c4", "large"), ("t5_xl_c4", "xl"),
                         ("t5_xxl_c4", "xxl")):
        cfg = load_run_config(str(repo_root / f"training/configs/{name}.yaml"), [])
        assert cfg.model.preset == preset
        assert cfg.optim.total_steps == base.optim.total_steps
        assert cfg.output_dir == f"runs/{name}"
    for hours in (16, 24):
        cfg = load_run_config(str(repo_root / f"training/configs/t5_base_c4_budget_{hours}h.yaml"), [])
        assert cfg.budget.hours == hours
        assert dataclasses.replace(cfg, output_dir=base.output_dir, budget=base.budget) == base


def test_tiny_demo_is_a_small_fp32_run(repo_root):
    cfg = load_run_config(str(repo_root / "training/configs/tiny_demo.yaml"), [])
    assert (cfg.precision, cfg.model.preset, cfg.model.compile) == ("fp32", "tiny", False)
    assert cfg.device in ("auto", "cpu")
    assert cfg.output_dir == "runs/demo" and cfg.data.dir.startswith("runs/demo")
    assert cfg.optim.warmup_steps < cfg.optim.total_steps <= 1000
    assert cfg.logging.wandb in ("offline", "disabled")
    assert micro_batch_size(cfg, 1) == cfg.optim.batch_size


def test_overrides_are_parsed_by_field_type():
    cfg = load_run_config(
        None,
        [
            "optim.base_lr=1e-2",
            "optim.total_steps=1000",
            "optim.warmup_steps=1e2",
            "optim.betas=0.9,0.98",
            "model.compile=false",
            "model.preset=small",
            "model.init_from=/ckpt/dir",
            "eval.max_samples=null",
            "budget.hours=1.5",
            "logging.run_name=None",
            "seed=7",
            "data.dir=/data/shards",
        ],
    )
    assert cfg.optim.base_lr == 0.01 and isinstance(cfg.optim.base_lr, float)
    assert cfg.optim.total_steps == 1000 and cfg.optim.warmup_steps == 100
    assert cfg.optim.betas == (0.9, 0.98)
    assert cfg.model.compile is False and cfg.model.preset == "small"
    assert cfg.model.init_from == "/ckpt/dir"
    assert cfg.eval.max_samples is None
    assert cfg.budget.hours == 1.5
    assert cfg.logging.run_name is None
    assert cfg.seed == 7 and cfg.data.dir == "/data/shards"


def test_apply_overrides_returns_new_validated_config():
    cfg = RunConfig()
    new = apply_overrides(cfg, ["optim.grad_acc=4", "eval.every_steps=0"])
    assert (new.optim.grad_acc, new.eval.every_steps) == (4, 0)
    assert cfg.optim.grad_acc == 1  # the original is untouched
    with pytest.raises(ConfigError, match="divisible"):
        apply_overrides(cfg, ["optim.grad_acc=3"])


def test_unknown_keys_list_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["optim.lr=1e-3"])
    assert "optim.lr" in str(e.value) and "base_lr" in str(e.value) and "warmup_steps" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_run_config(None, ["optimizer.base_lr=1e-3"])
    assert "optimizer" in str(e.value) and "optim" in str(e.value)
    with pytest.raises(ConfigError, match="output_dir"):
        load_run_config(None, ["outdir=x"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_run_config(None, ["optim.base_lr"])


def test_unknown_key_in_yaml_is_an_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  base_lr: 1.0e-2\n  warmup: 100\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(str(path), [])
    assert "optim.warmup" in str(e.value) and "warmup_steps" in str(e.value)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("optim.batch_size=abc", "not an int"),
        ("optim.batch_size=12.5", "not an int"),
        ("optim.base_lr=fast", "not a float"),
        ("model.compile=maybe", "true or false"),
        ("optim.betas=0.9", "2 comma-separated"),
        ("precision=fp16", "bf16, fp32"),
        ("device=tpu", "auto, cuda, cpu"),
        ("model.preset=huge", "tiny, small, base, large, xl, xxl"),
        ("model.zero3_compile=all", "blocks, pointwise"),
        ("model.compile_mode=fast", "default, reduce-overhead, max-autotune-no-cudagraphs"),
        ("optim.name=sgd", "adamwscale"),
        ("optim.lr_scheduler=step", "cosine"),
        ("logging.wandb=yes", "offline"),
    ],
)
def test_ill_typed_or_invalid_values_say_what_is_valid(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_run_config(None, [override])


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["optim.batch_size=128", "optim.grad_acc=3"], "divisors of batch_size"),
        (["optim.warmup_steps=65536"], "lower warmup_steps or raise total_steps"),
        (["eval.every_steps=-1"], "eval.every_steps"),
        (["checkpoint.every_steps=-5"], "checkpoint.every_steps"),
        (["checkpoint.keep_last=0"], "keep_last"),
        (["optim.grad_clip=-1"], "0 disables"),
        (["optim.base_lr=0"], "base_lr"),
        (["budget.hours=0"], "budget.hours"),
        (["model.dropout_rate=1.0"], "dropout_rate"),
        (["data.noise_density=0"], "noise_density"),
        (["optim.betas=0.9,1.0"], "betas"),
        (["eval.max_samples=-1"], "max_samples"),
    ],
)
def test_validation_messages_say_how_to_fix(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_run_config(None, overrides)


def test_validation_runs_on_the_merged_result():
    # Each override alone would be invalid for the other's default; together they are fine.
    cfg = load_run_config(None, ["optim.total_steps=100", "optim.warmup_steps=10"])
    assert (cfg.optim.total_steps, cfg.optim.warmup_steps) == (100, 10)


def test_yaml_exponent_without_dot_is_a_float(tmp_path):
    # PyYAML reads `2e-2` (no dot) as a string; the loader must still treat it as a float.
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  base_lr: 2e-2\n  final_cosine: 1e-5\n  betas: [0.9, 0.95]\n")
    cfg = load_run_config(str(path), [])
    assert cfg.optim.base_lr == 0.02 and cfg.optim.final_cosine == 1e-5
    assert cfg.optim.betas == (0.9, 0.95)


def test_extends_inherits_and_overrides(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.yaml").write_text(
        "seed: 1\noptim:\n  base_lr: 0.5\n  grad_acc: 2\nmodel:\n  preset: small\n"
    )
    (tmp_path / "sub" / "child.yaml").write_text("extends: ../base.yaml\noptim:\n  grad_acc: 4\n")
    cfg = load_run_config(str(tmp_path / "sub" / "child.yaml"), ["seed=3"])
    assert cfg.optim.base_lr == 0.5  # inherited from the parent's section
    assert cfg.optim.grad_acc == 4  # the child's key wins
    assert cfg.model.preset == "small"
    assert cfg.seed == 3  # command line wins over both


def test_extends_cycle_and_missing_parent(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_run_config(str(tmp_path / "a.yaml"), [])
    (tmp_path / "c.yaml").write_text("extends: nope.yaml\n")
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(str(tmp_path / "c.yaml"), [])


def test_to_dict_is_plain_and_complete():
    d = RunConfig().to_dict()
    assert d["optim"]["betas"] == [0.9, 0.999]
    assert set(d) == {f.name for f in dataclasses.fields(RunConfig)}
    assert from_dict(d) == RunConfig()
    yaml.safe_dump(d)  # only plain types


def test_micro_batch_size():
    cfg = load_run_config(None, ["optim.batch_size=128", "optim.grad_acc=2"])
    assert micro_batch_size(cfg, 1) == 64
    assert micro_batch_size(cfg, 4) == 16
    assert micro_batch_size(cfg, 64) == 1
    with pytest.raises(ConfigError) as e:
        micro_batch_size(cfg, 3)
    msg = str(e.value)
    assert "world_size" in msg and "optim.grad_acc" in msg and "optim.batch_size" in msg
    with pytest.raises(ConfigError):
        micro_batch_size(cfg, 128)  # 128 / (2 * 128) is not a whole sequence
    assert eval_batch_size_per_rank(cfg, 4) == 32
    with pytest.raises(ConfigError, match="eval.batch_size"):
        eval_batch_size_per_rank(cfg, 3)


def test_command_line_prints_the_resolved_config_or_says_what_is_wrong(tmp_path):
    """`python -m training.config_loader CONFIG.yaml key=value ...` prints YAML that loads back to the
    same config; a bad file or key exits 2 with the loader's message and no traceback."""
    repo = Path(__file__).resolve().parents[1]
    demo = repo / "training/configs/tiny_demo.yaml"

    def run(*args):
        return subprocess.run([sys.executable, "-m", "training.config_loader", *map(str, args)], cwd=repo,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    done = run(demo, "optim.base_lr=1e-2", "seed=5")
    assert done.returncode == 0, done.stderr
    printed = from_dict(yaml.safe_load(done.stdout))
    assert printed == load_run_config(str(demo), ["optim.base_lr=1e-2", "seed=5"])
    assert printed.optim.base_lr == 1e-2 and printed.seed == 5
    missing = run(tmp_path / "nosuch.yaml")
    assert missing.returncode == 2 and "nosuch.yaml does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    typo = run(demo, "optim.lr=1e-3")
    assert typo.returncode == 2 and "unknown key optim.lr" in typo.stderr and "base_lr" in typo.stderr


def test_every_field_is_documented():
    """Each dataclass field in training/config.py is followed by a docstring (units, meaning)."""
    tree = ast.parse(Path(config_module.__file__).read_text())
    undocumented = []
    for node in tree.body:
        if (
            not (isinstance(node, ast.ClassDef) and node.name.endswith("Config"))
            or node.name == "ConfigError"
        ):
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                is_section = stmt.target.id in config_module.SECTION_TYPES
                documented = isinstance(nxt, ast.Expr) and isinstance(
                    getattr(nxt, "value", None), ast.Constant
                )
                if not documented and not is_section:
                    undocumented.append(f"{node.name}.{stmt.target.id}")
    assert undocumented == []


def test_choices_match_the_model_package():
    from training.model.config import (
        ACTIVATION_CHECKPOINTING,
        ATTENTION_BACKENDS,
        ATTENTION_BIAS_LAYOUTS,
        FFN_KERNELS,
        RESIDUAL_DTYPES,
        T5Config,
    )
    from training.zero3_compile import ZERO3_COMPILE_MODES

    assert set(config_module.ATTENTION_BACKENDS) == set(ATTENTION_BACKENDS)
    assert config_module.RESIDUAL_DTYPES == RESIDUAL_DTYPES
    assert config_module.FFN_KERNELS == FFN_KERNELS
    assert config_module.ACTIVATION_CHECKPOINTING == ACTIVATION_CHECKPOINTING
    assert config_module.ATTENTION_BIAS_LAYOUTS == ATTENTION_BIAS_LAYOUTS
    assert config_module.ZERO3_COMPILE_MODES == ZERO3_COMPILE_MODES
    for preset in config_module.MODEL_PRESETS:
        T5Config.from_preset(preset)  # every preset the run config accepts exists
    with pytest.raises(ConfigError, match="sdpa"):
        load_run_config(None, ["model.attention_backend=fast"])
    with pytest.raises(ConfigError, match="model.attention_bias_layout"):
        load_run_config(None, ["model.attention_bias_layout=relative"])


def test_shipped_configs_and_tokenizer_are_found_from_any_directory(tmp_path, monkeypatch):
    """Run from outside the repository, the shipped config and the default tokenizer resolve to the
    repository's files; a path that exists where the command runs keeps its meaning."""
    from training.config_loader import REPO_ROOT
    from training.finetune_config import FinetuneConfig

    monkeypatch.chdir(tmp_path)
    cfg = load_run_config("training/configs/tiny_demo.yaml", [])
    assert cfg.data.tokenizer == str(REPO_ROOT / "assets" / "t5" / "spiece.model")
    assert cfg.data.dir == "runs/demo/shards"  # the user's data stays relative to where they run
    # fine-tuning takes its init's tokenizer unless one is given
    assert load_run_config("training/configs/sni_tiny.yaml", [], root=FinetuneConfig).data.tokenizer is None
    assert load_run_config("training/configs/sni_tiny.yaml", ["data.tokenizer=assets/t5/spiece.model"],
                           root=FinetuneConfig).data.tokenizer == str(REPO_ROOT / "assets" / "t5" / "spiece.model")
    (tmp_path / "assets" / "t5").mkdir(parents=True)
    (tmp_path / "assets" / "t5" / "spiece.model").write_bytes(b"the user's own")
    assert load_run_config("training/configs/tiny_demo.yaml", []).data.tokenizer == "assets/t5/spiece.model"
    with pytest.raises(ConfigError, match="does not exist; the shipped run configs in .*tiny_demo.yaml"):
        load_run_config("training/configs/tiny_demo_typo.yaml", [])


@dataclasses.dataclass
class _Source:
    dir: str
    weight: float = 1.0


@dataclasses.dataclass
class _ListSection:
    sources: tuple[_Source, ...] = ()
    lengths: tuple[int, ...] = ()


@dataclasses.dataclass
class _ListRoot:
    data: _ListSection = dataclasses.field(default_factory=_ListSection)


def test_list_fields_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  sources:\n    - {dir: a, weight: 3}\n    - dir: b\n  lengths: [1, 2]\n")
    cfg = config_loader.load_run_config(path, root=_ListRoot)
    assert cfg.data.sources == (_Source("a", 3.0), _Source("b", 1.0))
    assert cfg.data.lengths == (1, 2)
    cfg = config_loader.load_run_config(path, ["data.sources=[{dir: c, weight: 0.5}]", "data.lengths=[7]"],
                                        root=_ListRoot)
    assert cfg.data.sources == (_Source("c", 0.5),) and cfg.data.lengths == (7,)
    for bad, message in (("data.sources=[{dir: c, size: 1}]", r"unknown key data.sources\[0\].size"),
                         ("data.sources={dir: c}", "must be a list"),
                         ("data.lengths=[1, x]", r"data.lengths\[1\]='x' is not an int")):
        with pytest.raises(ConfigError, match=message):
            config_loader.load_run_config(path, [bad], root=_ListRoot)
