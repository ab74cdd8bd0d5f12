"""The Triton kernels on a machine without a GPU: tests/interpreted_kernels.py run through Triton's
CPU interpreter (TRITON_INTERPRET=1) with small tiles. tests/test_model_gpu.py runs the same kernels
compiled, at the real tile sizes, on a GPU. The checks of the launchers' rules and compile keys need
no triton."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs the triton package (pip install triton)"
)
def test_kernels_match_torch_in_the_triton_interpreter():
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=python_path, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interpreted_kernels"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "ALL KERNEL CHECKS PASSED" in out
    # every backward: the one-block kernel of short queries (with and without a bias, causal), and the
    # two kernels of longer ones, dQ from the stored dS (a bias) or recomputed (none, causal too)
    for how in ("one-block backward", "dK/dV + dQ from the stored dS", "dK/dV + dQ recomputed"):
        assert f"dq|dk|dv ({how})" in out and f"dk|dv ({how})" in out, how
    assert "dbias (one-block backward)" in out and "dbias (dK/dV + dQ from the stored dS)" in out
    assert "b2 35x35 causal=True padded=True bias=False packed=True out" in out  # dQ recomputed, causal
    assert out.count("one-block backward)") == 12 and out.count("dQ recomputed)") == 6
    assert out.count("dQ from the stored dS)") == 20
    # the bias gradient given T5's far distance: the encoder's from the rows' zero sums, the decoder's whole
    assert out.count("with and without far: identical") == 3
    assert "causal, bias gradient as without far" in out
    # the bias as its row (long inputs): T5's encoder and decoder bias, exact per region; a random row, per offset
    assert out.count("bucket table gradient against math") == 5 and "row gradient per offset" in out
    assert out.count("row gradient in the band") == 3 and out.count("row bias, far") == 4 * 2 + 3 * 2 + 1 + 3
    assert out.count("tiles beyond far as without far: identical") == 3  # the row's tile table, clamped at far
    assert out.count("dS summed over the batch") == 4  # 2 shapes x 2 dtypes
    assert out.count("dS batch sum over far regions") == 12  # 2 shapes x 2 dtypes x 3 checks
    for read_in in ("fp16", "fp32"):  # the bias in either dtype: 3 shapes x 4 tensors
        assert out.count(f"bias read in {read_in}") == 12, read_in
    # the whole tiny model: short targets (one-block backward) and longer ones (two kernels)
    for targets in (17, 30):
        assert f"tiny T5 loss, triton attention, {targets} targets" in out
    assert "tiny T5 loss, triton attention, bias as its row, 30 targets" in out
    for stack in ("encoder", "decoder"):  # its own line, whichever parameter is the worst
        assert f"\n  {stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight " in out, stack
    assert out.count("fused AdamWScale") == 4  # the optimizer's update: guard, clip, decay, bf16 grads
    # decoding: the self-attention kernel over fixed-size caches, and whole generate() calls
    for table in ("own slots", "history table"):
        assert f"decode attention, {table}, slot 36, bfloat16" in out
    for name in ("greedy", "3-beam search"):
        assert f"tiny T5 {name} tokens, triton against math" in out


def test_one_block_backward_applies_to_queries_that_fit_its_tile(monkeypatch):
    """The one-block kernel takes the backward of attentions whose queries fit its class's tile (the
    short classes, at most 128 rows), with or without a bias; longer queries take the two kernels,
    and so do short ones past a smaller tile (as a tile sweep may set). No triton needed."""
    from training.model import triton_attention as ta

    for causal, has_bias in ((True, True), (False, False), (False, True)):
        assert ta.one_block_applies(ta.tile_class(causal, has_bias, 114), 114)
        assert ta.one_block_applies(ta.tile_class(causal, has_bias, 128), 128)
        assert not ta.one_block_applies(ta.tile_class(causal, has_bias, 129), 129)
    monkeypatch.setitem(ta.ONE_BLOCK_TILES, "dec-short", ta.Tiles(64, 64, 8, 3))
    assert not ta.one_block_applies("dec-short", 114) and ta.one_block_applies("dec-short", 64)


def test_launch_settings_digest_every_setting_the_launchers_read(monkeypatch):
    """`launch_settings()` goes into the attention ops' arguments so that torch.compile's caches
    cannot hand a graph traced under other tiles or code back: it must change with every tile and
    block the launchers read and with their source, and stay the same from process to process
    (warm caches still hit)."""
    from training.model import triton_attention as ta
    from training.model import triton_bias_grad as bg

    base = ta.launch_settings()
    changes = [("DELTA_BLOCK_M", 32), ("SHORT_QUERIES", 64), ("_SOURCE_DIGEST", "another checkout's launchers and kernels")]
    for name, value in changes:
        with monkeypatch.context() as m:
            m.setattr(ta, name, value)
            assert ta.launch_settings() != base, name
    for name in ("DS_SUM_BLOCK", "DS_SUM_BLOCK_B", "DS_FAR_ROWS", "DS_FAR_COLS", "DS_FAR_BLOCK_B"):  # the batch sums'
        with monkeypatch.context() as m:
            m.setattr(bg, name, getattr(bg, name) * 2)
            assert ta.launch_settings() != base, name
    for kernel, table in ta.TILE_TABLES.items():  # any entry of any tile table
        key = next(iter(table))
        with monkeypatch.context() as m:
            m.setitem(table, key, table[key]._replace(stages=table[key].stages + 1))
            assert ta.launch_settings() != base, kernel
    assert ta.launch_settings() == base
    code = "from training.model import triton_attention as ta; print(ta.launch_settings())"
    digests = [
        subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        for _ in range(2)
    ]
    assert digests[0] == digests[1] == base


def test_tile_tables_cover_every_class_of_attention():
    """Each kernel's table has tiles for every class it is launched for: the one-block kernel's for
    the short classes (up to SHORT_QUERIES rows), the others' for all six. No triton needed."""
    from training.model import triton_attention as ta

    assert set(ta.TILE_TABLES) == {"FWD", "DKDV", "DQ", "DQDS", "DKDV_ROW", "ONEBLOCK"}
    assert all(tiles.block_m == tiles.block_n for tiles in ta.DKDV_ROW_TILES.values())  # square: see the table
    for kernel, table in ta.TILE_TABLES.items():
        expected = {c for c in ta.TILE_CLASSES if c.endswith("-short")} if kernel == "ONEBLOCK" else set(ta.TILE_CLASSES)
        assert set(table) == expected, kernel
        assert all(isinstance(tiles, ta.Tiles) for tiles in table.values()), kernel
    assert all(tiles.block_m == ta.SHORT_QUERIES for tiles in ta.ONE_BLOCK_TILES.values())


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
    too (AOTAutograd's cache serves the whole training step): it changes with every tile their
    launchers read and with the source, and stays the same from process to process."""
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
