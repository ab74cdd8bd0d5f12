"""Tk-Instruct prompt template, T5 tokenisation, and length-grouped dynamically padded batches.

The template reproduces `DataCollatorForNI.__call__` of Tk-Instruct (`src/ni_collator.py`, copied
verbatim into nanoT5's `nanoT5/utils/copied_utils.py`) with nanoT5's fine-tuning settings
(add_task_definition=True, num_pos_examples=2, num_neg_examples=0, add_explanation=False,
add_task_name=False, max_source_length=1024, max_target_length=128); tests/test_sni_data.py checks
real tasks' prompts against it. Tokenisation reproduces Hugging Face's T5 tokenizer: SentencePiece pieces + EOS
(`tokenizer(text)["input_ids"]`), truncation to max_length keeps max_length - 1 pieces + EOS, and
`decode(ids, skip_special_tokens=True)` drops pad/EOS/UNK/sentinels and applies HF's
`clean_up_tokenization` (the default of the transformers versions Tk-Instruct and nanoT5 used).
"""

from __future__ import annotations

import logging
import os
import random
import string
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import sentencepiece as spm
import torch

from training.sni.tasks import SNIInstance, SNITask

logger = logging.getLogger(__name__)

PAD_ID = 0  # T5: pad = decoder start
EOS_ID = 1
UNK_ID = 2
LABEL_PAD_ID = -100  # ignored by the cross-entropy
DEFAULT_SPIECE = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "t5", "spiece.model")


@dataclass(frozen=True)
class TemplateConfig:
    """What goes into the prompt and how long sequences may be (nanoT5 `task/ft.yaml` defaults)."""

    # Prefix the prompt with "<task name>. " (Tk-Instruct option; off in nanoT5 / Tk-Instruct runs).
    add_task_name: bool = False
    # "Definition: <instruction>\n\n" at the start of the prompt.
    add_task_definition: bool = True
    # Number of positive demonstrations to try to add (each only if the prompt still fits).
    num_pos_examples: int = 2
    # Number of negative demonstrations to try to add.
    num_neg_examples: int = 0
    # Append " Explanation: ..." to each demonstration.
    add_explanation: bool = False
    # Maximum encoder input length in tokens, EOS included.
    max_source_length: int = 1024
    # Maximum target length in tokens, EOS included.
    max_target_length: int = 128

    def __post_init__(self) -> None:
        if self.num_pos_examples < 0 or self.num_neg_examples < 0:
            raise ValueError("TemplateConfig.num_pos_examples / num_neg_examples must be >= 0")
        if self.max_source_length < 2 or self.max_target_length < 2:
            raise ValueError(
                "TemplateConfig.max_source_length and max_target_length must be >= 2 (one piece + EOS); "
                "Tk-Instruct / nanoT5 use 1024 and 128"
            )


class SNITokenizer:
    """The T5 SentencePiece model, used the way HF's T5 tokenizer uses it (EOS appended, no BOS)."""

    def __init__(self, spiece_path: str | os.PathLike | None = None) -> None:
        path = str(spiece_path if spiece_path is not None else DEFAULT_SPIECE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"SentencePiece model {path} not found (the T5 one is assets/t5/spiece.model)"
            )
        self._sp = spm.SentencePieceProcessor(model_file=path)
        self.num_pieces = self._sp.get_piece_size()  # 32000 for T5; ids >= this are sentinels / padding

    def pieces(self, text: str) -> list[int]:
        """SentencePiece ids of `text`, without EOS."""
        return self._sp.encode(text)

    def encode(self, text: str, max_length: int | None = None) -> list[int]:
        """HF `tokenizer(text, max_length=..., truncation=True)["input_ids"]`: pieces[:max_length-1] + EOS."""
        ids = self._sp.encode(text)
        if max_length is not None and len(ids) > max_length - 1:
            ids = ids[: max_length - 1]
        ids.append(EOS_ID)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """HF `decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)` for T5:
        pad, EOS, UNK and every id >= num_pieces (sentinels, embedding padding) are dropped."""
        kept = [
            int(i) for i in ids if int(i) not in (PAD_ID, EOS_ID, UNK_ID) and 0 <= int(i) < self.num_pieces
        ]
        return clean_up_tokenization(self._sp.decode(kept))


