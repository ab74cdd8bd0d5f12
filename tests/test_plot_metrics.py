"""`python -m training.plot_metrics` on the metrics of two real tiny runs (tests/assets/runs): every
logged metric is drawn on labelled axes, the image lands in the run directory, bad input is refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from training.plot_metrics import build_figure, main, run_series  # noqa: E402

RUNS = Path(__file__).resolve().parent / "assets" / "runs"


def _copy(name: str, tmp_path: Path) -> Path:
    run = tmp_path / name
    shutil.copytree(RUNS / name, run)
    return run


def _logged(run: Path) -> set[tuple[str, str]]:
    """(kind, field) of every numeric training or evaluation field with a finite value, read directly."""
    fields = set()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] not in ("train", "eval"):
            continue
        for field, value in record.items():
            if field not in ("kind", "time", "step") and isinstance(value, (int, float)) and math.isfinite(value):
                fields.add((record["kind"], field))
    return fields


def _lines(fig) -> dict[str, object]:
    """gid ("RUN|kind|field") -> the axes that draws it."""
    return {line.get_gid(): ax for ax in fig.axes for line in ax.get_lines()}


@pytest.mark.parametrize("name", ["pretrain_tiny", "finetune_tiny"])
def test_every_logged_metric_is_plotted_on_labelled_axes(name, tmp_path):
    run = _copy(name, tmp_path)
    lines = _lines(build_figure([run]))
    assert set(lines) == {f"{name}|{kind}|{field}" for kind, field in _logged(run)}
    for ax in lines.values():
        assert ax.get_xlabel() == "optimizer step" and ax.get_ylabel() and ax.get_title()


def test_a_pretraining_run_gets_its_loss_held_out_loss_and_norms(tmp_path):
    run = _copy("pretrain_tiny", tmp_path)
    lines = _lines(build_figure([run]))
    loss = lines["pretrain_tiny|train|loss"]
    assert lines["pretrain_tiny|eval|eval_loss"] is loss and "span-corruption" in loss.get_title()
    assert {"grad_l2", "lr", "tokens_per_s", "eval_accuracy"} <= {gid.split("|")[2] for gid in lines}


def test_a_finetuning_run_is_labelled_as_one_with_rouge_per_category(tmp_path):
    run = _copy("finetune_tiny", tmp_path)
    lines = _lines(build_figure([run]))
    loss = lines["finetune_tiny|train|loss"]
    assert "span-corruption" not in loss.get_title() + loss.get_ylabel()
    rouge = lines["finetune_tiny|eval|rougeL"]
    assert "Rouge-L" in rouge.get_ylabel()
    categories = {field for kind, field in _logged(run) if field.startswith("rougeL/")}
    assert categories and all(lines[f"finetune_tiny|eval|{field}"] is rouge for field in categories)
    legend = {text.get_text() for text in rouge.get_legend().get_texts()}
    assert {field.split("/", 1)[1] for field in categories} <= legend


def test_the_image_goes_into_the_run_directory_unless_out_says_otherwise(tmp_path, capsys):
    run = _copy("pretrain_tiny", tmp_path)
    other = _copy("finetune_tiny", tmp_path)
    assert main([str(run)]) == 0
    assert (run / "metrics.png").stat().st_size > 10_000
    assert main([str(run), str(other)]) == 0
    assert (run / "metrics_compared.png").is_file()
    out = tmp_path / "figures" / "both.pdf"
    assert main([str(run), str(other), "--out", str(out), "--log-y"]) == 0
    assert out.read_bytes().startswith(b"%PDF")
    lines = _lines(build_figure([run, other]))
    assert "pretrain_tiny|train|loss" in lines and "finetune_tiny|train|loss" in lines


def test_a_step_logged_twice_keeps_its_later_record(tmp_path):
    run = _copy("pretrain_tiny", tmp_path)
    train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    replayed = [dict(r, loss=r["loss"] + 1.0) for r in train[len(train) // 2:]]  # a resume trains these again
    with open(run / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in replayed)
    steps, losses = run_series(run)[("train", "loss")]
    assert steps == sorted({r["step"] for r in train})
    assert dict(zip(steps, losses)) == {**{r["step"]: r["loss"] for r in train},
                                        **{r["step"]: r["loss"] for r in replayed}}


def test_bad_input_gets_one_line_and_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl not found" in err and len(err.strip().splitlines()) == 1
    run = _copy("pretrain_tiny", tmp_path)
    events = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "event"' in line]
    (run / "metrics.jsonl").write_text("\n".join(events) + "\n")
    assert main([str(run)]) == 2
    assert "nothing to plot" in capsys.readouterr().err
    assert not (run / "metrics.png").exists()
