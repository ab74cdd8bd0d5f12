"""A text-to-text dataset: its splits read from local files or a saved Hugging Face dataset, each row
turned into an input text and its reference target(s) by templates, then tokenised.

A task directory holds either a `datasets.DatasetDict` written by `save_to_disk` (dataset_dict.json),
or one file set per split, named after the split: `train.jsonl`, `validation.csv`,
`test-00000-of-00001.parquet` (`<split>.<ext>` or `<split>-*.<ext>`; ext: jsonl, json, jsonl.gz,
json.gz, csv, parquet). Files are read with the `datasets` library's json / csv / parquet builders
(into a temporary cache that is removed once the rows are in memory).

Templates are Python format strings over a row's fields: T5's RTE input
`"rte sentence1: {sentence1} sentence2: {sentence2}"`, a target `"{label}"`. With `label_words`,
an integer `label_field` value i becomes label_words[i] (Hugging Face's GLUE stores classes as
integers: RTE 0 -> "entailment"). A target template that is one field holding a list of strings
(`"{answers[text]}"` in SQuAD) gives several references: training draws one per epoch (as SNI
does), metrics take the best match.

Lengths: inputs longer than `max_source_length` tokens and targets longer than `max_target_length`
(EOS included) are truncated, and each split says how many in one warning line. Bad rows (a field
the template names is missing, an empty target, a label outside label_words) raise ValueError naming
the split, the row and what to fix.
"""

from __future__ import annotations

import logging
import os
import re
import string
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.sni.encoding import EncodedExample, SNITokenizer

logger = logging.getLogger(__name__)

BUILDERS = {"jsonl": "json", "json": "json", "jsonl.gz": "json", "json.gz": "json", "csv": "csv",
            "parquet": "parquet"}
_ONE_FIELD = re.compile(r"^\{([^{}]+)\}$")


@dataclass(frozen=True)
class TextFormat:
    """How a row becomes (input text, references): templates, label words, length limits."""

    input_template: str
    target_template: str = "{label}"
    label_field: str = "label"
    label_words: tuple[str, ...] = ()
    max_source_length: int = 512
    max_target_length: int = 128

    def fields(self) -> set[str]:
        """The top-level row fields the templates name."""
        names = set()
        for template in (self.input_template, self.target_template):
            for _, name, _, _ in string.Formatter().parse(template):
                if name:
                    names.add(re.split(r"[.\[]", name, maxsplit=1)[0])
        return names


@dataclass
class Text2TextSplit:
    """One split, encoded: examples to train on or generate for, and each example's references."""

    name: str
    examples: list[EncodedExample]
    references: dict[str, tuple[str, ...]]  # by example id
    inputs: dict[str, str]  # by example id, the input text (written next to the predictions)
    max_target_tokens: int  # the longest encoded reference, EOS included, after truncation


def find_split_files(directory: Path, split: str) -> tuple[str, list[str]]:
    """(datasets builder, files) of `split` in a directory of per-split files; ValueError if none."""
    for ext, builder in BUILDERS.items():
        files = sorted({*directory.glob(f"{split}.{ext}"), *directory.glob(f"{split}-*.{ext}")})
        if files:
            return builder, [str(f) for f in files]
    present = sorted(p.name for p in directory.iterdir() if p.is_file())
    raise ValueError(f"no {split} split in {directory}: expected {split}.jsonl / .json / .csv / .parquet "
                     f"(or {split}-*.<ext>); found {present[:8]}")


def read_split(path: str | os.PathLike, split: str) -> list[dict[str, Any]]:
    """The rows of one split of a task directory (see the module docstring) as plain dicts."""
    import datasets  # here: a second to import, and only data reading needs it

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"task directory {directory} does not exist")
    datasets.disable_progress_bars()
    if (directory / "dataset_dict.json").is_file():
        saved = datasets.load_from_disk(str(directory))
        if split not in saved:
            raise ValueError(f"no {split} split in the saved dataset {directory}: it has {sorted(saved)}")
        return saved[split].to_list()
    if (directory / "state.json").is_file():
        raise ValueError(f"{directory} is a single saved Dataset: save a DatasetDict with named splits "
                         "(DatasetDict({'train': ..., 'validation': ...}).save_to_disk(dir))")
    builder, files = find_split_files(directory, split)
    with tempfile.TemporaryDirectory(prefix="t5ds-datasets-") as cache:
        try:
            rows = datasets.load_dataset(builder, data_files={split: files}, split=split, cache_dir=cache).to_list()
        except Exception as exc:  # the builders raise many kinds for a malformed file
            raise ValueError(f"cannot read {split} split {files[0]} ({type(exc).__name__}: {exc})") from exc
    return rows


