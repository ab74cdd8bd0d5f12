"""Tokenise a corpus into packed-row shards (`data_prep.shard_format`), in parallel, resumable.

    python -m data_prep.shard --input 'assets/c4/en/c4-*.json.gz' --output data/c4-sample
    python -m data_prep.shard --input allenai/c4 --hf-config en --output data/c4 --workers 16

Pipeline: the main process reads documents in input order and groups them into chunks; a process
pool encodes chunks (JSON parsing + tokenisation) and returns them *in order* (a bounded window of
futures); the main process appends EOS-terminated documents to one token stream per split, cuts it
into rows of `row_length` tokens and writes a shard every `rows_per_shard` rows. Output is therefore
byte-identical whatever the worker count.

Resume: after each finished shard, DIR/progress.json (written atomically) records the shard list
with sha256s, the stream position (unit = file index, record index inside it), the tokens carried
over into the next shard, and the document / skip counts. A rerun with the same options verifies
the finished shards against it and continues from the position (earlier documents are read but not
tokenised again); a rerun with different options refuses. DIR/manifest.json is written (atomically)
only when every split is done, so a loader never sees a half-written dataset.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_prep import __version__
from data_prep.chunk_encoding import init_worker, iter_chunks, ordered_results
from data_prep.invocation import command_name
from data_prep.progress import (
    STATE_NAME,
    ProgressWriter,
    check_finished_shards,
    diff_fingerprints,
    fresh_split_state,
    load_progress,
    remove_progress,
    save_progress,
    write_json_atomic,
)
from data_prep.shard_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    encode_shard,
    shard_name,
    t5_span_lengths,
    token_dtype,
    write_shard_atomic,
)
from data_prep.sources import (
    CORRUPT_GZIP,
    INVALID_JSON,
    MISSING_TEXT_FIELD,
    NON_UTF8,
    SOURCE_KINDS,
    TXT_MODES,
    FileSource,
    Source,
    SourceError,
    resolve_source,
    split_c4_layout,
)
from data_prep.tokenizer import DEFAULT_SPIECE, TokenizerInfo, load_tokenizer

logger = logging.getLogger(__name__)

# Test hook: exit abruptly (no cleanup, like SIGKILL) right after shard number K (0-based) is renamed
# into place and before progress.json records it.
KILL_AFTER_SHARD_ENV = "T5DS_DATA_PREP_KILL_AFTER_SHARD"
_WINDOW_PER_WORKER = 4  # at most this many chunks (pool tasks) per worker are in flight


class DataError(RuntimeError):
    """A skipped document under --strict; the message names the file and line."""


class OptionsMismatch(RuntimeError):
    """The output directory was started with other options."""


class EmptySplitError(DataError):
    """A split ended with no rows; the message gives the counts and the likely fix."""


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
        # Raises with a clear message on bad span-corruption settings.
        raw, targets = t5_span_lengths(self.input_length, self.noise_density, self.mean_noise_span_length)
        self._derived = {"span_tokens_length": raw, "targets_length": targets}

    @property
    def resolved_row_length(self) -> int:
        return self.row_length if self.row_length is not None else self._derived["span_tokens_length"]

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


# ----------------------------------------------------------------------------------------------
# Main side: read -> chunks -> ordered results -> rows -> shards


class _Packer:
    """Cuts the split's token stream into rows and writes a shard every `rows_per_shard` rows."""

    def __init__(self, split_dir: Path, split: str, cfg: ShardConfig, dtype: np.dtype, state: dict) -> None:
        self.split_dir, self.split, self.dtype = split_dir, split, dtype
        self.row_length = cfg.resolved_row_length
        self.rows_per_shard, self.rows_per_block = cfg.rows_per_shard, cfg.rows_per_block
        self.shard_tokens = self.row_length * self.rows_per_shard
        self.entries: list[dict] = state["shards"]
        carry = np.asarray(state["carry"], dtype=dtype)
        self.pieces, self.buffered = ([carry] if len(carry) else []), len(carry)

    def add(self, tokens: np.ndarray) -> int:
        """Append one document's tokens; returns how many shards were written."""
        self.pieces.append(tokens)
        self.buffered += len(tokens)
        if self.buffered < self.shard_tokens:
            return 0
        flat, start, written = np.concatenate(self.pieces), 0, 0
        while len(flat) - start >= self.shard_tokens:
            self._write(flat[start : start + self.shard_tokens])
            start += self.shard_tokens
            written += 1
        rest = flat[start:].copy()
        self.pieces, self.buffered = ([rest] if len(rest) else []), len(rest)
        return written

    def carry(self) -> list[int]:
        return np.concatenate(self.pieces).tolist() if self.pieces else []

    def finish(self) -> int:
        """Write the last (short) shard of whole rows; returns the dropped tail length in tokens."""
        rows = self.buffered // self.row_length
        if rows:
            self._write(np.concatenate(self.pieces)[: rows * self.row_length])
        dropped = self.buffered - rows * self.row_length
        self.pieces, self.buffered = [], 0
        return dropped

    def _write(self, tokens: np.ndarray) -> None:
        index = len(self.entries)
        rows = tokens.reshape(-1, self.row_length)
        data = encode_shard(rows, index, self.rows_per_block)
        rel = f"{self.split}/{shard_name(index)}"
        digest = write_shard_atomic(self.split_dir / shard_name(index), data)
        self.entries.append(
            {"path": rel, "rows": int(rows.shape[0]), "tokens": int(rows.size), "sha256": digest}
        )
        kill_after = os.environ.get(KILL_AFTER_SHARD_ENV)
        if kill_after is not None and index >= int(kill_after):
            os._exit(75)  # simulate a kill: shard renamed into place, progress.json not yet updated


