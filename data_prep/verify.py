"""Check a sharded dataset against its manifest.

    python -m data_prep.verify DIR [--tokenizer PATH]

Checks, for every shard of every split: the file exists and opens as a tar of `.tokens.npy` blocks
with keys `{shard:06d}-{block:04d}` in order; blocks are 2-D with `row_length` columns, the manifest
dtype, and `rows_per_block` rows (the last block may be short); row and token counts and sha256
match the manifest entry; every id is below the vocabulary size. Per split: totals equal the sum of
the shards. Tokenizer: its hash equals the manifest's, for `--tokenizer` if given, else for the
manifest's recorded path if that exists. A dataset without any shard is a problem too. Exits 1 and
prints every problem on a mismatch; exits 0 with a one-line summary otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from data_prep.invocation import command_name
from data_prep.shard_format import iter_shard_blocks, load_manifest, sha256_file, split_shards
from data_prep.tokenizer import tokenizer_sha256


def verify_dataset(data_dir: str | Path, tokenizer: str | None = None) -> tuple[list[str], dict]:
    """Returns (problems, totals); no problems means the directory matches its manifest."""
    data_dir = Path(data_dir)
    problems: list[str] = []
    try:
        manifest = load_manifest(data_dir)
    except (FileNotFoundError, ValueError) as exc:
        return [str(exc)], {}
    row_length = manifest["row_length"]
    vocab_size = manifest["tokenizer"]["vocab_size"]
    dtype = np.dtype(manifest["dtype"])
    rows_per_block = manifest.get("options", {}).get("rows_per_block")
    totals = {"shards": 0, "rows": 0, "tokens": 0, "tokenizer_checked": False}

    tok_path = tokenizer or manifest["tokenizer"].get("path")
    if tokenizer is not None or (tok_path and Path(tok_path).exists()):
        try:
            digest = tokenizer_sha256(tok_path)
            totals["tokenizer_checked"] = True
            if digest != manifest["tokenizer"]["sha256"]:
                problems.append(
                    f"tokenizer {tok_path}: sha256 {digest} differs from the manifest's "
                    f"{manifest['tokenizer']['sha256']} (shards were made with another tokenizer)"
                )
        except (OSError, ValueError) as exc:
            problems.append(f"tokenizer {tok_path}: cannot hash it ({exc})")

    for split, info in manifest.get("splits", {}).items():
        split_rows = split_tokens = 0
        for index, entry in enumerate(split_shards(manifest, split)):
            path = data_dir / entry.path
            totals["shards"] += 1
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            digest = sha256_file(path)
            if digest != entry.sha256:
                problems.append(f"{path}: sha256 {digest} != manifest {entry.sha256}")
            rows = tokens = 0
            try:
                for block_index, (key, block) in enumerate(iter_shard_blocks(path)):
                    expected_key = f"{index:06d}-{block_index:04d}"
                    if key != expected_key:
                        problems.append(f"{path}: block key {key} where {expected_key} was expected")
                    if block.shape[1] != row_length:
                        problems.append(
                            f"{path}: block {key} has rows of {block.shape[1]} tokens, not {row_length}"
                        )
                    if block.dtype != dtype:
                        problems.append(f"{path}: block {key} dtype {block.dtype}, manifest says {dtype}")
                    if rows_per_block and block.shape[0] > rows_per_block:
                        problems.append(
                            f"{path}: block {key} has {block.shape[0]} rows > rows_per_block {rows_per_block}"
                        )
                    if block.size and int(block.max()) >= vocab_size:
                        problems.append(
                            f"{path}: block {key} holds id {int(block.max())} >= vocab_size {vocab_size}"
                        )
                    rows += block.shape[0]
                    tokens += block.size
            except Exception as exc:  # a damaged tar or npy: report and go on with the next shard
                problems.append(f"{path}: cannot read ({type(exc).__name__}: {exc})")
                continue
            if rows != entry.rows or tokens != entry.tokens:
                problems.append(
                    f"{path}: {rows} rows / {tokens} tokens, manifest says {entry.rows} / {entry.tokens}"
                )
            if rows == 0:
                problems.append(f"{path}: holds no rows")
            split_rows += entry.rows
            split_tokens += entry.tokens
        if split_rows != info.get("rows") or split_tokens != info.get("tokens"):
            problems.append(
                f"split {split}: shards sum to {split_rows} rows / {split_tokens} tokens, manifest totals say "
                f"{info.get('rows')} / {info.get('tokens')}"
            )
        totals["rows"] += split_rows
        totals["tokens"] += split_tokens
    empty = [split for split in manifest.get("splits", {}) if not split_shards(manifest, split)]
    if empty or not manifest.get("splits"):
        problems.append(f"{data_dir / 'manifest.json'}: {', '.join(empty) or 'no split'} holds no shards: there is "
                        "nothing to train on there; shard the corpus again (data_prep.shard says why a split is empty)")
    return problems, totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="dataset directory holding manifest.json")
    parser.add_argument("--tokenizer", default=None, help="check this tokenizer's hash against the manifest")
    args = parser.parse_args(argv)
    problems, totals = verify_dataset(args.dir, args.tokenizer)
    if problems:
        for problem in problems:
            print(f"PROBLEM: {problem}")
        print(f"{args.dir}: {len(problems)} problem(s)", file=sys.stderr)
        return 1
    tok = "tokenizer hash ok" if totals["tokenizer_checked"] else "tokenizer not checked (file not found)"
    print(
        f"{args.dir}: OK: {totals['shards']} shards, {totals['rows']} rows, {totals['tokens']} tokens; {tok}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
