"""training/model/triton_access_cache.py: torch's analysis of which tensors a Triton kernel writes,
memoised per kernel specialization; the same answers as torch's own over a whole T5 step."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from training.model import triton_access_cache

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs the triton package (pip install triton)"
)


@pytest.fixture
def stub_analysis(monkeypatch):
    """torch's analysis replaced by a stub that counts its calls (and answers a fresh list each time),
    then memoised; torch's own restored afterwards."""
    import torch._higher_order_ops.triton_kernel_wrap as kernel_wrap

    calls = []

    def identify_accessed_tensors(kernel, kwargs, tma_descriptor_metadata):
        calls.append(kwargs)
        return ["written"]

    monkeypatch.setattr(kernel_wrap, "identify_accessed_tensors", identify_accessed_tensors)
    assert triton_access_cache.install()
    assert triton_access_cache.install()  # idempotent: not memoised twice
    assert kernel_wrap.identify_accessed_tensors.__wrapped__ is identify_accessed_tensors
    yield kernel_wrap.identify_accessed_tensors, calls
    triton_access_cache.uninstall()
    assert kernel_wrap.identify_accessed_tensors is identify_accessed_tensors


def test_one_analysis_per_kernel_specialization(stub_analysis):
    """A launch of the same kernel with traced tensors of the same dtypes and the same other values
    reuses the answer; a new dtype or value, a real tensor, a TMA descriptor or another package's
    kernel is analysed again."""
    import triton
    from triton.runtime.autotuner import Autotuner

    from training.model.triton_add_norm import _add_rms_norm_fwd_kernel as kernel

    analysis, calls = stub_analysis
    with FakeTensorMode():
        fp32, fp32_again, bf16 = torch.empty(8), torch.empty(16), torch.empty(8, dtype=torch.bfloat16)
    answer = analysis(kernel, {"H": fp32, "n_rows": 8, "eps": 1e-6}, {})
    answer.append("changed by its caller")
    assert analysis(kernel, {"H": fp32_again, "n_rows": 8, "eps": 1e-6}, {}) == ["written"]  # a copy
    assert len(calls) == 1
    for kwargs, tma in [({"H": bf16, "n_rows": 8, "eps": 1e-6}, {}), ({"H": fp32, "n_rows": 9, "eps": 1e-6}, {}),
                        ({"H": fp32, "n_rows": True, "eps": 1e-6}, {}), ({"H": fp32, "n_rows": 8, "eps": 1e-5}, {}),
                        ({"H": fp32, "n_rows": 8, "eps": 1e-6}, {"H": ("stable", ([8],))})]:  # fmt: skip
        analysis(kernel, kwargs, tma)
        analysis(kernel, kwargs, tma)
    assert len(calls) == 1 + 4 + 2  # each new specialization once; the TMA launch each time
    real = {"H": torch.empty(8), "n_rows": 8, "eps": 1e-6}  # its address's alignment specialises the kernel
    analysis(kernel, real, {})
    analysis(kernel, real, {})
    assert len(calls) == 9

    # torch wraps a launch given num_warps in a new single-config Autotuner: the same settings, one answer
    def wrapped(num_warps):
        return Autotuner(kernel, kernel.arg_names, [triton.Config({}, num_warps=num_warps)], [], None, None)

    kwargs = {"H": fp32, "n_rows": 8, "eps": 1e-6}
    analysis(wrapped(4), kwargs, {})
    analysis(wrapped(4), kwargs, {})
    analysis(wrapped(8), kwargs, {})
    assert len(calls) == 11

    @triton.jit
    def elsewhere(x_ptr):  # a kernel of this test module, not of the training package: torch's own
        pass

    analysis(elsewhere, {"x_ptr": fp32}, {})
    analysis(elsewhere, {"x_ptr": fp32}, {})
    assert len(calls) == 13


def test_install_leaves_an_analysis_of_another_signature_alone(monkeypatch):
    import torch._higher_order_ops.triton_kernel_wrap as kernel_wrap

    def identify_accessed_tensors(kernel, kwargs):
        return []

    monkeypatch.setattr(kernel_wrap, "identify_accessed_tensors", identify_accessed_tensors)
    assert not triton_access_cache.install()
    assert kernel_wrap.identify_accessed_tensors is identify_accessed_tensors
    monkeypatch.delattr(kernel_wrap, "identify_accessed_tensors")
    monkeypatch.delattr(kernel_wrap, "identify_mutated_tensors", raising=False)
    assert triton_access_cache.analysis_name() is None
    assert not triton_access_cache.install()


def test_install_memoises_the_analysis_of_torch_before_2_13(monkeypatch):
    """Before torch 2.13 the analysis is `identify_mutated_tensors`, with the same arguments; inductor
    looks it up on the module at each call, so memoising it there reaches every caller."""
    import torch._higher_order_ops.triton_kernel_wrap as kernel_wrap

    from training.model.triton_add_norm import _add_rms_norm_fwd_kernel as kernel

    calls = []

    def identify_mutated_tensors(kernel, kwargs, tma_descriptor_metadata):
        calls.append(kwargs)
        return ["written"]

    monkeypatch.delattr(kernel_wrap, "identify_accessed_tensors", raising=False)
    monkeypatch.setattr(kernel_wrap, "identify_mutated_tensors", identify_mutated_tensors, raising=False)
    assert triton_access_cache.analysis_name() == "identify_mutated_tensors"
    try:
        assert triton_access_cache.install()
        with FakeTensorMode():
            kwargs = {"H": torch.empty(8), "n_rows": 8, "eps": 1e-6}
        assert kernel_wrap.identify_mutated_tensors(kernel, kwargs, {}) == ["written"]
        assert kernel_wrap.identify_mutated_tensors(kernel, kwargs, {}) == ["written"]
        assert len(calls) == 1
    finally:
        triton_access_cache.uninstall()
    assert kernel_wrap.identify_mutated_tensors is identify_mutated_tensors


def test_a_t5_step_traces_with_the_same_writes_and_fewer_analyses():
    """AOTAutograd's trace of a T5 step through the Triton kernels (tools/triton_access_trace.py):
    every launch writes the same tensors with the analysis memoised as with torch's own, for a
    fraction of the analyses."""
    from tools.triton_access_trace import trace_step

    memoised = trace_step("tiny", batch=2, inputs=64, targets=16, cache=True)
    torch_own = trace_step("tiny", batch=2, inputs=64, targets=16, cache=False)
    assert memoised["launches"] == torch_own["launches"] > 20
    assert [w for _, w in memoised["writes"]] == [w for _, w in torch_own["writes"]]
    assert all(w for _, w in memoised["writes"])  # every launch writes its outputs
    assert memoised["analysis_calls"] < torch_own["analysis_calls"] / 2


def test_the_models_compile_memoises_the_analysis(monkeypatch):
    """compile_forward (like every compile of the model, through compile_options) installs it."""
    import torch._higher_order_ops.triton_kernel_wrap as kernel_wrap

    from training.compile_settings import compile_forward

    name = triton_access_cache.analysis_name()
    triton_access_cache.uninstall()
    assert not hasattr(getattr(kernel_wrap, name), "answers")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    try:
        compile_forward(torch.nn.Linear(2, 2))
        assert hasattr(getattr(kernel_wrap, name), "answers")
    finally:
        triton_access_cache.uninstall()


def test_the_trace_tool_prints_its_figures(capsys):
    from tools.triton_access_trace import main

    main(["--preset", "tiny", "--batch", "2", "--inputs", "32", "--targets", "8", "--no-cache"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("T5 tiny, torch analysis: trace ") and line.endswith(" Triton launches"), line
