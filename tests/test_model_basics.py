"""Our T5 on its own: buckets, masks, generation, presets, FLOPs, config (the fused cross-entropy:
test_fused_cross_entropy.py)."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from training.model import T5Config, T5ForConditionalGeneration, triton_attention
from training.model.attention import (
    ROW_BIAS_FROM_SCORES,
    _math_attention,
    bias_saturation_distance,
    dense_bias,
    packed_attention,
    relative_position_bucket,
    row_bias_applies,
)
from training.model.flops import model_flops_per_step
from training.model.generation import beam_search_generate
from training.model.t5 import T5Stack


def mesh_tf_bucket(rel: int, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> int:
    """Scalar transcription of Mesh TF `_relative_position_bucket` (n = -relative_position)."""
    ret = 0
    n = -rel
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(val, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bucket_matches_reference(bidirectional):
    rel = torch.arange(-600, 601)
    ours = relative_position_bucket(rel, bidirectional=bidirectional)
    expected = torch.tensor([mesh_tf_bucket(int(r), bidirectional) for r in rel])
    assert torch.equal(ours, expected)
    transformers = pytest.importorskip("transformers")
    hf = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
        rel, bidirectional=bidirectional
    )
    assert torch.equal(ours, hf)
    assert (
        ours.min() >= 0 and ours.max() == 31 and len(ours.unique()) == (31 if bidirectional else 32)
    )  # +0 never occurs


@pytest.mark.parametrize(
    "bidirectional, num_buckets, max_distance",
    [(True, 32, 128), (False, 32, 128), (True, 8, 16), (False, 8, 6), (False, 32, 10)],
)
def test_bias_saturation_distance_is_where_the_buckets_stop_changing(bidirectional, num_buckets, max_distance):
    """Beyond the distance the fused kernel is promised, every key - query offset of a direction
    shares one bucket (so one bias value per head), checked against Mesh TF's buckets far past
    max_distance; one step closer, some offset does not (the promise is as tight as it can be)."""
    far = bias_saturation_distance(bidirectional, num_buckets, max_distance)
    if max_distance <= (num_buckets // 2 if bidirectional else num_buckets) // 2:
        assert far == 0  # (False, 32, 10): the log buckets do not end at max_distance: no promise
        return
    rel = range(-4096, 4097)
    bucket = {r: mesh_tf_bucket(r, bidirectional, num_buckets, max_distance) for r in rel}

    def constant_beyond(d: int) -> bool:
        after = {bucket[r] for r in rel if r >= d}
        before = {bucket[r] for r in rel if r <= -d}
        return len(after) == 1 and len(before) == 1

    assert constant_beyond(far) and not constant_beyond(far - 1)
    if (bidirectional, num_buckets, max_distance) == (True, 32, 128):
        assert far == 91  # T5's encoder: 30 of the 64 tiles of 64 x 64 at 512 x 512 lie beyond it


def test_backend_choice_falls_back_where_the_fused_kernel_does_not_run(monkeypatch):
    """"auto" is our Triton kernel on CUDA (where triton imports) and math elsewhere; the triton
    backend hands attention dropout to sdpa (math on CPU) and cached decoding (causal, fewer queries
    than keys) to sdpa; sdpa and math run as named."""
    from training.model import attention as attn

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(attn.triton_attention, "available", lambda: True)
    assert attn.resolve_backend("auto", cuda) == "triton"
    assert attn.resolve_backend("auto", cpu) == "math"
    choose = attn._choose_backend
    assert choose("auto", cuda, False, 512, 512, 0.0) == "triton"
    assert choose("triton", cuda, True, 114, 114, 0.0) == "triton"
    assert choose("triton", cuda, False, 114, 512, 0.0) == "triton"  # cross-attention
    assert choose("triton", cuda, False, 512, 512, 0.1) == "sdpa"  # dropout
    assert choose("triton", cpu, False, 512, 512, 0.1) == "math"
    assert choose("auto", cuda, True, 1, 9, 0.0) == "sdpa"  # decoding with a cache
    for backend in ("sdpa", "math"):
        assert choose(backend, cuda, True, 1, 9, 0.1) == backend
    monkeypatch.setattr(attn.triton_attention, "available", lambda: False)
    assert attn.resolve_backend("auto", cuda) == "math"


@pytest.mark.parametrize("backend", ["cudnn", "flex", "fused"])
def test_config_refuses_an_attention_backend_it_does_not_have(backend):
    """Only "auto", "triton", "sdpa" and "math" exist; any other name stops with the list."""
    with pytest.raises(ValueError, match="'auto', 'math', 'sdpa', 'triton'"):
        T5Config.from_preset("tiny", attention_backend=backend)


def _tiny(seed: int = 0, **overrides) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(
        T5Config.from_preset("tiny", attention_backend="math", **overrides)
    ).eval()


@pytest.mark.parametrize(
    "is_decoder, q_len, k_len, q_offset", [(False, 13, 13, 0), (True, 7, 7, 0), (True, 1, 6, 5)]
)
def test_position_bias_is_the_bucketed_table_per_pair(is_decoder, q_len, k_len, q_offset):
    """The stack's bias (one lookup per key - query offset, expanded) is table[bucket(key - query)]."""
    torch.manual_seed(0)
    config = T5Config.from_preset("tiny", relative_attention_num_buckets=8, relative_attention_max_distance=6)
    model = T5ForConditionalGeneration(config)  # small buckets: the log-spaced ones show at these lengths
    stack = model.decoder if is_decoder else model.encoder
    bias = stack.position_bias(q_len, k_len, q_offset, torch.device("cpu"))
    # A 0-dim tensor offset (decoding into a fixed-size cache) gives the same bias.
    again = stack.position_bias(q_len, k_len, torch.tensor(q_offset), torch.device("cpu"))
    assert torch.equal(again, bias)
    q_pos = torch.arange(q_offset, q_offset + q_len)[:, None]
    buckets = relative_position_bucket(torch.arange(k_len)[None, :] - q_pos, bidirectional=not is_decoder,
                                       num_buckets=8, max_distance=6)  # fmt: skip
    expected = stack.bias_table.weight[buckets].permute(2, 0, 1)
    torch.testing.assert_close(bias, expected, rtol=0, atol=0)
    row = torch.arange(q_len + k_len - 1.0).expand(model.config.num_heads, -1)
    offsets = torch.arange(k_len)[None, :] - q_pos + q_offset  # key - query, from the first query
    assert torch.equal(dense_bias(row, q_len, k_len)[0], (offsets + q_len - 1).float())
    with pytest.raises(ValueError, match="q_len \\+ k_len - 1"):
        dense_bias(row, q_len + 1, k_len)


