"""Resume state of a sharding run: DIR/progress.json plus one append-only shard log per split.

After each finished shard, its entry ({path, rows, tokens, sha256}) is appended to
DIR/progress-{split}.jsonl (fsync) and DIR/progress.json is replaced atomically: the stream position
[unit (file index), record index inside it] of the next document, the tokens carried over into the
next shard, document / skip counts and `num_shards`, the number of log entries that count. Appending
keeps saving O(1) per shard (full C4 makes ~37k shards); log lines past `num_shards` are from a run
killed between the two writes and are dropped on resume.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from data_prep.shard_format import sha256_file

logger = logging.getLogger(__name__)

STATE_NAME = "progress.json"


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _shard_log(out: Path, split: str) -> Path:
    return out / f"progress-{split}.jsonl"


def _compact(state: dict) -> dict:
    """progress.json content: each split's shard list replaced by its length (the list is in the log)."""
    splits = {
        split: {**{k: v for k, v in st.items() if k != "shards"}, "num_shards": len(st["shards"])}
        for split, st in state["splits"].items()
    }
    return {**state, "splits": splits}


def load_progress(out: str | os.PathLike) -> dict:
    """DIR/progress.json with each split's finished shards read back from DIR/progress-{split}.jsonl."""
    out = Path(out)
    with open(out / STATE_NAME) as f:
        state = json.load(f)
    for split, st in state["splits"].items():
        n, entries = st.pop("num_shards"), []
        if n:
            with open(_shard_log(out, split)) as f:
                for line in f:
                    if len(entries) == n:
                        break  # entries past n: a run killed between the log append and progress.json
                    entries.append(json.loads(line))
        if len(entries) < n:
            raise RuntimeError(
                f"{_shard_log(out, split)} lists {len(entries)} shards but {STATE_NAME} says {n}: the "
                f"directory was modified. Delete {out} and rerun."
            )
        st["shards"] = entries
    return state


def save_progress(out: str | os.PathLike, state: dict) -> None:
    """Rewrite the shard logs and progress.json from `state` (on resume: drops unrecorded log lines)."""
    out = Path(out)
    for split, st in state["splits"].items():
        tmp = _shard_log(out, split).with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in st["shards"])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, _shard_log(out, split))
    write_json_atomic(out / STATE_NAME, _compact(state))


class ProgressWriter:
    """Saves the state after each finished shard in O(1): new shard entries are appended to the
    split's log (fsync), then progress.json (position, carry, counts, num_shards) is replaced."""

    def __init__(self, out: Path, state: dict) -> None:
        self.out, self.state = out, state
        self.logged = {split: len(st["shards"]) for split, st in state["splits"].items()}

    def save(self) -> None:
        for split, st in self.state["splits"].items():
            new = st["shards"][self.logged[split] :]
            if new:
                with open(_shard_log(self.out, split), "a") as f:
                    f.writelines(json.dumps(e) + "\n" for e in new)
                    f.flush()
                    os.fsync(f.fileno())
                self.logged[split] = len(st["shards"])
        write_json_atomic(self.out / STATE_NAME, _compact(self.state))


def fresh_split_state() -> dict:
    return {
        "done": False,
        "shards": [],
        "position": [0, 0],  # [unit (file index), record index inside it] of the next record to read
        "carry": [],  # tokens read but not yet in a shard (the start of the next row)
        "documents": 0,
        "records": 0,
        "skipped": {},
        "dropped_tail_tokens": 0,
    }


def check_finished_shards(out: Path, split: str, split_state: dict) -> None:
    """Verify the shards progress.json lists; remove temp files and shards it does not list."""
    for entry in split_state["shards"]:
        path = out / entry["path"]
        if not path.is_file() or sha256_file(path) != entry["sha256"]:
            problem = "is missing" if not path.is_file() else "has a different sha256"
            raise RuntimeError(
                f"{path} {problem} than progress.json records for a finished shard: the directory was "
                f"modified. Delete {out} and rerun (or restore the shard)."
            )
    split_dir = out / split
    if split_dir.is_dir():
        listed = {Path(e["path"]).name for e in split_state["shards"]}
        for path in split_dir.iterdir():
            if path.name.endswith(".tmp") or (path.name.startswith("shard-") and path.name not in listed):
                logger.info("removing %s (not recorded as finished; it will be rewritten)", path)
                path.unlink()


def diff_fingerprints(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += diff_fingerprints(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {json.dumps(va)[:120]} (in DIR) vs {json.dumps(vb)[:120]} (now)")
    return out


def remove_progress(out: str | os.PathLike, splits: list[str]) -> None:
    """Remove the resume state and the empty split directories of a run that wrote no shard at all, so
    that the command, rerun with other options, starts afresh in the same directory."""
    out = Path(out)
    for name in [STATE_NAME] + [_shard_log(out, split).name for split in splits]:
        (out / name).unlink(missing_ok=True)
    for split in splits:
        if (out / split).is_dir() and not any((out / split).iterdir()):
            (out / split).rmdir()
