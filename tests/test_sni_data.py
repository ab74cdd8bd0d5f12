"""SNI reading (compact and natural-instructions checkout forms) and the Tk-Instruct template."""

import gzip
import json
import shutil
from pathlib import Path

import pytest

from training.sni.encoding import SNITokenizer, TemplateConfig, encode_source, encode_tasks
from training.sni.tasks import load_references, load_sni, select_instances

SNI_ASSETS = Path(__file__).resolve().parent / "assets" / "sni"
GOLDEN = {
    "task1159_bard_analogical_reasoning_containers": "golden_task1159.txt",
    "task641_esnli_classification": "golden_task641.txt",
    "task1540_parsed_pdfs_summarization": "golden_task1540.txt",
}
TRUNCATED_ID = "task1540-2479aee0207845029a47031141ee29fb"


@pytest.fixture(scope="module")
def tokenizer(spiece_path):
    return SNITokenizer(spiece_path)


def _read_compact(name):
    with gzip.open(SNI_ASSETS / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def make_checkout(root: Path) -> Path:
    """A natural-instructions checkout (tasks/*.json in the original key names + splits/default)."""
    (root / "tasks").mkdir(parents=True)
    (root / "splits" / "default").mkdir(parents=True)
    for split in ("train", "test"):
        names = []
        for r in _read_compact(f"{split}.jsonl.gz"):
            names.append(r["task"])
            original = {
                "Contributors": ["someone"],
                "Source": ["somewhere"],
                "Categories": r["categories"],
                "Definition": [r["definition"]],
                "Input_language": ["English"],
                "Positive Examples": r["positive_examples"],
                "Negative Examples": r["negative_examples"],
                "Instances": r["instances"],
                "Instance License": r["instance_license"],
            }
            (root / "tasks" / f"{r['task']}.json").write_text(json.dumps(original, indent=1))
        (root / "splits" / "default" / f"{split}_tasks.txt").write_text("\n".join(names) + "\n")
    return root


@pytest.mark.parametrize("split", ["train", "test"])
def test_both_forms_give_identical_tasks_and_encodings(tmp_path, tokenizer, split):
    checkout = make_checkout(tmp_path / "natural-instructions")
    compact = load_sni(SNI_ASSETS, split)
    from_checkout = load_sni(checkout, split)
    assert [t.name for t in compact] == [t.name for t in from_checkout]
    assert compact == from_checkout
    a = encode_tasks(compact, tokenizer)
    b = encode_tasks(from_checkout, tokenizer)
    assert len(a) == sum(len(t.instances) for t in compact) > 0
    for x, y in zip(a, b):
        assert x.id == y.id and x.task == y.task
        assert x.input_ids.tolist() == y.input_ids.tolist()
        assert [c.tolist() for c in x.label_choices] == [c.tolist() for c in y.label_choices]
    # a single compact file works as well as its directory
    assert load_sni(SNI_ASSETS / f"{split}.jsonl.gz", split) == compact


def test_reading_fields(tmp_path):
    tasks = {t.name: t for t in load_sni(SNI_ASSETS, "test")}
    t = tasks["task036_qasc_topic_word_to_generate_related_fact"]
    assert t.category == "Keyword Tagging" and t.instance_license == ("CC BY 4.0",)
    assert len(t.instances) == 6 and all(len(i.outputs) > 1 for i in t.instances)
    assert t.positive_examples[0].explanation  # explanations are read
    only = load_sni(SNI_ASSETS, "test", tasks=["task641_esnli_classification"])
    assert [x.name for x in only] == ["task641_esnli_classification"]
    with pytest.raises(ValueError, match="not in the test split"):
        load_sni(SNI_ASSETS, "test", tasks=["task999_nope"])
    with pytest.raises(FileNotFoundError, match="neither a compact"):
        load_sni(tmp_path, "test")
    with pytest.raises(ValueError, match="looks like the train split"):
        load_sni(SNI_ASSETS / "train.jsonl.gz", "test")
    with pytest.raises(ValueError, match="split must be"):
        load_sni(SNI_ASSETS, "dev")
    refs = load_references(SNI_ASSETS)
    assert refs is not None and len(refs) == 26  # the 24 asset instances + 2 of task1159 the assets lack
    assert all(r.track == "default" for r in refs.values())
    assert {r.task for r in refs.values()} == set(tasks)


def test_instance_selection_is_seeded_and_tk_instruct_like():
    task = load_sni(SNI_ASSETS, "train")[0]
    ids = [i.id for i in task.instances]
    a = select_instances(task, "train", 5, seed=0)
    assert len(a) == 5 and set(i.id for i in a) <= set(ids)
    assert a == select_instances(task, "train", 5, seed=0)
    shuffled = [select_instances(task, "train", None if s is None else 100, seed=s) for s in (None, 1, 2)]
    assert [i.id for i in shuffled[0]] == ids  # no maximum: the file order
    assert sorted(i.id for i in shuffled[1]) == sorted(ids)  # maximum above the count: all, shuffled
    assert [i.id for i in shuffled[1]] != [i.id for i in shuffled[2]]


@pytest.mark.parametrize("task_name", sorted(GOLDEN))
def test_golden_prompts(tokenizer, task_name):
    """The first instance of three real tasks, checked by hand against Tk-Instruct's ni_collator.py."""
    task = load_sni(SNI_ASSETS, "test", tasks=[task_name])[0]
    golden = (SNI_ASSETS / GOLDEN[task_name]).read_text(encoding="utf-8")
    source = encode_source(task, task.instances[0].input, tokenizer, TemplateConfig())
    assert source.text == golden
    assert source.num_pos_examples == 2 and not source.truncated
    assert source.input_ids == tokenizer.encode(golden) and source.input_ids[-1] == 1
    assert golden.startswith("Definition: ") and golden.endswith("\nOutput: ")
    assert "\n\n Positive Example 1 -\nInput: " in golden and "\n\n Positive Example 2 -\nInput: " in golden


def test_truncation_and_example_dropping(tokenizer):
    task = load_sni(SNI_ASSETS, "test", tasks=["task1540_parsed_pdfs_summarization"])[0]
    inst = next(i for i in task.instances if i.id == TRUNCATED_ID)
    source = encode_source(task, inst.input, tokenizer, TemplateConfig())
    assert source.truncated and source.num_pos_examples == 0  # no demonstration fits next to it
    assert source.text == (SNI_ASSETS / "golden_task1540_truncated.txt").read_text(encoding="utf-8")
    assert len(source.input_ids) <= 1024 and source.input_ids[-1] == 1
    # a short limit drops the second demonstration first
    short = encode_source(task, task.instances[0].input, tokenizer, TemplateConfig(max_source_length=700))
    assert short.num_pos_examples == 1 and "Positive Example 2" not in short.text
    # targets: 127 pieces + EOS at most
    long_output = " ".join(["word"] * 400)
    assert len(tokenizer.encode(long_output, max_length=128)) == 128


def test_matches_transformers_t5_tokenizer(tmp_path, tokenizer, spiece_path):
    """Our SentencePiece encode / decode equals transformers' T5 tokenizer on every asset prompt and
    target, including the decode-and-re-encode truncation path."""
    transformers = pytest.importorskip("transformers")
    shutil.copy(spiece_path, tmp_path / "spiece.model")
    hf = transformers.T5Tokenizer.from_pretrained(str(tmp_path), extra_ids=100)
    for split in ("train", "test"):
        for task in load_sni(SNI_ASSETS, split):
            for inst in task.instances:
                source = encode_source(task, inst.input, tokenizer, TemplateConfig())
                assert hf([source.text], max_length=1024, truncation=True)["input_ids"][0] == source.input_ids
                for out in inst.outputs:
                    assert hf([out], max_length=128, truncation=True)["input_ids"][0] == tokenizer.encode(
                        out, 128
                    )
    ids = tokenizer.encode("Hello world, this isn't a T5 test . Really ?")
    ids_with_specials = [0, *ids[:-1], 32099, 2, 1, 0]
    assert tokenizer.decode(ids_with_specials) == hf.decode(
        ids_with_specials, skip_special_tokens=True, clean_up_tokenization_spaces=True
    )
