"""Weighted mixtures of sharded corpora (training/data/mixture.py, `data.sources`): the interleave's
proportions, the loader's rows, exact resume (also on another world size), per-source held-out loss and
the refusals. Two real corpora: the bundled C4 sample and a Wikipedia slice (tests/assets/wikipedia),
sharded at input length 64."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_pretrain import (
    STEPS,
    assert_weights_close,
    copy_run_until,
    final_weights,
    losses,
    train,
)
from training.config import ConfigError
from training.config_loader import load_run_config
from training.data import EpochPermutation, PretrainBatches, WeightedCorpus
from training.data.mixture import InterleaveSchedule, MixtureError, integer_weights
from training.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
SOURCES = "data.sources=[{{dir: {c4}, weight: 3, name: c4}}, {{dir: {wiki}, weight: 1, name: wiki}}]"


def shard(inputs: str, validation: str | None, out: Path, input_length: int = 64) -> Path:
    command = [sys.executable, "-m", "data_prep.shard", "--input", inputs, "--tokenizer", "assets/t5/spiece.model",
               "--output", str(out), "--input-length", str(input_length), "--rows-per-shard", "1024",
               "--workers", "1", "-q"]
    subprocess.run(command + (["--validation-input", validation] if validation else []), cwd=REPO, check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpora")
    return {
        "c4": shard("assets/c4/en/c4-train.*.json.gz", "assets/c4/en/c4-validation.*.json.gz", root / "c4"),
        "wiki": shard("tests/assets/wikipedia/enwiki-train.jsonl.gz", "tests/assets/wikipedia/enwiki-validation.jsonl.gz",
                      root / "wiki"),
    }


def mixture(corpora, c4_weight=3.0, wiki_weight=1.0) -> list[WeightedCorpus]:
    return [WeightedCorpus("c4", str(corpora["c4"]), c4_weight), WeightedCorpus("wiki", str(corpora["wiki"]), wiki_weight)]


def loader(data, **overrides) -> PretrainBatches:
    kwargs = dict(rank=0, world_size=1, micro_batch_size=8, grad_acc=1, seed=5, num_workers=0, input_length=64,
                  include_indices=True)
    return PretrainBatches(data, "train", **{**kwargs, **overrides})


# --- the interleave ----------------------------------------------------------------------------


def test_weights_become_the_smallest_integers_of_the_same_ratios():
    assert integer_weights([3, 1]) == (3, 1)
    assert integer_weights([0.7, 0.3]) == (7, 3)
    assert integer_weights([0.5, 0.25, 0.25]) == (2, 1, 1)
    assert integer_weights([6, 4]) == (3, 2)
    for bad in ([1, 0], [1, -2], [float("nan")], []):
        with pytest.raises(ValueError, match="must all be finite and > 0"):
            integer_weights(bad)
    with pytest.raises(ValueError, match="round them to fewer decimals"):
        integer_weights([0.1234567, 0.3])


@pytest.mark.parametrize("weights", [(3, 1), (7, 3), (1, 1), (5, 2, 1), (1, 2, 3, 4, 9)])
def test_every_window_holds_each_corpus_at_its_share(weights):
    """Any W consecutive samples (W = sum of the weights) hold exactly w_k of corpus k; any window of L
    samples holds L * w_k / W of them within less than 2, any prefix within less than 1."""
    schedule = InterleaveSchedule(weights)
    period, share = schedule.period, np.array(weights) / sum(weights)
    start = 12345  # far into the line: the schedule is periodic
    sources, _ = schedule.locate(np.arange(start, start + 5 * period))
    counts = np.vstack([np.zeros(len(weights)), np.cumsum(np.eye(len(weights))[sources], axis=0)])
    for length in range(1, 2 * period + 1):
        in_window = counts[length:] - counts[:-length]
        assert np.abs(in_window - length * share).max() < 2, length
        if length % period == 0:
            assert (in_window == length // period * np.array(weights)).all(), length
    prefix_counts = np.cumsum(np.eye(len(weights))[schedule.locate(np.arange(20 * period))[0]], axis=0)
    assert np.abs(prefix_counts - np.arange(1, 20 * period + 1)[:, None] * share).max() < 1
    # each corpus's samples are numbered 0, 1, 2, ... along the line, without gaps or repeats
    all_sources, all_ordinals = schedule.locate(np.arange(20 * period))
    for k in range(len(weights)):
        assert (all_ordinals[all_sources == k] == np.arange(20 * weights[k])).all()


def test_the_loader_serves_the_rows_the_pure_function_gives(corpora):
    """Sample g holds row perm_{n // N_k}(n % N_k) of corpus k, (k, n) from the schedule; over a wiki
    epoch every wiki row comes once, and the next wiki epoch is another order."""
    data = loader(mixture(corpora))
    rows = data.sample_rows
    sizes = [len(store) for store in rows.stores]
    samples = np.arange(4 * sizes[1] + 8)
    read_rows, row_ids, sources = rows.read(samples)
    assert (np.bincount(sources[: 4 * sizes[1]]) == [3 * sizes[1], sizes[1]]).all()
    wiki_rows = row_ids[sources == 1]
    assert sorted(wiki_rows[: sizes[1]]) == list(range(sizes[1]))
    assert (wiki_rows[sizes[1]:] == EpochPermutation(sizes[1], 5, 1, stream=1)(np.arange(2))).all()
    c4_rows = row_ids[sources == 0]
    assert (c4_rows == EpochPermutation(sizes[0], 5, 0)(np.arange(len(c4_rows)))).all()
    for k, store in enumerate(rows.stores):
        np.testing.assert_array_equal(read_rows[sources == k], store.read(row_ids[sources == k]))
    batch = next(iter(data))
    assert (batch["source_index"].numpy() == sources[:8]).all() and (batch["row_index"].numpy() == row_ids[:8]).all()


def test_a_mixture_of_one_corpus_is_that_corpus(corpora):
    alone, mixed = iter(loader(str(corpora["wiki"]))), iter(loader([WeightedCorpus("wiki", str(corpora["wiki"]), 2.0)]))
    for _ in range(3):
        a, b = next(alone), next(mixed)
        for key in ("input_ids", "labels", "row_index"):
            assert (a[key] == b[key]).all()


def test_a_mixture_cursor_resumes_exactly_on_another_world_size(corpora):
    straight = iter(loader(mixture(corpora)))
    reference = [next(straight) for _ in range(6)]
    first = loader(mixture(corpora))
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
    assert state["sources"] == [{"name": "c4", "rows": 7337, "weight": 3}, {"name": "wiki", "rows": 1741, "weight": 1}]
    ranks = [iter(loader(mixture(corpora), rank=r, world_size=2, micro_batch_size=4, cursor=state)) for r in range(2)]
    for step in range(3, 6):
        halves = [next(it) for it in ranks]
        for key in ("sample_index", "source_index", "row_index", "input_ids"):
            assert (np.concatenate([h[key].numpy() for h in halves]) == reference[step][key].numpy()).all()


# --- refusals ----------------------------------------------------------------------------------


def test_refuses_corpora_of_another_tokenizer_or_row_layout_and_a_missing_one(corpora, tmp_path):
    other_tokenizer = Path(shutil.copytree(corpora["wiki"], tmp_path / "wiki_other_tokenizer"))
    manifest = json.loads((other_tokenizer / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64
    (other_tokenizer / "manifest.json").write_text(json.dumps(manifest))
    short_rows = shard("tests/assets/wikipedia/enwiki-validation.jsonl.gz", None, tmp_path / "wiki_32", 32)
    cases = [
        (other_tokenizer, rf"{corpora['c4']} and {other_tokenizer} were tokenised differently \(tokenizer sha256 "
                          ".*re-shard one with the other's tokenizer"),
        (short_rows, rf"{corpora['c4']} and {short_rows} have different row layouts \(row_length 70 vs 34\)"),
        (tmp_path / "nowhere", r"data.sources\[1\] \(wiki\): .*nowhere/manifest.json not found"),
    ]
    for wiki_dir, message in cases:
        with pytest.raises(MixtureError, match=message):
            loader([WeightedCorpus("c4", str(corpora["c4"]), 3), WeightedCorpus("wiki", str(wiki_dir), 1)])


def test_refuses_a_cursor_of_other_corpora_or_weights(corpora):
    saved = loader(mixture(corpora)).state_dict()
    with pytest.raises(MixtureError, match=r"saved on a mixture of c4 \(7337 rows, weight 3\).*this run reads a "
                                           r"mixture of c4 \(7337 rows, weight 1\)"):
        loader(mixture(corpora, c4_weight=1.0), cursor=saved)
    with pytest.raises(MixtureError, match=r"saved on one corpus \(data.dir\), this run reads a mixture"):
        loader(mixture(corpora), cursor=loader(str(corpora["c4"])).state_dict())
    loader(mixture(corpora, 6.0, 2.0), cursor=saved)  # the same ratios: the same line


@pytest.mark.parametrize("overrides, message", [
    (["data.sources=[{dir: a}]"], r"data.dir and data.sources are both set: drop one \(data.dir=null"),
    (["data.dir=null"], "data.dir must name the shard directory"),
    (["data.dir=null", "data.sources=[{dir: a, weight: 0}]"], r"data.sources\[0\].weight=0.0 must be a number > 0"),
    (["data.dir=null", "data.sources=[{dir: a, weight: -1}, {dir: b}]"], r"data.sources\[0\].weight=-1.0"),
    (["data.dir=null", "data.sources=[{weight: 1}]"], r"data.sources\[0\].dir must name a directory"),
    (["data.dir=null", "data.sources=[{dir: x/c4}, {dir: y/c4}]"], "the same name twice"),
    (["data.dir=null", "data.sources=[{dir: x/c4}, {dir: y/R_mu3_r0.15}]", "data.objective=ul2"],
     r"data.sources and the denoisers both use the name\(s\) \['R_mu3_r0.15'\]"),
])
def test_bad_sources_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("training/configs/tiny_demo.yaml", overrides)


def test_sources_are_named_after_their_directories():
    cfg = load_run_config("training/configs/mixture_c4_wiki_base.yaml", ["data.sources=[{dir: data/c4/}, {dir: w, "
                                                                         "weight: 0.5, name: wiki}]"])
    assert [(s.name, s.weight) for s in cfg.data.sources] == [("c4", 1.0), ("wiki", 0.5)]


# --- end to end: training/pretrain.py on a mixture -----------------------------------------------


@pytest.fixture(scope="module")
def mixture_run(corpora, tmp_path_factory) -> tuple[Path, str, str]:
    """10 steps on one rank of C4 and Wikipedia at 3:1; returns the run, its sources override, its log."""
    sources = SOURCES.format(**corpora)
    out = tmp_path_factory.mktemp("mixture_runs") / "reference"
    proc = train(out, corpora["c4"], "data.dir=null", sources)
    return out, sources, proc.stderr


def test_a_mixture_run_logs_its_proportions_and_each_source_held_out_loss(mixture_run):
    run, _, stderr = mixture_run
    assert "mixture: c4 gets 75.00% of the samples; 7337 rows, 0.00818 epochs of them in 10 steps" in stderr
    assert "mixture: wiki gets 25.00% of the samples; 1741 rows, 0.0115 epochs of them in 10 steps" in stderr
    start = read_metrics(run / "metrics.jsonl", "event")[0]
    assert [(s["name"], s["share"], s["rows"]) for s in start["mixture"]] == [("c4", 0.75, 7337), ("wiki", 0.25, 1741)]
    final = read_metrics(run / "metrics.jsonl", "eval")[-1]
    assert final["eval_tokens"] == final["eval_tokens/c4"] + final["eval_tokens/wiki"] > 0
    assert final["eval_loss"] == pytest.approx(0.75 * final["eval_loss/c4"] + 0.25 * final["eval_loss/wiki"])
    assert final["eval_loss/c4"] != final["eval_loss/wiki"]
    line = next(x for x in stderr.splitlines() if "[eval] Step 10" in x)
    assert f"| c4 --> {final['eval_loss/c4']:.4f} | wiki --> {final['eval_loss/wiki']:.4f}" in line


def test_a_mixture_run_resumes_exactly(mixture_run, corpora, tmp_path):
    """5 steps, stop, resume, 5 steps == 10 straight steps on a mixture."""
    reference, sources, _ = mixture_run
    resumed = tmp_path / "resumed"
    copy_run_until(reference, resumed, 5)
    train(resumed, corpora["c4"], "data.dir=null", sources)
    ref, got = losses(reference), losses(resumed)
    assert sorted(got) == list(range(6, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-6), step
    assert_weights_close(final_weights(resumed), final_weights(reference), rtol=1e-6)


@pytest.mark.slow
def test_a_mixture_run_on_two_ranks_resumes_on_one(mixture_run, corpora, tmp_path):
    reference, sources, _ = mixture_run
    two = tmp_path / "two_ranks"
    train(two, corpora["c4"], "data.dir=null", sources, nproc=2)
    ref, got = losses(reference), losses(two)
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(ref[step], rel=1e-4), step
    resumed = tmp_path / "resumed_on_one"
    copy_run_until(two, resumed, 5)
    train(resumed, corpora["c4"], "data.dir=null", sources, nproc=1)
    got_resumed = losses(resumed)
    for step in range(6, STEPS + 1):
        assert got_resumed[step] == pytest.approx(got[step], rel=1e-4), step
    assert_weights_close(final_weights(resumed), final_weights(two), rtol=1e-4)



def test_a_mixture_of_corpora_under_denoisers_reports_each_corpus_and_each_denoiser():
    """evaluate_mixture: each corpus's span-corruption figures, and every figure (each denoiser's
    included) as the mean over the corpora weighted by their shares."""
    from training.evaluation import evaluate_mixture, evaluate_sets
    from training.model import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math"))

    def batches(seed: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [{"input_ids": torch.randint(2, 500, (2, 12), generator=g),
                 "labels": torch.randint(2, 500, (2, 5), generator=g)}]

    sets = {"c4": {"": batches(0), "R": batches(1)}, "wiki": {"": batches(2), "R": batches(3)}}
    result = evaluate_mixture(model, sets, {"c4": 0.75, "wiki": 0.25}, torch.device("cpu"))
    per_source = {name: evaluate_sets(model, s, torch.device("cpu")) for name, s in sets.items()}
    assert result["eval_loss/c4"] == per_source["c4"]["eval_loss"] != per_source["wiki"]["eval_loss"]
    for key in ("eval_loss", "eval_accuracy", "eval_loss/R", "eval_accuracy/R"):
        assert result[key] == pytest.approx(0.75 * per_source["c4"][key] + 0.25 * per_source["wiki"][key])
    assert result["eval_tokens"] == result["eval_tokens/c4"] + result["eval_tokens/wiki"] == 20