class _SkipLog:
    """Counts skipped documents by reason, warns (capped) with file and line, raises under --strict."""

    def __init__(self, split: str, counts: dict, cfg: ShardConfig, out: Path, finished: int) -> None:
        self.split, self.cfg, self.out, self.finished = split, cfg, out, finished
        self.counts = Counter(counts)
        self.warned: Counter = Counter()
        self.first: dict[str, str] = {}  # reason -> "file:line: detail" of its first skip in this process

    def skip(self, label: str, line: int, reason: str, detail: str) -> None:
        where = f"{label}:{line}"
        if self.cfg.strict:
            raise DataError(
                f"{where}: {reason}: {detail}. --strict stops here; the {self.finished} finished "
                f"{self.split} shards in {self.out} are kept and a rerun resumes after them. Fix the input, "
                "or rerun without --strict to skip and count such documents."
            )
        self.counts[reason] += 1
        self.warned[reason] += 1
        self.first.setdefault(reason, f"{where}: {detail}")
        if self.warned[reason] <= self.cfg.max_warnings:
            logger.warning("%s: skipped document (%s): %s", where, reason, detail)
            if self.warned[reason] == self.cfg.max_warnings:
                logger.warning("further %s skips in %s are counted but not logged", reason, self.split)


def _run_split(
    split: str,
    source: Source,
    cfg: ShardConfig,
    dtype: np.dtype,
    state: dict,
    save_state,
    executor: ProcessPoolExecutor | None,
) -> dict[str, str]:
    """Shard one split; returns the first skip of each reason (for the message of an empty split)."""
    out = Path(cfg.output)
    split_dir = out / split
    split_dir.mkdir(parents=True, exist_ok=True)
    packer = _Packer(split_dir, split, cfg, dtype, state)
    skips = _SkipLog(split, state["skipped"], cfg, out, len(state["shards"]))
    documents, records = state["documents"], state["records"]
    position = tuple(state["position"])

    bar = tqdm(desc=split, unit="doc", file=sys.stderr, disable=not cfg.progress, mininterval=1.0)
    t0, tokens_done = time.perf_counter(), 0
    window = max(1, cfg.workers) * _WINDOW_PER_WORKER
    try:
        for chunk, (tokens, lengths, chunk_skips) in ordered_results(
            iter_chunks(source, position, cfg.chunk_docs), executor, window
        ):
            offset, j = 0, 0
            for record in chunk.records:
                written = 0
                if record.error is not None:
                    skips.skip(chunk.label, record.line, *record.error)
                else:
                    n = int(lengths[j])
                    if n < 0:
                        skips.skip(chunk.label, record.line, *chunk_skips[j])
                    else:
                        written = packer.add(tokens[offset : offset + n])
                        offset += n
                        documents += 1
                    j += 1
                records += 1
                if written:  # record where the stream stands right after the finished shard(s)
                    skips.finished = len(packer.entries)
                    state.update(
                        position=[chunk.unit, record.index + 1],
                        carry=packer.carry(),
                        documents=documents,
                        records=records,
                        skipped=dict(skips.counts),
                    )
                    save_state()
            tokens_done += offset
            bar.update(len(chunk.records))
            bar.set_postfix_str(
                f"{tokens_done / max(time.perf_counter() - t0, 1e-9) / 1e6:.2f}M tok/s", refresh=False
            )
    finally:
        bar.close()
    dropped = packer.finish()
    state.update(
        done=True,
        position=[source.num_units, 0],
        carry=[],
        documents=documents,
        records=records,
        skipped=dict(skips.counts),
        dropped_tail_tokens=dropped,
    )
    save_state()
    if skips.counts:
        summary = ", ".join(f"{r}={c}" for r, c in sorted(skips.counts.items()))
        logger.warning(
            "%s: skipped %d documents (%s); counted in the manifest",
            split,
            sum(skips.counts.values()),
            summary,
        )
    return skips.first


