"""T5 v1.1 encoder-decoder with Hugging Face parameter names (original T5 as an option).

Every parameter lives under exactly the name and shape it has in an HF T5 checkpoint
(`shared.weight`, `encoder.block.0.layer.0.SelfAttention.q.weight`, ..., `lm_head.weight`), so
`state_dict()` / `load_state_dict()` speak HF names with no conversion (DeepSpeed checkpoints too).
Speed comes from the forward pass instead: q/k/v (and wi_0/wi_1) weights are concatenated on the fly
so each projection is one GEMM, the relative bias is computed once per stack as (heads, q, k) fp32
(expanded from one (heads, q + k - 1) row of bucket lookups), and attention goes through
`attention.packed_attention` (fused Triton kernel on CUDA).

Numerics follow HF: RMS norm in fp32 (no mean, no bias), fp32 residual stream, no 1/sqrt(d_kv)
scaling, loss in fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from training.model import quack_ffn, triton_decode_attention
from training.model.activation_checkpointing import run_block
from training.model.attention import (
    attention,
    bias_saturation_distance,
    dense_bias,
    packed_attention,
    relative_position_bucket,
    resolve_backend,
    row_bias_applies,
)
from training.model.config import T5Config
from training.model.cross_entropy import fused_linear_cross_entropy
from training.model.generation import beam_search_generate, greedy_generate
from training.model.triton_add_norm import add_rms_norm, rms_norm
from training.model.triton_add_norm import kernel_applies as add_norm_kernel_applies
from training.model.triton_gated_gelu import gated_gelu_packed


class Seq2SeqOutput(NamedTuple):
    """What `T5ForConditionalGeneration.forward` returns (a NamedTuple: torch.compile returns it as is)."""

    # Mean fp32 cross-entropy over label positions != -100 (None without labels).
    loss: torch.Tensor | None
    # (batch, target_len, vocab) fp32 logits, or None when forward(return_logits=False).
    logits: torch.Tensor | None


def gated_gelu(h: torch.Tensor) -> torch.Tensor:
    """T5 v1.1's gated activation gelu_tanh(gate) * lin of the fused projection output h = [gate | lin]
    (a Triton kernel each way on CUDA, torch ops elsewhere: training/model/triton_gated_gelu.py)."""
    return gated_gelu_packed(h)


class T5LayerNorm(nn.Module):
    """RMS norm: x / sqrt(mean(x^2) + eps) * weight, computed in fp32; no bias, no mean subtraction."""

    norm_fn = staticmethod(rms_norm)  # compile_pointwise() sets a compiled copy on the instance

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, add: torch.Tensor | None = None, linear_reads_it: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """rms_norm(x); with `add` (a sublayer's output), the residual add first: (x + add, its norm).

        The add and the norm run as one Triton kernel each way on CUDA (triton_add_norm.py).
        linear_reads_it: a linear layer reads the norm, so under autocast the kernel writes it in
        the autocast dtype, the dtype the linear would cast it to."""
        if add is None:
            return self.norm_fn(x, self.weight, self.variance_epsilon)
        if add_norm_kernel_applies(x):
            device = x.device.type
            y_dtype = (
                torch.get_autocast_dtype(device)
                if linear_reads_it and torch.is_autocast_enabled(device)
                else None
            )
            return add_rms_norm(x, add, self.weight, self.variance_epsilon, y_dtype)
        h = x + add
        return h, self.norm_fn(h, self.weight, self.variance_epsilon)


class T5Attention(nn.Module):
    """Multi-head attention with HF's q/k/v/o names; block 0 of a stack also owns the bias table."""

    def __init__(self, config: T5Config, has_relative_attention_bias: bool) -> None:
        super().__init__()
        inner = config.num_heads * config.d_kv
        self.n_heads, self.d_kv = config.num_heads, config.d_kv
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)
        self.has_relative_attention_bias = has_relative_attention_bias
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(
                config.relative_attention_num_buckets, config.num_heads
            )
        self.dropout_rate = config.dropout_rate
        self.backend = config.attention_backend
        # From which |key - query| T5's relative bias is one value per head, for encoder (bidirectional)
        # and decoder (causal) self-attention; plain ints, so torch.compile sees constants.
        buckets = (config.relative_attention_num_buckets, config.relative_attention_max_distance)
        self.bias_far = {causal: bias_saturation_distance(not causal, *buckets) for causal in (False, True)}

    def forward(
        self,
        x: torch.Tensor,
        kv_input: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
        cache: dict | None = None,
        cache_prefix: str = "self",
        kv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`kv`: cross-attention's packed [k | v] of `kv_input` where the caller projected it already
        (`T5Stack.cross_kv`); None projects it here."""
        b, sq, _ = x.shape
        heads = (self.n_heads, self.d_kv)
        dropout_p = self.dropout_rate if self.training else 0.0
        if kv_input is None:  # self-attention: one GEMM for q, k and v
            q_src, kv_src = F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight])), None
        else:  # cross-attention: one GEMM for the encoder output's k and v (once when decoding)
            q_src = self.q(x)
            kv_src = kv if cache is None else cache.get(f"{cache_prefix}_kv")
            if kv_src is None:
                kv_src = F.linear(kv_input, torch.cat([self.k.weight, self.v.weight]))
                if cache is not None:
                    cache[f"{cache_prefix}_kv"] = kv_src  # packed [k | v], as the fused kernel reads it
        if kv_src is not None and kv_src.shape[0] != b:
            # Rows that share an encoder output (beam search's beams of one input): without a bias or
            # a causal mask each query attends on its own, so a group's queries are one sequence's.
            # The keys and values are then computed, kept and read once per input, not per beam.
            groups = b // kv_src.shape[0]
            if bias is not None or causal or groups * kv_src.shape[0] != b:
                raise ValueError(
                    f"cross-attention of {b} query rows over an encoder output of {kv_src.shape[0]} rows: "
                    "the query rows must be whole groups of consecutive rows, one group per encoder row"
                )
            q_src = q_src.reshape(kv_src.shape[0], groups * sq, q_src.shape[-1])
            out = packed_attention(
                q_src, kv_src, self.n_heads, None, key_mask, False, self.backend, dropout_p
            )
            return self.o(out.reshape(b, sq, out.shape[-1]))
        if cache is None or kv_input is not None:  # attention reads the fused projection outputs as they are
            # The stack's bias is T5's relative one (queries from position 0 here): constant per head
            # from this distance on, which the fused kernel's bias gradient uses.
            far = 0 if bias is None else self.bias_far[causal]
            out = packed_attention(
                q_src, kv_src, self.n_heads, bias, key_mask, causal, self.backend, dropout_p, far
            )
            return self.o(out)
        # Decoding's self-attention: this position's keys/values fill one slot of the fixed-size
        # cache (static shapes, for CUDA graphs), and the query attends over all its slots.
        q, k, v = (t.view(b, sq, *heads) for t in q_src.chunk(3, dim=-1))
        if sq == 1 and dropout_p == 0.0 and self._decode_kernel_applies(q.device):
            # One kernel reads each visible slot where it lies (through beam search's history table),
            # instead of a gather of every slot and SDPA over the copy with a float mask. The stack's
            # key mask is exactly "slot <= position", which the kernel applies itself.
            k_buf, v_buf = _store_cache_slot(cache, cache_prefix, k, v)
            out = triton_decode_attention.decode_attention(
                q, k_buf, v_buf, cache.get("history"), bias, cache["position"]
            )
            return self.o(out)
        k, v = _write_cache_slot(cache, cache_prefix, k, v)
        out = attention(q, k, v, bias, key_mask, causal, self.backend, dropout_p)
        return self.o(out.reshape(b, sq, self.n_heads * self.d_kv))

    def _decode_kernel_applies(self, device: torch.device) -> bool:
        """Whether decoding's self-attention runs `triton_decode_attention` (the `triton` backend,
        `auto` on CUDA included, and a head size the kernel takes)."""
        return resolve_backend(self.backend, device) == "triton" and triton_decode_attention.supports(
            self.d_kv
        )


def _write_cache_slot(
    cache: dict, prefix: str, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one position's k/v (b, 1, heads, d_kv) into a fixed-size cache at slot cache["position"]
    (a 0-dim device tensor) and return the whole (b, cache["length"], heads, d_kv) keys and values;
    slots after the position hold zeros or stale values, which the stack's key mask hides. The
    buffers are allocated at the first call, in the dtype the projection produced.

    Row r of the buffers holds what the sequence in row r wrote at each step. Beam search moves
    sequences between rows; instead of reordering every buffer after each step it keeps
    cache["history"], a (b, length) table shared by the blocks: where slot s of the sequence now in
    row r is, as an index into the buffers flattened to (b * length) rows, row' * length + s for the
    row' that wrote it (r itself at the position being written). The keys and values are then
    gathered through it, one gather per buffer, where a reordering would gather and copy back."""
    k_buf, v_buf = _store_cache_slot(cache, prefix, k, v)
    history = cache.get("history")
    if history is None:
        return k_buf, v_buf
    # One index into the flattened buffers: index_select's gather kernel (advanced indexing with
    # (row, slot) index pairs: 6.6 against 1.5 ms a beam-search step, H100). The table holds the
    # flat indices already, so no block recomputes them.
    return tuple(
        buf.flatten(0, 1).index_select(0, history.view(-1)).view(buf.shape) for buf in (k_buf, v_buf)
    )


