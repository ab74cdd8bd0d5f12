"""Tokenizers for sharding (SentencePiece model file or Hugging Face tokenizer directory) and a trainer.

Vocabulary convention (T5's and mT5's): a SentencePiece model has `pieces` ids (32000 for T5: pad=0,
eos=1, unk=2, no bos). The model side adds 100 sentinels *after* the pieces, counting down:
`<extra_id_k>` = pieces + 99 - k, so `<extra_id_0>` = 32099 and `<extra_id_99>` = 32000 for T5.
`vocab_size` recorded in the manifest is pieces + sentinels (32100 for T5); the model pads its
embedding further (32128). A Hugging Face tokenizer directory holds its sentinels as tokens
`<extra_id_k>`, `<extra_id_0>` the highest and the others contiguous below it (T5, mT5); its
`len(tokenizer)` is the vocabulary size (32100 for T5, 250100 for mT5).

Train a new model for another language or domain:

    python -m data_prep.tokenizer train --input 'corpus/*.jsonl.gz' --vocab-size 32000 --output my/spiece

writes `my/spiece.model` (+ `.vocab`) with T5's special ids (pad=0, eos=1, unk=2, no bos), byte
fallback (no text maps to unk), the UL2 mode tokens `[NLU]` `[NLG]` `[S2S]` as pieces 3-5
(`--mode-tokens ''` for none), and `my/spiece-hf/`, the same vocabulary with its sentinels as a
Hugging Face tokenizer directory (`AutoTokenizer.from_pretrained`), which export copies next to the
model. A number of sentinels other than 100 (`--extra-ids N`) is recorded in that directory only,
so give the directory as the tokenizer wherever one is asked for.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import sentencepiece as spm

from data_prep.invocation import command_name
from data_prep.sources import payload_to_text, resolve_source

logger = logging.getLogger(__name__)

NUM_SENTINELS = 100
UL2_MODE_TOKENS = ("[NLU]", "[NLG]", "[S2S]")  # UL2's paradigm tokens, one piece each
HF_DIR_SUFFIX = "-hf"  # `train --output PREFIX` writes the Hugging Face directory PREFIX-hf
DEFAULT_SPIECE = Path(__file__).resolve().parents[1] / "assets" / "t5" / "spiece.model"
# Files hashed for a Hugging Face tokenizer directory (in sorted order); weights/configs are not.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


def sentinel_id(k: int, num_pieces: int) -> int:
    """Id of `<extra_id_k>` for a SentencePiece model of `num_pieces` pieces (T5: 32099 - k)."""
    if not 0 <= k < NUM_SENTINELS:
        raise ValueError(f"sentinel index must be in [0, {NUM_SENTINELS}), got {k}")
    return num_pieces + NUM_SENTINELS - 1 - k


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer."""

    path: str  # as given (a .model file or a directory)
    kind: str  # "sentencepiece" or "huggingface"
    sha256: str  # of the .model file; for a directory: over its tokenizer files, sorted by name
    vocab_size: int  # ids the model may see: pieces + 100 sentinels (32100 for T5)
    eos_id: int  # appended after every document (1 for T5)
    pad_id: int  # 0 for T5
    sentinel_start_id: int  # id of <extra_id_0>; <extra_id_k> = sentinel_start_id - k (32099 for T5)
    num_sentinels: int  # 100 for T5 and mT5


def hf_tokenizer_sha256(directory: str | os.PathLike) -> str:
    """sha256 over (name, sha256(content)) of the tokenizer files of a directory, sorted by name."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(directory) if n in HF_TOKENIZER_FILES)
    if not names:
        raise ValueError(f"{directory}: no tokenizer files ({', '.join(HF_TOKENIZER_FILES)})")
    for name in names:
        with open(Path(directory) / name, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


def tokenizer_sha256(path: str | os.PathLike) -> str:
    """The hash the manifest records for a tokenizer path (file or HF directory)."""
    if os.path.isdir(path):
        return hf_tokenizer_sha256(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


class Tokenizer:
    """Batch encoder with the ids and hash the manifest needs. Encodes without BOS/EOS."""

    def __init__(self, path: str | os.PathLike) -> None:
        path = str(path)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"tokenizer {path!r} not found: pass a SentencePiece .model file or a Hugging Face "
                f"tokenizer directory (default: {DEFAULT_SPIECE})"
            )
        self._sp = None
        self._hf = None
        if os.path.isdir(path):
            from transformers import AutoTokenizer  # here: slow to import, and only HF tokenizers need it

            self._hf = AutoTokenizer.from_pretrained(path)
            eos, pad = self._hf.eos_token_id, self._hf.pad_token_id
            if eos is None:
                raise ValueError(
                    f"{path}: tokenizer has no EOS token; sharding appends EOS after each document"
                )
            start, count = _hf_sentinels(self._hf, path)
            self.info = TokenizerInfo(
                path, "huggingface", hf_tokenizer_sha256(path), len(self._hf), int(eos), int(pad or 0), start, count
            )
        else:
            self._sp = spm.SentencePieceProcessor(model_file=path)
            eos = self._sp.eos_id()
            if eos < 0:
                raise ValueError(f"{path}: SentencePiece model has no EOS id; train it with eos_id=1")
            self.info = TokenizerInfo(
                path,
                "sentencepiece",
                tokenizer_sha256(path),
                self._sp.get_piece_size() + NUM_SENTINELS,
                eos,
                max(self._sp.pad_id(), 0),
                sentinel_id(0, self._sp.get_piece_size()),
                NUM_SENTINELS,
            )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no BOS, no EOS), single-threaded (parallelism is across processes)."""
        if not texts:
            return []
        if self._sp is not None:
            return self._sp.encode(list(texts), num_threads=1)
        return self._hf(list(texts), add_special_tokens=False)["input_ids"]