def test_long_inputs_hand_the_fused_attention_the_bias_as_its_row():
    """T5Config.attention_bias_layout: "auto" hands the triton backend the relative row from
    ROW_BIAS_FROM_SCORES query x key pairs on (T5 base's 512 x 512 and 114 x 114 stay dense),
    "dense" never, "row" at any length; other backends (and decoding's tensor offsets) always get
    the dense bias, and packed_attention expands a row for them."""
    cpu, side = torch.device("cpu"), int(ROW_BIAS_FROM_SCORES**0.5)
    assert not row_bias_applies("auto", "triton", cpu, 512, 512) and not row_bias_applies("auto", "triton", cpu, 114, 114)
    assert row_bias_applies("auto", "triton", cpu, side, side) and not row_bias_applies("auto", "triton", cpu, side - 1, side)
    assert not row_bias_applies("dense", "triton", cpu, 16384, 16384) and row_bias_applies("row", "triton", cpu, 9, 9)
    assert not row_bias_applies("row", "math", cpu, 9, 9) and not row_bias_applies("row", "auto", cpu, 9, 9)  # auto: math on CPU
    with pytest.raises(ValueError, match="attention_bias_layout must be one of"):
        T5Config.from_preset("tiny", attention_bias_layout="relative")
    stack = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math")).encoder
    dense = stack.position_bias(9, 9, 0, cpu)
    stack.config.attention_backend, stack.config.attention_bias_layout = "triton", "row"
    row = stack.position_bias(9, 9, 0, cpu)
    assert row.shape == (dense.shape[0], 17) and torch.equal(dense_bias(row, 9, 9), dense)
    assert torch.equal(stack.position_bias(9, 9, torch.tensor(0), cpu), dense)  # decoding: dense
    qkv = torch.randn(2, 9, 3 * dense.shape[0] * 8)
    got = packed_attention(qkv, None, dense.shape[0], row, None, False, "math")
    assert torch.equal(got, packed_attention(qkv, None, dense.shape[0], dense, None, False, "math"))
    from training.config import ModelConfig
    from training.run_setup import build_model

    built = build_model(ModelConfig(preset="tiny", attention_bias_layout="row"), cpu)[0]  # the run config's
    assert built.config.attention_bias_layout == "row"
    # a dense bias past int32 offsets (T5 base at 16,384 x 16,384) is refused before any kernel runs
    huge = torch.zeros(1).expand(12, 16384, 16384)
    with pytest.raises(ValueError, match="past the fused kernel's 32-bit offsets: hand it the bias as its row"):
        triton_attention.t5_flash_attention_packed(torch.randn(1, 4, 3 * 12 * 64), None, 12, huge, None, False)