def clean_up_tokenization(text: str) -> str:
    """transformers' `PreTrainedTokenizerBase.clean_up_tokenization` (spaces before punctuation)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


# ----------------------------------------------------------------------------------------------
# The template (string building exactly as in DataCollatorForNI.__call__)


def _add_period(text: str) -> str:
    # `if not x[-1] in string.punctuation: x += "."`
    return text if text[-1] in string.punctuation else text + "."


def _task_input(instance_input: str) -> str:
    task_input = "Now complete the following example -\n"
    task_input += f"Input: {instance_input.strip()}"
    task_input = _add_period(task_input)
    task_input += "\n"
    task_input += "Output: "
    return task_input


def _definition(task: SNITask) -> str:
    definition = "Definition: " + task.definition.strip()
    definition = _add_period(definition)
    return definition + "\n\n"


def _example_str(kind: str, idx: int, example, add_explanation: bool) -> str:
    s = f" {kind} Example {idx + 1} -\n"
    s += f"Input: {example.input.strip()}"
    s = _add_period(s)
    s += "\n"
    s += f" Output: {example.output.strip()}"
    s = _add_period(s)
    s += "\n"
    if add_explanation:  # Tk-Instruct: `if add_explanation and "explanation" in pos_example` (always there)
        s += f" Explanation: {example.explanation.strip()}"
        s = _add_period(s)
        s += "\n"
    return s + "\n"


@dataclass(frozen=True)
class EncodedSource:
    """The prompt of one instance: its text (after Tk-Instruct's truncation) and token ids."""

    text: str
    input_ids: list[int]  # <= max_source_length, ends with EOS
    num_pos_examples: int  # demonstrations that fitted
    num_neg_examples: int
    truncated: bool  # the prompt was cut to max_source_length tokens


def encode_source(
    task: SNITask, instance_input: str, tokenizer: SNITokenizer, config: TemplateConfig
) -> EncodedSource:
    """Tk-Instruct's prompt for one instance, tokenised (see the module docstring)."""
    max_len = config.max_source_length
    memo: dict[str, list[int]] = {}

    def tokenize(text: str) -> list[int]:  # with EOS, as `self.tokenizer(text)["input_ids"]`
        if text not in memo:
            memo[text] = tokenizer.encode(text)
        return memo[text]

    task_input = _task_input(instance_input)
    task_name = task.name + ". " if config.add_task_name else ""
    definition = _definition(task) if config.add_task_definition else ""

    # Demonstrations are added while the prompt (checked with " ".join, as theirs) still fits.
    pos_examples: list[str] = []
    for idx, example in enumerate(task.positive_examples[: config.num_pos_examples]):
        candidate = _example_str("Positive", idx, example, config.add_explanation)
        if len(tokenize(definition + " ".join(pos_examples) + candidate + task_input)) <= max_len:
            pos_examples.append(candidate)
        else:
            break
    neg_examples: list[str] = []
    for idx, example in enumerate(task.negative_examples[: config.num_neg_examples]):
        candidate = _example_str("Negative", idx, example, config.add_explanation)
        check = definition + " ".join(pos_examples) + " ".join(neg_examples) + candidate + task_input
        if len(tokenize(check)) <= max_len:
            neg_examples.append(candidate)
        else:
            break

    source = task_name + definition + "".join(pos_examples) + "".join(neg_examples) + task_input
    ids = tokenize(source)
    truncated = len(ids) > max_len
    if truncated:
        # `self.tokenizer.decode(tokenized_source[: self.max_source_length], skip_special_tokens=True)`,
        # then the batch call `self.tokenizer(sources, max_length=..., truncation=True)`.
        source = tokenizer.decode(ids[:max_len])
        ids = tokenizer.encode(source, max_length=max_len)
    return EncodedSource(source, list(ids), len(pos_examples), len(neg_examples), truncated)


# ----------------------------------------------------------------------------------------------
# Encoded examples


@dataclass
class EncodedExample:
    """One instance ready for batching."""

    id: str  # SNI instance id
    task: str  # task name
    input_ids: np.ndarray  # int32 (source_len,), ends with EOS
    label_choices: list[np.ndarray] = field(default_factory=list)  # int32 ids of each reference (+EOS)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def encode_instance(
    task: SNITask, instance: SNIInstance, tokenizer: SNITokenizer, config: TemplateConfig
) -> EncodedExample:
    source = encode_source(task, instance.input, tokenizer, config)
    labels = [
        np.asarray(tokenizer.encode(o, max_length=config.max_target_length), dtype=np.int32)
        for o in instance.outputs
    ]
    return EncodedExample(instance.id, task.name, np.asarray(source.input_ids, dtype=np.int32), labels)


def encode_tasks(
    tasks: Sequence[SNITask], tokenizer: SNITokenizer, config: TemplateConfig | None = None
) -> list[EncodedExample]:
    """Every instance of every task, in task order (about 30 s for the 68,817 training instances on
    one CPU core: each prompt is tokenised up to three times, as Tk-Instruct does)."""
    config = config or TemplateConfig()
    examples = [encode_instance(task, inst, tokenizer, config) for task in tasks for inst in task.instances]
    logger.info(
        "encoded %d SNI instances of %d tasks (mean source length %.1f tokens)",
        len(examples),
        len(tasks),
        float(np.mean([e.length for e in examples])) if examples else 0.0,
    )
    return examples


