"""Reading Super-Natural-Instructions (SNI) tasks in either of its two on-disk forms.

1. The compact form of `/work/shared/data/sni/` (see its SOURCES.txt): `{train,test}.jsonl.gz`, one
   task per line with keys `task`, `definition` (str), `positive_examples` / `negative_examples`
   ([{input, output, explanation}]), `instances` ([{id, input, output: [...]}]), `categories`,
   `instance_license`; plus `test_references.jsonl.gz` (official references with `task_category`).
2. A checkout of github.com/allenai/natural-instructions: `tasks/<task>.json` (keys "Definition"
   (list), "Positive Examples", "Negative Examples", "Instances", "Categories", "Instance License")
   and `splits/default/{train,test}_tasks.txt`.

Both become the same `SNITask` dataclasses. Instance selection follows Tk-Instruct's
`src/ni_dataset.py` (`_generate_examples`):

    if subset == "test": instances = all_instances[:100]   # the label-balanced evaluation instances
    else: instances = all_instances
    if max_num_instances_per_task is not None and max_num_instances_per_task >= 0:
        random.shuffle(instances); instances = instances[:max_num_instances_per_task]

with a per-task seeded RNG instead of Python's global one (so the selection is reproducible). The
compact train file only holds the first 100 instances of each task, so with it the 100 training
instances are "the first 100, shuffled" rather than "100 random ones of the whole task".
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
# Tk-Instruct evaluates the first 100 instances of a test task (label-balanced, put first in SNI).
TEST_INSTANCES_PER_TASK = 100


@dataclass(frozen=True)
class SNIExample:
    """A demonstration shown in the prompt (positive or negative example of a task)."""

    input: str
    output: str  # a single string, as in the SNI task files
    explanation: str = ""


@dataclass(frozen=True)
class SNIInstance:
    """One input of a task with every acceptable output (the first is not special)."""

    id: str  # e.g. "task1159-3c5e..."; unique over SNI
    input: str
    outputs: tuple[str, ...]  # references; a training target is one of them, drawn at random


@dataclass(frozen=True)
class SNITask:
    """A task: its instruction, demonstrations and the instances selected for this split."""

    name: str  # e.g. "task1159_bard_analogical_reasoning_containers"
    definition: str  # "Definition"[0] of the task file (Tk-Instruct uses only the first)
    positive_examples: tuple[SNIExample, ...]
    negative_examples: tuple[SNIExample, ...]
    instances: tuple[SNIInstance, ...]
    categories: tuple[str, ...] = ()  # e.g. ("Word Analogy",); the first is the task's category
    instance_license: tuple[str, ...] = ()  # the task's "Instance License" (often not Apache-2.0)

    @property
    def category(self) -> str:
        """The first category, as the official per-category metrics use it ("" if none)."""
        return self.categories[0] if self.categories else ""


@dataclass(frozen=True)
class SNIReference:
    """An official evaluation reference (a line of Tk-Instruct's test_references.jsonl)."""

    id: str
    references: tuple[str, ...]
    task: str
    category: str  # "task_category", e.g. "Title Generation"
    track: str = "default"  # "default" (English) or "xlingual"


@dataclass
class _Source:
    """Where a split's tasks come from (resolved from the user's path)."""

    kind: str  # "compact" or "checkout"
    path: Path  # the .jsonl.gz file, or the checkout root
    references: Path | None = field(default=None)  # test_references.jsonl(.gz) next to it, if any


def _resolve(path: str | os.PathLike, split: str) -> _Source:
    path = Path(path)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not path.exists():
        raise FileNotFoundError(
            f"SNI data {path} does not exist: pass the compact directory (e.g. /work/shared/data/sni, "
            "holding train.jsonl.gz / test.jsonl.gz) or a natural-instructions checkout root"
        )
    if path.is_file():
        other = [s for s in SPLITS if s != split and path.name.startswith(f"{s}.")]
        if other:
            raise ValueError(f"{path} looks like the {other[0]} split but split={split!r} was asked for")
        return _Source("compact", path, _find_references(path.parent))
    if (path / "tasks").is_dir() and (path / "splits").is_dir():
        return _Source("checkout", path, _find_references(path))
    for name in (f"{split}.jsonl.gz", f"{split}.jsonl"):
        if (path / name).is_file():
            return _Source("compact", path / name, _find_references(path))
    raise FileNotFoundError(
        f"{path} is neither a compact SNI directory (no {split}.jsonl.gz) nor a natural-instructions "
        "checkout (no tasks/ and splits/ directories)"
    )


def _find_references(directory: Path) -> Path | None:
    for name in ("test_references.jsonl.gz", "test_references.jsonl"):
        if (directory / name).is_file():
            return directory / name
    return None


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _examples(raw: Sequence[dict]) -> tuple[SNIExample, ...]:
    return tuple(
        SNIExample(str(e["input"]), str(e["output"]), str(e.get("explanation", "") or "")) for e in raw
    )


def _instances(raw: Sequence[dict]) -> tuple[SNIInstance, ...]:
    out = []
    for inst in raw:
        outputs = inst["output"]
        outputs = (outputs,) if isinstance(outputs, str) else tuple(str(o) for o in outputs)
        out.append(SNIInstance(str(inst["id"]), str(inst["input"]), outputs))
    return tuple(out)


def _task_from_compact(record: dict) -> SNITask:
    return SNITask(
        name=record["task"],
        definition=record["definition"],
        positive_examples=_examples(record.get("positive_examples", [])),
        negative_examples=_examples(record.get("negative_examples", [])),
        instances=_instances(record.get("instances", [])),
        categories=tuple(record.get("categories") or ()),
        instance_license=tuple(record.get("instance_license") or ()),
    )


def _task_from_checkout(name: str, record: dict) -> SNITask:
    definition = record["Definition"]
    if isinstance(definition, list):
        definition = definition[0]  # Tk-Instruct: `instance["Definition"][0].strip()`
    return SNITask(
        name=name,
        definition=definition,
        positive_examples=_examples(record.get("Positive Examples", [])),
        negative_examples=_examples(record.get("Negative Examples", [])),
        instances=_instances(record.get("Instances", [])),
        categories=tuple(record.get("Categories") or ()),
        instance_license=tuple(record.get("Instance License") or ()),
    )


def _read_compact(path: Path, wanted: set[str] | None) -> list[SNITask]:
    tasks = []
    with _open_text(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON line ({e})") from e
            if wanted is None or record.get("task") in wanted:
                tasks.append(_task_from_compact(record))
    return tasks


def _read_checkout(root: Path, split: str, wanted: set[str] | None) -> list[SNITask]:
    split_file = root / "splits" / "default" / f"{split}_tasks.txt"
    if not split_file.is_file():
        raise FileNotFoundError(f"{split_file} not found (expected natural-instructions' default split)")
    names = [line.strip() for line in split_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    tasks = []
    for name in names:
        if wanted is not None and name not in wanted:
            continue
        task_path = root / "tasks" / f"{name}.json"
        if not task_path.is_file():
            raise FileNotFoundError(f"{task_path} (listed in {split_file}) does not exist")
        with open(task_path, encoding="utf-8") as f:
            tasks.append(_task_from_checkout(name, json.load(f)))
    return tasks


def select_instances(
    task: SNITask, split: str, max_instances_per_task: int | None, seed: int
) -> tuple[SNIInstance, ...]:
    """Tk-Instruct's selection: test -> the first 100; then, if a maximum is given, a seeded shuffle
    and the first `max_instances_per_task` (the shuffle depends only on seed and task name)."""
    instances = list(task.instances)
    if split == "test":
        instances = instances[:TEST_INSTANCES_PER_TASK]
    if max_instances_per_task is not None and max_instances_per_task >= 0:
        random.Random(f"{seed}-{task.name}").shuffle(instances)
        instances = instances[:max_instances_per_task]
    return tuple(instances)


def load_sni(
    path: str | os.PathLike,
    split: str,
    tasks: Sequence[str] | None = None,
    max_instances_per_task: int | None = None,
    seed: int = 0,
) -> list[SNITask]:
    """Tasks of the default split, from a compact `.jsonl.gz` file / directory or a checkout root.

    tasks: only these task names (all of the split if None); an unknown name raises.
    max_instances_per_task: Tk-Instruct / nanoT5 use 100 for training; None keeps every instance
        present (for test: the first 100 of the task, i.e. all its evaluation instances).
    seed: seeds the per-task shuffle applied when max_instances_per_task is given.
    """
    source = _resolve(path, split)
    wanted = set(tasks) if tasks is not None else None
    if source.kind == "compact":
        loaded = _read_compact(source.path, wanted)
    else:
        loaded = _read_checkout(source.path, split, wanted)
    if wanted is not None:
        missing = sorted(wanted - {t.name for t in loaded})
        if missing:
            raise ValueError(f"tasks not in the {split} split of {path}: {missing}")
    if not loaded:
        raise ValueError(f"no {split} tasks found in {path}")
    out = []
    for task in loaded:
        selected = select_instances(task, split, max_instances_per_task, seed)
        out.append(
            SNITask(
                task.name,
                task.definition,
                task.positive_examples,
                task.negative_examples,
                selected,
                task.categories,
                task.instance_license,
            )
        )
    logger.info(
        "loaded %d %s tasks (%d instances) from %s (%s form)",
        len(out),
        split,
        sum(len(t.instances) for t in out),
        path,
        source.kind,
    )
    return out


def load_references(path: str | os.PathLike) -> dict[str, SNIReference] | None:
    """Official references keyed by instance id, from a test_references.jsonl(.gz) file, or from the
    one next to SNI data given as a directory / compact file; None if there is none."""
    path = Path(path)
    if path.is_dir() or not path.name.startswith("test_references"):
        ref_path = _find_references(path if path.is_dir() else path.parent)
    else:
        ref_path = path
    if ref_path is None:
        return None
    refs: dict[str, SNIReference] = {}
    with _open_text(ref_path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            refs[r["id"]] = SNIReference(
                id=r["id"],
                references=tuple(r["references"]),
                task=r.get("task_id", ""),
                category=r.get("task_category", ""),
                track=r.get("track", "default"),
            )
    return refs