@pytest.mark.parametrize("cross", [False, True])
def test_packed_attention_equals_attention_on_split_views(cross):
    torch.manual_seed(0)
    b, sq, sk, h, d = 2, 6, 9 if cross else 6, 3, 4
    q_src = torch.randn(b, sq, h * d if cross else 3 * h * d)
    kv_src = torch.randn(b, sk, 2 * h * d) if cross else None
    kv = kv_src if cross else q_src[..., h * d :]
    q = q_src[..., : h * d].unflatten(-1, (h, d))
    k, v = kv[..., : h * d].unflatten(-1, (h, d)), kv[..., h * d : 2 * h * d].unflatten(-1, (h, d))
    bias = None if cross else torch.randn(h, sq, sk)
    mask = torch.ones(b, sk, dtype=torch.bool)
    mask[1, -2:] = False
    out = packed_attention(q_src, kv_src, h, bias, mask, causal=not cross, backend="math")
    ref = _math_attention(q, k, v, bias, mask, not cross, 0.0)
    torch.testing.assert_close(out, ref.flatten(2))


def test_causal_mask_future_decoder_token_does_not_change_earlier_logits():
    model = _tiny()
    input_ids = torch.randint(2, 32128, (2, 11))
    dec = torch.randint(2, 32128, (2, 9))
    changed = dec.clone()
    changed[:, 5] = (changed[:, 5] + 17) % 32128
    a = model(input_ids, decoder_input_ids=dec).logits
    b = model(input_ids, decoder_input_ids=changed).logits
    torch.testing.assert_close(a[:, :5], b[:, :5], rtol=0, atol=0)
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_padding_the_encoder_input_leaves_logits_unchanged():
    model = _tiny()
    input_ids = torch.randint(2, 32128, (1, 10))
    dec = torch.randint(2, 32128, (1, 6))
    ref = model(input_ids, decoder_input_ids=dec).logits
    padded = torch.cat([input_ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 5)], dim=1).long()
    out = model(padded, attention_mask=mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    unmasked = model(padded, decoder_input_ids=dec).logits
    assert not torch.allclose(unmasked, ref, rtol=1e-3, atol=1e-3)


def test_labels_shift_right_and_ignore_index():
    model = _tiny()
    labels = torch.tensor([[5, 6, 1, -100, -100]])
    assert model.shift_right(labels).tolist() == [[0, 5, 6, 1, 0]]
    input_ids = torch.randint(2, 32128, (1, 8))
    out = model(input_ids, labels=labels)
    logits = out.logits[0, :3]
    expected = torch.nn.functional.cross_entropy(logits, labels[0, :3])
    torch.testing.assert_close(out.loss, expected)


def _generate_without_cache(model, input_ids, attention_mask, max_new_tokens):
    config = model.config
    out = torch.full((input_ids.shape[0], 1), config.decoder_start_token_id)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=out).logits[:, -1]
        nxt = torch.where(
            finished, torch.full_like(finished, config.pad_token_id, dtype=torch.long), logits.argmax(-1)
        )
        out = torch.cat([out, nxt[:, None]], dim=1)
        finished |= nxt == config.eos_token_id
        if finished.all():
            break
    return out


