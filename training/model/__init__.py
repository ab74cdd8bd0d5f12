"""Our T5 v1.1 (HF-compatible parameter names), HF load/export, generation and FLOP counting."""

from training.model import flops, hf_compat
from training.model.config import T5Config
from training.model.t5 import Seq2SeqOutput, T5ForConditionalGeneration

__all__ = ["T5Config", "T5ForConditionalGeneration", "Seq2SeqOutput", "flops", "hf_compat"]
