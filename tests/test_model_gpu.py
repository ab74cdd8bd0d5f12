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


@pytest.mark.parametrize("path", ["atomic", "kernel"])
@pytest.mark.parametrize("case", [c for c in CASES if c[3]], ids=str)
def test_other_bias_gradient_paths_match_math_fp32(case, path, monkeypatch):
    """The bias gradient by atomic adds from the dQ kernel and from the separate dbias kernel (the
    default, dS summed by torch, is in the test above), the other gradients unchanged."""
    monkeypatch.setattr(ta, "DBIAS_PATH", path)
    test_triton_matches_math_fp32(case)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_dq_from_stored_ds_matches_math(case, dtype, monkeypatch):
    """DQ_PATH "stored": the dK/dV kernel stores dS and dQ = dS K is computed from it, with and
    without a bias, masks and the causal diagonal; every gradient as under "recompute"."""
    monkeypatch.setattr(ta, "DQ_PATH", "stored")
    (test_triton_matches_math_fp32 if dtype == "fp32" else test_triton_matches_math_bf16)(case)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("case", [c for c in CASES if c[1] <= ta.SHORT_QUERIES], ids=str)
def test_short_queries_without_the_one_block_backward_match_math(case, dtype, monkeypatch):
    """ONE_BLOCK_BWD off: short queries take the dK/dV and dQ kernels of long ones (the tests above
    run the one-block kernel, the default, on these cases)."""
    monkeypatch.setattr(ta, "ONE_BLOCK_BWD", False)
    (test_triton_matches_math_fp32 if dtype == "fp32" else test_triton_matches_math_bf16)(case)


def test_compiled_attention_follows_the_switches_through_the_compile_caches(monkeypatch, compile_caches_on):
    """A switch read inside the op's launcher when torch.compile traces it (here ONE_BLOCK_BWD)
    changes the compiled kernels with AOTAutograd's and inductor's caches on: without
    `launch_settings()` in the op's arguments, the second compile below got the first one's kernels."""
    from torch.profiler import ProfilerActivity, profile


    def backward_kernels(one_block: bool) -> set:
        monkeypatch.setattr(ta, "ONE_BLOCK_BWD", one_block)
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


@pytest.mark.parametrize(
    "dq_path, relative", [("recompute", False), ("stored_bias", False), ("stored_bias", True)],
    ids=["recompute", "stored_bias", "stored_bias-relative"],
)  # fmt: skip
def test_model_triton_backend_matches_math_and_compiles_without_graph_breaks(dq_path, relative, monkeypatch):
    """relative: the kernels get the stacks' relative bias rows and sum their gradients per offset."""
    monkeypatch.setattr(ta, "DQ_PATH", dq_path)
    monkeypatch.setattr(ta, "RELATIVE_BIAS", relative)
    torch.manual_seed(0)
    config = T5Config.from_preset("tiny", attention_backend="math", num_layers=3)
    model = T5ForConditionalGeneration(config).cuda()
    ids = torch.randint(2, 32128, (3, 96), device="cuda")
    labels = torch.randint(2, 32128, (3, 40), device="cuda")
    am = torch.ones_like(ids)
    am[1, -20:] = 0
    dm = torch.ones_like(labels)
    dm[0, -7:] = 0
    labels = labels.masked_fill(dm == 0, -100)

    def run(backend, compiled=False):
        for m in model.modules():
            if hasattr(m, "backend"):
                m.backend = backend
        tg.ENABLED = tn.ENABLED = backend == "triton"  # the reference runs torch's GELU and norms too
        model.zero_grad()
        fn = lambda: model(ids, labels=labels, attention_mask=am, decoder_attention_mask=dm).loss  # noqa: E731
        loss = torch.compile(fn, fullgraph=True)() if compiled else fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    try:
        ref_loss, ref_grads = run("math")
        results = [run("triton", compiled) for compiled in (False, True)]
    finally:
        tg.ENABLED = tn.ENABLED = True
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