def test_generate_with_cache_equals_step_by_step_argmax():
    model = _tiny(seed=1)
    input_ids = torch.randint(2, 32128, (3, 9))
    mask = torch.ones_like(input_ids)
    mask[0, -3:] = 0
    with torch.no_grad():
        expected = _generate_without_cache(model, input_ids, mask, 8)
    got = model.generate(input_ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, expected)
    assert got.shape == (3, 9)


def _assert_padded_after_eos(got: torch.Tensor) -> None:
    """Some rows produced EOS (id 1), and every such row holds only pad (0) after its first EOS."""
    eos_rows = (got == 1).any(dim=1)
    assert eos_rows.any()
    for row in got[eos_rows]:
        first = int((row == 1).nonzero()[0])
        assert (row[first + 1 :] == 0).all()


def test_fixed_size_cache_decodes_one_position_without_a_decoder_mask():
    model = _tiny()
    enc = model.encoder(torch.randint(2, 32128, (2, 5)))
    caches = [{"position": torch.tensor(0), "length": 4} for _ in model.decoder.block]
    with pytest.raises(ValueError, match="one position per call"):
        model.decoder(torch.zeros(2, 2, dtype=torch.long), encoder_hidden_states=enc, caches=caches)
    with pytest.raises(ValueError, match="one position per call"):
        model.decoder(torch.zeros(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 1),
                      encoder_hidden_states=enc, caches=caches)  # fmt: skip
    with pytest.raises(ValueError, match="caches must be fixed-size"):  # e.g. a growing cache's empty dicts
        model.decoder(torch.zeros(2, 1, dtype=torch.long), encoder_hidden_states=enc,
                      caches=[{} for _ in model.decoder.block])  # fmt: skip


def test_cache_history_table_gathers_each_slot_from_the_row_that_wrote_it():
    """Beam search's history table (`_write_cache_slot`): slot s of row r is read from the
    flattened buffers' row history[r, s] (row' * length + s for the row' that wrote it); this
    position's slot from the row itself, as written; no table: the buffers."""
    from training.model.t5 import _write_cache_slot

    rows, length, heads, d = 3, 4, 2, 5
    cache = {"position": torch.tensor(2), "length": length}
    k, v = torch.randn(rows, 1, heads, d), torch.randn(rows, 1, heads, d)
    plain_k, plain_v = _write_cache_slot(cache, "self", k, v)
    assert plain_k is cache["self_k"] and torch.equal(plain_k[:, 2:3], k) and not plain_k[:, 3].any()
    cache["self_k"].copy_(torch.randn(rows, length, heads, d))
    cache["self_v"].copy_(torch.randn(rows, length, heads, d))
    sources = torch.tensor([[2, 0, 0, 1], [0, 0, 1, 1], [1, 2, 2, 2]])  # column 2: the rows themselves
    cache["history"] = sources * length + torch.arange(length)
    k2, v2 = torch.randn(rows, 1, heads, d), torch.randn(rows, 1, heads, d)
    got_k, got_v = _write_cache_slot(cache, "self", k2, v2)
    for r in range(rows):
        for s in range(length):
            source = sources[r, s]
            assert torch.equal(got_k[r, s], cache["self_k"][source, s])
            assert torch.equal(got_v[r, s], cache["self_v"][source, s])
    assert torch.equal(cache["self_k"][:, 2:3], k2) and torch.equal(got_k[:, 2:3], k2)  # as written