def _store_cache_slot(
    cache: dict, prefix: str, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes one position's k/v (b, 1, heads, d_kv) into the fixed-size buffers at slot
    cache["position"] and returns the buffers (b, cache["length"], heads, d_kv) as they are, rows
    not reordered (see `_write_cache_slot`). The buffers are allocated at the first call, in the
    dtype the projection produced."""
    if f"{prefix}_k" not in cache:
        shape = (k.shape[0], cache["length"], *k.shape[2:])
        cache[f"{prefix}_k"], cache[f"{prefix}_v"] = k.new_zeros(shape), v.new_zeros(shape)
    slot = cache["position"].view(1)
    cache[f"{prefix}_k"].index_copy_(1, slot, k)
    cache[f"{prefix}_v"].index_copy_(1, slot, v)
    return cache[f"{prefix}_k"], cache[f"{prefix}_v"]


class T5DenseGatedActDense(nn.Module):
    """T5 v1.1 FFN: wo(gelu_tanh(wi_0 x) * wi_1 x), wi_0/wi_1 run as one GEMM."""

    act_fn = staticmethod(gated_gelu)  # compile_pointwise() sets a compiled copy on the instance

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        # T5Config.ffn_kernel "quack": QuACK's GEMM epilogues in training steps where they can run
        # (training/model/quack_ffn.py); the path below elsewhere, e.g. on CPU.
        self.use_quack = config.ffn_kernel == "quack" and quack_ffn.available()
        if self.use_quack:
            quack_ffn.load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wcat = torch.cat([self.wi_0.weight, self.wi_1.weight])
        if self.use_quack and quack_ffn.applies(x, wcat.shape[0] // 2, self.training and self.dropout.p > 0):
            return quack_ffn.gated_ffn(x, wcat, self.wo.weight)  # the GELU in QuACK's GEMM epilogues
        h = F.linear(x, wcat)  # [wi_0 x | wi_1 x]
        return self.wo(self.dropout(self.act_fn(h)))


class T5DenseActDense(nn.Module):
    """Original T5 FFN: wo(relu(wi x))."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(F.relu(self.wi(x))))


class T5LayerSelfAttention(nn.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias: bool) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(config, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)


class T5LayerCrossAttention(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.EncDecAttention = T5Attention(config, has_relative_attention_bias=False)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)


class T5LayerFF(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.DenseReluDense = T5DenseGatedActDense(config) if config.is_gated_act else T5DenseActDense(config)
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)


class T5Block(nn.Module):
    """Pre-norm block: self-attention, (cross-attention,) FFN; HF layout `layer.{0,1,2}`."""

    def __init__(self, config: T5Config, is_decoder: bool, has_relative_attention_bias: bool) -> None:
        super().__init__()
        self.is_decoder = is_decoder
        layers: list[nn.Module] = [T5LayerSelfAttention(config, has_relative_attention_bias)]
        if is_decoder:
            layers.append(T5LayerCrossAttention(config))
        layers.append(T5LayerFF(config))
        self.layer = nn.ModuleList(layers)

    def forward(
        self,
        h: torch.Tensor,
        bias: torch.Tensor,
        key_mask: torch.Tensor | None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_key_mask: torch.Tensor | None = None,
        cache: dict | None = None,
        pending: torch.Tensor | None = None,
        encoder_kv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, this block's FFN output). The FFN output is not yet added to h: the next block's
        first norm adds it, or the stack's final norm (each residual add runs in one kernel with
        the norm after it). `pending` is the previous block's FFN output (None in block 0).
        `encoder_kv`: this block's cross-attention keys and values, packed, where the stack
        projected them (`T5Stack.cross_kv`)."""
        sa = self.layer[0]
        if pending is None:
            x = sa.layer_norm(h)
        else:
            h, x = sa.layer_norm(h, pending, linear_reads_it=True)
        out = sa.dropout(
            sa.SelfAttention(x, bias=bias, key_mask=key_mask, causal=self.is_decoder, cache=cache)
        )
        if self.is_decoder:
            ca = self.layer[1]
            h, x = ca.layer_norm(h, out, linear_reads_it=True)
            out = ca.dropout(
                ca.EncDecAttention(
                    x,
                    kv_input=encoder_hidden_states,
                    key_mask=encoder_key_mask,
                    cache=cache,
                    cache_prefix="cross",
                    kv=encoder_kv,
                )
            )
        ff = self.layer[-1]
        h, x = ff.layer_norm(h, out, linear_reads_it=True)
        return h, ff.dropout(ff.DenseReluDense(x))


class T5Stack(nn.Module):
    """Encoder or decoder: embeddings (shared module), blocks, final RMS norm."""

    def __init__(self, config: T5Config, embed_tokens: nn.Embedding, is_decoder: bool) -> None:
        super().__init__()
        self.config, self.is_decoder = config, is_decoder
        self.embed_tokens = embed_tokens  # the same module as T5ForConditionalGeneration.shared
        n = config.num_decoder_layers if is_decoder else config.num_layers
        self.block = nn.ModuleList(
            T5Block(config, is_decoder, has_relative_attention_bias=i == 0) for i in range(n)
        )
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    @property
    def bias_table(self) -> nn.Embedding:
        """The stack's (num_buckets, heads) relative bias table; it lives in block 0 (HF layout)."""
        return self.block[0].layer[0].SelfAttention.relative_attention_bias

    def position_bias(
        self, q_len: int, k_len: int, q_offset: int | torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """The learned bias (heads, q_len, k_len) fp32, shared by every block of the stack: looked up
        once per key - query offset (a (heads, q_len + k_len - 1) row) and expanded by `dense_bias`,
        or that row itself where `attention.row_bias_applies` (long inputs on the fused kernel).
        Queries sit at positions q_offset .. q_offset + q_len - 1 (an int, or a 0-dim device tensor
        when decoding into a fixed-size cache), keys at 0 .. k_len - 1."""
        offsets = torch.arange(-(q_len - 1), k_len, device=device) - q_offset  # key position - query position
        buckets = relative_position_bucket(
            offsets,
            bidirectional=not self.is_decoder,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance,
        )
        rel = self.bias_table(buckets).t().float()
        c = self.config
        if isinstance(q_offset, int) and row_bias_applies(
            c.attention_bias_layout, c.attention_backend, device, q_len, k_len
        ):
            return rel
        return dense_bias(rel, q_len, k_len)

    def cross_kv(self, encoder_hidden_states: torch.Tensor) -> list[torch.Tensor]:
        """Each decoder block's cross-attention keys and values of the encoder output, packed [k | v]
        (batch, encoder length, 2 * heads * d_kv), projected before the first block runs. In one
        compiled graph (`compile_blocks`, or the whole forward) the gradients the blocks send to the
        encoder output are summed inside that graph, not by autograd one block at a time."""
        attn = [block.layer[1].EncDecAttention for block in self.block]
        return [F.linear(encoder_hidden_states, torch.cat([a.k.weight, a.v.weight])) for a in attn]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        caches: list[dict] | None = None,
    ) -> torch.Tensor:
        """Hidden states (batch, q_len, d_model) after the final norm. Decoding (`generation`) passes
        one fixed-size cache dict per block in `caches` (keys "position" and "length", see
        `_write_cache_slot`) and one token per row."""
        h = self.dropout(self.embed_tokens(input_ids))
        device_type = input_ids.device.type
        if self.config.residual_dtype == "autocast" and torch.is_autocast_enabled(device_type):
            h = h.to(torch.get_autocast_dtype(device_type))  # the residual adds then stay in it
        q_len = input_ids.shape[1]
        key_mask = None if attention_mask is None else attention_mask.to(torch.bool)
        past_length, k_len = 0, q_len
        if caches is not None:
            # One query at position caches[0]["position"] (a device tensor, so every step has the same
            # shapes), keys in all cache["length"] slots, those not yet written masked.
            if not all("position" in c and "length" in c for c in caches):
                raise ValueError(
                    'caches must be fixed-size: one dict per block with "position" (a 0-dim device tensor) '
                    'and "length" (see training.model.generation._fixed_caches)'
                )
            if q_len != 1 or key_mask is not None:
                raise ValueError("a fixed-size cache decodes one position per call, without a decoder mask")
            past_length, k_len = caches[0]["position"], caches[0]["length"]
            slots = torch.arange(k_len, device=input_ids.device)
            key_mask = (slots <= past_length).expand(input_ids.shape[0], k_len)
        bias = self.position_bias(q_len, k_len, past_length, input_ids.device)
        enc_mask = None if encoder_attention_mask is None else encoder_attention_mask.to(torch.bool)
        pending = None  # each block's FFN output, added to h by the next norm (see T5Block.forward)
        policy = self.config.activation_checkpointing if caches is None and self.training else "none"
        encoder_kvs = [None] * len(self.block)
        if self.is_decoder and caches is None and policy == "none" and not _gathered_per_module(self):
            encoder_kvs = self.cross_kv(encoder_hidden_states)
        for i, block in enumerate(self.block):
            h, pending = run_block(
                policy,
                block,
                h,
                bias,
                key_mask,
                encoder_hidden_states,
                enc_mask,
                None if caches is None else caches[i],
                pending,
                encoder_kvs[i],
            )
        return self.dropout(
            self.final_layer_norm(h) if pending is None else self.final_layer_norm(h, pending)[1]
        )


class T5ForConditionalGeneration(nn.Module):
    """T5 encoder-decoder with an LM head; parameter names are those of HF checkpoints."""

    loss_fn = staticmethod(fused_linear_cross_entropy)  # compile_blocks() sets a compiled copy on the instance

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, self.shared, is_decoder=False)
        self.decoder = T5Stack(config, self.shared, is_decoder=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """T5 v1.1 / nanoT5 init (HF `T5PreTrainedModel._init_weights`), scaled by initializer_factor."""
        c, f = self.config, self.config.initializer_factor
        nn.init.normal_(self.shared.weight, std=f * 1.0)
        if not c.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, std=f * 1.0)
        for m in self.modules():
            if isinstance(m, T5LayerNorm):
                nn.init.constant_(m.weight, f * 1.0)
            elif isinstance(m, T5Attention):
                nn.init.normal_(m.q.weight, std=f * (c.d_model * c.d_kv) ** -0.5)
                nn.init.normal_(m.k.weight, std=f * c.d_model**-0.5)
                nn.init.normal_(m.v.weight, std=f * c.d_model**-0.5)
                nn.init.normal_(m.o.weight, std=f * (c.num_heads * c.d_kv) ** -0.5)
                if m.has_relative_attention_bias:
                    nn.init.normal_(m.relative_attention_bias.weight, std=f * c.d_model**-0.5)
            elif isinstance(m, T5DenseGatedActDense):
                nn.init.normal_(m.wi_0.weight, std=f * c.d_model**-0.5)
                nn.init.normal_(m.wi_1.weight, std=f * c.d_model**-0.5)
                nn.init.normal_(m.wo.weight, std=f * c.d_ff**-0.5)
            elif isinstance(m, T5DenseActDense):
                nn.init.normal_(m.wi.weight, std=f * c.d_model**-0.5)
                nn.init.normal_(m.wo.weight, std=f * c.d_ff**-0.5)

    def compile_pointwise(self) -> None:
        """torch.compile the element-wise parts that hold no parameter of their own (RMS norm, the
        gated GELU), each on its own: one fused kernel forward and one backward instead of eager's
        five to eight, and fewer fp32 intermediates kept for the backward. ZeRO 3's
        `model.zero3_compile=pointwise` (training/zero3_compile.py): the rest of the model, and the
        parameter gathering, stay eager. One compiled function serves every layer.
        """
        norm, act = torch.compile(rms_norm), torch.compile(gated_gelu)
        for m in self.modules():
            if isinstance(m, T5LayerNorm):
                m.norm_fn = norm
            elif isinstance(m, T5DenseGatedActDense):
                m.act_fn = act

    def compile_blocks(self, *, backend: str = "inductor", options: dict | None = None, loss: bool = True) -> int:
        """torch.compile each T5 block's forward on its own (fullgraph), the final RMS norms, the
        decoder's cross-attention projections (`T5Stack.cross_kv`) and, with `loss`, the fused linear
        cross-entropy; the embeddings and the relative bias stay eager. The blocks of a stack share
        one code object, so dynamo traces and inductor compiles each kind of block once, not once per
        layer: the first step comes sooner than with the whole forward compiled, and the step is
        slower (no fusion across the blocks' borders; docs/performance.md).
        `model.compile_scope=blocks` at ZeRO 0-2 and ZeRO 3's `model.zero3_compile=blocks`
        (training/zero3_compile.py, without the loss). `options`: inductor's (training.compile_settings);
        tests use backend "aot_eager" (options None). Returns the number of blocks compiled."""
        # The variants of all blocks count against one recompile limit: {encoder, decoder} x {train,
        # no_grad} x {with, without key mask} x {static, dynamic lengths} = 16 at most. 32 leaves room
        # and still stops a per-block recompile (48 blocks in XL) early.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        norm = torch.compile(rms_norm, backend=backend)
        # Under ZeRO 3 the stack never calls cross_kv (see _gathered_per_module), so nothing compiles.
        self.decoder.cross_kv = torch.compile(self.decoder.cross_kv, fullgraph=True, backend=backend, options=options)
        blocks = 0
        for stack in (self.encoder, self.decoder):
            stack.final_layer_norm.norm_fn = norm
            for block in stack.block:
                block.forward = _compiled_block_forward(block, backend, options)
                blocks += 1
        if loss:
            self.loss_fn = torch.compile(fused_linear_cross_entropy, fullgraph=True, backend=backend, options=options)
        return blocks

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied lm_head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """Decoder inputs: decoder_start_token_id, then labels[:-1], with -100 replaced by pad."""
        shifted = labels.new_full(labels.shape, self.config.decoder_start_token_id)
        shifted[:, 1:] = labels[:, :-1]
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask)

    def head_input(self, decoder_hidden: torch.Tensor) -> torch.Tensor:
        if self.config.scale_decoder_outputs:
            decoder_hidden = decoder_hidden * self.config.d_model**-0.5
        return decoder_hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> Seq2SeqOutput:
        """Loss (mean fp32 CE over labels != -100) and logits; return_logits=False skips the logits
        tensor and, with labels, uses the chunked fused linear + cross-entropy (no (B, T, V) tensor)."""
        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("T5ForConditionalGeneration.forward needs labels or decoder_input_ids")
            decoder_input_ids = self.shift_right(labels)
        enc = self.encoder(input_ids, attention_mask)
        dec = self.decoder(
            decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=enc,
            encoder_attention_mask=attention_mask,
        )
        dec = self.head_input(dec)
        if not return_logits and labels is not None:
            loss = self.loss_fn(dec, self.lm_head.weight, labels)
            return Seq2SeqOutput(loss=loss, logits=None)
        logits = self.lm_head(dec).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return Seq2SeqOutput(loss=loss, logits=logits if return_logits else None)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Standard load that also accepts HF files where tied aliases were dropped on save
        (`encoder.embed_tokens.weight`, `decoder.embed_tokens.weight`, tied `lm_head.weight`)."""
        state_dict = dict(state_dict)
        for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            if "shared.weight" not in state_dict and alias in state_dict:
                state_dict["shared.weight"] = state_dict[alias]
        for alias in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            state_dict.setdefault(alias, state_dict.get("shared.weight"))
        if self.config.tie_word_embeddings:
            state_dict.setdefault("lm_head.weight", state_dict.get("shared.weight"))
        state_dict = {k: v for k, v in state_dict.items() if v is not None}
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 128,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        cuda_graph: bool = True,
    ) -> torch.Tensor:
        """Greedy decoding (num_beams=1) or beam search with a key/value cache, as transformers'
        `generate(num_beams=..., length_penalty=...)` decodes (see `training.model.generation`).
        cuda_graph: on CUDA, decoding replays its step as a CUDA graph (False: every step eager)."""
        if num_beams == 1:
            return greedy_generate(self, input_ids, attention_mask, max_new_tokens, cuda_graph)
        return beam_search_generate(
            self, input_ids, attention_mask, max_new_tokens, num_beams, length_penalty, cuda_graph
        )


def _gathered_per_module(stack: T5Stack) -> bool:
    """Whether DeepSpeed ZeRO 3 partitions the stack's weights: each module's are gathered only while
    its own forward runs, so no block's weights may be read from outside it (`T5Stack.cross_kv`)."""
    return hasattr(stack.final_layer_norm.weight, "ds_id")


def _compiled_block_forward(block: nn.Module, backend: str, options: dict | None):
    """`block.forward` compiled (fullgraph) for `T5ForConditionalGeneration.compile_blocks`; decoding
    with a key/value cache runs the eager forward (a cache grows by one position per step: each length
    would be a new graph)."""
    eager = block.forward
    compiled = torch.compile(eager, fullgraph=True, backend=backend, options=options)

    def forward(
        h, bias, key_mask, encoder_hidden_states=None, encoder_key_mask=None, cache=None, pending=None, encoder_kv=None
    ):
        fn = eager if cache is not None else compiled
        return fn(h, bias, key_mask, encoder_hidden_states, encoder_key_mask, cache, pending, encoder_kv)

    return forward
