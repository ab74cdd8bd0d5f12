"""Tokenise a corpus into packed-row shards (`data_prep.shard_format`), in parallel, resumable.

    python -m data_prep.shard --input 'assets/c4/en/c4-*.json.gz' --output data/c4-sample
    python -m data_prep.shard --input allenai/c4 --hf-config en --output data/c4 --workers 16

Pipeline: a process pool encodes the input in chunks (line splitting, JSON parsing + tokenisation):
whole line-per-document files that each worker reads itself when there are enough of them, else
chunks the main process reads (`data_prep.chunk_encoding`); the results come back *in order* (a
bounded window of futures), and the main process appends
the EOS-terminated documents to one token stream per split and cuts it into rows of `row_length`
tokens, and a writer thread writes a shard every `rows_per_shard` rows (`data_prep.shard_writer`).
Output is therefore byte-identical whatever the worker count.

Many nodes: `--part K/N` shards the K-th of N contiguous ranges of each split's files into
DIR/part-K-of-N, keeping the tail that makes no row; `python -m data_prep.join DIR` then cuts the
parts' streams into the rows and shards that one run over all the files writes, byte for byte.

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
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone

from data_prep import __version__
from data_prep.chunk_encoding import init_worker
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
from data_prep.shard_config import (
    DataError,
    EmptySplitError,
    OptionsMismatch,
    ShardConfig,
    parse_part,
    resolve_split_sources,
    select_part,
)
from data_prep.shard_format import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, SPLITS, token_dtype
from data_prep.shard_writer import KILL_AFTER_SHARD_ENV
from data_prep.sources import SOURCE_KINDS, TXT_MODES, SourceError
from data_prep.split_run import empty_split_message, run_split
from data_prep.tokenizer import DEFAULT_SPIECE, TokenizerInfo, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = [  # names the tests and benchmarks import from here
    "KILL_AFTER_SHARD_ENV", "DataError", "EmptySplitError", "OptionsMismatch", "ShardConfig", "load_progress",
    "run_sharding", "save_progress",
]


def split_summary(s: dict) -> dict:
    """manifest["splits"][split] from the split's state (shard list and counts)."""
    return {
        "shards": s["shards"],
        "rows": sum(e["rows"] for e in s["shards"]),
        "tokens": sum(e["tokens"] for e in s["shards"]),
        "documents": s["documents"],
        "records": s["records"],  # documents + skipped (+1 per corrupt gzip stream)
        "skipped": dict(sorted(s["skipped"].items())),
        "skipped_total": sum(s["skipped"].values()),
        "dropped_tail_tokens": s["dropped_tail_tokens"],
    }


def run_sharding(cfg: ShardConfig) -> dict:
    """Shard `cfg.input` into `cfg.output`; resumes an interrupted run. Returns the manifest."""
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.tokenizer)
    info: TokenizerInfo = tok.info
    dtype = token_dtype(info.vocab_size)
    sources = resolve_split_sources(cfg)
    part = None
    if cfg.part is not None:
        sources, units = select_part(sources, *cfg.part)
        part = {"index": cfg.part[0], "count": cfg.part[1], "units": units}
    fingerprint = json.loads(
        json.dumps(
            {
                "format": FORMAT_NAME,
                "format_version": FORMAT_VERSION,
                "tool_version": __version__,
                "tokenizer": {k: v for k, v in asdict(info).items() if k != "path"},
                "options": cfg.output_options(),
                "source": {s: (src.describe() if src is not None else None) for s, src in sources.items()},
                **({"part": part} if part else {}),
            }
        )
    )

    out = cfg.output_dir
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

    executor, context = None, multiprocessing.get_context("spawn")
    stop = context.Event()  # set on an error, so that workers reading whole files give up at once
    if cfg.workers > 0:
        executor = ProcessPoolExecutor(
            cfg.workers,
            mp_context=context,
            initializer=init_worker,
            initargs=(cfg.tokenizer, cfg.text_field, dtype.str, os.getpid(), stop),
        )
    else:
        init_worker(cfg.tokenizer, cfg.text_field, dtype.str)
    first_skips: dict[str, dict[str, str]] = {}
    try:
        for split, split_state in state["splits"].items():
            if not split_state["done"]:
                first_skips[split] = run_split(split, sources[split], cfg, dtype, split_state, save_state, executor)
    except BaseException:
        stop.set()
        raise
    finally:
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
    empty = [split for split, s in state["splits"].items() if not s["shards"] and not part]
    if empty:
        kept = [split for split in state["splits"] if split not in empty]
        if not kept:
            remove_progress(out, list(state["splits"]))
        split = empty[0]
        raise EmptySplitError(empty_split_message(split, state["splits"][split], sources.get(split), cfg,
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
        manifest["splits"][split] = split_summary(s)
    if part:  # what `data_prep.join` needs: which files this part read, and the tails it kept
        manifest["part"] = {**part, "tails": {split: s["carry"] for split, s in state["splits"].items()}}
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
        help="encoder processes (default: usable cores; the main process that packs needs a share of one)",
    )
    p.add_argument("--chunk-docs", type=int, default=512, help="documents per pool task")
    p.add_argument("--part", default=None, metavar="K/N",
                   help="shard the K-th of N contiguous ranges of the input files into OUTPUT/part-K-of-N "
                        "(one node or SLURM array task each); `python -m data_prep.join OUTPUT` joins them")
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
        part = parse_part(args.part) if args.part is not None else None
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
            part=part,
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
    print(f"wrote {cfg.output_dir / MANIFEST_NAME} in {manifest['run']['elapsed_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
