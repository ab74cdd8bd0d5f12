"""The Triton kernels on a machine without a GPU: tests/interpreted_kernels.py run through Triton's
CPU interpreter (TRITON_INTERPRET=1) with small tiles. tests/test_model_gpu.py runs the same kernels
compiled, at the real tile sizes, on a GPU. The checks of the backward's switches need no triton."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# 16-32 row/column tiles: the test shapes (16-50 positions) then span several tiles, partial ones,
# and the causal diagonal, as 512 positions do at the GPU's 64 x 64 tiles. (The dK/dV kernel's
# tiles, which differ per class of attention, are set in tests/interpreted_kernels.py.)
SMALL_TILES = {
    "T5DS_ATTN_FWD_BM": "16",
    "T5DS_ATTN_FWD_BN": "16",
    "T5DS_ATTN_DQ_BM": "32",
    "T5DS_ATTN_DQ_BN": "16",
    "T5DS_ATTN_DQDS_BM": "16",
    "T5DS_ATTN_DQDS_BN": "32",
    "T5DS_ATTN_DBIAS_BM": "16",
    "T5DS_ATTN_DBIAS_BN": "16",
    "T5DS_ATTN_DS_SUM_BLOCK": "64",
    "T5DS_ATTN_DS_SUM_BLOCK_B": "2",
    "T5DS_ATTN_DS_FAR_ROWS": "4",
    "T5DS_ATTN_DS_FAR_COLS": "8",
    "T5DS_ATTN_DS_FAR_BLOCK_B": "2",
    "T5DS_ATTN_DELTA_BM": "16",
}


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs the triton package (pip install triton)"
)
def test_kernels_match_torch_in_the_triton_interpreter():
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=python_path, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", **SMALL_TILES)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interpreted_kernels"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ALL KERNEL CHECKS PASSED" in proc.stdout
    # every bias-gradient path was exercised, in the kernels and in the model, and the far tiles
    for path in ("ds", "atomic", "kernel"):
        assert f"tiny T5 loss, triton attention (bias gradient path {path})" in proc.stdout
    for dq_path in ("stored", "stored_bias"):
        assert f"tiny T5 loss, triton attention (bias gradient path ds, dQ {dq_path})" in proc.stdout
    assert "tiny T5 loss, triton attention (bias gradient path ds, far tiles)" in proc.stdout
    # the one-block backward of short queries: self-attention (causal, bias), cross-attention, the model
    for line in (
        "dq|dk|dv (bias gradient path ds, dQ stored_bias, one-block backward)",
        "dk|dv (bias gradient path ds, dQ stored_bias, one-block backward)",
        "dbias (bias gradient path ds, dS summed by torch, one-block backward)",
        "relative bias gradient, summed densely (one-block backward)",
        "tiny T5 loss, triton attention (bias gradient path ds, dQ stored_bias, one-block backward)",
    ):
        assert line in proc.stdout, line
    # decoding: the self-attention kernel over fixed-size caches, and whole generate() calls
    for table in ("own slots", "history table"):
        assert f"decode attention, {table}, slot 36, bfloat16" in proc.stdout
    for name in ("greedy", "3-beam search"):
        assert f"tiny T5 {name} tokens, triton against math" in proc.stdout
    assert "tiny T5 loss, triton attention (bias gradient path ds, dS summed by torch)" in proc.stdout
    relative = (
        "tiny T5 loss, triton attention (bias gradient path ds, dQ stored_bias, one-block backward, relative bias)"
    )
    assert relative in proc.stdout
    # a relative bias's gradient, summed by the dQ-from-dS kernel (square tiles) and densely (7 cases
    # of the two kernels, 2 of the one-block kernel)
    assert proc.stdout.count("relative bias gradient, summed in the dQ kernel") == 5
    assert proc.stdout.count("relative bias gradient, summed densely") == 9
    assert proc.stdout.count("dS summed over the batch") == 4  # 2 shapes x 2 dtypes
    assert proc.stdout.count("dS batch sum over far regions") == 12  # 2 shapes x 2 dtypes x 3 checks
    assert "tiny T5 loss, triton attention (bias gradient path ds, dQ stored_bias, dS summed by far)" in proc.stdout
    assert proc.stdout.count("FFN epilogue") == 6  # 2 kernel pairs x 3 tensors
    assert proc.stdout.count("with and without far tiles") == 27  # 3 shapes x 3 paths x 3 tensors
    for read_in in ("fp16", "fp32"):  # the bias in either dtype for bf16 inputs: 3 shapes x 4 tensors
        assert proc.stdout.count(f"bias read in {read_in}") == 12, read_in


def test_tile_variables_set_a_kernels_tiles_for_every_class():
    """T5DS_ATTN_<KERNEL>_BM / _BN / _WARPS / _STAGES set that kernel's tiles for every class of
    attention (tuning runs), the rest of each class's tiles staying its own; the backward's kernels also take
    T5DS_ATTN_BWD_*, which their own variables override. No triton needed."""
    code = ("import json; from training.model import triton_attention as ta; "
            "print(json.dumps(ta.TILE_TABLES))")  # fmt: skip
    default = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                                        check=True).stdout)  # fmt: skip
    env = dict(os.environ, T5DS_ATTN_DKDV_BN="16", T5DS_ATTN_BWD_WARPS="8", T5DS_ATTN_DQ_WARPS="2",
               T5DS_ATTN_FWD_STAGES="5", T5DS_ATTN_ONEBLOCK_BN="32")  # fmt: skip
    tuned = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                                      check=True).stdout)  # fmt: skip
    classes = {"enc", "dec", "cross", "enc-short", "dec-short", "cross-short"}
    assert set(default) == {"FWD", "DKDV", "DQ", "DQDS", "ONEBLOCK"}
    assert all(set(default[kernel]) == classes for kernel in default if kernel != "ONEBLOCK")
    # the one-block backward: the short classes, up to 128 queries; its own variables only
    assert set(default["ONEBLOCK"]) == {"enc-short", "dec-short", "cross-short"}
    for key, (bm, _, warps, stages) in default["ONEBLOCK"].items():
        assert bm == 128 and tuned["ONEBLOCK"][key] == [bm, 32, warps, stages]
    for key, (bm, _, _, stages) in default["DKDV"].items():
        assert tuned["DKDV"][key] == [bm, 16, 8, stages]
        assert tuned["DQDS"][key] == [*default["DQDS"][key][:2], 8, default["DQDS"][key][3]]
        assert tuned["DQ"][key] == [*default["DQ"][key][:2], 2, default["DQ"][key][3]]
        assert tuned["FWD"][key] == [*default["FWD"][key][:3], 5]


@pytest.mark.parametrize(
    "dq_path, dbias_path, ds_sum, message",
    [
        ("stored", "atomic", "kernel", "set DBIAS_PATH to 'ds'"),
        ("stored", "kernel", "kernel", "set DBIAS_PATH to 'ds'"),
        ("recomputed", "ds", "kernel", "DQ_PATH must be one of"),
        ("recompute", "sum", "kernel", "DBIAS_PATH must be one of"),
        ("recompute", "ds", "inductor", "DS_SUM must be one of"),
    ],
)
def test_attention_backward_switches_refuse_what_they_cannot_run(dq_path, dbias_path, ds_sum, message, monkeypatch):
    """The backward's module switches are checked before any kernel runs (no triton needed here): dQ
    from the stored dS needs the bias gradient summed from that dS, and unknown values are named."""
    from training.model import triton_attention as ta

    monkeypatch.setattr(ta, "DQ_PATH", dq_path)
    monkeypatch.setattr(ta, "DBIAS_PATH", dbias_path)
    monkeypatch.setattr(ta, "DS_SUM", ds_sum)
    with pytest.raises(ValueError, match=message):
        ta._launch_bwd(*_backward_inputs())


def test_one_block_backward_applies_to_short_queries_with_a_bias_gradient_from_ds(monkeypatch):
    """The one-block kernel takes the backward of attentions whose queries fit its tile (the short
    classes, at most 128 rows), with the bias gradient summed from dS; the other bias-gradient
    paths and ONE_BLOCK_BWD off keep the two kernels. No triton needed."""
    from training.model import triton_attention as ta

    monkeypatch.setattr(ta, "ONE_BLOCK_BWD", True)
    monkeypatch.setattr(ta, "DBIAS_PATH", "ds")
    for causal, has_bias in ((True, True), (False, False), (False, True)):
        assert ta.one_block_applies(ta.tile_class(causal, has_bias, 114), 114, has_bias)
        assert ta.one_block_applies(ta.tile_class(causal, has_bias, 128), 128, has_bias)
        assert not ta.one_block_applies(ta.tile_class(causal, has_bias, 129), 129, has_bias)
    monkeypatch.setattr(ta, "DBIAS_PATH", "atomic")
    assert not ta.one_block_applies("dec-short", 114, True)
    assert ta.one_block_applies("cross-short", 114, False)
    monkeypatch.setattr(ta, "ONE_BLOCK_BWD", False)
    assert not ta.one_block_applies("cross-short", 114, False)


def test_launch_settings_digest_every_setting_the_launchers_read(monkeypatch):
    """`launch_settings()` goes into the attention ops' arguments so that torch.compile's caches
    cannot hand a graph traced under other settings or code back: it must change with every path,
    switch and tile the launchers read and with their source, and stay the same from process to
    process (warm caches still hit)."""
    from training.model import triton_attention as ta
    from training.model import triton_bias_grad as bg

    base = ta.launch_settings()
    changes = [("DQ_PATH", "recompute"), ("DBIAS_PATH", "atomic"), ("DS_SUM", "torch"), ("FAR_TILES", () if ta.FAR_TILES else ("fwd",)),
               ("ONE_BLOCK_BWD", not ta.ONE_BLOCK_BWD), ("RELATIVE_BIAS", not ta.RELATIVE_BIAS),
               ("BIAS_HALF", not ta.BIAS_HALF),
               ("DELTA_BLOCK_M", 32), ("SHORT_QUERIES", 64),
               ("_SOURCE_DIGEST", "another checkout's launchers and kernels")]  # fmt: skip
    for name, value in changes:
        with monkeypatch.context() as m:
            m.setattr(ta, name, value)
            assert ta.launch_settings() != base, name
    for name in ("DS_SUM_BLOCK", "DS_SUM_BLOCK_B", "DS_FAR_ROWS", "DS_FAR_COLS", "DS_FAR_BLOCK_B"):  # the batch sums'
        with monkeypatch.context() as m:
            m.setattr(bg, name, getattr(bg, name) * 2)
            assert ta.launch_settings() != base, name
    assert ta.launch_settings() == base
    with monkeypatch.context() as m:
        m.setitem(ta.DKDV_TILES, "dec-short", ta.Tiles(16, 16, 4, 1))
        assert ta.launch_settings() != base
    code = "from training.model import triton_attention as ta; print(ta.launch_settings())"
    digests = [
        subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, **env), capture_output=True,
                       text=True, check=True).stdout.strip()
        for env in ({}, {}, {"T5DS_ATTN_ONEBLOCK_BN": "32"})
    ]  # fmt: skip
    assert digests[0] == digests[1] == base != digests[2]


@pytest.mark.parametrize(
    "module, changes",
    [
        ("triton_add_norm", [("FWD_ROWS", 8), ("BWD_ROWS", 4), ("BWD_PROGRAMS_PER_SM", 3), ("BWD_WARPS", 8),
                             ("BWD_STAGES", 2), ("BWD_STAGES_HALF", 1), ("_SOURCE_DIGEST", "another checkout")]),
        ("triton_gated_gelu", [("BLOCK", 512), ("_SOURCE_DIGEST", "another checkout")]),
    ],
)  # fmt: skip
def test_add_norm_and_gelu_launch_settings_digest_their_tiles_and_source(monkeypatch, module, changes):
    """The residual add + RMS norm and the gated GELU ops take their module's `launch_settings()`
    too (the training step is cached whole since the fused cross-entropy stopped making AOTAutograd's
    cache step aside): it changes with every tile their launchers read and with the source, and
    stays the same from process to process."""
    import importlib

    mod = importlib.import_module(f"training.model.{module}")
    base = mod.launch_settings()
    for name, value in changes:
        with monkeypatch.context() as m:
            m.setattr(mod, name, value)
            assert mod.launch_settings() != base, name
    assert mod.launch_settings() == base
    code = f"from training.model import {module} as mod; print(mod.launch_settings())"
    again = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert again.stdout.strip() == base


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the ops are registered where triton is installed"
)
def test_every_triton_op_takes_the_launch_settings():
    """Each of the model's Triton ops has the `settings` argument that keys it in the compile caches."""
    import torch

    from training.model import triton_add_norm, triton_attention, triton_gated_gelu  # noqa: F401 - registers

    if not hasattr(torch.library, "triton_op"):
        pytest.skip("torch < 2.6 has no triton_op: the kernels run outside torch.compile's graph")
    names = ["flash_attention_fwd", "flash_attention_bwd", "add_rms_norm_fwd", "add_rms_norm_bwd",
             "gated_gelu_fwd", "gated_gelu_bwd"]  # fmt: skip
    for name in names:
        arguments = getattr(torch.ops.t5ds, name).default._schema.arguments
        assert [(a.name, str(a.type)) for a in arguments][-1] == ("settings", "str"), name


