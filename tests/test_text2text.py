"""Text-to-text fine-tuning pieces on CPU: the metrics against their reference implementations, the
dataset formats and templates, bad data, the distributed evaluation with two simulated ranks, and
best-checkpoint selection. (End-to-end runs: tests/test_finetune_text2text.py.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from training.best_checkpoint import BestSelection
from training.config import ConfigError
from training.sni.encoding import SNITokenizer
from training.sni.evaluate import generate_predictions
from training.text2text.data import TextFormat, encode_split, load_split, read_split
from training.text2text.evaluate import evaluate_text2text, generation_length
from training.text2text.metrics import matthews_correlation, positive_class_f1, score_examples, squad_f1

REPO = Path(__file__).resolve().parents[1]
RTE = REPO / "tests/assets/glue/rte"
RTE_FORMAT = TextFormat("rte sentence1: {sentence1} sentence2: {sentence2}", "{label}",
                        label_words=("entailment", "not_entailment"), max_source_length=64, max_target_length=8)


@pytest.fixture(scope="module")
def tokenizer() -> SNITokenizer:
    return SNITokenizer()


# ---------------------------------------------------------------------------------------------
# Metrics


PREDICTIONS = {"a": "The cat sat on the mat.", "b": "a dog barked loudly", "c": "entailment", "d": ""}
REFERENCES = {"a": ("the cat sat on a mat", "A cat was sitting."), "b": ("The dog barked.",),
              "c": ("entailment",), "d": ("not_entailment",)}


def test_rouge_and_bleu_equal_their_packages():
    import sacrebleu
    from rouge_score import rouge_scorer

    corpus, per_example = score_examples(PREDICTIONS, REFERENCES, ["rouge1", "rouge2", "rougeL", "bleu"])
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for name in ("rouge1", "rouge2", "rougeL"):
        best = {i: max(scorer.score(r, PREDICTIONS[i])[name].fmeasure for r in REFERENCES[i]) for i in REFERENCES}
        assert corpus[name] == pytest.approx(100 * sum(best.values()) / len(best), abs=1e-3)
        assert per_example["a"][name] == pytest.approx(100 * best["a"], abs=1e-3)
    ids = list(REFERENCES)
    expected = sacrebleu.corpus_bleu([PREDICTIONS[i] for i in ids],
                                     [[REFERENCES[i][0] for i in ids], ["A cat was sitting.", None, None, None]])
    assert corpus["bleu"] == pytest.approx(expected.score, abs=1e-3) and corpus["bleu"] > 0


def test_squad_exact_match_f1_and_label_accuracy_by_hand():
    corpus, per_example = score_examples(PREDICTIONS, REFERENCES, ["exact_match", "f1", "accuracy"])
    # a: "the cat sat on a mat" normalises (articles, punctuation, case) to "cat sat on mat" = the prediction
    assert per_example["a"] == {"exact_match": 100.0, "f1": 100.0, "accuracy": 0.0}
    # b: "dog barked loudly" vs "dog barked": 2 common tokens, P = 2/3, R = 1, F1 = 0.8
    assert per_example["b"] == {"exact_match": 0.0, "f1": 80.0, "accuracy": 0.0}
    assert per_example["c"]["accuracy"] == 100.0 and per_example["d"] == {"exact_match": 0.0, "f1": 0.0,
                                                                          "accuracy": 0.0}
    assert corpus == {"exact_match": 50.0, "f1": 70.0, "accuracy": 25.0}
    assert squad_f1("the the", "a") == 0.0  # both normalise to nothing: SQuAD v1.1 scores 0


def test_class_metrics_over_the_generated_labels():
    """`mcc` is Matthews' correlation over the label classes, a generated text that is no label a class
    of its own (scikit-learn's multi-class matthews_corrcoef; the figures below are its formula by
    hand); `class_f1` the F1 of the second label word; both corpus-level, x100."""
    # binary: true counts (2, 2), predicted (1, 3), 3 correct of 4: (3*4 - 8) / sqrt((16 - 10) (16 - 8))
    assert matthews_correlation(list("aabb"), list("abbb")) == pytest.approx(4 / 48**0.5)
    # the same as TP TN - FP FN over the margins with b positive: (2*1 - 1*0) / sqrt(3*2*2*1)
    assert matthews_correlation(list("aabb"), list("abbb")) == pytest.approx(2 / 12**0.5)
    # "x" is a third class: (3*4 - (1*2 + 2*2)) / sqrt((16 - 6) (16 - 8))
    assert matthews_correlation(list("aabb"), list("axbb")) == pytest.approx(6 / 80**0.5)
    assert matthews_correlation(list("aabb"), list("bbbb")) == 0.0  # one predicted class
    assert matthews_correlation(list("abab"), list("abab")) == 1.0 and matthews_correlation(list("ab"), list("ba")) == -1.0
    # positive e: TP 1, one false positive, two false negatives (one of them generated "x"): 2 / (2 + 3)
    assert positive_class_f1(list("neee"), list("eenx"), "e") == pytest.approx(0.4)
    assert positive_class_f1(list("nn"), list("nn"), "e") == 0.0
    refs = {str(i): (t,) for i, t in enumerate(["no", "yes", "yes", "yes"])}
    preds = {"0": "yes", "1": " yes", "2": "no", "3": "maybe"}
    corpus, per_example = score_examples(preds, refs, ["class_f1", "mcc", "accuracy"], labels=("no", "yes"))
    assert corpus == {"class_f1": 40.0, "mcc": round(100 * matthews_correlation(
        ["no", "yes", "yes", "yes"], ["yes", "yes", "no", "maybe"]), 4), "accuracy": 25.0}
    assert set(per_example["0"]) == {"accuracy"}  # the class metrics have no per-example score
    with pytest.raises(ValueError, match="set task.label_words to the task's labels"):
        score_examples(preds, refs, ["mcc"])
    with pytest.raises(ValueError, match="set task.label_words to two labels"):
        score_examples(preds, refs, ["class_f1"], labels=("a", "b", "c"))


def test_unknown_metric_and_missing_prediction_are_refused():
    with pytest.raises(ValueError, match="unknown metric 'rouge'.*exact_match, f1, accuracy"):
        score_examples(PREDICTIONS, REFERENCES, ["rouge"])
    with pytest.raises(ValueError, match="1 examples have no prediction"):
        score_examples({"a": "x"}, {"a": ("x",), "b": ("y",)}, ["accuracy"])


# ---------------------------------------------------------------------------------------------
# Data


def test_formats_give_the_same_rows(tmp_path):
    import datasets

    rows = read_split(RTE, "train")
    assert len(rows) == 16 and rows[0]["sentence1"].startswith("A man")
    ds = datasets.Dataset.from_list(rows)
    (tmp_path / "csv").mkdir()
    ds.to_csv(str(tmp_path / "csv" / "train.csv"), index=False)
    (tmp_path / "pq").mkdir()
    ds.to_parquet(str(tmp_path / "pq" / "train-00000-of-00001.parquet"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved"))
    for form in ("csv", "pq", "saved"):
        assert read_split(tmp_path / form, "train") == rows, form
    with pytest.raises(ValueError, match="no test split in .*rte: expected test.jsonl"):
        read_split(RTE, "test")
    with pytest.raises(ValueError, match=r"no test split in the saved dataset .*: it has \['train'\]"):
        read_split(tmp_path / "saved", "test")
    ds.save_to_disk(str(tmp_path / "single"))
    with pytest.raises(ValueError, match="single saved Dataset: save a DatasetDict"):
        read_split(tmp_path / "single", "train")


def test_templates_label_words_and_several_references(tokenizer):
    split = load_split(RTE, "validation", RTE_FORMAT, tokenizer, "rte")
    assert split.inputs["0"] == ("rte sentence1: The chef cooked a meal for forty guests. "
                                 "sentence2: A meal was cooked.")
    assert split.references["0"] == ("entailment",) and split.references["1"] == ("not_entailment",)
    ex = split.examples[1]
    assert tokenizer.decode(ex.input_ids) == split.inputs["1"]
    assert [tokenizer.decode(c) for c in ex.label_choices] == ["not_entailment"]
    squad = [{"question": "Who?", "answers": {"text": ["Ada", "Ada Lovelace"]}}]
    qa = encode_split(squad, TextFormat("question: {question}", "{answers[text]}"), tokenizer, "train")
    assert qa.references["0"] == ("Ada", "Ada Lovelace") and len(qa.examples[0].label_choices) == 2
    assert generation_length(split, 8) == 8 and generation_length(qa, 128) == qa.max_target_tokens + 8


def test_long_examples_are_truncated_and_counted_in_one_line(tokenizer, caplog):
    fmt = TextFormat("{text}", "{target}", max_source_length=4, max_target_length=3)
    rows = [{"text": "one two three four five six", "target": "a b c d e"}, {"text": "hi", "target": "ok"}]
    with caplog.at_level(logging.WARNING):
        split = encode_split(rows, fmt, tokenizer, "train")
    assert len(split.examples[0].input_ids) == 4 and len(split.examples[0].label_choices[0]) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["train split: 1 of 2 inputs longer than data.max_source_length=4 tokens and 1 targets "
                        "longer than data.max_target_length=3 are truncated"]


@pytest.mark.parametrize("rows, fmt, message", [
    ([{"sentence1": "x", "label": 0}], RTE_FORMAT,
     r"train row #0: task.input template .* names 'sentence2', which the row lacks \(its fields: \['label', 'sentence1'\]\)"),
    ([{"text": "x", "summary": "  "}], TextFormat("{text}", "{summary}"),
     "train row #0: the target is empty: fix the row or task.target='{summary}'"),
    ([{"sentence1": "x", "sentence2": "y", "label": 2}], RTE_FORMAT,
     r"train row #0: label=2 is not an index into task.label_words \['entailment', 'not_entailment'\]"),
    ([], RTE_FORMAT, "the train split has no rows"),
])
def test_bad_rows_are_refused_with_one_line(tokenizer, rows, fmt, message):
    with pytest.raises(ValueError, match=message):
        encode_split(rows, fmt, tokenizer, "train")


def test_task_config_refusals():
    from training.config_loader import load_run_config
    from training.finetune_config import FinetuneConfig

    rte = REPO / "training/configs/glue_rte.yaml"
    for overrides, message in ((["task.metrics=[accuracy, bleu4]"], "unknown metric 'bleu4'"),
                               (["eval.best_metric=f1"], r"eval.best_metric='f1' must be one of task.metrics \['accuracy'\]"),
                               (["task.input="], "task.input must be a template"),
                               (["task.input={premise"], "task.input='{premise' is not a format template"),
                               (["eval.best_metric=null", "eval.patience=3"], "eval.patience needs eval.best_metric"),
                               (["task.metrics=[mcc]", "eval.best_metric=mcc", "task.label_words=[]"],
                                "mcc scores generated labels: set task.label_words")):
        with pytest.raises(ConfigError, match=message):
            load_run_config(rte, overrides, root=FinetuneConfig)
    with pytest.raises(ConfigError, match="eval.best_metric needs a validation split: SNI has none"):
        load_run_config(REPO / "training/configs/sni.yaml", ["eval.best_metric=rougeL"], root=FinetuneConfig)


# ---------------------------------------------------------------------------------------------
# Distributed evaluation, with two ranks simulated in this process


class LabelModel(torch.nn.Module):
    """Generates "entailment" for inputs of even length, "not_entailment" otherwise."""

    def __init__(self, tokenizer: SNITokenizer):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.words = [tokenizer.encode("entailment"), tokenizer.encode("not_entailment")]

    def generate(self, input_ids, attention_mask=None, max_new_tokens=128, **beam):
        rows = [[0, *self.words[int(m.sum()) % 2]][: max_new_tokens + 1] for m in attention_mask]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def test_two_ranks_score_every_example_once_as_one_rank(tokenizer, tmp_path):
    split = load_split(RTE, "train", RTE_FORMAT, tokenizer, "rte")
    model = LabelModel(tokenizer)
    one = evaluate_text2text(model, split, tokenizer, ["accuracy", "f1"], out_dir=tmp_path / "one", batch_size=3)
    shares = [generate_predictions(model, split.examples, tokenizer, 3, rank, 2, 8) for rank in (0, 1)]
    assert not set(shares[0]) & set(shares[1]) and set(shares[0]) | set(shares[1]) == set(split.references)

    def gather(local, world_size):  # what all_gather_object gives rank 0
        assert world_size == 2 and local == shares[0]
        return {**shares[0], **shares[1]}

    two = evaluate_text2text(model, split, tokenizer, ["accuracy", "f1", "mcc", "class_f1"], out_dir=tmp_path / "two",
                             batch_size=3, rank=0, world_size=2, max_new_tokens=8, gather=gather,
                             labels=RTE_FORMAT.label_words)  # fmt: skip
    assert {k: two[k] for k in ("accuracy", "f1", "n_examples")} == {k: one[k] for k in ("accuracy", "f1", "n_examples")}
    truth = [split.references[e.id][0] for e in split.examples]
    predicted = [{**shares[0], **shares[1]}[e.id] for e in split.examples]
    assert two["mcc"] == round(100 * matthews_correlation(truth, predicted), 4)
    assert two["class_f1"] == round(100 * positive_class_f1(truth, predicted, "not_entailment"), 4)
    assert 0 < one["accuracy"] < 100 and one["generated_tokens"] > 0 and one["examples_per_s"] > 0
    lines = [json.loads(x) for x in (tmp_path / "two" / "predictions.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == [e.id for e in split.examples]
    assert lines[0]["prediction"] in ("entailment", "not_entailment") and set(lines[0]["scores"]) == {"accuracy", "f1"}
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())["mcc"] == two["mcc"]
    assert json.loads((tmp_path / "two" / "metrics.json").read_text())["accuracy"] == two["accuracy"]
    with pytest.raises(RuntimeError, match="examples got no prediction after gathering"):
        evaluate_text2text(model, split, tokenizer, ["accuracy"], rank=0, world_size=2, gather=lambda local, n: local)


# ---------------------------------------------------------------------------------------------
# Best-checkpoint selection


def test_best_selection_counts_patience_and_round_trips():
    sel = BestSelection("loss", "min", patience=2)
    assert sel.observe(3.0, 10) and not sel.observe(3.0, 20) and sel.observe(2.0, 30, {"loss": 2.0})
    assert not sel.observe(2.5, 40) and not sel.should_stop and not sel.observe(2.1, 50) and sel.should_stop
    again = BestSelection("loss", "min", patience=2)
    again.load_state_dict(sel.state_dict())
    assert (again.best, again.best_step, again.best_record, again.should_stop) == (2.0, 30, {"loss": 2.0}, True)
    assert not BestSelection().active and not BestSelection("accuracy").should_stop


def test_glue_command_refuses_unknown_tasks_and_missing_directories():
    from training.cli_errors import ExpectedError
    from training.glue import known_tasks, parse_tasks

    assert known_tasks() == ["boolq", "cola", "mrpc", "rte", "sst2"]
    assert parse_tasks(f"rte={RTE}, sst2={RTE.parent / 'sst2'}") == {"rte": RTE, "sst2": RTE.parent / "sst2"}
    for text, message in (("mnli=/x", "unknown task 'mnli'; the recipe has boolq, cola"),
                          ("rte=/no/such", "no such directory"), ("rte", "write TASK=DIR"), (" ,", "names no task")):
        with pytest.raises(ExpectedError, match=message):
            parse_tasks(text)