def _value(row: Mapping[str, Any], name: str) -> Any:
    return string.Formatter().get_field(name, (), row)[0]


def _fill(template: str, row: Mapping[str, Any], what: str, where: str) -> str:
    try:
        return template.format_map(row)
    except (KeyError, IndexError, AttributeError) as exc:
        raise ValueError(f"{where}: {what} template {template!r} names {exc}, which the row lacks "
                         f"(its fields: {sorted(row)})") from None


def row_texts(row: Mapping[str, Any], fmt: TextFormat, where: str) -> tuple[str, tuple[str, ...]]:
    """(input text, references) of one row; ValueError naming `where` when the row does not fit."""
    row = dict(row)
    if fmt.label_words and fmt.label_field in row:
        label = row[fmt.label_field]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(fmt.label_words):
            raise ValueError(f"{where}: {fmt.label_field}={label!r} is not an index into task.label_words "
                             f"{list(fmt.label_words)}")
        row[fmt.label_field] = fmt.label_words[label]
    source = _fill(fmt.input_template, row, "task.input", where)
    one_field = _ONE_FIELD.match(fmt.target_template)
    value = None
    if one_field:
        try:
            value = _value(row, one_field.group(1))
        except (KeyError, IndexError, AttributeError):
            value = None
    if isinstance(value, (list, tuple)):
        references = tuple(str(v) for v in value)
    else:
        references = (_fill(fmt.target_template, row, "task.target", where),)
    if not references or not any(r.strip() for r in references):
        raise ValueError(f"{where}: the target is empty: fix the row or task.target={fmt.target_template!r}")
    return source, tuple(r for r in references if r.strip())


def encode_split(rows: Sequence[Mapping[str, Any]], fmt: TextFormat, tokenizer: SNITokenizer, name: str,
                 task: str = "text2text") -> Text2TextSplit:
    """Every row of a split, encoded; one warning line counts what the length limits truncated."""
    if not rows:
        raise ValueError(f"the {name} split has no rows")
    examples, references, inputs = [], {}, {}
    long_inputs = long_targets = 0
    longest = 0
    for i, row in enumerate(rows):
        source, refs = row_texts(row, fmt, f"{name} row #{i}")
        ids = tokenizer.pieces(source)
        long_inputs += len(ids) + 1 > fmt.max_source_length
        labels = []
        for ref in refs:
            pieces = tokenizer.pieces(ref)
            long_targets += len(pieces) + 1 > fmt.max_target_length
            labels.append(np.asarray(tokenizer.encode(ref, max_length=fmt.max_target_length), dtype=np.int32))
            longest = max(longest, len(labels[-1]))
        example_id = str(i)
        examples.append(EncodedExample(example_id, task, np.asarray(
            tokenizer.encode(source, max_length=fmt.max_source_length), dtype=np.int32), labels))
        references[example_id], inputs[example_id] = refs, source
    if long_inputs or long_targets:
        logger.warning("%s split: %d of %d inputs longer than data.max_source_length=%d tokens and %d targets longer "
                       "than data.max_target_length=%d are truncated", name, long_inputs, len(rows),
                       fmt.max_source_length, long_targets, fmt.max_target_length)
    logger.info("encoded %d %s examples (mean input length %.1f tokens)", len(examples), name,
                float(np.mean([e.length for e in examples])))
    return Text2TextSplit(name, examples, references, inputs, longest)


def load_split(path: str | os.PathLike, split: str, fmt: TextFormat, tokenizer: SNITokenizer,
               task: str = "text2text") -> Text2TextSplit:
    """Read and encode one split of a task directory."""
    return encode_split(read_split(path, split), fmt, tokenizer, split, task)
