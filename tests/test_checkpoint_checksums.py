"""Content checksums of checkpoint files (training/checkpoint_checksums.py): blocks, shares, damage reports."""

from __future__ import annotations

import hashlib
import json

import torch

from training.checkpoint_checksums import (
    blocks,
    checksum_record,
    hash_blocks,
    mismatches,
    share,
    verify_checkpoint,
)


def test_blocks_cover_every_byte_once_in_a_fixed_order():
    files = {"b.pt": 2500, "a.pt": 1024, "empty.pt": 0}
    units = blocks(files, block_bytes=1024)
    assert units == [("a.pt", 0, 1024), ("b.pt", 0, 1024), ("b.pt", 1024, 1024), ("b.pt", 2048, 452),
                     ("empty.pt", 0, 0)]
    # the ranks' shares are disjoint and together are all blocks
    shares = [share(units, r, 3) for r in range(3)]
    assert sorted(u for s in shares for u in s) == sorted(units)


def test_digests_are_the_sha256_of_each_block_and_a_changed_byte_is_named(tmp_path):
    data = bytes(range(256)) * 14  # 3584 bytes
    (tmp_path / "f.pt").write_bytes(data)
    files = {"f.pt": len(data)}
    units = blocks(files, block_bytes=1024)
    digests = hash_blocks(tmp_path, units, threads=2)
    assert digests[("f.pt", 2048)] == hashlib.sha256(data[2048:3072]).hexdigest()
    recorded = {"f.pt": [digests[("f.pt", o)] for _, o, _ in units]}
    assert mismatches(files, recorded, digests, block_bytes=1024) == []

    damaged = bytearray(data)
    damaged[1100] ^= 0x40
    (tmp_path / "f.pt").write_bytes(bytes(damaged))
    found = mismatches(files, recorded, hash_blocks(tmp_path, units), block_bytes=1024)
    assert found == ["f.pt: bytes 1024-2048 do not match the sha256 recorded when it was written"]
    # a share that does not hold the damaged block (units 0 and 2) finds nothing; the one that holds it does
    assert mismatches(files, recorded, hash_blocks(tmp_path, share(units, 0, 2)), block_bytes=1024) == []
    assert len(mismatches(files, recorded, hash_blocks(tmp_path, share(units, 1, 2)), block_bytes=1024)) == 1


def test_a_file_shorter_than_recorded_is_reported_not_raised(tmp_path):
    (tmp_path / "f.pt").write_bytes(b"x" * 100)
    digests = hash_blocks(tmp_path, [("f.pt", 0, 200)])
    assert digests[("f.pt", 0)].startswith("error: ")
    assert "cannot be read at bytes 0-200" in mismatches({"f.pt": 200}, {"f.pt": ["0" * 64]}, digests)[0]


def _checkpoint_dir(tmp_path, with_checksums: bool):
    torch.save({"cursor": 5}, tmp_path / "rank_state_0.pt")
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"weights" * 100)
    files = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    meta = {"step": 5, "world_size": 1, "files": files}
    if with_checksums:
        meta["checksums"] = checksum_record(files, hash_blocks(tmp_path, blocks(files)))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return tmp_path


def test_verify_checkpoint_checks_contents_or_test_reads_the_rank_states_of_an_older_one(tmp_path):
    (tmp_path / "new").mkdir()
    new = _checkpoint_dir(tmp_path / "new", with_checksums=True)
    assert verify_checkpoint(new) == ([], True)
    rank_state = new / "rank_state_0.pt"
    raw = bytearray(rank_state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    rank_state.write_bytes(bytes(raw))
    found, has_checksums = verify_checkpoint(new)
    assert has_checksums and len(found) == 1 and found[0].startswith("rank_state_0.pt: bytes 0-")
    # only the named files are checked
    assert verify_checkpoint(new, ["mp_rank_00_model_states.pt"]) == ([], True)

    (tmp_path / "old").mkdir()
    old = _checkpoint_dir(tmp_path / "old", with_checksums=False)
    assert verify_checkpoint(old) == ([], False)
    (old / "rank_state_0.pt").write_bytes(b"\x80\x02garbage" + b"\xff" * 50)
    found, has_checksums = verify_checkpoint(old)
    assert not has_checksums and found[0].startswith("rank_state_0.pt cannot be read (")