def _hf_sentinels(tokenizer, path: str) -> tuple[int, int]:
    """(id of <extra_id_0>, number of sentinels) of a Hugging Face tokenizer; raises unless it has
    T5's sentinels: <extra_id_0> the highest, each next one the id below."""
    vocab = tokenizer.get_vocab()
    if "<extra_id_0>" not in vocab:
        raise ValueError(
            f"{path}: tokenizer has no sentinel tokens <extra_id_0>, <extra_id_1>, ... that span corruption needs; "
            "train one with `python -m data_prep.tokenizer train` or use a T5 / mT5 tokenizer"
        )
    start, count = vocab["<extra_id_0>"], 0
    while f"<extra_id_{count}>" in vocab:
        if vocab[f"<extra_id_{count}>"] != start - count:
            raise ValueError(
                f"{path}: <extra_id_{count}> has id {vocab[f'<extra_id_{count}>']}, not {start - count}: sentinels must "
                "count down contiguously from <extra_id_0> (T5's convention); rebuild the tokenizer with extra_ids"
            )
        count += 1
    return start, count


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """A `Tokenizer` for a .model file or HF directory (default: the bundled T5 spiece.model)."""
    return Tokenizer(path if path is not None else DEFAULT_SPIECE)


def tokenize_documents(texts: Iterable[str], tokenizer: Tokenizer, add_eos: bool = True) -> list[list[int]]:
    """Token ids of each document, each followed by EOS (as in the shards) unless `add_eos=False`."""
    ids = tokenizer.encode_batch(list(texts))
    if add_eos:
        eos = tokenizer.info.eos_id
        for doc in ids:
            doc.append(eos)
    return ids


# ----------------------------------------------------------------------------------------------
# Training a SentencePiece unigram model (T5's special ids)


def _iter_training_sentences(input_glob: str, text_field: str, txt_mode: str, max_docs: int) -> Iterator[str]:
    """Lines of the documents of `input_glob` (SentencePiece trains on sentences, not whole documents)."""
    source = resolve_source(input_glob, kind="files", text_field=text_field, txt_mode=txt_mode)
    docs = 0
    for unit in range(source.num_units):
        fmt = source.unit_format(unit)
        for record in source.iter_unit(unit):
            if record.error is not None:
                logger.warning("%s:%d: %s", source.unit_label(unit), record.line, record.error[1])
                continue
            text, _, _ = payload_to_text(fmt, record.payload, text_field)
            if text is None:
                continue
            for line in text.splitlines():
                if line.strip():
                    yield line
            docs += 1
            if max_docs and docs >= max_docs:
                return


def train_sentencepiece(
    input_glob: str,
    vocab_size: int,
    output_prefix: str,
    text_field: str = "text",
    txt_mode: str = "line",
    max_docs: int = 0,
    input_sentence_size: int = 10_000_000,
    character_coverage: float = 0.9999,
    model_type: str = "unigram",
    num_threads: int = os.cpu_count() or 1,
    seed_sentencepiece_size: int = 1_000_000,
    extra_ids: int = NUM_SENTINELS,
    mode_tokens: Sequence[str] = UL2_MODE_TOKENS,
) -> TokenizerInfo:
    """Train a SentencePiece model with T5's special ids (pad=0, eos=1, unk=2, no bos), byte fallback
    and `mode_tokens` as user-defined pieces (ids 3, 4, ...), and write its Hugging Face directory.

    The `extra_ids` sentinels are not pieces of the model: `<extra_id_k>` = vocab_size +
    extra_ids - 1 - k, as T5 assigns them; `{output_prefix}-hf/` holds them as tokens. Returns the
    info of the written `{output_prefix}.model`.
    """
    if vocab_size < 8:
        raise ValueError(f"vocab_size must be >= 8, got {vocab_size}")
    if extra_ids < 1:
        raise ValueError(f"extra_ids must be >= 1 (span corruption needs sentinels), got {extra_ids}")
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_iter_training_sentences(input_glob, text_field, txt_mode, max_docs),
        model_prefix=output_prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        user_defined_symbols=list(mode_tokens),
        byte_fallback=True,
        character_coverage=character_coverage,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size,
        num_threads=num_threads,
        minloglevel=2,
    )
    write_hf_tokenizer(f"{output_prefix}.model", f"{output_prefix}{HF_DIR_SUFFIX}", extra_ids)
    return load_tokenizer(f"{output_prefix}.model").info


