"""The developer tools (tools/): the trace analysis on hand-made traces, the attention micro-benchmark's
rows on CPU (math and SDPA, times stubbed), the tile sweep's choice of kernels and its restoring of
the tile tables, and their refusals."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_trace_gaps_finds_idle_stretches_and_host_bound_launches(tmp_path, capsys):
    """tools/trace_gaps.py on a hand-made chrome trace: a step's window runs from the first kernel
    launched inside its host range to the next step's first kernel; overlapping work merges into one
    busy stretch; a gap is host-bound only when its next kernel was launched after the GPU went idle."""
    from tools.trace_gaps import idle_gaps, main, step_windows

    def x(cat, name, ts, dur, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {} if corr is None else {"correlation": corr}}  # fmt: skip

    events = [
        x("user_annotation", "benchmark_step", -10, 50), x("user_annotation", "benchmark_step", 60, 40),
        x("kernel", "a", 0, 10, 1), x("cuda_runtime", "cudaLaunchKernel", -5, 1, 1),
        x("kernel", "b", 12, 8, 2), x("cuda_runtime", "cudaLaunchKernel", 5, 1, 2),  # queued before a ended
        x("kernel", "c", 30, 10, 3), x("cuda_driver", "cuLaunchKernel", 25, 1, 3),  # launched while idle
        x("gpu_memcpy", "copy", 35, 10, 4), x("cuda_runtime", "cudaMemcpyAsync", 26, 1, 4),  # overlaps c
        x("kernel", "d", 100, 5, 5), x("cuda_runtime", "cudaLaunchKernel", 70, 1, 5),  # second step
        x("kernel", "e", 114, 6, 6), x("cuda_runtime", "cudaLaunchKernel", 80, 1, 6),
        x("kernel", "z", 300, 5, 7), x("cuda_runtime", "cudaLaunchKernel", 200, 1, 7),  # outside every step
        x("cpu_op", "aten::mm", 0, 200),  # host work is not GPU time
    ]  # fmt: skip
    trace = {"traceEvents": events}
    # step 0 ends where step 1's first kernel starts (idle between steps counts), step 1 at its last
    assert step_windows(trace) == [(0.0, 100.0), (100.0, 120.0)]
    busy, gaps = idle_gaps(trace, (0.0, 100.0))
    assert busy == 33.0
    assert [(g.start_us, g.length_us, g.before, g.after, g.host_bound) for g in gaps] == [
        (10.0, 2.0, "a", "b", False), (20.0, 10.0, "b", "c", True)]  # fmt: skip
    assert [g.length_us for g in idle_gaps(trace, (0.0, 100.0), min_us=5)[1]] == [10.0]
    busy, gaps = idle_gaps(trace, (100.0, 120.0))
    assert busy == 11.0 and [(g.length_us, g.host_bound) for g in gaps] == [(9.0, False)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    main([str(path), "--min-us", "5"])
    printed = capsys.readouterr().out
    assert "| 0 | 0.10 | 0.03 | 0.07 | 0.01 | 1 |" in printed and "| 1 | 0.02 | 0.01 | 0.01 | 0.00 | 1 |" in printed
    assert "| 10.0 | yes | b | c |" in printed and "| 9.0 | no | d | e |" in printed
    with pytest.raises(SystemExit, match="--trace FILE"):
        main([str(tmp_path / "missing.json")])
    path.write_text(json.dumps({"traceEvents": [x("cpu_op", "aten::mm", 0, 10)]}))
    with pytest.raises(SystemExit, match="no GPU kernels"):
        main([str(path)])


def test_trace_parts_sums_each_parts_kernels_per_step(tmp_path, capsys):
    """`trace_gaps.py --parts`: kernel time per step by part of the step (by kernel name, the first
    matching part; copies and memsets apart), only from the kernels inside the steps' windows."""
    from tools.trace_gaps import main, part_of

    assert part_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "kernel") == "GEMMs (cuBLAS, QuACK)"
    attention = {part_of(name, "kernel") for name in ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_one_block_kernel",
                                                      "_ds_batch_sum_far_kernel", "_far_region_sums_kernel")}  # fmt: skip
    assert attention == {"attention (ours)"}
    assert part_of("_add_rms_norm_fwd_kernel", "kernel") == part_of("_add_rms_norm_bwd_kernel", "kernel") \
        == "residual add + RMS norm (ours)"  # not attention's
    assert part_of("_gated_gelu_bwd_kernel", "kernel") == "gated GELU (ours)"
    assert part_of("triton_red_fused_add_mul_0", "kernel").startswith("inductor's")
    assert part_of("Memset (Device)", "gpu_memset") == "memsets and copies"
    assert part_of("void at::native::vectorized_elementwise_kernel", "kernel") == "other"

    def x(cat, name, ts, dur, corr):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [{"ph": "X", "cat": "user_annotation", "name": "benchmark_step", "ts": ts, "dur": 40, "args": {}}
              for ts in (-10, 40)]  # fmt: skip
    for step, start in enumerate((0, 50)):  # two steps of the same kernels: 300 + 100 + 100 + 20 µs
        for i, (cat, name, dur) in enumerate([("kernel", "nvjet_a", 300), ("kernel", "_fwd_kernel", 100),
                                              ("kernel", "triton_poi_fused_0", 60), ("kernel", "triton_poi_fused_0", 40),
                                              ("gpu_memset", "Memset (Device)", 20)]):  # fmt: skip
            corr = 10 * step + i
            events += [x(cat, name, start + i, dur, corr), x("cuda_runtime", "cudaLaunchKernel", start - 5 + i, 1, corr)]
    events += [x("kernel", "nvjet_late", 900, 1000, 99), x("cuda_runtime", "cudaLaunchKernel", 800, 1, 99)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    main([str(path), "--parts"])
    printed = capsys.readouterr().out
    assert "| GEMMs (cuBLAS, QuACK) | 0.30 | 57.7% |" in printed  # the kernel outside the steps is left out
    assert "| attention (ours) | 0.10 | 19.2% |" in printed and "| memsets and copies | 0.02 | 3.8% |" in printed
    assert "| **all GPU work** | **0.52** | |" in printed
    assert "| 0.10 | 2 | inductor's kernels (norms, casts, loss, optimizer, ...) | triton_poi_fused_0 |" in printed
    assert "nvjet_late" not in printed


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_attention_backends_rows_on_cpu(monkeypatch, capsys):
    """The math and SDPA rows through the model's `packed_attention` on CPU (times stubbed): math is
    the reference of each shape (dashes), SDPA's outputs and gradients agree with it to bf16's
    precision, the bias's gradient only where there is a bias and kv's only in the cross-attention;
    --kernels prints each kernel under its row."""
    import tools.attention_backends as ab

    monkeypatch.setattr(ab, "kernel_ms", lambda fn, iters: {"fwd": 2.0, "fwd_bwd": 7.0}[fn.__name__])
    monkeypatch.setattr(ab, "kernel_table", lambda fn, iters: {"k1": 4.0, "k2": 3.0})
    args = argparse.Namespace(batch_size=2, heads=2, d_kv=8, iters=1, kernels=True, compile=False)
    ab.run_table(args, ["enc", "cross"], ["math", "sdpa"], device="cpu")
    rows = [_cells(line) for line in capsys.readouterr().out.splitlines()]
    assert [row[:2] for row in rows] == [["enc", "math"], ["", "k1"], ["", "k2"], ["enc", "sdpa"], ["", "k1"], ["", "k2"],
                                         ["cross", "math"], ["", "k1"], ["", "k2"], ["cross", "sdpa"], ["", "k1"], ["", "k2"]]  # fmt: skip
    (_, _, _, *times, _, _, out, dq, dkv, dbias), enc_sdpa = rows[0], rows[3]
    assert times == ["2.000", "5.000", "7.000"] and [out, dq, dkv, dbias] == ["-"] * 4
    assert enc_sdpa[10] == "-" and all(float(err) < 2e-2 for err in enc_sdpa[8:10] + enc_sdpa[11:])
    cross_sdpa = rows[9]
    assert cross_sdpa[11] == "-" and all(float(err) < 2e-2 for err in cross_sdpa[8:11])
    assert rows[1][4] == "4.000"


def test_attention_backends_nobias_row_drops_only_the_bias_and_has_no_reference(monkeypatch):
    """`triton-nobias` runs the case's own inputs without its bias (and without `far`, which needs one),
    is compared with nothing, and is left out where the shape has no bias; the other rows are compared
    with the shape's first row that keeps the bias."""
    import tools.attention_backends as ab

    biases = {"enc": torch.ones(2, 3, 3), "cross": torch.empty(0)}
    monkeypatch.setattr(ab, "Case", lambda name, *sizes, device: argparse.Namespace(
        name=name, q_src=torch.ones(2, 3), bias=biases[name], far=91 if name == "enc" else 0))  # fmt: skip
    monkeypatch.setattr(ab, "run_model_path", lambda case, backend, compiled: (case.bias.numel(), case.far, backend))
    seen = []
    monkeypatch.setattr(ab, "timed_row", lambda name, label, build, case, ref, iters, kernels:
                        seen.append((name, label, build(), ref)) or f"{name} {label} outputs")  # fmt: skip
    args = argparse.Namespace(batch_size=2, heads=2, d_kv=8, iters=1, kernels=False, compile=True)
    ab.run_table(args, ["enc", "cross"], ["triton-nobias", "triton", "sdpa"])
    assert seen == [
        ("enc", "triton-nobias", (0, 0, "triton"), None), ("enc", "triton", (18, 91, "triton"), None),
        ("enc", "sdpa", (18, 91, "sdpa"), "enc triton outputs"),
        ("cross", "triton", (0, 0, "triton"), None), ("cross", "sdpa", (0, 0, "sdpa"), "cross triton outputs"),
    ]  # fmt: skip


def test_attention_backends_row_of_a_backend_that_refuses_is_its_error(capsys):
    import tools.attention_backends as ab

    def refuses():
        raise RuntimeError("no kernel for this shape")

    assert ab.timed_row("dec", "sdpa", refuses, None, None, iters=3, kernels=True) is None
    assert capsys.readouterr().out == "| dec | sdpa | RuntimeError: 'no kernel for this shape' |\n"


def test_attention_backends_comma_lists_are_checked_against_their_choices():
    from tools.attention_backends import comma_choices

    assert comma_choices("enc, cross", ["enc", "dec", "cross"], "--shapes", "shape") == ["enc", "cross"]
    with pytest.raises(SystemExit, match="--shapes: unknown shape 'x'; choose among enc, dec"):
        comma_choices("enc,x", ["enc", "dec"], "--shapes", "shape")
    r = subprocess.run([sys.executable, "tools/attention_backends.py", "--backends", "triton,cudnn"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "--backends: unknown backend 'cudnn'" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize(
    "argv, says",
    [(["--kernels", "dq"], "the enc attention with 512 queries runs the kernels fwd, dkdv, dqds"),
     (["--shape", "dec", "--kernels", "fwd,dkdv"], "the dec attention with 114 queries runs the kernels fwd, oneblock"),
     (["--shape", "cross", "--lengths", "512,512", "--kernels", "dqds"], "runs the kernels fwd, dkdv, dq"),
     (["--shape", "enc", "--kernels", "oneblock"], "runs the kernels fwd, dkdv, dqds"),
     (["--bias-layout", "row", "--kernels", "dqds"], "runs the kernels fwd, dq, dkdvrow"),
     (["--lengths", "512"], "give two positive integers"),
     (["--shape", "dec", "--lengths", "512,114"], "give equal lengths")],
)  # fmt: skip
def test_attention_tiles_refuses_kernels_the_backward_does_not_run(argv, says):
    """The sweep times the forward or the whole backward: a kernel that this attention's backward does
    not run would time nothing that changes, so it stops before any GPU work and names the ones that
    run (the one-block kernel where the queries fit one block; else dK/dV and the dQ kernel of the
    attention's bias)."""
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "tools/attention_tiles.py", *argv],
                       cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and says in r.stderr, r.stderr[-500:]


def test_attention_tiles_sweep_patches_the_table_entry_and_restores_it(monkeypatch, capsys):
    """Each setting is in the attention's entry of the kernel's table while its call is timed, and only
    there; the entry is back after the sweep, also when timing a setting raised; the best comes first."""
    pytest.importorskip("triton")
    import tools.attention_tiles as at
    from training.model import triton_attention as ta

    before = {name: dict(table) for name, table in ta.TILE_TABLES.items()}
    seen = []

    def timed(call, iters):
        tiles = ta.TILE_TABLES["DKDV"]["dec"]
        seen.append(tiles)
        assert {name: table for name, table in ta.TILE_TABLES.items() if name != "DKDV"} == \
            {name: table for name, table in before.items() if name != "DKDV"}
        if tiles.block_m == 128:
            raise RuntimeError("out of resources: shared memory")
        return tiles.block_m / tiles.block_n + tiles.warps + tiles.stages / 10

    monkeypatch.setattr(at, "kernel_ms", timed)
    monkeypatch.setattr(at, "timed_call", lambda kernel, case: (None, 1e9))
    case = argparse.Namespace(causal=True, bias=torch.ones(1), sq=512, sk=512, b=2, h=2, d=8)
    rows = at.sweep("dkdv", case, argparse.Namespace(shape="dec", top=3, iters=1))
    assert len(seen) == 3 * 3 * 2 * 2 and len(rows) == 2 * 3 * 2 * 2  # the 12 settings of BLOCK_M 128 failed
    assert {name: dict(table) for name, table in ta.TILE_TABLES.items()} == before
    assert rows[0][1] == ta.Tiles(32, 128, 4, 2)
    printed = capsys.readouterr().out
    assert "dkdv (32, 128, 4, 2): RuntimeError" not in printed and "(128, 32, 4, 2): RuntimeError" in printed
    assert "best: TILE_TABLES['DKDV']['dec'] = Tiles(block_m=32, block_n=128, warps=4, stages=2)" in printed
    assert printed.count("(current)") == 1


def test_attention_sweep_row_case_holds_the_dense_bias_as_its_row():
    """The row bias the sweep times is the dense one's relative row: expanded as the model expands a
    row, it is the dense bias, for the encoder's bidirectional buckets and the decoder's causal ones."""
    from tools.attention_backends import Case
    from training.model.attention import dense_bias

    for shape, lengths in (("enc", (40, 40)), ("dec", (24, 24))):
        dense = Case(shape, 1, 2, 8, lengths=lengths, device="cpu")
        row = Case(shape, 1, 2, 8, lengths=lengths, device="cpu", bias_layout="row")
        assert row.bias.shape == (2, 2 * lengths[0] - 1) and row.far == dense.far
        assert torch.equal(dense_bias(row.bias, *lengths), dense.bias)


def test_attention_tiles_sweeps_only_square_tiles_of_the_row_kernel(monkeypatch, capsys):
    """The row bias's dK/dV kernel refuses tiles that are not square: the sweep times only square ones."""
    pytest.importorskip("triton")
    import tools.attention_tiles as at

    seen = []
    monkeypatch.setattr(at, "kernel_ms", lambda call, iters: seen.append(at.ta.TILE_TABLES["DKDV_ROW"]["enc"]) or 1.0)
    monkeypatch.setattr(at, "timed_call", lambda kernel, case: (None, 1e9))
    case = argparse.Namespace(causal=False, bias=torch.ones(2, 7), sq=4, sk=4, b=1, h=2, d=8)
    at.sweep("dkdvrow", case, argparse.Namespace(shape="enc", top=3, iters=1))
    assert len(seen) == 3 * 2 * 2 and all(tiles.block_m == tiles.block_n for tiles in seen)
    assert "bias=row" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_only_tools_say_what_they_need():
    for script in ("tools/attention_backends.py", "tools/attention_tiles.py"):
        r = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and f"{script} needs triton and a CUDA GPU" in r.stderr, r.stderr[-500:]

