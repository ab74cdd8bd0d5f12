"""The fused Triton kernels (attention, gated GELU, residual add + RMS norm) against torch's ops on a
GPU (skipped without CUDA)."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from training.model import T5Config, T5ForConditionalGeneration
from training.model import triton_add_norm as tn
from training.model import triton_attention as ta
from training.model import triton_gated_gelu as tg
from training.model.attention import (
    _math_attention,
    bias_saturation_distance,
    dense_bias,
    packed_attention,
    relative_position_bucket,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ta.available(), reason="needs CUDA and triton"),
]


def _inputs(b, sq, sk, h, d, dtype, with_bias, with_mask, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, sk, h, d, device="cuda", generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, sk, h, d, device="cuda", generator=g).to(dtype).requires_grad_()
    bias = torch.randn(h, sq, sk, device="cuda", generator=g).requires_grad_() if with_bias else None
    mask = None
    if with_mask:
        mask = torch.ones(b, sk, dtype=torch.bool, device="cuda")
        mask[0, sk // 2 :] = False
        mask[-1, -3:] = False
    return q, k, v, bias, mask


def _grads(out, tensors, dout):
    return torch.autograd.grad(out, [t for t in tensors if t is not None], dout)


# (b, sq, sk, bias, mask, causal): encoder self, decoder self, cross-attention, odd sizes; every
# class of tiles (triton_attention.tile_class: short queries are at most 128 rows)
CASES = [
    (4, 512, 512, True, True, False),
    (4, 114, 114, True, True, True),
    (4, 114, 512, False, True, False),
    (3, 77, 77, True, False, True),
    (5, 200, 200, True, False, False),
    (2, 300, 300, True, False, True),
    (3, 200, 512, False, True, False),
    (2, 100, 100, True, True, False),
]


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_math_fp32(case):
    b, sq, sk, with_bias, with_mask, causal = case
    q, k, v, bias, mask = _inputs(b, sq, sk, 4, 64, torch.float32, with_bias, with_mask)
    ref = _math_attention(q, k, v, bias, mask, causal, 0.0)
    out = ta.t5_flash_attention(q, k, v, bias, mask, causal)
    dout = torch.randn_like(ref)
    for got, exp, name in zip(
        _grads(out, [q, k, v, bias], dout) + (out,), _grads(ref, [q, k, v, bias], dout) + (ref,), "qkvbo"
    ):
        scale = exp.abs().max()
        torch.testing.assert_close(
            got, exp, rtol=1e-4, atol=1e-4 * float(scale), msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", [c for c in CASES if c[1] <= ta.SHORT_QUERIES], ids=str)
def test_short_queries_past_the_one_block_tile_match_math(case, dtype, monkeypatch):
    """Short queries with a one-block tile smaller than them (as a tile sweep may set) take the
    dK/dV and dQ kernels of long ones, with the short classes' tiles (the tests above run the
    one-block kernel on these cases)."""
    for key in ta.ONE_BLOCK_TILES:
        monkeypatch.setitem(ta.ONE_BLOCK_TILES, key, ta.ONE_BLOCK_TILES[key]._replace(block_m=16))
    (test_triton_matches_math_fp32 if dtype == "fp32" else test_triton_matches_math_bf16)(case)


def test_compiled_attention_follows_the_tiles_through_the_compile_caches(monkeypatch, compile_caches_on):
    """A tile table read inside the op's launcher when torch.compile traces it (here the one-block
    kernel's, which decides whether 100 queries take it) changes the compiled kernels with
    AOTAutograd's and inductor's caches on: without `launch_settings()` in the op's arguments, the
    second compile below would get the first one's kernels."""
    from torch.profiler import ProfilerActivity, profile

    one_block_tiles = ta.ONE_BLOCK_TILES["cross-short"]

    def backward_kernels(one_block: bool) -> set:
        tiles = one_block_tiles if one_block else one_block_tiles._replace(block_m=64)
        monkeypatch.setitem(ta.ONE_BLOCK_TILES, "cross-short", tiles)
        torch._dynamo.reset()
        attend = torch.compile(
            lambda q, kv: ta.t5_flash_attention_packed(q, kv, 4, None, None, False), fullgraph=True
        )
        q = torch.randn(2, 100, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.randn(2, 200, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        attend(q, kv).sum().backward()  # compiles
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            attend(q, kv).sum().backward()
            torch.cuda.synchronize()
        return {e.key for e in prof.key_averages() if "_bwd_" in e.key}

    try:
        first, second, third = backward_kernels(True), backward_kernels(False), backward_kernels(True)
    finally:
        torch._dynamo.reset()
    assert any("one_block" in k for k in first) and not any("dkdv" in k for k in first), first
    assert any("dkdv" in k for k in second) and not any("one_block" in k for k in second), second
    assert third == first


@pytest.mark.parametrize("module, name, values, kernel", [
    (tn, "FWD_ROWS", (4, 8), "_add_rms_norm_fwd_kernel"),
    (tg, "BLOCK", (1024, 512), "_gated_gelu_fwd_kernel"),
])  # fmt: skip
def test_compiled_add_norm_and_gelu_follow_their_tiles_through_the_compile_caches(
    monkeypatch, compile_caches_on, tmp_path, module, name, values, kernel
):
    """The residual add + RMS norm and the gated GELU ops, compiled with the caches on, launch with
    the tiles their module holds at each compile (seen in each launch's grid): without their
    `launch_settings()` argument the second compile below would get the first one's kernel."""
    import json

    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(0)
    h, out = (torch.randn(64, 768, device="cuda", generator=g) for _ in range(2))
    weight = torch.rand(768, device="cuda", generator=g)
    packed = torch.randn(8, 4096, device="cuda", generator=g).bfloat16()

    def run() -> torch.Tensor:
        if module is tn:
            return tn.add_rms_norm(h, out, weight, 1e-6)[1]
        return tg.gated_gelu_packed(packed)

    def grids(value: int) -> list:
        monkeypatch.setattr(module, name, value)
        torch._dynamo.reset()
        compiled = torch.compile(run, fullgraph=True)
        compiled()  # compiles
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled()
            torch.cuda.synchronize()
        trace = tmp_path / f"{name}-{value}.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        return [e["args"]["grid"] for e in events if e.get("cat") == "kernel" and kernel in e["name"]]

    try:
        first, second, third = grids(values[0]), grids(values[1]), grids(values[0])
    finally:
        torch._dynamo.reset()
    assert first and second and first != second, (first, second)
    assert third == first


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_math_bf16(case):
    b, sq, sk, with_bias, with_mask, causal = case
    q, k, v, bias, mask = _inputs(b, sq, sk, 12, 64, torch.bfloat16, with_bias, with_mask)
    # Reference in fp32 from the same bf16 inputs; the kernel rounds P and dS to bf16 (like FlashAttention).
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _math_attention(q32, k32, v32, bias, mask, causal, 0.0)
    out = ta.t5_flash_attention(q, k, v, bias, mask, causal)
    dout = torch.randn_like(ref)
    got = _grads(out, [q, k, v, bias], dout.to(out.dtype)) + (out,)
    exp = _grads(ref, [q32, k32, v32, bias], dout) + (ref,)
    for g, e, name in zip(got, exp, "qkvbo"):
        err = (g.float() - e).norm() / e.norm()
        assert err < 2e-2, f"{name}: relative error {err:.3e}"


# (input length, target length): every attention's queries in one tile (the one-block backward), and
# longer ones (the dK/dV kernel with dQ from the stored dS in the encoder and the decoder, recomputed
# in the cross-attention)
MODEL_LENGTHS = [(96, 40), (200, 150)]


@pytest.mark.parametrize("layout", ["auto", "row"])
@pytest.mark.parametrize("lengths", MODEL_LENGTHS, ids=str)
def test_model_triton_backend_matches_math_and_compiles_without_graph_breaks(lengths, layout, monkeypatch):
    """The tiny model with the triton backend, eager and compiled with fullgraph=True, against the
    math backend with torch's GELU and norms (the Triton GELU and add + norm ops turned off for the
    reference run): loss and every parameter's gradient. `layout` "row": the stacks hand the fused
    attention its bias as the relative row (T5Config.attention_bias_layout, as at long inputs)."""
    inputs, targets = lengths
    torch.manual_seed(0)
    config = T5Config.from_preset("tiny", attention_backend="math", num_layers=3)
    model = T5ForConditionalGeneration(config).cuda()
    ids = torch.randint(2, 32128, (3, inputs), device="cuda")
    labels = torch.randint(2, 32128, (3, targets), device="cuda")
    am = torch.ones_like(ids)
    am[1, -20:] = 0
    dm = torch.ones_like(labels)
    dm[0, -7:] = 0
    labels = labels.masked_fill(dm == 0, -100)
    ops = tg._OP, tn._OP

    def run(backend, compiled=False):
        for m in model.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        config.attention_backend, config.attention_bias_layout = backend, layout
        # the reference runs torch's GELU and norms too
        tg._OP, tn._OP = ops if backend == "triton" else (None, None)
        model.zero_grad()
        fn = lambda: model(ids, labels=labels, attention_mask=am, decoder_attention_mask=dm).loss  # noqa: E731
        loss = torch.compile(fn, fullgraph=True)() if compiled else fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    try:
        ref_loss, ref_grads = run("math")
        results = [run("triton", compiled) for compiled in (False, True)]
    finally:
        tg._OP, tn._OP = ops
        torch._dynamo.reset()
    for loss, grads in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
        for name, g in grads.items():
            e = ref_grads[name]
            torch.testing.assert_close(
                g, e, rtol=1e-3, atol=1e-3 * float(e.abs().max()), msg=lambda m, n=name: n + m
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gated_gelu_kernel_matches_torch(dtype, compiled):
    """[gate | lin] -> gelu_tanh(gate) * lin and its (..., 2F) gradient, against torch's ops; a
    d_ff with a partial column block (1500) and T5-base's 2048."""
    for f in (1500, 2048):
        g = torch.Generator(device="cuda").manual_seed(f)
        h = (3 * torch.randn(3, 37, 2 * f, device="cuda", generator=g)).to(dtype).requires_grad_()
        dout = torch.randn(3, 37, f, device="cuda", generator=g).to(dtype)
        assert tg.kernel_applies(h)
        fn = torch.compile(tg.gated_gelu_packed, fullgraph=True) if compiled else tg.gated_gelu_packed
        out = fn(h)
        (dh,) = torch.autograd.grad(out, h, dout)
        h32 = h.detach().float().requires_grad_()
        ref = tg.gated_gelu_reference(h32)
        (ref_dh,) = torch.autograd.grad(ref, h32, dout.float())
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(out.float(), ref, **tol)
        torch.testing.assert_close(dh.float(), ref_dh, **tol)


# (h, out, weight, y) dtypes: the model under autocast (fp32 residual, bf16 sublayer output, y for a
# linear), all fp32, the bf16 residual, bf16 weights (DeepSpeed's bf16 mode)
ADD_NORM_DTYPES = [
    (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float32, torch.float32, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.parametrize("dtypes", ADD_NORM_DTYPES, ids=["autocast", "fp32", "bf16residual", "bf16weight"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_add_rms_norm_kernel_matches_torch(dtypes, compiled):
    """(h + out, rms_norm(h + out)) and the gradients of h, out and the weight, against torch's
    autograd of the same ops on the same inputs; T5-base's 768 columns (a partial 1024 block) and an
    odd width, with and without a gradient from a later add."""
    h_dtype, out_dtype, w_dtype, y_dtype = dtypes
    for shape in ((3, 37, 768), (1000, 200)):
        for with_dres in (True, False):
            g = torch.Generator(device="cuda").manual_seed(shape[-1])
            h = (3 * torch.randn(shape, device="cuda", generator=g)).to(h_dtype).requires_grad_()
            out = torch.randn(shape, device="cuda", generator=g).to(out_dtype).requires_grad_()
            w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)).to(w_dtype).requires_grad_()
            assert tn.kernel_applies(h)
            fn = torch.compile(tn.add_rms_norm, fullgraph=True) if compiled else tn.add_rms_norm
            results = []
            for f in (fn, tn.add_rms_norm_reference):
                h_new, y = f(h, out, w, 1e-6, y_dtype)
                dy = torch.randn(shape, device="cuda", generator=g.manual_seed(1)).to(y.dtype)
                grads_out = [y, h_new] if with_dres else [y]
                dres = [torch.randn(shape, device="cuda", generator=g).to(h_new.dtype)] if with_dres else []
                grads = torch.autograd.grad(grads_out, [h, out, w], [dy, *dres])
                results.append((h_new, y, *grads))
            for name, got, ref in zip(("h + out", "y", "dh", "dout", "dweight"), *results):
                assert got.dtype == ref.dtype, name
                exact = got.dtype == torch.float32 and w_dtype == torch.float32
                # bf16: errors of the largest value's rounding (the reference rounds each product
                # of a bf16 weight's gradient to bf16 before summing; the kernel sums in fp32)
                largest = float(ref.abs().max())
                tol = (
                    dict(rtol=1e-5, atol=1e-5 * largest) if exact else dict(rtol=1.6e-2, atol=1e-2 * largest)
                )
                torch.testing.assert_close(got, ref, **tol, msg=lambda m, n=f"{name} {shape}": f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_far_ds_sum_gives_the_bias_table_gradient(dtype):
    """The encoder's bias gradient given T5's far distance, at 512 x 512 (padding in one row): the
    batch sum reads about half of dS and fills each row's larger far region from the rows' zero sums,
    so the dense bias gradient differs per element from the whole sum's (no distance given) but the
    bucket table's gradient is that of the whole sum and of float64 math attention (fp32: 1e-4 of
    the largest; bf16: as close as the whole sum, within 2e-2). Given the distance, the source
    gradients are the very same."""
    g = torch.Generator(device="cuda").manual_seed(2)
    b, s, h, d = 4, 512, 12, 64
    buckets = relative_position_bucket(torch.arange(-(s - 1), s, device="cuda"), True)
    table = torch.randn(32, h, device="cuda", generator=g, dtype=torch.float64)
    qkv = torch.randn(b, s, 3 * h * d, device="cuda", generator=g, dtype=torch.float64)
    key_mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
    key_mask[0, 300:] = False
    dout = torch.randn(b, s, h * d, device="cuda", generator=g, dtype=torch.float64)

    def grads(attention, x, tab):
        x, tab = x.clone().requires_grad_(), tab.clone().requires_grad_()
        bias = dense_bias(tab[buckets].t(), s, s)
        bias.retain_grad()
        attention(x, bias).backward(dout.to(x.dtype))
        return bias.grad, tab.grad, x.grad

    def math(x, bias):
        q, k, v = (t.unflatten(-1, (h, d)) for t in x.split(h * d, -1))
        return _math_attention(q, k, v, bias, key_mask, False, 0.0).flatten(2)

    def fused(far):
        return lambda x, bias: packed_attention(x, None, h, bias, key_mask, False, "triton", bias_far=far)

    _, expected, _ = grads(math, qkv, table)
    results = {
        how: grads(fused(far), qkv.to(dtype), table.float())
        for how, far in (("kernel", 0), ("far", bias_saturation_distance(True)))
    }
    assert not torch.equal(results["far"][0], results["kernel"][0])  # the far sum skipped keys
    assert torch.equal(results["far"][2], results["kernel"][2])
    again = grads(fused(bias_saturation_distance(True)), qkv.to(dtype), table.float())  # one fixed order
    assert all(torch.equal(a, b) for a, b in zip(again, results["far"]))
    errors = {how: float((tab.double() - expected).abs().max() / expected.abs().max()) for how, (_, tab, _) in results.items()}
    print(f"bucket table gradient, largest error of the largest value, {dtype}: {errors}")
    if dtype == torch.float32:
        assert errors["far"] < 1e-4, errors
    else:
        assert errors["far"] < 2e-2 and errors["far"] < 2 * errors["kernel"] + 1e-3, errors


def _kernels_without_assume(tmp_path):
    """The attention kernels' module with every `tl.assume` taken out. ptxas then serializes their
    wgmma (each waits for the one before), so no race between them survives: the reference the
    kernels must equal bit for bit."""
    from training.model import triton_attention_kernels

    source, n = re.subn(r"tl\.assume\([^)]*\)", "pass", Path(triton_attention_kernels.__file__).read_text())
    assert n >= 5, "the kernels' loops state their trip counts with tl.assume"
    path = tmp_path / "kernels_without_assume.py"
    path.write_text(source)  # triton reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location("kernels_without_assume", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (b, sq, sk, bias, causal, the one-block backward, dK/dV tiles): thin query blocks of the dK/dV
# kernel (cross-attention, no bias: the case that raced), long queries in them, the decoder's table
# entry, and the one-block kernel's query blocks of 16 and 32 rows
ASSUME_CASES = [
    (4, 114, 512, False, False, False, (32, 128, 4, 3)),
    (4, 114, 512, False, False, False, (16, 128, 4, 3)),
    (4, 114, 512, False, False, False, (32, 64, 4, 3)),
    (2, 300, 512, False, False, False, (32, 128, 4, 3)),
    (4, 114, 512, False, False, False, (64, 128, 4, 3)),
    (4, 114, 114, True, True, False, (32, 32, 4, 2)),
    (8, 10, 512, False, False, True, None),
    (8, 20, 20, True, True, True, None),
]


@pytest.mark.parametrize("case", ASSUME_CASES, ids=str)
def test_loop_assumptions_change_no_bit(case, tmp_path, monkeypatch):
    """bf16 output and gradients, twice, equal those of the same kernels without `tl.assume`.

    On an H200 (Triton 3.6) the assumption in the dK/dV kernel's loop makes the kernels with query
    blocks of 32 rows or fewer race without a bias: dK wrong (up to 0.16 relative) and different
    from run to run. That kernel states it only for blocks of 64 rows or more. Short queries take the
    dK/dV kernel where the case says so (a one-block tile smaller than them)."""
    b, sq, sk, with_bias, causal, one_block, tiles = case
    key = ta.tile_class(causal, with_bias, sq)
    if not one_block and key in ta.ONE_BLOCK_TILES:
        monkeypatch.setitem(ta.ONE_BLOCK_TILES, key, ta.ONE_BLOCK_TILES[key]._replace(block_m=16))
    assert ta.one_block_applies(key, sq) == one_block
    if tiles is not None:
        monkeypatch.setitem(ta.DKDV_TILES, ta.tile_class(causal, with_bias, sq), ta.Tiles(*tiles))
    g = torch.Generator(device="cuda").manual_seed(0)
    h, d = 12, 64
    q, k, v = (torch.randn(b, n, h, d, device="cuda", generator=g).to(torch.bfloat16) for n in (sq, sk, sk))
    bias = torch.randn(h, sq, sk, device="cuda", generator=g) if with_bias else None
    mask = torch.ones(b, sk, dtype=torch.bool, device="cuda")
    mask[0, sk // 2 :] = False
    mask[-1, -3:] = False
    dout = torch.randn(b, sq, h, d, device="cuda", generator=g).to(torch.bfloat16)

    def run():
        inputs = [t.clone().requires_grad_() for t in (q, k, v, bias) if t is not None]
        out = ta.t5_flash_attention(*inputs[:3], inputs[3] if with_bias else None, mask, causal)
        return (out, *torch.autograd.grad(out, inputs, dout))

    results = [run(), run()]
    import triton

    # every kernel the launchers call, so that an assumption added to any of them is checked too
    for name, kernel in vars(_kernels_without_assume(tmp_path)).items():
        if isinstance(kernel, triton.runtime.JITFunction) and hasattr(ta, name):
            monkeypatch.setattr(ta, name, kernel)
    expected = run()
    for got in results:
        for name, x, e in zip(("out", "dq", "dk", "dv", "dbias"), got, expected):
            assert torch.equal(x, e), f"{name}: max difference {float((x.float() - e.float()).abs().max()):.3e}"


@pytest.mark.parametrize("s, causal", [(4096, False), (2304, True)], ids=["encoder-4096", "decoder-2304"])
def test_row_bias_matches_the_dense_bias_at_long_inputs(s, causal):
    """T5's bias handed to the fused attention as its (heads, 2 s - 1) row (`attention.
    row_bias_applies`: the kernels read it along the diagonals, the backward stores no dS) and the
    same bias expanded (the dense path), bf16, T5 base's heads, padding in one row, both against
    float64 math attention on the same bf16-rounded inputs: out, the source gradients and the bucket
    table's gradient within 2e-2 of the largest value and at most twice the dense path's error
    (+1e-3); the row path's results bit-identical from run to run."""
    g = torch.Generator(device="cuda").manual_seed(4)
    b, h, d = 2, 12, 64
    buckets = relative_position_bucket(torch.arange(-(s - 1), s, device="cuda"), not causal)
    table = torch.randn(32, h, device="cuda", generator=g, dtype=torch.float64)
    qkv = torch.randn(b, s, 3 * h * d, device="cuda", generator=g, dtype=torch.float64)
    key_mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
    key_mask[0, s - 700 :] = False
    dout = torch.randn(b, s, h * d, device="cuda", generator=g, dtype=torch.float64)
    far = bias_saturation_distance(not causal)

    def math(x, bias):
        q, k, v = (t.unflatten(-1, (h, d)) for t in x.split(h * d, -1))
        return _math_attention(q, k, v, dense_bias(bias, s, s), key_mask, causal, 0.0).flatten(2)

    def fused(expand: bool):
        def attention(x, row):
            bias = dense_bias(row, s, s) if expand else row
            return packed_attention(x, None, h, bias, key_mask, causal, "triton", bias_far=far)

        return attention

    def run(attention, dtype):
        # copies: .to() of the dtype a tensor has is the tensor itself, which requires_grad_ would change
        x = qkv.to(dtype, copy=True).requires_grad_()
        tab = table.to(torch.promote_types(dtype, torch.float32), copy=True).requires_grad_()
        out = attention(x, tab[buckets].t())
        out.backward(dout.to(dtype))
        return out.detach(), x.grad, tab.grad

    # the reference sees the kernels' inputs: q, k, v and dO rounded to bf16 as the fused runs take them
    qkv, dout = qkv.to(torch.bfloat16).double(), dout.to(torch.bfloat16).double()
    expected = run(math, torch.float64)
    dense, row, again = run(fused(True), torch.bfloat16), run(fused(False), torch.bfloat16), run(fused(False), torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(row, again))
    errors = {name: [float((t.double() - ref).abs().max() / ref.abs().max()) for t in (got, base)]
              for name, got, base, ref in zip(("out", "dq|dk|dv", "bucket table gradient"), row, dense, expected)}
    print(f"{s} causal={causal}, largest error of the largest value, row / dense: {errors}")
    assert all(e[0] < 2e-2 and e[0] < 2 * e[1] + 1e-3 for e in errors.values()), errors