def write_hf_tokenizer(spiece_model: str | os.PathLike, out_dir: str | os.PathLike,
                       extra_ids: int = NUM_SENTINELS) -> Path:
    """Write a Hugging Face tokenizer directory for a SentencePiece model plus `extra_ids` sentinels
    (`<extra_id_0>` the highest id): spiece.model, tokenizer.json, tokenizer_config.json.

    A model without byte fallback (T5's) becomes what transformers' T5Tokenizer makes of it. One with
    byte fallback is built from the model's own settings (transformers' SpmConverter), because
    T5Tokenizer builds its Unigram without byte fallback and would map unseen characters to unk.
    """
    from transformers import PreTrainedTokenizerFast, T5Tokenizer  # here: slow to import, only this needs it
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(spiece_model, out / "spiece.model")
    sp = spm.SentencePieceProcessor(model_file=str(out / "spiece.model"))
    if not any(sp.is_byte(i) for i in range(sp.get_piece_size())):  # byte pieces exist with byte fallback only
        # Loading from a directory that holds spiece.model converts it properly in transformers 4 and 5.
        T5Tokenizer.from_pretrained(str(out), extra_ids=extra_ids).save_pretrained(str(out))
        return out
    proto = import_protobuf().ModelProto()
    proto.ParseFromString((out / "spiece.model").read_bytes())
    if not hasattr(SpmConverter, "build_tokenizer_from_spm_proto"):
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} cannot convert a byte-fallback SentencePiece "
                           "model: pip install -U transformers")
    from tokenizers import processors

    sentinels = [f"<extra_id_{k}>" for k in range(extra_ids)]
    vocab = [(p.piece, p.score) for p in proto.pieces] + [(t, 0.0) for t in reversed(sentinels)]
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    eos = proto.pieces[proto.trainer_spec.eos_id].piece
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, proto.trainer_spec.eos_id)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos, unk_token=proto.pieces[proto.trainer_spec.unk_id].piece,
        pad_token=proto.pieces[proto.trainer_spec.pad_id].piece, extra_special_tokens=sentinels,
    ).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a SentencePiece unigram model with T5's special ids")
    train.add_argument("--input", required=True, help="glob of .jsonl/.json.gz/.txt/.parquet files")
    train.add_argument(
        "--vocab-size", type=int, required=True, help="pieces (T5: 32000; +100 sentinels later)"
    )
    train.add_argument("--output", required=True, help="output prefix: writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--text-field", default="text", help="JSON / parquet field holding the text")
    train.add_argument("--txt-mode", default="line", choices=["line", "blank-line"])
    train.add_argument("--max-docs", type=int, default=0, help="read at most this many documents (0: all)")
    train.add_argument("--input-sentence-size", type=int, default=10_000_000, help="sentences sampled")
    train.add_argument("--character-coverage", type=float, default=0.9999)
    train.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    train.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    train.add_argument("--extra-ids", type=int, default=NUM_SENTINELS,
                       help="sentinels <extra_id_k> (T5: 100); another number is recorded in PREFIX-hf/ only")
    train.add_argument("--mode-tokens", default=",".join(UL2_MODE_TOKENS),
                       help="comma-separated pieces reserved with one id each (UL2's mode tokens; '' for none)")
    info_cmd = sub.add_parser("info", help="print vocab size, special ids and sha256 of a tokenizer")
    info_cmd.add_argument("tokenizer", nargs="?", default=str(DEFAULT_SPIECE))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "info":
            print(asdict(load_tokenizer(args.tokenizer).info))
            return 0
        return _train(args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else exc!r}", file=sys.stderr)
        return 2


def _train(args: argparse.Namespace) -> int:
    info = train_sentencepiece(
        args.input,
        args.vocab_size,
        args.output,
        text_field=args.text_field,
        txt_mode=args.txt_mode,
        max_docs=args.max_docs,
        input_sentence_size=args.input_sentence_size,
        character_coverage=args.character_coverage,
        model_type=args.model_type,
        num_threads=args.num_threads,
        extra_ids=args.extra_ids,
        mode_tokens=[t for t in args.mode_tokens.split(",") if t],
    )
    pieces = info.vocab_size - NUM_SENTINELS
    print(
        f"wrote {info.path}: {pieces} pieces (+{args.extra_ids} sentinels = vocab_size {pieces + args.extra_ids}), "
        f"eos={info.eos_id} pad={info.pad_id} sha256={info.sha256}; Hugging Face directory "
        f"{args.output}{HF_DIR_SUFFIX}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "NUM_SENTINELS",
    "UL2_MODE_TOKENS",
    "Tokenizer",
    "TokenizerInfo",
    "load_tokenizer",
    "sentinel_id",
    "tokenize_documents",
    "tokenizer_sha256",
    "train_sentencepiece",
    "write_hf_tokenizer",
]
