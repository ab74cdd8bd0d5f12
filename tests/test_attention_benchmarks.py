"""The attention micro-benchmarks' CPU-testable parts: their refusals, the rows they time and compare,
and what they hand the kernels (benchmarks/attention_*.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("chunks, says", [("0,x", "comma list of integers"), ("4,200", "1..128"), ("-1", "1..128")])
def test_attention_batch_chunks_refuses_sizes_the_batch_cannot_take(chunks, says):
    r = subprocess.run([sys.executable, "benchmarks/attention_batch_chunks.py", "--chunks", chunks],
                       cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and says in r.stderr, r.stderr[-500:]


def test_attention_outputs_names_what_differs_and_says_what_it_needs(tmp_path):
    """`attention_outputs.py`: per case, the tensors not bit-identical to another checkout's (a case
    that file lacks counts as all different; None matches only None); without a GPU it says what it
    needs, and a missing --against file is named before any work."""
    from benchmarks.attention_outputs import NAMES, differing

    a, b = torch.arange(6.0), torch.arange(6.0)
    old = {"enc 512x512": [a, a, None, a], "dec 114x114": [a, a, None, a]}
    new = {"enc 512x512": [b, b, None, b], "dec 114x114": [b, b + 1e-7, a, b], "cross 114x512": [b, b, b, None]}
    assert differing(new, old) == {"enc 512x512": [], "dec 114x114": ["dq_src", "dkv_src"], "cross 114x512": list(NAMES)}
    script = [sys.executable, "benchmarks/attention_outputs.py", str(tmp_path / "new.pt")]
    r = subprocess.run([*script, "--against", str(tmp_path / "old.pt")], cwd=REPO, capture_output=True, text=True)
    assert r.returncode != 0 and "old.pt: no such file" in r.stderr, r.stderr[-500:]
    if not torch.cuda.is_available():
        r = subprocess.run(script, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "needs triton and a CUDA GPU" in r.stderr, r.stderr[-500:]
    r = subprocess.run([sys.executable, "benchmarks/attention_backends.py", "--far-tiles", "bwd"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "--far-tiles: unknown kernel 'bwd'" in r.stderr, r.stderr[-500:]


def test_attention_benchmarks_time_a_row_or_print_why_not(monkeypatch, capsys):
    """`attention_backends.timed_row` (both attention benchmarks' rows): the backward is the forward +
    backward less the forward, TFLOP/s from the case's FLOPs, errors against the reference row's
    outputs, one line per kernel with --kernels; a build that raises is its row's text, no outputs."""
    import benchmarks.attention_backends as ab

    times = {"fwd": 2.0, "fwd_bwd": 7.0}  # GPU ms per call, as the profiler would give them
    monkeypatch.setattr(ab, "kernel_ms", lambda fn, iters: times[fn.__name__])
    monkeypatch.setattr(ab, "kernel_table", lambda fn, iters: {"_fwd_kernel": 2.0, "_bwd_kernel": 5.0})
    case = argparse.Namespace(flops=lambda: 4e9)

    def fwd():
        pass

    def fwd_bwd():
        pass

    ref = (torch.ones(4), torch.ones(4), None, None)
    outputs = (torch.full((4,), 1.5), torch.ones(4), None, None)
    got = ab.timed_row("enc", "fa4", lambda: (fwd, fwd_bwd, outputs), case, ref, iters=3, kernels=True)
    assert got is outputs
    row, *kernel_rows = capsys.readouterr().out.strip().splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["enc", "fa4"] and cells[3:8] == ["2.000", "5.000", "7.000", "2", "2"]
    assert cells[8:] == ["5.0e-01", "0.0e+00", "-", "-"]
    assert [r.split("|")[2].strip() for r in kernel_rows] == ["_fwd_kernel", "_bwd_kernel"]

    def refuses():
        raise RuntimeError("flash attention takes no bias")

    assert ab.timed_row("dec", "sdpa-flash", refuses, case, ref, iters=3, kernels=True) is None
    assert capsys.readouterr().out == "| dec | sdpa-flash | RuntimeError: 'flash attention takes no bias' |\n"


def test_attention_benchmark_rows_compare_with_the_triton_row_of_the_same_bias_and_skip_what_a_shape_lacks(
    monkeypatch,
):
    """Rows that drop the bias (`without_bias`) are compared with `triton-nobias`, the others with
    `triton`; in the cross-attention, which has no bias, every row with `triton`."""
    import benchmarks.attention_backends as ab

    biases = {"enc": torch.ones(2, 3, 3), "cross": torch.empty(0)}
    monkeypatch.setattr(ab, "Case", lambda name, *sizes: argparse.Namespace(name=name, bias=biases[name]))
    seen = []
    monkeypatch.setattr(ab, "timed_row", lambda name, label, build, case, ref, iters, kernels:
                        seen.append((name, label, build(), ref)) or f"{name} {label} outputs")  # fmt: skip
    args = argparse.Namespace(batch_size=2, heads=2, d_kv=8, iters=1, kernels=False)
    no_row = {("cross", "fa4-bias"), ("cross", "triton-nobias")}
    builder = lambda case, label: None if (case.name, label) in no_row else (lambda: f"{case.name} {label}")  # noqa: E731
    labels = ["triton", "fa4-bias", "triton-nobias", "fa4", "sdpa"]
    ab.run_rows(args, ["enc", "cross"], labels, builder, without_bias=("triton-nobias", "fa4"))
    assert seen == [
        ("enc", "triton", "enc triton", None), ("enc", "fa4-bias", "enc fa4-bias", "enc triton outputs"),
        ("enc", "triton-nobias", "enc triton-nobias", None),  # the first row without the bias: no errors
        ("enc", "fa4", "enc fa4", "enc triton-nobias outputs"), ("enc", "sdpa", "enc sdpa", "enc triton outputs"),
        ("cross", "triton", "cross triton", None), ("cross", "fa4", "cross fa4", "cross triton outputs"),
        ("cross", "sdpa", "cross sdpa", "cross triton outputs"),
    ]  # fmt: skip
    seen.clear()  # the default: only `triton-nobias` drops the bias, so `fa4` is held against `triton`
    ab.run_rows(args, ["enc"], ["triton", "triton-nobias", "fa4"], builder)
    assert [ref for *_, ref in seen] == [None, None, "enc triton outputs"]


def test_attention_benchmark_nobias_row_drops_only_the_bias(monkeypatch):
    """`triton-nobias` runs the case's own inputs without its bias (and without far tiles, which
    need one); a case without a bias (the cross-attention) has no such row."""
    import benchmarks.attention_backends as ab

    case = argparse.Namespace(q_src=torch.ones(2, 3), kv_src=torch.empty(0), bias=torch.ones(2, 3, 3),
                              rel=torch.ones(2, 5), far=91)  # fmt: skip
    plain = ab.without_bias(case)
    assert plain.q_src is case.q_src and plain.kv_src is case.kv_src
    assert plain.bias.numel() == plain.rel.numel() == plain.far == 0
    assert case.bias.shape == (2, 3, 3) and case.far == 91  # the case itself keeps its bias
    monkeypatch.setattr(ab, "run_model_path", lambda c, backend, compiled: (c.bias.numel(), backend, compiled))
    builders = []
    monkeypatch.setattr(ab, "run_rows", lambda args, shapes, labels, builder: builders.append(builder))
    ab.run_table(argparse.Namespace(compile=True), ["enc"], ["triton-nobias"])
    (builder,) = builders
    assert builder(case, "triton-nobias")() == (0, "triton", True)  # the model's path, the bias dropped
    assert builder(plain, "triton-nobias") is None  # no bias to drop: no row


def test_fa4_benchmark_hands_fa4_head_views_of_the_packed_sources():
    """FA4 reads (batch, seq, heads, d_kv) views of the model's packed projection outputs and writes
    its gradients through such views into packed buffers: no copies either way."""
    from benchmarks.attention_fa4 import fa4_views

    packed = torch.arange(2 * 3 * 3 * 4 * 8, dtype=torch.float32).view(2, 3, 3 * 4 * 8)  # [q | k | v]
    q, k, v = fa4_views(packed, packed.new_empty((0,)), heads=4)
    assert q.shape == k.shape == v.shape == (2, 3, 4, 8)
    assert all(t.data_ptr() - packed.data_ptr() == i * 32 * 4 for i, t in enumerate((q, k, v)))
    assert torch.equal(v[1, 2, 3], packed[1, 2, 2 * 32 + 3 * 8 : 2 * 32 + 4 * 8])
    before = packed.clone()
    v.zero_()  # a write through the view lands in the packed tensor's v columns, and only there
    assert not packed[..., 64:].any() and torch.equal(packed[..., :64], before[..., :64])


@pytest.mark.parametrize(
    "argv, runs",
    [([], "dqds"), (["--no-bias"], "dq"), (["--dq-path", "recompute"], "dq"), (["--dq-path", "stored", "--no-bias"], "dqds")],
)
def test_attention_tiles_refuses_a_dq_kernel_the_backward_does_not_run(argv, runs):
    """The sweep times the whole backward: naming the dQ kernel that these settings do not run would
    time nothing that changes, so it stops before any GPU work and names the one that runs."""
    other = {"dq": "dqds", "dqds": "dq"}[runs]
    r = subprocess.run([sys.executable, "benchmarks/attention_tiles.py", "--kernels", f"dkdv,{other}", *argv],
                       cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and f"the backward runs {runs}, not {other}" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize(
    "argv, says",
    [(["--shape", "dec", "--kernels", "dkdv"], "add --no-one-block"),
     (["--shape", "cross", "--kernels", "fwd,dq"], "add --no-one-block"),
     (["--kernels", "oneblock"], "only with at most 128 queries"),
     (["--shape", "dec", "--no-one-block", "--kernels", "oneblock"], "without --no-one-block"),
     (["--shape", "dec", "--lengths", "512,512", "--kernels", "oneblock"], "only with at most 128 queries")],
)  # fmt: skip
def test_attention_tiles_refuses_kernels_the_one_block_backward_does_not_run(argv, says):
    """Where the queries fit one block the backward is the one-block kernel alone: sweeping the
    dK/dV or dQ kernel there would time nothing that changes, and so would sweeping the one-block
    kernel where it does not run."""
    r = subprocess.run([sys.executable, "benchmarks/attention_tiles.py", *argv],
                       cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and says in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("caps", ["96,abc", "8", "96,300"])
def test_attention_tiles_refuses_register_caps_a_thread_cannot_have(caps):
    r = subprocess.run([sys.executable, "benchmarks/attention_tiles.py", "--maxnreg", caps],
                       cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "between 16 and 255" in r.stderr, r.stderr[-500:]


def test_attention_tiles_register_cap_reaches_the_launch_and_goes_away(monkeypatch):
    """`--maxnreg`: inside `register_cap` a launch of the kernel's Triton function carries the cap
    (checked at JITFunction.run, where Triton reads launch options); after it, launches carry none."""
    pytest.importorskip("triton")
    from benchmarks import attention_tiles as at
    from training.model import triton_attention as ta

    fn = ta._bwd_dkdv_kernel
    seen = []
    monkeypatch.setattr(type(fn), "run", lambda self, *args, **kwargs: seen.append((self, kwargs.get("maxnreg"))))
    with at.register_cap("dkdv", 128):
        fn[(1,)](0)
        ta._fwd_kernel[(1,)](0)  # another kernel: uncapped
    fn[(1,)](0)
    assert seen == [(fn, 128), (ta._fwd_kernel, None), (fn, None)] and "run" not in fn.__dict__
