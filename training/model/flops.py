"""Model FLOPs of one training step, counted like the peer figures in shared/notes/anchors.md.

Counted: every matmul (2 * m * n * k) of the forward pass, including the attention score and
value products and the lm_head; elementwise work, norms, softmax and the loss are not. The backward
pass costs twice the forward, so a training step is 3x the forward. T5 v1.1 base at batch 128,
inputs 512, targets 114 gives 5.45e13.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from training.model.config import T5Config


def forward_flops(config: T5Config, batch_size: int, input_length: int, target_length: int) -> float:
    """Matmul FLOPs of one forward pass over a batch (no padding assumed)."""
    d, inner, v = config.d_model, config.num_heads * config.d_kv, config.vocab_size
    ffn_mats = 3 if config.is_gated_act else 2  # wi_0, wi_1, wo  vs  wi, wo
    ffn = ffn_mats * d * config.d_ff
    enc_tokens, dec_tokens = batch_size * input_length, batch_size * target_length
    s, t = input_length, target_length

    encoder = config.num_layers * (
        2 * enc_tokens * (4 * d * inner + ffn)  # q, k, v, o + FFN
        + batch_size * 2 * 2 * s * s * inner  # QK^T and PV
    )
    decoder = config.num_decoder_layers * (
        2 * dec_tokens * (4 * d * inner + 2 * d * inner + ffn)  # self q,k,v,o + cross q,o + FFN
        + 2 * enc_tokens * 2 * d * inner  # cross-attention k, v of the encoder output
        + batch_size * 2 * 2 * t * t * inner  # self-attention QK^T and PV
        + batch_size * 2 * 2 * t * s * inner  # cross-attention QK^T and PV
    )
    lm_head = 2 * dec_tokens * d * v
    return float(encoder + decoder + lm_head)


def model_flops_per_step(config: T5Config, batch_size: int, input_length: int, target_length: int) -> float:
    """Forward + backward FLOPs of one training step (3x the forward)."""
    return 3.0 * forward_flops(config, batch_size, input_length, target_length)


def samples_flops_per_step(config: T5Config, input_lengths, target_lengths) -> float:
    """Forward + backward FLOPs of a batch whose samples have these real (unpadded) lengths."""
    pairs, counts = np.unique(np.stack([np.asarray(input_lengths), np.asarray(target_lengths)], axis=1), axis=0,
                              return_counts=True)
    return sum(model_flops_per_step(config, int(n), int(s), int(t)) for (s, t), n in zip(pairs, counts))


def measure_matmul_tflops(device, n: int = 8192, iters: int = 20) -> float:
    """Achieved bf16 TFLOP/s of an n^3 matmul on a CUDA device: the practical ceiling MFU is quoted
    against (well under a second on an H100)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12
