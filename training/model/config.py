"""T5 model configuration: one typed dataclass, presets for the T5 v1.1 sizes, HF config conversion.

Field names follow Hugging Face's `T5Config` so that `from_hf_config(json.load(...))` and
`to_hf_config()` are plain renames. Only the architecture lives here; optimisation settings belong
to the training config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

ATTENTION_BACKENDS = ("auto", "math", "sdpa", "triton")
FEED_FORWARD_PROJ = ("gated-gelu", "relu")
RESIDUAL_DTYPES = ("float32", "autocast")
FFN_KERNELS = ("default", "quack")
ATTENTION_BIAS_LAYOUTS = ("auto", "dense", "row")  # training/model/attention.py: row_bias_applies
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")  # training/model/activation_checkpointing.py

# T5 v1.1 dimensions (google/t5-v1_1-*): d_model, d_ff, layers (encoder = decoder), heads; d_kv = 64.
_V11_SIZES = {
    "small": (512, 1024, 8, 6),
    "base": (768, 2048, 12, 12),
    "large": (1024, 2816, 24, 16),
    "xl": (2048, 5120, 24, 32),
    "xxl": (4096, 10240, 24, 64),
}


@dataclass
class T5Config:
    """Architecture of a T5 encoder-decoder (T5 v1.1 by default; original T5 via the flags below)."""

    # Vocabulary size of the embedding and lm_head (T5's 32000 SentencePiece pieces + 100 sentinels,
    # padded to a multiple of 128 = 32128).
    vocab_size: int = 32128
    # Width of the residual stream.
    d_model: int = 768
    # Width of one attention head (T5 keeps it at 64 for every size; num_heads * d_kv need not be d_model).
    d_kv: int = 64
    # Hidden width of the feed-forward block (per branch for the gated FFN).
    d_ff: int = 2048
    # Number of encoder blocks.
    num_layers: int = 12
    # Number of decoder blocks (None = same as num_layers).
    num_decoder_layers: int | None = None
    # Attention heads per layer.
    num_heads: int = 12
    # Relative position buckets (half per direction in the encoder, all for the past in the decoder).
    relative_attention_num_buckets: int = 32
    # Distances >= this share the last bucket.
    relative_attention_max_distance: int = 128
    # Dropout on embeddings, residual branches, FFN hidden and attention probabilities (0 for pre-training).
    dropout_rate: float = 0.0
    # Epsilon of the RMS norm.
    layer_norm_epsilon: float = 1e-6
    # "gated-gelu" (T5 v1.1: gelu_new(wi_0 x) * wi_1 x) or "relu" (original T5: relu(wi x)).
    feed_forward_proj: str = "gated-gelu"
    # Share the lm_head with the input embedding (original T5: True; T5 v1.1: False).
    tie_word_embeddings: bool = False
    # Multiply the decoder output by d_model**-0.5 before the lm_head (original T5: True).
    scale_decoder_outputs: bool = False
    # Multiplies every init std (HF `initializer_factor`).
    initializer_factor: float = 1.0
    # Token ids.
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0
    # Attention implementation: "auto" (triton kernel on CUDA, math on CPU), "math" (explicit scores,
    # matches HF eager), "sdpa" (torch SDPA with an additive bias), "triton" (our fused kernel with the
    # shared relative bias and its gradient; CUDA only; attention dropout and cached decoding run on
    # sdpa). See training/model/attention.py.
    attention_backend: str = "auto"
    # dtype of the residual stream (the hidden states between blocks): "float32" (HF's numerics, the
    # default) or "autocast" (under torch.autocast, the autocast dtype, e.g. bf16 as T5X's activation
    # dtype; the RMS norm still computes in fp32). Outside autocast both are float32. A training
    # speed knob: half the element-wise traffic of the residual adds and norms.
    residual_dtype: str = "float32"
    # Kernels of the gated FFN's training steps: "default" (cuBLAS GEMMs and our Triton gated-GELU
    # kernels) or "quack" (the GELU and its gradient in the epilogues of QuACK's GEMMs: quack-kernels
    # on a Hopper or newer GPU; 5-6 ms a step and 3.9 GiB less for T5 base at batch 128 on an H100
    # under ZeRO 0, no measurable time under ZeRO 2; held-out loss as the default's over a 600-step
    # schedule). The same function, rounded differently (the GELU on the GEMM's fp32 accumulator);
    # where QuACK cannot run (CPU, dropout, no gradients) the FFN takes the default path.
    ffn_kernel: str = "default"
    # Activation checkpointing of the blocks in training: "none", "block" (keep only each block's
    # inputs, recompute its forward in the backward) or "selective" (keep the GEMM and attention
    # outputs, recompute the element-wise ops). See training/model/activation_checkpointing.py.
    activation_checkpointing: str = "none"
    # How a stack hands the fused attention its relative bias: "dense" (expanded to (heads, q, k)
    # once per stack; the kernels read its tiles and the backward stores dS for the bias gradient),
    # "row" (the (heads, q + k - 1) row, read as whole tiles of its tile table; the backward stores no dS,
    # memory O(length) instead of O(length^2)) or "auto" (row from
    # attention.ROW_BIAS_FROM_SCORES query x key pairs on). Only the triton backend reads the row.
    attention_bias_layout: str = "auto"

    def __post_init__(self) -> None:
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        for name in (
            "vocab_size",
            "d_model",
            "d_kv",
            "d_ff",
            "num_layers",
            "num_decoder_layers",
            "num_heads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"T5Config.{name} must be a positive int, got {value!r}")
        if self.relative_attention_num_buckets < 4 or self.relative_attention_num_buckets % 2:
            raise ValueError(
                "T5Config.relative_attention_num_buckets must be an even int >= 4 (T5 uses 32), "
                f"got {self.relative_attention_num_buckets}"
            )
        if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
            # the decoder's exact buckets cover distances below num_buckets / 2; a max_distance inside
            # them turns its log buckets negative (an index error in the bias table at longer inputs)
            raise ValueError(
                "T5Config.relative_attention_max_distance must exceed num_buckets / 2 (T5 uses 128), "
                f"got {self.relative_attention_max_distance}"
            )
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"T5Config.dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if self.layer_norm_epsilon <= 0:
            raise ValueError(f"T5Config.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}")
        if self.feed_forward_proj not in FEED_FORWARD_PROJ:
            raise ValueError(
                f"T5Config.feed_forward_proj must be one of {FEED_FORWARD_PROJ} "
                f"(T5 v1.1: 'gated-gelu', original T5: 'relu'), got {self.feed_forward_proj!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"T5Config.attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f"T5Config.residual_dtype must be one of {RESIDUAL_DTYPES} ('float32': HF numerics; "
                f"'autocast': bf16 hidden states under bf16 autocast), got {self.residual_dtype!r}"
            )
        if self.ffn_kernel not in FFN_KERNELS:
            raise ValueError(
                f"T5Config.ffn_kernel must be one of {FFN_KERNELS} ('quack' needs quack-kernels and a "
                f"Hopper or newer GPU), got {self.ffn_kernel!r}"
            )
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"T5Config.activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING}, "
                f"got {self.activation_checkpointing!r}"
            )
        if self.attention_bias_layout not in ATTENTION_BIAS_LAYOUTS:
            raise ValueError(
                f"T5Config.attention_bias_layout must be one of {ATTENTION_BIAS_LAYOUTS}, "
                f"got {self.attention_bias_layout!r}"
            )
        if self.initializer_factor <= 0:
            raise ValueError(f"T5Config.initializer_factor must be > 0, got {self.initializer_factor}")
        for name in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"T5Config.{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def is_gated_act(self) -> bool:
        return self.feed_forward_proj == "gated-gelu"

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> T5Config:
        """T5 v1.1 sizes ("small", "base", "large", "xl", "xxl") or "tiny" (CPU tests), with overrides."""
        if name == "tiny":
            fields: dict[str, Any] = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
        elif name in _V11_SIZES:
            d_model, d_ff, layers, heads = _V11_SIZES[name]
            fields = dict(d_model=d_model, d_kv=64, d_ff=d_ff, num_layers=layers, num_heads=heads)
        else:
            raise ValueError(f"unknown T5 preset {name!r}; choose one of {['tiny', *_V11_SIZES]}")
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> T5Config:
        """Build from a Hugging Face `config.json` dict (unknown keys are ignored).

        HF transformers 5 rewrites `tie_word_embeddings`; the saved json of a T5 v1.1 checkpoint says
        `"tie_word_embeddings": false`, and a missing key means True (original T5 behaviour).
        """
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in hf.items() if k in names and v is not None}
        fields.pop("attention_backend", None)
        fields.pop("ffn_kernel", None)
        fields.pop("activation_checkpointing", None)
        fields.pop("attention_bias_layout", None)
        tie = hf.get("tie_word_embeddings", True)
        fields["tie_word_embeddings"] = bool(tie)
        # HF scales decoder outputs exactly when the embeddings are tied (see transformers T5 code).
        fields["scale_decoder_outputs"] = bool(hf.get("scale_decoder_outputs", tie))
        if fields.get("decoder_start_token_id") is None:
            fields["decoder_start_token_id"] = fields.get("pad_token_id", 0)
        if isinstance(fields.get("eos_token_id"), list):
            fields["eos_token_id"] = fields["eos_token_id"][0]
        if fields.get("feed_forward_proj") == "gated-gelu_new":
            fields["feed_forward_proj"] = "gated-gelu"
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict transformers' `T5ForConditionalGeneration.from_pretrained` reads."""
        return {
            "architectures": ["T5ForConditionalGeneration"],
            "model_type": "t5",
            "vocab_size": self.vocab_size,
            "d_model": self.d_model,
            "d_kv": self.d_kv,
            "d_ff": self.d_ff,
            "num_layers": self.num_layers,
            "num_decoder_layers": self.num_decoder_layers,
            "num_heads": self.num_heads,
            "relative_attention_num_buckets": self.relative_attention_num_buckets,
            "relative_attention_max_distance": self.relative_attention_max_distance,
            "dropout_rate": self.dropout_rate,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_factor": self.initializer_factor,
            "feed_forward_proj": self.feed_forward_proj,
            "dense_act_fn": "gelu_new" if self.is_gated_act else "relu",
            "is_gated_act": self.is_gated_act,
            "tie_word_embeddings": self.tie_word_embeddings,
            "is_encoder_decoder": True,
            "use_cache": True,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": self.eos_token_id,
            "decoder_start_token_id": self.decoder_start_token_id,
            "torch_dtype": "float32",
        }