# ----------------------------------------------------------------------------------------------
# Length-grouped batches (as transformers' `group_by_length`, spread over data-parallel ranks)


def length_grouped_batches(
    lengths: Sequence[int],
    batch_size: int,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    mega_batch_mult: int = 50,
    drop_last: bool = False,
) -> list[list[int]]:
    """This rank's batches (lists of example indices) for one epoch.

    A seeded permutation of all examples (depends only on seed and epoch) is cut into mega-batches of
    `mega_batch_mult` global batches (batch_size * world_size examples); each mega-batch is sorted by
    length, longest first, and cut into global batches; rank r takes every world_size-th example of
    each global batch, so all ranks see similar lengths at a step. The global batch holding the longest
    example comes first (an out-of-memory shows at step 0). Ranks get disjoint examples and the same
    number of batches. The tail: drop_last=True drops the last incomplete global batch;
    drop_last=False pads the permutation with its first examples to a multiple of world_size (as
    torch's DistributedSampler: at most world_size - 1 repeats) and shares the last, smaller global
    batch evenly.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if mega_batch_mult < 1:
        raise ValueError(f"mega_batch_mult must be >= 1, got {mega_batch_mult}")
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    n = len(lengths_arr)
    global_batch = batch_size * world_size
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    if drop_last:
        perm = perm[: n // global_batch * global_batch]
    elif n % world_size and n > 0:
        pad = world_size - n % world_size
        perm = np.concatenate([perm, np.resize(perm, pad)])
    mega = mega_batch_mult * global_batch
    steps: list[np.ndarray] = []
    for start in range(0, len(perm), mega):
        chunk = perm[start : start + mega]
        chunk = chunk[np.argsort(-lengths_arr[chunk], kind="stable")]
        steps.extend(chunk[i : i + global_batch] for i in range(0, len(chunk), global_batch))
    if steps:
        longest = int(np.argmax([lengths_arr[s].max() for s in steps]))
        steps[0], steps[longest] = steps[longest], steps[0]
    return [s[rank::world_size].tolist() for s in steps]


def choose_label(example: EncodedExample, seed: int, epoch: int) -> np.ndarray:
    """Tk-Instruct's `random.choice(instance["output"])`, from an RNG seeded by (seed, epoch, id)."""
    if not example.label_choices:
        raise ValueError(f"instance {example.id} of {example.task} has no output to train on")
    return random.Random(f"{seed}-{epoch}-{example.id}").choice(example.label_choices)


def collate(
    examples: Sequence[EncodedExample],
    seed: int = 0,
    epoch: int = 0,
    pad_to_multiple_of: int = 1,
    with_labels: bool = True,
) -> dict[str, torch.Tensor]:
    """Pad to the longest in the batch (rounded up to pad_to_multiple_of; nanoT5 uses 8):
    {"input_ids", "attention_mask"} (pad 0 / mask 0) and, with labels, "labels" (pad -100)."""
    if not examples:
        raise ValueError("collate needs at least one example")

    def padded(seqs: list[np.ndarray], value: int) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        out = np.full((len(seqs), width), value, dtype=np.int64)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = s
        return torch.from_numpy(out)

    inputs = [e.input_ids for e in examples]
    batch = {"input_ids": padded(inputs, PAD_ID)}
    mask = np.zeros(tuple(batch["input_ids"].shape), dtype=np.int64)
    for i, s in enumerate(inputs):
        mask[i, : len(s)] = 1
    batch["attention_mask"] = torch.from_numpy(mask)
    if with_labels:
        batch["labels"] = padded([choose_label(e, seed, epoch) for e in examples], LABEL_PAD_ID)
    return batch


def num_train_batches(
    num_examples: int, batch_size: int, world_size: int = 1, drop_last: bool = False
) -> int:
    """Batches per rank per epoch of `length_grouped_batches` (to size LR schedules)."""
    global_batch = batch_size * world_size
    if drop_last:
        return num_examples // global_batch
    padded = -(-num_examples // world_size) * world_size
    return -(-padded // global_batch)


def train_batches(
    examples: Sequence[EncodedExample],
    batch_size: int,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    start_batch: int = 0,
    drop_last: bool = False,
    pad_to_multiple_of: int = 8,
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's padded training batches for one epoch (from `start_batch`, to resume mid-epoch)."""
    plan = length_grouped_batches(
        [e.length for e in examples], batch_size, seed, epoch, rank, world_size, drop_last=drop_last
    )
    for indices in plan[start_batch:]:
        yield collate([examples[i] for i in indices], seed, epoch, pad_to_multiple_of)
