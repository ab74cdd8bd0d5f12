"""The options of one sharding run (`ShardConfig`), the sources they name, and the part of the
input files one node shards when the corpus is split over several (`--part K/N`)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from data_prep.shard_format import t5_span_lengths
from data_prep.sources import SOURCE_KINDS, TXT_MODES, FileSource, Source, resolve_source, split_c4_layout
from data_prep.tokenizer import DEFAULT_SPIECE

logger = logging.getLogger(__name__)


class DataError(RuntimeError):
    """A skipped document under --strict; the message names the file and line."""


class OptionsMismatch(RuntimeError):
    """The output directory was started with other options."""


class EmptySplitError(DataError):
    """A split ended with no rows; the message gives the counts and the likely fix."""


_PART_DIR = re.compile(r"part-(\d+)-of-(\d+)")


def parse_part(spec: str) -> tuple[int, int]:
    """`K/N` (1 <= K <= N) -> (K, N); ValueError with the expected form otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise ValueError(f"--part {spec!r}: expected K/N with 1 <= K <= N, e.g. --part 2/8 (the 2nd of 8 parts)")
    return int(match[1]), int(match[2])


def part_dir_name(index: int, count: int) -> str:
    """DIR/part-K-of-N: K zero-padded to N's width, so that names sort in part order."""
    return f"part-{index:0{len(str(count))}d}-of-{count}"


def parse_part_dir(name: str) -> tuple[int, int] | None:
    match = _PART_DIR.fullmatch(name)
    return (int(match[1]), int(match[2])) if match else None


def part_range(num_units: int, index: int, count: int) -> tuple[int, int]:
    """The files [first, end) of `num_units` that part `index` of `count` shards (contiguous, in order)."""
    return (index - 1) * num_units // count, index * num_units // count


@dataclass
class ShardConfig:
    """Options of one sharding run (mirrors the CLI flags)."""

    input: str  # glob of files, local HF dataset directory, or HF Hub name (the train source)
    output: str  # output directory DIR
    tokenizer: str = str(DEFAULT_SPIECE)  # SentencePiece .model or HF tokenizer directory
    validation_input: str | None = None  # validation source; None: C4 name split / HF split / none
    source_kind: str = "auto"  # auto | files | hf
    text_field: str = "text"  # JSON / parquet / dataset field holding the document text
    txt_mode: str = "line"  # .txt files: "line" = one document per line, "blank-line" = paragraphs
    hf_config: str | None = None  # HF dataset config (e.g. "en" for allenai/c4)
    hf_train_split: str = "train"
    hf_validation_split: str | None = "validation"  # None: no validation split from an HF dataset
    hf_revision: str | None = None
    input_length: int = 512  # encoder input length the rows are sized for (span corruption)
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    row_length: int | None = None  # tokens per row; None: derived via t5_span_lengths (568 for 512)
    rows_per_shard: int = 8192  # 8192 x 568 uint16 tokens = 9.3 MB per shard
    rows_per_block: int = 256  # rows per tar member
    workers: int = 1  # encoder processes; 0 encodes in the main process (no pool)
    chunk_docs: int = 512  # documents per pool task (does not change the output)
    strict: bool = False  # any skipped document is an error
    progress: bool = True  # tqdm bar on stderr
    max_warnings: int = 20  # warnings logged per skip reason and split, then only counted
    part: tuple[int, int] | None = None  # (K, N): shard the K-th of N file ranges into DIR/part-K-of-N
    _derived: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.source_kind not in SOURCE_KINDS:
            raise ValueError(f"source_kind must be one of {SOURCE_KINDS}, got {self.source_kind!r}")
        if self.txt_mode not in TXT_MODES:
            raise ValueError(f"txt_mode must be one of {TXT_MODES}, got {self.txt_mode!r}")
        for name in ("rows_per_shard", "rows_per_block", "chunk_docs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0 = no pool), got {self.workers}")
        if self.row_length is not None and self.row_length < 1:
            raise ValueError(f"row_length must be >= 1, got {self.row_length}")
        if self.part is not None:
            parse_part(f"{self.part[0]}/{self.part[1]}")
        # Raises with a clear message on bad span-corruption settings.
        raw, targets = t5_span_lengths(self.input_length, self.noise_density, self.mean_noise_span_length)
        self._derived = {"span_tokens_length": raw, "targets_length": targets}

    @property
    def resolved_row_length(self) -> int:
        return self.row_length if self.row_length is not None else self._derived["span_tokens_length"]

    @property
    def output_dir(self) -> Path:
        """Where this run writes: DIR, or DIR/part-K-of-N for one part of a split corpus."""
        out = Path(self.output)
        return out / part_dir_name(*self.part) if self.part else out

    def output_options(self) -> dict:
        """The options that change the bytes written (recorded in the manifest, compared on resume)."""
        return {
            "row_length": self.resolved_row_length,
            "row_length_explicit": self.row_length is not None,
            "input_length": self.input_length,
            "noise_density": self.noise_density,
            "mean_noise_span_length": self.mean_noise_span_length,
            "targets_length": self._derived["targets_length"],
            "rows_per_shard": self.rows_per_shard,
            "rows_per_block": self.rows_per_block,
            "text_field": self.text_field,
            "txt_mode": self.txt_mode,
        }


def resolve_split_sources(cfg: ShardConfig) -> dict[str, Source | None]:
    """{"train": source, "validation": source or None} following the rules in the module docs."""
    common = dict(text_field=cfg.text_field, txt_mode=cfg.txt_mode, hf_config=cfg.hf_config)
    train = resolve_source(
        cfg.input, cfg.source_kind, hf_split=cfg.hf_train_split, hf_revision=cfg.hf_revision, **common
    )
    validation: Source | None = None
    if cfg.validation_input:
        validation = resolve_source(
            cfg.validation_input,
            cfg.source_kind,
            hf_split=cfg.hf_validation_split or "validation",
            hf_revision=cfg.hf_revision,
            **common,
        )
    elif isinstance(train, FileSource):
        train, validation = split_c4_layout(train)
    elif cfg.hf_validation_split:
        validation = resolve_source(
            cfg.input, "hf", hf_split=cfg.hf_validation_split, hf_revision=cfg.hf_revision, **common
        )
    if validation is None:
        logger.warning(
            "no validation source (pass --validation-input, or C4 files named c4-validation.*): "
            "writing the train split only; manifest['splits'] has no 'validation'"
        )
    return {"train": train, "validation": validation}


def select_part(sources: dict[str, Source | None], index: int, count: int) -> tuple[dict, dict]:
    """Each split's files restricted to part `index` of `count`; returns (sources, {split: units})
    where units = {"first", "end", "total", "files_sha256"} says which of the split's files the part holds."""
    selected, units = {}, {}
    for split, source in sources.items():
        if source is None:
            selected[split] = None
            continue
        if not isinstance(source, FileSource):
            raise ValueError(
                f"--part splits input files over nodes; {source.unit_label(0)} is a Hugging Face dataset. "
                "Download it as files (e.g. the C4 json.gz files), or shard it on one node without --part"
            )
        first, end = part_range(source.num_units, index, count)
        selected[split] = replace(source, files=source.files[first:end])
        # every part records which whole list it took its range from, so that a join can tell
        listed = hashlib.sha256(json.dumps(source.describe()["files"]).encode()).hexdigest()
        units[split] = {"first": first, "end": end, "total": source.num_units, "files_sha256": listed}
    return selected, units