@pytest.mark.parametrize("q_len", [1, 3])
def test_cross_attention_groups_of_rows_share_one_encoder_row(q_len):
    """Beam search keeps the encoder output at one row per input: k consecutive decoder rows attend
    to encoder row i. The result equals that of the encoder output repeated k times, padding mask
    included; query rows that are not whole groups are refused."""
    model = _tiny(seed=4)
    attn = model.decoder.block[0].layer[1].EncDecAttention
    batch, groups, k_len, d_model = 3, 4, 9, model.config.d_model
    enc = torch.randn(batch, k_len, d_model)
    mask = torch.ones(batch, k_len, dtype=torch.bool)
    mask[1, 6:] = False
    x = torch.randn(batch * groups, q_len, d_model)
    repeated = attn(x, kv_input=enc.repeat_interleave(groups, 0), key_mask=mask.repeat_interleave(groups, 0))
    grouped = attn(x, kv_input=enc, key_mask=mask)
    torch.testing.assert_close(grouped, repeated, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(grouped[4:8], attn(x[4:8], kv_input=enc[:1], key_mask=mask[:1]), atol=1e-3)
    with pytest.raises(ValueError, match="whole groups of consecutive rows"):
        attn(x[:-1], kv_input=enc, key_mask=mask)


class _NoHostReads(TorchDispatchMode):
    """Fails on aten._local_scalar_dense, the op that every read of a tensor's value on the host goes
    through (`.item()`, `bool(t)`, `int(t)`, and `x[t]` with a 0-dim integer tensor t)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a decoding step read a tensor's value on the host")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("num_beams", [1, 3])
def test_decoding_steps_never_read_the_device_on_the_host(monkeypatch, num_beams):
    """A CUDA graph cannot hold a host read, so the step that greedy decoding and beam search capture
    must make none (a 0-dim tensor used as an index once broke beam search's capture). Checked on
    CPU, where the step runs the same ops: every step runs under `_NoHostReads`."""
    from training.model import generation

    model = _tiny(seed=3)
    input_ids = torch.randint(2, 32128, (3, 9))
    mask = torch.ones_like(input_ids)
    mask[0, -3:] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, num_beams=num_beams)
    expected = model.generate(input_ids, **kwargs)
    real, steps = generation._run_steps, []

    def guarded_run_steps(step, done, *args):
        def guarded_step():
            with _NoHostReads():
                step()
            steps.append(1)

        return real(guarded_step, done, *args)

    monkeypatch.setattr(generation, "_run_steps", guarded_run_steps)
    assert torch.equal(model.generate(input_ids, **kwargs), expected)
    assert len(steps) == expected.shape[1] - 1 >= 2
    with pytest.raises(AssertionError, match="read a tensor's value on the host"), _NoHostReads():
        torch.arange(5.0)[torch.tensor(2)]  # the guard sees such a read


def test_generate_stops_at_eos_and_pads_after():
    model = _tiny(seed=2)
    with torch.no_grad():  # make EOS the argmax whenever the hidden state's first feature is positive
        model.lm_head.weight[model.config.eos_token_id] = 0.0
        model.lm_head.weight[model.config.eos_token_id, 0] = 1e4
    input_ids = torch.randint(2, 32128, (4, 7))
    with torch.no_grad():
        expected = _generate_without_cache(model, input_ids, None, 10)
    got = model.generate(input_ids, max_new_tokens=10)
    assert torch.equal(got, expected)
    _assert_padded_after_eos(got)


def test_beam_search_rows_are_independent_and_padded_after_eos():
    """Each row's beams stay with that row: a batch decodes as its rows do one by one (the cache
    reordering never mixes rows), and rows are padded after their EOS."""
    model = _tiny(seed=4, vocab_size=64)
    with torch.no_grad():
        model.lm_head.weight[model.config.eos_token_id] *= 3.0
    input_ids = torch.randint(2, 64, (4, 9))
    mask = torch.ones_like(input_ids)
    mask[2, -4:] = 0
    got = model.generate(input_ids, attention_mask=mask, max_new_tokens=9, num_beams=3)
    assert (got[:, 0] == model.config.decoder_start_token_id).all() and got.shape[1] <= 10
    for i in range(4):
        alone = model.generate(input_ids[i : i + 1], attention_mask=mask[i : i + 1], max_new_tokens=9, num_beams=3)
        assert torch.equal(got[i, : alone.shape[1]], alone[0]) and (got[i, alone.shape[1] :] == 0).all()
    _assert_padded_after_eos(got)


def test_beam_search_rejects_bad_arguments():
    model = _tiny(seed=0)
    input_ids = torch.randint(2, 32128, (1, 5))
    with pytest.raises(ValueError, match="num_beams must be >= 1"):
        beam_search_generate(model, input_ids, num_beams=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        model.generate(input_ids, max_new_tokens=0, num_beams=2)


def _hf_parameter_count(config: T5Config) -> int:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**config.to_hf_config()))
    shared = sum(p.numel() for p in hf.parameters())
    return shared + (0 if config.tie_word_embeddings else config.vocab_size * config.d_model)  # untied head


@pytest.mark.parametrize("preset", ["small", "base"])
def test_preset_parameter_counts_match_hf(preset):
    config = T5Config.from_preset(preset)
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    assert model.num_parameters() == _hf_parameter_count(config)
    if preset == "base":
        assert model.num_parameters() == 247_577_856  # "247.6M" (google/t5-v1_1-base)


def test_model_flops_per_step_reproduces_anchor():
    flops = model_flops_per_step(T5Config.from_preset("base"), 128, 512, 114)
    assert abs(flops / 5.45e13 - 1) < 0.01


def test_config_validation_and_hf_round_trip():
    with pytest.raises(ValueError, match="feed_forward_proj"):
        T5Config(feed_forward_proj="swiglu")
    with pytest.raises(ValueError, match="attention_backend"):
        T5Config(attention_backend="cuda")
    with pytest.raises(ValueError, match="preset"):
        T5Config.from_preset("huge")
    # inside the decoder's exact buckets (16 for 32 buckets) the log buckets would turn negative
    with pytest.raises(ValueError, match="max_distance must exceed num_buckets / 2"):
        T5Config(relative_attention_num_buckets=32, relative_attention_max_distance=10)
    assert relative_position_bucket(torch.tensor([-200]), bidirectional=False, max_distance=10).item() < 0
    config = T5Config.from_preset("large", dropout_rate=0.1)
    assert (config.d_model, config.d_ff, config.num_layers, config.num_decoder_layers, config.num_heads) == (
        1024,
        2816,
        24,
        24,
        16,
    )
    back = T5Config.from_hf_config(config.to_hf_config())
    assert back == config
    # An HF v1.1 config.json as published (no decoder_start_token_id, "gated-gelu", untied).
    hf_json = {
        "d_model": 768,
        "d_ff": 2048,
        "num_layers": 12,
        "num_heads": 12,
        "d_kv": 64,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "vocab_size": 32128,
        "dropout_rate": 0.1,
        "model_type": "t5",
    }
    assert T5Config.from_hf_config(hf_json, dropout_rate=0.0) == T5Config.from_preset("base")
    original = T5Config.from_hf_config(
        {"feed_forward_proj": "relu", "d_model": 512, "d_ff": 2048, "num_layers": 6, "num_heads": 8}
    )
    assert original.tie_word_embeddings and original.scale_decoder_outputs


def test_init_statistics_follow_t5_v11():
    config = T5Config.from_preset("tiny", d_model=256, d_ff=512)
    model = T5ForConditionalGeneration(config)
    attn = model.encoder.block[0].layer[0].SelfAttention
    ff = model.encoder.block[0].layer[-1].DenseReluDense
    checks = {
        model.shared.weight: 1.0,
        model.lm_head.weight: 1.0,
        attn.q.weight: (256 * 16) ** -0.5,
        attn.k.weight: 256**-0.5,
        attn.o.weight: (4 * 16) ** -0.5,
        ff.wi_0.weight: 256**-0.5,
        ff.wo.weight: 512**-0.5,
    }
    for tensor, std in checks.items():
        assert abs(float(tensor.std()) / std - 1) < 0.1
    assert torch.equal(model.encoder.final_layer_norm.weight, torch.ones(256))
    assert model.lm_head.weight is not model.shared.weight


def test_compile_pointwise_keeps_loss_and_gradients():
    """ZeRO 3's compiled RMS norms and gated GELUs (inductor on CPU here) change no figure."""
    eager, compiled = _tiny(), _tiny()
    cfg = eager.config
    compiled.compile_pointwise()
    from training.model.t5 import gated_gelu, rms_norm

    assert all(m.norm_fn is not rms_norm for m in compiled.modules() if hasattr(m, "norm_fn"))
    assert all(m.act_fn is not gated_gelu for m in compiled.modules() if hasattr(m, "act_fn"))
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    y = torch.randint(0, cfg.vocab_size, (2, 5))
    losses = []
    for model in (eager, compiled):
        out = model(input_ids=x, labels=y)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        # fp32 reductions fused in another order: ~2e-6 of the gradient's scale
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5 * float(a.grad.abs().max()), msg=name)


