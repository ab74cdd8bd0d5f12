"""The vocabulary of a run, from its tokenizer (`data.tokenizer`: a SentencePiece .model file or a
Hugging Face tokenizer directory).

The model's embedding and head get the tokenizer's ids (pieces + sentinels) rounded up to a multiple
of 128, which keeps the head's GEMMs on full tiles: 32100 -> 32128 for T5, 250100 -> 250112 for mT5
(T5's and mT5's own sizes). `model.vocab_size` sets the size explicitly; one smaller than the
tokenizer needs is refused. Span corruption takes the tokenizer's sentinel ids (enough of them for a
row's noise spans: `training.data.objectives.build_objective`); the shards' manifest and a starting
checkpoint are checked against them (training/data/row_store.py, `check_init_vocabulary`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data_prep.tokenizer import DEFAULT_SPIECE, TokenizerInfo, load_tokenizer
from training.cli_errors import ExpectedError
from training.run_dir import RunDir

VOCAB_MULTIPLE = 128


def padded_vocab_size(ids: int) -> int:
    """`ids` rounded up to a multiple of 128 (32100 -> 32128)."""
    return -(-ids // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class RunVocabulary:
    tokenizer: TokenizerInfo
    model_vocab_size: int  # rows of the embedding and the head

    @property
    def sentinel_start_id(self) -> int:
        return self.tokenizer.sentinel_start_id


def run_vocabulary(tokenizer_path: str | Path, model_vocab_size: int | None = None) -> RunVocabulary:
    """The run's vocabulary: the tokenizer's, and the model's size (explicit, or padded from it)."""
    if not Path(tokenizer_path).exists():
        raise ExpectedError(f"tokenizer {tokenizer_path} not found: set data.tokenizer to the tokenizer the data was "
                            "made with (assets/t5/spiece.model for T5)")
    try:
        info = load_tokenizer(tokenizer_path).info
    except ValueError as err:  # no EOS, no sentinels
        raise ExpectedError(f"data.tokenizer: {err}") from None
    if model_vocab_size is None:
        return RunVocabulary(info, padded_vocab_size(info.vocab_size))
    if model_vocab_size < info.vocab_size:
        raise ExpectedError(
            f"model.vocab_size={model_vocab_size} is smaller than the {info.vocab_size} ids of tokenizer "
            f"{tokenizer_path}: remove model.vocab_size (the run then takes {padded_vocab_size(info.vocab_size)}) "
            f"or set it to at least {info.vocab_size}"
        )
    return RunVocabulary(info, model_vocab_size)


def check_init_vocabulary(init: str, init_vocab_size: int, vocab: RunVocabulary) -> None:
    """Refuse starting weights whose embedding does not have the run's vocabulary size."""
    if init_vocab_size != vocab.model_vocab_size:
        raise ExpectedError(
            f"init={init} has a vocabulary of {init_vocab_size} entries, but tokenizer {vocab.tokenizer.path} "
            f"({vocab.tokenizer.vocab_size} ids) gives this run {vocab.model_vocab_size}: set data.tokenizer to the "
            f"tokenizer the checkpoint was trained with, or model.vocab_size={init_vocab_size} if this is it"
        )


def init_tokenizer(init: str) -> str:
    """The tokenizer that goes with starting weights `init`: one of our runs' data.tokenizer, a Hugging
    Face directory itself where it holds spiece.model (an export, a T5 / mT5 download), else T5's."""
    if init in ("", "random"):
        return str(DEFAULT_SPIECE)
    if RunDir(init).is_run():
        return RunDir(init).read_config()["data"]["tokenizer"]
    if (Path(init) / "spiece.model").is_file():
        return str(init)
    return str(DEFAULT_SPIECE)
