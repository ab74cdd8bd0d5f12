"""Join the parts of a corpus sharded on several nodes into one dataset.

    python -m data_prep.shard --input 'c4/en/c4-*.json.gz' --output data/c4 --part K/N   # K = 1..N, one per node
    python -m data_prep.join data/c4

Each part (`data_prep.shard --part K/N`) holds the rows of its range of input files and the tail
that makes no row of its own. Joining reads the parts in order and cuts their streams, each tail
followed by the next part's rows, into the rows and shards that one run over all the files writes:
DIR/train/, DIR/validation/ and DIR/manifest.json come out byte for byte as that run's (but for
`manifest["run"]`). The parts are only read; once `data_prep.verify DIR` passes, DIR/part-* can go.
The join rewrites every token (about 2 GB per billion tokens); it is disk-bound. A join that stops
midway leaves no manifest, and running it again starts it over.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from data_prep.invocation import command_name
from data_prep.progress import STATE_NAME, diff_fingerprints, write_json_atomic
from data_prep.shard import split_summary
from data_prep.shard_config import parse_part_dir, part_dir_name
from data_prep.shard_format import MANIFEST_NAME, load_manifest, read_shard
from data_prep.shard_writer import Packer, ShardWriter

logger = logging.getLogger(__name__)

# Manifest fields every part must agree on (the tokenizer's path may differ from node to node).
_SAME_IN_EVERY_PART = ("format", "format_version", "tool_version", "tokenizer", "row_length", "dtype", "options")


class JoinError(ValueError):
    """The parts cannot be joined (missing, unfinished, from other settings) or DIR is already joined."""


def _settings(manifest: dict) -> dict:
    settings = {k: manifest.get(k) for k in _SAME_IN_EVERY_PART}
    settings["tokenizer"] = {k: v for k, v in (settings["tokenizer"] or {}).items() if k != "path"}
    settings["splits"] = sorted(manifest["splits"])
    return settings


def find_parts(out: Path) -> list[tuple[Path, dict]]:
    """The part directories of `out` with their manifests, in part order; JoinError if they cannot be joined."""
    found: dict[int, dict[int, Path]] = {}
    for path in out.iterdir() if out.is_dir() else []:
        if path.is_dir() and (k_n := parse_part_dir(path.name)):
            found.setdefault(k_n[1], {})[k_n[0]] = path
    if not found:
        raise JoinError(f"{out} holds no part directories (part-K-of-N): shard into it with "
                        "`python -m data_prep.shard ... --output {out} --part K/N` for K = 1..N first")
    if len(found) > 1:
        raise JoinError(f"{out} holds parts of {' and of '.join(str(n) for n in sorted(found))} parts: keep the "
                        "part-*-of-N directories of one N (move the others away) and join again")
    count, parts = next(iter(found.items()))
    missing = [k for k in range(1, count + 1) if k not in parts]
    if missing:
        raise JoinError(f"{out} lacks part(s) {', '.join(map(str, missing))} of {count} "
                        f"({out / part_dir_name(missing[0], count)}): run the shard command with "
                        f"--part {missing[0]}/{count} (the same input and options), then join again")
    result = []
    for k in range(1, count + 1):
        if not (parts[k] / MANIFEST_NAME).is_file():
            state = "is still being written or was stopped" if (parts[k] / STATE_NAME).is_file() else "has no manifest"
            raise JoinError(f"{parts[k]} {state}: run (or rerun: it resumes) the shard command with "
                            f"--part {k}/{count}, then join again")
        manifest = load_manifest(parts[k])
        if (manifest.get("part") or {}).get("index") != k or manifest["part"].get("count") != count:
            raise JoinError(f"{parts[k] / MANIFEST_NAME} is not the manifest of part {k} of {count}: "
                            f"shard that part again with --part {k}/{count}")
        result.append((parts[k], manifest))
    first = _settings(result[0][1])
    for path, manifest in result[1:]:
        if (settings := _settings(manifest)) != first:
            differences = "; ".join(diff_fingerprints(first, settings))
            raise JoinError(f"{path} was sharded with other settings than {result[0][0]} ({differences}): shard "
                            "every part with the same command but for --part, then join again")
    for split in first["splits"]:
        units = [m["part"]["units"][split] for _, m in result]
        expected = [0] + [u["end"] for u in units[:-1]]
        if [u["first"] for u in units] != expected or units[-1]["end"] != units[0]["total"] or any(
                (u["total"], u["files_sha256"]) != (units[0]["total"], units[0]["files_sha256"]) for u in units):
            raise JoinError(f"the parts in {out} were sharded from different {split} file lists (files "
                            f"{[(u['first'], u['end'], u['total']) for u in units]} of each part's list): shard every "
                            "part from the same --input (the same files, paths and sizes)")
    return result


def join_parts(out: str | Path) -> dict:
    """Join DIR/part-K-of-N into DIR (shards + manifest); returns the manifest."""
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    out = Path(out)
    if (out / MANIFEST_NAME).exists():
        raise JoinError(f"{out / MANIFEST_NAME} exists: {out} is already joined (or a one-node run); "
                        "nothing to do. Check it with `python -m data_prep.verify`")
    if (out / STATE_NAME).exists():
        raise JoinError(f"{out} holds a one-node run ({STATE_NAME}): shard the parts into their own --output")
    parts = find_parts(out)
    first = parts[0][1]
    manifest = {k: v for k, v in first.items() if k not in ("part", "run")}
    manifest["source"], manifest["splits"] = {}, {}
    dtype = np.dtype(first["dtype"])
    writer = ShardWriter(first["options"]["rows_per_block"])
    try:
        for split in first["splits"]:
            split_dir = out / split
            split_dir.mkdir(exist_ok=True)
            for stale in list(split_dir.glob("shard-*.tar")) + list(split_dir.glob("*.tmp")):
                stale.unlink()  # a join that stopped midway: its shards are written again
            state = {"shards": [], "documents": 0, "records": 0, "skipped": {}}
            packer = Packer(first["row_length"], first["options"]["rows_per_shard"], dtype, [])
            for path, part in parts:
                info = part["splits"][split]
                for entry in info["shards"]:
                    for _, rows in packer.add(read_shard(path / entry["path"]).reshape(-1)):
                        writer.put(split_dir, state["shards"], rows, None)
                for _, rows in packer.add(np.asarray(part["part"]["tails"][split], dtype=dtype)):
                    writer.put(split_dir, state["shards"], rows, None)
                state["documents"] += info["documents"]
                state["records"] += info["records"]
                for reason, count in info["skipped"].items():
                    state["skipped"][reason] = state["skipped"].get(reason, 0) + count
            last, tail = packer.finish()
            if last is not None:
                writer.put(split_dir, state["shards"], last, None)
            writer.drain()
            if not state["shards"]:
                raise JoinError(f"{split}: the parts hold {len(tail)} tokens in all, no row of {first['row_length']}: "
                                "give the split more text, or a smaller --input-length")
            state["dropped_tail_tokens"] = len(tail)
            manifest["splits"][split] = split_summary(state)
            sources = [part["source"][split] for _, part in parts]
            manifest["source"][split] = {**sources[0], "files": [f for s in sources for f in s["files"]]}
    finally:
        writer.queue.join()
        writer.close()
    for split, source in first["source"].items():
        manifest["source"].setdefault(split, source)  # a split without a source (None) in every part
    manifest["source"] = {split: manifest["source"][split] for split in first["source"]}
    manifest["splits"] = {split: manifest["splits"][split] for split in first["splits"]}
    manifest["run"] = {
        "started_at": started.isoformat(timespec="seconds"),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(time.perf_counter() - t0, 3),
        "workers": first["run"]["workers"],
        "resumed": False,
        "joined_parts": len(parts),
    }
    write_json_atomic(out / MANIFEST_NAME, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=command_name(), description=__doc__.split("\n")[0])
    p.add_argument("dir", help="the --output of the `data_prep.shard --part K/N` runs")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        manifest = join_parts(args.dir)
    except (ValueError, OSError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for split, s in manifest["splits"].items():
        print(f"{split}: {len(s['shards'])} shards, {s['rows']} rows x {manifest['row_length']} = {s['tokens']} "
              f"tokens from {s['documents']} documents (dropped tail {s['dropped_tail_tokens']} tokens)")
    print(f"joined {manifest['run']['joined_parts']} parts into {Path(args.dir) / MANIFEST_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
