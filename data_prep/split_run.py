"""One split of a sharding run: encoded chunks in input order -> rows -> shards, with the skipped
documents counted and the resume state recorded after every finished shard."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from tqdm import tqdm

from data_prep.chunk_encoding import Chunk, iter_chunks, ordered_results
from data_prep.shard_config import DataError, ShardConfig
from data_prep.shard_writer import Packer, ShardWriter
from data_prep.sources import CORRUPT_GZIP, INVALID_JSON, MISSING_TEXT_FIELD, NON_UTF8, FileSource, Source

logger = logging.getLogger(__name__)

_WINDOW_PER_WORKER = 4  # at most this many chunks (pool tasks) per worker are in flight


class SkipLog:
    """Counts skipped documents by reason, warns (capped) with file and line, raises under --strict."""

    def __init__(self, split: str, counts: dict, cfg: ShardConfig, finished: int) -> None:
        self.split, self.cfg, self.finished = split, cfg, finished
        self.counts = Counter(counts)
        self.warned: Counter = Counter()
        self.first: dict[str, str] = {}  # reason -> "file:line: detail" of its first skip in this process

    def skip(self, label: str, line: int, reason: str, detail: str) -> None:
        where = f"{label}:{line}"
        if self.cfg.strict:
            raise DataError(
                f"{where}: {reason}: {detail}. --strict stops here; the {self.finished} finished "
                f"{self.split} shards in {self.cfg.output_dir} are kept and a rerun resumes after them. Fix the "
                "input, or rerun without --strict to skip and count such documents."
            )
        self.counts[reason] += 1
        self.warned[reason] += 1
        self.first.setdefault(reason, f"{where}: {detail}")
        if self.warned[reason] <= self.cfg.max_warnings:
            logger.warning("%s: skipped document (%s): %s", where, reason, detail)
            if self.warned[reason] == self.cfg.max_warnings:
                logger.warning("further %s skips in %s are counted but not logged", reason, self.split)


def _chunk_records(chunk: Chunk, lengths: np.ndarray, chunk_skips: dict) -> tuple[np.ndarray, list]:
    """(tokens per record of the chunk, 0 where skipped; [(record, reason, detail)] in record order)."""
    if chunk.records is None:  # a block of lines: record i is payload i
        return np.maximum(lengths, 0), sorted((i, *why) for i, why in chunk_skips.items())
    per_record = np.zeros(len(chunk.records), dtype=np.int64)
    skips, j = [], 0
    for i, record in enumerate(chunk.records):
        if record.error is not None:
            skips.append((i, *record.error))
            continue
        if lengths[j] < 0:
            skips.append((i, *chunk_skips[j]))
        else:
            per_record[i] = lengths[j]
        j += 1
    return per_record, skips


def run_split(split: str, source: Source, cfg: ShardConfig, dtype: np.dtype, state: dict, save_state,
              executor: ProcessPoolExecutor | None) -> dict[str, str]:
    """Shard one split; returns the first skip of each reason (for the message of an empty split)."""
    split_dir = cfg.output_dir / split
    split_dir.mkdir(parents=True, exist_ok=True)
    entries: list = state["shards"]
    packer = Packer(cfg.resolved_row_length, cfg.rows_per_shard, dtype, state["carry"])
    skips = SkipLog(split, state["skipped"], cfg, len(entries))
    documents, records = state["documents"], state["records"]
    writer = ShardWriter(cfg.rows_per_block, save_state)

    bar = tqdm(desc=split, unit="doc", file=sys.stderr, disable=not cfg.progress, mininterval=1.0)
    t0, tokens_done = time.perf_counter(), 0
    window = max(1, cfg.workers) * _WINDOW_PER_WORKER
    try:
        tasks = iter_chunks(source, tuple(state["position"]), cfg.chunk_docs, cfg.workers if executor else 0)
        spill_dir = cfg.output_dir / f".{split}-unit-tokens"
        for chunk, (tokens, lengths, chunk_skips) in ordered_results(
            tasks, executor, window, spill_dir, cfg.chunk_docs, dtype
        ):
            per_record, chunk_skip_list = _chunk_records(chunk, lengths, chunk_skips)
            used = chunk.num_records
            if cfg.strict and chunk_skip_list:
                used = chunk_skip_list[0][0]  # pack the records before the first skip, then stop there
            ends = np.cumsum(per_record[:used])
            kept = np.cumsum(per_record[:used] > 0)
            shards = packer.add(tokens[: int(ends[-1]) if used else 0])
            for k, (end, rows) in enumerate(shards):
                r = int(np.searchsorted(ends, end, side="left"))  # the record that completes the shard
                update = None
                if k + 1 == len(shards) or int(np.searchsorted(ends, shards[k + 1][0], side="left")) != r:
                    # where the stream stands right after this record (resume continues from here)
                    counts = Counter(skips.counts)
                    counts.update(reason for i, reason, _ in chunk_skip_list if i < r)
                    update = (state, dict(
                        position=[chunk.unit, chunk.record_index(r) + 1],
                        carry=tokens[end : int(ends[r])].tolist(),
                        documents=documents + int(kept[r]),
                        records=records + r + 1,
                        skipped=dict(counts),
                    ))
                writer.put(split_dir, entries, rows, update)
            if used < chunk.num_records:
                writer.drain()
                skips.finished = len(entries)
            for i, reason, detail in chunk_skip_list:
                skips.skip(chunk.label, chunk.record_line(i), reason, detail)
            documents += int(kept[-1]) if used else 0
            records += used
            tokens_done += int(ends[-1]) if used else 0
            bar.update(used)
            bar.set_postfix_str(
                f"{tokens_done / max(time.perf_counter() - t0, 1e-9) / 1e6:.2f}M tok/s", refresh=False
            )
        last, tail = packer.finish()
        if last is not None:
            writer.put(split_dir, entries, last, None)
        writer.drain()
    finally:
        bar.close()
        writer.queue.join()  # shards already queued are written and recorded before an error goes up
        writer.close()
    state.update(
        done=True,
        position=[source.num_units, 0],
        carry=tail.tolist() if cfg.part else [],  # a part keeps its tail: joined, it starts the next part's rows
        documents=documents,
        records=records,
        skipped=dict(skips.counts),
        dropped_tail_tokens=len(tail),
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


def empty_split_message(split: str, s: dict, source: Source | None, cfg: ShardConfig,
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
    out = cfg.output_dir
    after = (f"the shards of {', '.join(kept)} in {out} are kept; shard this split again into a new --output"
             if kept else f"nothing was kept in {out}; fix the input and run the same command again")
    return f"{head}; {fix}. No manifest was written: {after}"