def test_decoder_projects_every_blocks_cross_attention_up_front_where_no_block_recomputes_it(monkeypatch):
    """Training without checkpointing projects all decoder blocks' keys and values of the encoder
    output before the first block (`T5Stack.cross_kv`): the same loss and gradients as each block
    projecting its own, which ZeRO 3's partitioned weights (each gathered inside its module), block
    checkpointing (kv recomputed, not kept) and decoding (a cache) keep."""
    calls = []
    original = T5Stack.cross_kv

    def counted(self, enc):
        calls.append(len(self.block))
        return original(self, enc)

    monkeypatch.setattr(T5Stack, "cross_kv", counted)
    up_front, per_block = _tiny(), _tiny()
    per_block.decoder.final_layer_norm.weight.ds_id = 0  # what DeepSpeed ZeRO 3 sets on partitioned weights
    x = torch.randint(0, up_front.config.vocab_size, (2, 12))
    y = torch.randint(0, up_front.config.vocab_size, (2, 5))
    losses = []
    for model in (up_front, per_block):
        out = model(input_ids=x, labels=y)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert calls == [len(up_front.decoder.block)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for (name, a), b in zip(up_front.named_parameters(), per_block.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6 * float(a.grad.abs().max()), msg=name)
    checkpointed = _tiny().train()  # checkpointing applies in training only
    checkpointed.config.activation_checkpointing = "block"
    checkpointed(input_ids=x, labels=y).loss.backward()
    up_front.eval().generate(x, max_new_tokens=3, cuda_graph=False)
    assert calls == [len(up_front.decoder.block)]


def test_residual_dtype_autocast_keeps_bf16_hidden_states_under_autocast_only():
    """residual_dtype='autocast': every block hands on bf16 hidden states under bf16 autocast (the
    residual adds stay in bf16), the loss stays within bf16 rounding of the fp32 stream's; outside
    autocast the model is the float32 one, bit for bit. A bad value names the choices."""
    torch.manual_seed(0)
    ref = T5ForConditionalGeneration(T5Config.from_preset("tiny"))
    fast = T5ForConditionalGeneration(T5Config.from_preset("tiny", residual_dtype="autocast"))
    fast.load_state_dict(ref.state_dict())
    x = torch.randint(2, 1000, (2, 12))
    y = torch.randint(2, 1000, (2, 5))
    seen = []
    for block in [*fast.encoder.block, *fast.decoder.block]:
        block.register_forward_hook(lambda m, args, out: seen.append(out[0].dtype))  # (h, FFN output)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fast = fast(x, labels=y).loss
        loss_ref = ref(x, labels=y).loss
    assert seen == [torch.bfloat16] * (len(fast.encoder.block) + len(fast.decoder.block))
    torch.testing.assert_close(loss_fast, loss_ref, rtol=2e-2, atol=0)
    seen.clear()
    assert torch.equal(fast(x, labels=y).loss, ref(x, labels=y).loss)
    assert seen and set(seen) == {torch.float32}
    with pytest.raises(ValueError, match="autocast"):
        T5Config.from_preset("tiny", residual_dtype="bf16")