# The likely fix of a split that ended with no rows, by the reason most of its records were skipped for.
_EMPTY_SPLIT_FIXES = {
    MISSING_TEXT_FIELD: "the records have no text field {field!r}: pass --text-field with the field that holds the text",
    CORRUPT_GZIP: "the .gz input could not be decompressed: check that the files are complete gzip files",
    INVALID_JSON: "the lines are not JSON: name a plain-text corpus .txt (one document per line, or "
                  "--txt-mode blank-line)",
    NON_UTF8: "the text is not UTF-8: re-encode the input as UTF-8",
}


def _empty_split_message(split: str, s: dict, source: Source | None, cfg: ShardConfig,
                         first_skips: dict[str, str], kept: list[str]) -> str:
    """One line: the split's counts, the likely fix, and what happened to the output directory."""
    what = f"{source.num_units} input file(s)" if isinstance(source, FileSource) else "the input"
    skipped = sum(s["skipped"].values())
    counts = ", ".join(f"{r}={c}" for r, c in sorted(s["skipped"].items()))
    head = (f"{split}: no rows were written: {what} gave {s['records']} records, {s['documents']} documents, "
            f"{skipped} skipped" + (f" ({counts})" if counts else ""))
    if s["records"] == 0:
        fix = "the input is empty"
    elif s["documents"] == 0:
        reason = max(s["skipped"], key=s["skipped"].get)
        fix = _EMPTY_SPLIT_FIXES.get(reason, "every record was skipped (see the warnings above)").format(
            field=cfg.text_field)
        if reason in first_skips:
            fix += f" (first: {first_skips[reason]})"
    else:
        fix = (f"its {s['dropped_tail_tokens']} tokens make no row of {cfg.resolved_row_length}: give it more text, "
               "or a smaller --input-length")
    out = Path(cfg.output)
    after = (f"the shards of {', '.join(kept)} in {out} are kept; shard this split again into a new --output"
             if kept else f"nothing was kept in {out}; fix the input and run the same command again")
    return f"{head}; {fix}. No manifest was written: {after}"


