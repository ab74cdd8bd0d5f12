"""Tokenizer loading, sentinel ids, and training a small SentencePiece model with T5's special ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import sentencepiece as spm

from data_prep.shard import ShardConfig, run_sharding
from data_prep.tokenizer import NUM_SENTINELS, load_tokenizer, sentinel_id, tokenize_documents
from data_prep.verify import verify_dataset


def test_t5_vocabulary_and_sentinels(spiece_path: Path):
    tok = load_tokenizer(spiece_path)
    info = tok.info
    assert (info.kind, info.vocab_size, info.eos_id, info.pad_id) == ("sentencepiece", 32100, 1, 0)
    assert info.sha256 == "d60acb128cf7b7f2536e8f38a5b18a05535c9e14c7a355904270e15b0945ea86"
    assert sentinel_id(0, 32000) == 32099 and sentinel_id(99, 32000) == 32000
    docs = tokenize_documents(["Hello world, this is a T5 test.", "Second."], tok)
    assert docs[0] == [8774, 296, 6, 48, 19, 3, 9, 332, 755, 794, 5, 1]
    assert docs[1][-1] == 1 and 1 not in docs[1][:-1]


def test_train_small_unigram_model_and_shard_with_it(tmp_path: Path, c4_train_path: Path, repo_root: Path):
    prefix = tmp_path / "tok" / "small"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep.tokenizer",
            "train",
            "--input",
            str(c4_train_path),
            "--vocab-size",
            "500",
            "--output",
            str(prefix),
            "--max-docs",
            "300",
            "--num-threads",
            "2",
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "vocab_size 600" in proc.stdout
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    assert sp.get_piece_size() == 500
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
    assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    text = "The quick brown fox jumps over the lazy dog."
    assert sp.decode(sp.encode(text)) == text
    tok = load_tokenizer(f"{prefix}.model")
    assert tok.info.vocab_size == 500 + NUM_SENTINELS
    assert sentinel_id(0, 500) == 599 and sentinel_id(99, 500) == 500

    out = tmp_path / "ds"
    manifest = run_sharding(
        ShardConfig(
            input=str(c4_train_path),
            output=str(out),
            tokenizer=f"{prefix}.model",
            row_length=128,
            rows_per_shard=256,
            workers=0,
            progress=False,
        )
    )
    assert manifest["tokenizer"]["vocab_size"] == 600 and manifest["dtype"] == "uint16"
    assert len(manifest["splits"]["train"]["shards"]) > 2
    assert verify_dataset(out)[0] == []
    assert json.loads((out / "manifest.json").read_text())["tokenizer"]["path"] == f"{prefix}.model"