def _backward_inputs() -> tuple:
    """`_launch_bwd`'s arguments for a self-attention with a bias: batch 1, 8 positions, 2 heads of 4."""
    import torch

    b, s, heads, d = 1, 8, 2, 4
    qkv, bias = torch.randn(b, s, 3 * heads * d), torch.randn(heads, s, s)
    out, lse, dout = torch.randn(b, s, heads * d), torch.zeros(2, b, heads, s), torch.randn(b, s, heads * d)
    return qkv, qkv.new_empty((0,)), bias, torch.empty((0,), dtype=torch.uint8), out, lse, dout, False, heads


def test_the_atomic_bias_gradient_refuses_deterministic_mode(monkeypatch):
    """Under `training.determinism.set_deterministic(True)` the bias gradient by atomic adds raises
    before any kernel runs (as torch's own non-deterministic ops do); the default path is allowed."""
    from training.determinism import set_deterministic
    from training.model import triton_attention as ta

    monkeypatch.setattr(ta, "DQ_PATH", "recompute")
    monkeypatch.setattr(ta, "DBIAS_PATH", "atomic")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    set_deterministic(True)
    try:
        with pytest.raises(RuntimeError, match="atomic adds, which is not deterministic"):
            ta._launch_bwd(*_backward_inputs())
    finally:
        set_deterministic(False)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs the triton package (pip install triton)"
)
def test_decode_attention_refuses_inputs_it_would_misread():
    """`triton_decode_attention.decode_attention` checks shapes and layouts before any launch: a cache
    of another shape, a non-contiguous buffer, heads not side by side, a history of another shape."""
    import torch

    from training.model.triton_decode_attention import decode_attention

    rows, length, heads, d = 3, 8, 2, 16
    q = torch.randn(rows, 1, 3 * heads * d)[..., : heads * d].view(rows, 1, heads, d)
    k, v = torch.randn(rows, length, heads, d), torch.randn(rows, length, heads, d)
    bias, position = torch.zeros(heads, 1, length), torch.tensor(2)
    with pytest.raises(ValueError, match="expected"):
        decode_attention(q, k[:2], v[:2], None, bias, position)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, None, bias, position)
    with pytest.raises(ValueError, match="side by side"):
        decode_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, None, bias, position)
    with pytest.raises(ValueError, match="history of shape"):
        decode_attention(q, k, v, torch.zeros(rows, length + 1, dtype=torch.long), bias, position)