def run_sharding(cfg: ShardConfig) -> dict:
    """Shard `cfg.input` into `cfg.output`; resumes an interrupted run. Returns the manifest."""
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.tokenizer)
    info: TokenizerInfo = tok.info
    dtype = token_dtype(info.vocab_size)
    sources = resolve_split_sources(cfg)
    fingerprint = json.loads(
        json.dumps(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "tool_version": __version__,
                "tokenizer": {k: v for k, v in asdict(info).items() if k != "path"},
                "options": cfg.output_options(),
                "source": {s: (src.describe() if src is not None else None) for s, src in sources.items()},
            }
        )
    )

    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / STATE_NAME
    resumed = state_path.is_file()
    if resumed:
        state = load_progress(out)
        if state.get("fingerprint") != fingerprint:
            differences = "\n  ".join(diff_fingerprints(state.get("fingerprint", {}), fingerprint))
            raise OptionsMismatch(
                f"{out} holds a run with different options or input:\n  {differences}\n"
                "Use a new --output directory, or delete this one to start over."
            )
        if all(s["done"] for s in state["splits"].values()) and (out / MANIFEST_NAME).is_file():
            for split in state["splits"]:
                check_finished_shards(out, split, state["splits"][split])
            logger.info("%s is already complete (shards verified); nothing to do", out)
            with open(out / MANIFEST_NAME) as f:
                return json.load(f)
        save_progress(out, state)  # drop log lines of shards that progress.json never recorded
        for split, split_state in state["splits"].items():
            check_finished_shards(out, split, split_state)
            if split_state["shards"] or split_state["records"]:
                logger.info(
                    "resuming %s after %d finished shards (position %s)",
                    split,
                    len(split_state["shards"]),
                    split_state["position"],
                )
    else:
        if (out / MANIFEST_NAME).exists() or any(
            (out / s).is_dir() and any((out / s).iterdir()) for s in SPLITS
        ):
            raise OptionsMismatch(
                f"{out} already holds shards but no {STATE_NAME}; use a new --output directory."
            )
        state = {
            "fingerprint": fingerprint,
            "splits": {s: fresh_split_state() for s, src in sources.items() if src is not None},
        }
        save_progress(out, state)
    save_state = ProgressWriter(out, state).save

    executor = None
    if cfg.workers > 0:
        executor = ProcessPoolExecutor(
            cfg.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=init_worker,
            initargs=(cfg.tokenizer, cfg.text_field, dtype.str, os.getpid()),
        )
    else:
        init_worker(cfg.tokenizer, cfg.text_field, dtype.str)
    first_skips: dict[str, dict[str, str]] = {}
    try:
        for split, split_state in state["splits"].items():
            if not split_state["done"]:
                first_skips[split] = _run_split(split, sources[split], cfg, dtype, split_state, save_state, executor)
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
    empty = [split for split, s in state["splits"].items() if not s["shards"]]
    if empty:
        kept = [split for split in state["splits"] if split not in empty]
        if not kept:
            remove_progress(out, list(state["splits"]))
        split = empty[0]
        raise EmptySplitError(_empty_split_message(split, state["splits"][split], sources.get(split), cfg,
                                                   first_skips.get(split, {}), kept))

    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tool_version": __version__,
        "tokenizer": asdict(info),
        "row_length": cfg.resolved_row_length,
        "dtype": dtype.name,
        "options": cfg.output_options(),
        "source": fingerprint["source"],
        "splits": {},
        # The only field that differs between runs with the same input and options.
        "run": {
            "started_at": started.isoformat(timespec="seconds"),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": round(time.perf_counter() - t0, 3),
            "workers": cfg.workers,
            "resumed": resumed,
        },
    }
    for split, s in state["splits"].items():
        manifest["splits"][split] = {
            "shards": s["shards"],
            "rows": sum(e["rows"] for e in s["shards"]),
            "tokens": sum(e["tokens"] for e in s["shards"]),
            "documents": s["documents"],
            "records": s["records"],  # documents + skipped (+1 per corrupt gzip stream)
            "skipped": dict(sorted(s["skipped"].items())),
            "skipped_total": sum(s["skipped"].values()),
            "dropped_tail_tokens": s["dropped_tail_tokens"],
        }
    write_json_atomic(out / MANIFEST_NAME, manifest)
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=command_name(),
        description="Tokenise a corpus into packed-row WebDataset shards (see docs/data_prep.md).",
    )
    p.add_argument("--input", required=True, help="train source: file glob, local HF dataset dir or HF name")
    p.add_argument("--output", required=True, help="output directory (manifest.json, train/, validation/)")
    p.add_argument(
        "--tokenizer", default=str(DEFAULT_SPIECE), help="SentencePiece .model or HF tokenizer dir"
    )
    p.add_argument("--validation-input", default=None, help="validation source (same kinds as --input)")
    p.add_argument("--source-kind", default="auto", choices=SOURCE_KINDS, help="how to read --input")
    p.add_argument("--text-field", default="text", help="JSON / parquet / dataset field with the text")
    p.add_argument(
        "--txt-mode", default="line", choices=TXT_MODES, help=".txt: document per line or per paragraph"
    )
    p.add_argument("--hf-config", default=None, help="HF dataset config, e.g. en for allenai/c4")
    p.add_argument("--hf-train-split", default="train")
    p.add_argument("--hf-validation-split", default="validation", help="'none' for no validation split")
    p.add_argument("--hf-revision", default=None)
    p.add_argument("--input-length", type=int, default=512, help="encoder input length rows are sized for")
    p.add_argument("--noise-density", type=float, default=0.15)
    p.add_argument("--mean-noise-span-length", type=float, default=3.0)
    p.add_argument("--row-length", type=int, default=None, help="tokens per row (overrides the derivation)")
    p.add_argument("--rows-per-shard", type=int, default=8192)
    p.add_argument("--rows-per-block", type=int, default=256)
    p.add_argument(
        "--workers",
        type=int,
        default=max(1, len(os.sched_getaffinity(0))),
        help="encoder processes (default: usable cores; the main process that reads and packs needs ~5%% of one)",
    )
    p.add_argument("--chunk-docs", type=int, default=512, help="documents per pool task")
    p.add_argument("--strict", action="store_true", help="any skipped document is an error")
    p.add_argument("--max-warnings", type=int, default=20, help="warnings logged per skip reason")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-q", "--quiet", action="store_true", help="log errors only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.ERROR if args.quiet else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    hf_validation = None if args.hf_validation_split.lower() in ("", "none") else args.hf_validation_split
    try:
        cfg = ShardConfig(
            input=args.input,
            output=args.output,
            tokenizer=args.tokenizer,
            validation_input=args.validation_input,
            source_kind=args.source_kind,
            text_field=args.text_field,
            txt_mode=args.txt_mode,
            hf_config=args.hf_config,
            hf_train_split=args.hf_train_split,
            hf_validation_split=hf_validation,
            hf_revision=args.hf_revision,
            input_length=args.input_length,
            noise_density=args.noise_density,
            mean_noise_span_length=args.mean_noise_span_length,
            row_length=args.row_length,
            rows_per_shard=args.rows_per_shard,
            rows_per_block=args.rows_per_block,
            workers=args.workers,
            chunk_docs=args.chunk_docs,
            strict=args.strict,
            progress=not args.no_progress,
            max_warnings=args.max_warnings,
        )
        manifest = run_sharding(cfg)
    except (DataError, OptionsMismatch, SourceError, ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for split, s in manifest["splits"].items():
        skipped = f", skipped {s['skipped_total']} {s['skipped']}" if s["skipped_total"] else ""
        print(
            f"{split}: {len(s['shards'])} shards, {s['rows']} rows x {manifest['row_length']} = {s['tokens']} tokens "
            f"from {s['documents']} documents (dropped tail {s['dropped_tail_tokens']} tokens{skipped})"
        )
    print(f"wrote {Path(cfg.output) / MANIFEST_NAME} in {manifest['run']['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