@pytest.mark.parametrize("causal", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_far_tiles_change_nothing(causal, dtype, monkeypatch):
    """FAR_TILES (every kernel) with T5's own bias at 512 x 512: tiles wholly beyond the saturation distance read
    one element instead of a tile; output and every gradient are the very same as with every tile read."""
    g = torch.Generator(device="cuda").manual_seed(1)
    b, s, h, d = 4, 512, 12, 64
    far = bias_saturation_distance(not causal)
    buckets = relative_position_bucket(torch.arange(-(s - 1), s, device="cuda"), not causal)
    bias = dense_bias(torch.randn(32, h, device="cuda", generator=g)[buckets].t(), s, s)
    qkv = torch.randn(b, s, 3 * h * d, device="cuda", generator=g).to(dtype)
    key_mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
    key_mask[0, 300:] = False
    dout = torch.randn(b, s, h * d, device="cuda", generator=g).to(dtype)
    results = []
    for far_tiles in (False, True):
        monkeypatch.setattr(ta, "FAR_TILES", ta.FAR_TILE_KERNELS if far_tiles else ())
        x, bb = qkv.clone().requires_grad_(), bias.clone().requires_grad_()
        out = packed_attention(x, None, h, bb, key_mask, causal, "triton", bias_far=far)
        out.backward(dout)
        results.append((out.detach(), x.grad, bb.grad))
    for name, dense_tiles, far_tiles in zip(("out", "dqkv", "dbias"), *results):
        assert torch.equal(dense_tiles, far_tiles), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_far_ds_sum_gives_the_bias_table_gradient(dtype, monkeypatch):
    """DS_SUM "far" with T5's encoder bias at 512 x 512 (padding in one row): it reads about half of dS
    and fills each row's larger far region from the rows' zero sums, so the dense bias gradient
    differs per element but the bucket table's gradient is that of the whole sum and of float64 math
    attention (fp32: 1e-4 of the largest; bf16: as close as the whole sum, within 2e-2)."""
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
        return bias.grad, tab.grad

    def math(x, bias):
        q, k, v = (t.unflatten(-1, (h, d)) for t in x.split(h * d, -1))
        return _math_attention(q, k, v, bias, key_mask, False, 0.0).flatten(2)

    def fused(x, bias):
        return packed_attention(x, None, h, bias, key_mask, False, "triton", bias_far=bias_saturation_distance(True))

    _, expected = grads(math, qkv, table)
    results = {}
    for how in ("kernel", "far"):
        monkeypatch.setattr(ta, "DS_SUM", how)
        results[how] = grads(fused, qkv.to(dtype), table.float())
    assert not torch.equal(results["far"][0], results["kernel"][0])  # the far sum skipped keys
    again = grads(fused, qkv.to(dtype), table.float())  # "far" again: one fixed order, bit-identical
    assert all(torch.equal(a, b) for a, b in zip(again, results["far"]))
    errors = {how: float((tab.double() - expected).abs().max() / expected.abs().max()) for how, (_, tab) in results.items()}
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

    On an H200 (Triton 3.6) the assumption in the dK/dV kernel's loop made the kernels with query
    blocks of 32 rows or fewer race without a bias: dK wrong (up to 0.16 relative) and different
    from run to run (docs/model_speed.md). That kernel now states it only for blocks of 64 rows or more."""
    b, sq, sk, with_bias, causal, one_block, tiles = case
    monkeypatch.setattr(ta, "ONE_BLOCK_BWD", one_block)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 512, False), (8, 114, True), (3, 77, False), (2, 300, True)], ids=str)
def test_relative_bias_gradient_equals_the_dense_ones_diagonal_sums(shape, dtype, monkeypatch):
    """The fused kernel given T5's relative bias row (bias_rel): the same output and q/k/v gradients
    as given its dense expansion, and as the row's gradient the dense gradient summed along each key -
    query offset (summed in the dQ-from-dS kernel at these tiles; autograd's scatter for the dense)."""
    b, s, causal = shape
    h, d = 12, 64
    assert ta.relative_grad_in_kernel(ta.tile_class(causal, True, s))
    g = torch.Generator(device="cuda").manual_seed(2)
    rel = torch.randn(h, 2 * s - 1, device="cuda", generator=g)
    qkv = torch.randn(b, s, 3 * h * d, device="cuda", generator=g).to(dtype)
    key_mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
    key_mask[0, s // 2 :] = False
    dout = torch.randn(b, s, h * d, device="cuda", generator=g).to(dtype)
    results = {}
    for relative in (False, True):
        monkeypatch.setattr(ta, "RELATIVE_BIAS", relative)
        x, r = qkv.clone().requires_grad_(), rel.clone().requires_grad_()
        out = packed_attention(x, None, h, dense_bias(r, s, s), key_mask, causal, "triton", bias_rel=r)
        out.backward(dout)
        results[relative] = (out.detach(), x.grad, r.grad)
    (out, dx, drel), (out_dense, dx_dense, drel_dense) = results[True], results[False]
    assert torch.equal(out, out_dense) and torch.equal(dx, dx_dense)
    largest = drel_dense.abs().max().item()
    torch.testing.assert_close(drel, drel_dense, rtol=1e-5, atol=1e-5 * largest)
