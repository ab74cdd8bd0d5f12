"""The benchmark scripts: wave planning, scaling arithmetic, and a real CPU run of
benchmarks/scaling.py (tiny model, gloo, 1 and 2 processes) that must produce agreeing losses; the
model benchmark's variant items; the GPU-only scripts' message on a CPU machine."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.scaling import add_scaling, loss_spread, plan_waves
from tests.test_pretrain import _env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The bundled C4 sample sharded for 64-token inputs (train and validation)."""
    out = tmp_path_factory.mktemp("shards") / "c4"
    subprocess.run([sys.executable, "-m", "data_prep.shard", "--input", "assets/c4/en/c4-train.00000-of-01024.json.gz",
                    "--validation-input", "assets/c4/en/c4-validation.00000-of-00008.json.gz",
                    "--tokenizer", "assets/t5/spiece.model", "--output", str(out), "--input-length", "64",
                    "--workers", "1"], cwd=REPO, env=_env(), check=True, capture_output=True)
    return out


def test_plan_waves_packs_disjoint_gpus():
    waves = plan_waves([1, 2, 4], ["zero0", "zero1", "zero2", "zero3"], total_gpus=4, parallel=True)
    assert [len(w) for w in waves] == [4, 2, 2, 1, 1, 1, 1]
    for wave in waves:
        ids = [g for run in wave for g in run["gpu_ids"]]
        assert len(ids) == len(set(ids)) and max(ids) < 4  # disjoint, on the machine
        assert all(len(run["gpu_ids"]) == run["gpus"] for run in wave)
    runs = [(r["gpus"], r["config"]) for w in waves for r in w]
    assert sorted(runs) == sorted((n, c) for n in (1, 2, 4) for c in ("zero0", "zero1", "zero2", "zero3"))
    sequential = plan_waves([1, 2], ["zero0", "zero1"], total_gpus=4, parallel=False)
    assert [len(w) for w in sequential] == [1, 1, 1, 1]
    with pytest.raises(SystemExit, match="4 GPUs but 2"):
        plan_waves([4], ["zero0"], total_gpus=2, parallel=False)


def test_scaling_efficiency_and_loss_spread():
    rows = [
        {"config": "zero1", "gpus": 1, "tokens_per_gpu": 400.0, "last_loss": 10.0},
        {"config": "zero1", "gpus": 4, "tokens_per_gpu": 360.0, "last_loss": 9.0},
        {"config": "zero2", "gpus": 4, "tokens_per_gpu": 380.0, "last_loss": 9.09},
        {"config": "zero3", "gpus": 4, "error": "exit 1"},
    ]
    add_scaling(rows)
    assert rows[0]["scaling_eff"] == 1.0 and rows[1]["scaling_eff"] == pytest.approx(0.9)
    assert "scaling_eff" not in rows[2]  # no 1-GPU zero2 run to compare with
    assert loss_spread(rows) == {4: pytest.approx(0.01)}
    # an earlier invocation's 1-GPU rows fill in the missing baselines; this one's own win
    earlier = [{"config": "zero2", "gpus": 1, "tokens_per_gpu": 400.0},
               {"config": "zero1", "gpus": 1, "tokens_per_gpu": 100.0}]
    add_scaling(rows, earlier)
    assert rows[2]["scaling_eff"] == pytest.approx(0.95) and rows[1]["scaling_eff"] == pytest.approx(0.9)


def test_scaling_script_runs_on_cpu(shards, tmp_path):
    out, results = tmp_path / "scaling", tmp_path / "rows.jsonl"
    cmd = [sys.executable, "benchmarks/scaling.py", "--data", str(shards), "--config", "training/configs/tiny_demo.yaml",
           "--configs", "zero0,zero2", "--gpus", "1,2", "--total-gpus", "2", "--parallel", "--per-gpu-batch", "4",
           "--steps", "4", "--log-every", "1", "--out", str(out), "--json", str(results),
           "data.input_length=64", "data.num_workers=0", "eval.batch_size=8", "eval.max_samples=16"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted((r["config"], r["gpus"]) for r in rows) == [("zero0", 1), ("zero0", 2), ("zero2", 1), ("zero2", 2)]
    for r in rows:
        assert r["global_batch"] == 4 * r["gpus"] and r["last_step"] == 4 and r["tokens_per_s"] > 0
        assert r["scaling_eff"] > 0
    # same global batch, same seed: ZeRO 0 and ZeRO 2 end at the same loss on the same GPU count
    for n in (1, 2):
        a, b = (r["last_loss"] for r in rows if r["gpus"] == n)
        assert abs(a - b) / a < 1e-3, rows
    assert "last losses of zero0, zero2 within" in proc.stdout
    # benchmark runs keep no checkpoint (checkpoint.at_end=false)
    assert not list(out.glob("*/checkpoints/step_*"))


def test_reshard_resume_script_on_cpu(shards, tmp_path):
    """ZeRO 2 on 2 processes, converted half-way, resumed as ZeRO 3 on 1: the losses go on."""
    cmd = [sys.executable, "benchmarks/reshard_resume.py", "--data", str(shards), "--config",
           "training/configs/tiny_demo.yaml", "--source", "zero2:2", "--target", "zero3:1", "--steps", "6",
           "--batch", "8", "--no-gpu-ids", "--out", str(tmp_path / "reshard"), "data.input_length=64",
           "data.num_workers=0", "eval.batch_size=8", "eval.max_samples=16"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(cols[0]) for cols in lines] == [4, 5, 6]
    gap = float(proc.stdout.split("largest relative gap after the resume: ")[1].split("%")[0])
    assert gap < 0.1  # percent: the resumed run continues the same trajectory


DQ_ITEMS = {"dqrecompute": "recompute", "dqstored": "stored", "dqstoredbias": "stored_bias"}


def test_model_benchmark_variant_items_parse():
    """Every variant item of `python -m training.benchmark --variants` sets what its docstring says,
    on top of the command-line defaults; an unknown item stops with its name."""
    from training.benchmark import main, parse_variant, variant_label
    from training.model import triton_attention as ta

    args = argparse.Namespace(attention="triton", compile=True, fused_ce=True, batch_size=128, compile_mode="",
                              optimizer_compiled=True, residual_dtype="float32")  # fmt: skip
    v = parse_variant("sdpa,nocompile,nofusedce,bs=256,mode=max-autotune,dbiaskernel,opteager,bf16residual,torchgelu,"
                      "fartiles,clipbefore,dqstored,deterministic,dssumtorch,enctiles,torchnorm,relbias,nooneblock,regional,"
                      "biasfp32,nopdl,quackffn,cublaslt,cdtune,nobias",
                      args)  # fmt: skip
    assert v == dict(attention="sdpa", compile=False, fused_ce=False, batch_size=256, mode="max-autotune",
                     dbias="kernel", ds_sum="torch", dq="stored", opt_compiled=False, residual_dtype="autocast", triton_gelu=False,
                     far_tiles=("fwd", "dq", "dkdv"), clip_in_step=False, deterministic=True,
                     tiles_per_class=False, triton_add_norm=False, relative_bias=True, one_block=False,
                     regional=True, bias_half=False, pdl=False, quack_ffn=True, blas="cublaslt",
                     cd_tuning=True, no_bias=True)  # fmt: skip
    default = parse_variant("", args)
    assert default["opt_compiled"] and default["triton_gelu"] and default["far_tiles"] == ta.FAR_TILES
    assert default["triton_add_norm"] and default["relative_bias"] == ta.RELATIVE_BIAS
    assert parse_variant("densebias,relbias", args)["relative_bias"]
    assert not parse_variant("relbias,densebias", args)["relative_bias"]
    assert default["one_block"] == ta.ONE_BLOCK_BWD and parse_variant("nooneblock,oneblock", args)["one_block"]
    assert not default["regional"] and not parse_variant("regional,wholemodel", args)["regional"]
    assert default["bias_half"] == ta.BIAS_HALF and parse_variant("biasfp32,biashalf", args)["bias_half"]
    assert default["pdl"] and parse_variant("nopdl,pdl", args)["pdl"]
    assert not default["quack_ffn"] and not parse_variant("quackffn,cublasffn", args)["quack_ffn"]
    assert default["blas"] is None and parse_variant("cublaslt,cublas", args)["blas"] == "cublas"
    assert not default["cd_tuning"] and not default["no_bias"]
    assert default["clip_in_step"] and parse_variant("clipbefore,clipinstep", args)["clip_in_step"]
    assert default["tiles_per_class"] and parse_variant("enctiles,classtiles", args)["tiles_per_class"]
    assert parse_variant("fartiles=dkdv+fwd", args)["far_tiles"] == ("dkdv", "fwd")
    assert parse_variant("nofartiles", args)["far_tiles"] == ()
    with pytest.raises(SystemExit, match="fwd"):
        parse_variant("fartiles=bwd", args)
    with pytest.raises(SystemExit, match="fwd"):
        parse_variant("fartiles=", args)
    # every item that changes the kernels, optimizer or dtypes shows in the printed row's label
    labels = {item: variant_label(parse_variant(item, args)) for item in
              ("", "dbiaskernel", "dbiasatomic", "opteager", "bf16residual", "torchgelu", "torchnorm", "fartiles", "fartiles=dq",
               "nofartiles" if ta.FAR_TILES else "fartiles=fwd", "clipbefore", "deterministic", "enctiles", "densebias" if ta.RELATIVE_BIAS else "relbias",
               *[f"dssum{how}" for how in ta.DS_SUMS if how != ta.DS_SUM], "nooneblock" if ta.ONE_BLOCK_BWD else "oneblock", "regional", "nopdl", "quackffn",
               "cublaslt", "cublas", "cdtune", "nobias", *[item for item, path in DQ_ITEMS.items() if path != ta.DQ_PATH])}  # fmt: skip
    assert len(set(labels.values())) == len(labels), labels
    assert parse_variant("dbiasatomic", args)["dbias"] == "atomic"
    assert {parse_variant(item, args)["ds_sum"] for item in ("dssumkernel", "dssumfar", "dssumtorch")} == set(ta.DS_SUMS)
    assert {parse_variant(item, args)["dq"] for item in DQ_ITEMS} == set(ta.DQ_PATHS)
    assert all(parse_variant(item, args)["dq"] == path for item, path in DQ_ITEMS.items())
    with pytest.raises(SystemExit, match="fast"):
        parse_variant("triton,fast", args)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            main([])


def test_enctiles_runs_every_attention_with_the_encoders_tiles_and_restores_them(monkeypatch):
    """`enctiles` gives every attention the encoder's tiles for the variant's run only: the tables
    are back to each class's own after it, also when the run fails."""
    import training.benchmark as bench
    from training.model import triton_attention as ta

    args = argparse.Namespace(attention="triton", compile=True, fused_ce=True, batch_size=128, compile_mode="",
                              optimizer_compiled=True, residual_dtype="float32")  # fmt: skip
    tables = ta.TILE_TABLES
    before = {name: dict(table) for name, table in tables.items()}
    seen = []

    def fake_run(variant, args, device):
        seen.append({name: dict(table) for name, table in tables.items()})
        raise RuntimeError("out of memory")

    monkeypatch.setattr(bench, "_run_variant", fake_run)
    for spec in ("enctiles", ""):
        with pytest.raises(RuntimeError, match="out of memory"):
            bench.run_variant(bench.parse_variant(spec, args), args, torch.device("cpu"))
        assert {name: dict(table) for name, table in tables.items()} == before
    # every table with an encoder entry; the one-block kernel's (short queries only) keeps its tiles
    assert all(tiles == table["enc"] for table in seen[0].values() if "enc" in table for tiles in table.values())
    assert seen[0]["ONEBLOCK"] == before["ONEBLOCK"]
    assert seen[1] == before and before["DKDV"]["dec-short"] != before["DKDV"]["enc"]


def test_nobias_runs_the_model_without_its_relative_bias_and_puts_it_back(monkeypatch):
    """`nobias` times a model whose attention has no relative bias: its loss is that of the same model
    with both bias tables zeroed, and differs from the model's own. T5Stack.position_bias is back after
    the variant's run, also when the run fails."""
    import training.benchmark as bench
    from training.model import T5Config, T5ForConditionalGeneration, t5

    args = argparse.Namespace(attention="math", compile=False, fused_ce=True, batch_size=2, compile_mode="",
                              optimizer_compiled=False, residual_dtype="float32")  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math"))
    x, y = torch.randint(2, 100, (2, 40)), torch.randint(2, 100, (2, 9))
    original = t5.T5Stack.position_bias
    losses = {}

    def fake_run(variant, args, device):
        assert (t5.T5Stack.position_bias is original) != variant["no_bias"]
        with torch.no_grad():
            losses[variant["no_bias"]] = model(x, labels=y).loss
        raise RuntimeError("out of memory")

    monkeypatch.setattr(bench, "_run_variant", fake_run)
    for spec in ("nobias", ""):
        with pytest.raises(RuntimeError, match="out of memory"):
            bench.run_variant(bench.parse_variant(spec, args), args, torch.device("cpu"))
        assert t5.T5Stack.position_bias is original
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            stack.bias_table.weight.zero_()
        zeroed = model(x, labels=y).loss
    torch.testing.assert_close(losses[True], zeroed, rtol=1e-6, atol=0)
    assert abs(float(losses[False] - zeroed)) > 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_gpu_only_benchmarks_say_what_they_need():
    for script, need in (("benchmarks/attention_tiles.py", "needs triton and a CUDA GPU"),
                         ("benchmarks/attention_backends.py", "needs triton and a CUDA GPU"),
                         ("benchmarks/attention_batch_chunks.py", "needs triton and a CUDA GPU"),
                         ("benchmarks/gemm_shapes.py", "needs a CUDA GPU"),
                         ("benchmarks/fp8_gemm_shapes.py", "needs a CUDA GPU with FP8 tensor cores"),
                         ("benchmarks/rms_norm.py", "needs a CUDA GPU"),
                         ("benchmarks/cross_entropy.py", "needs a CUDA GPU"),
                         ("benchmarks/add_norm_sweep.py", "needs triton and a CUDA GPU"),
                         ("benchmarks/decode_steps.py", "needs a CUDA GPU"),
                         ("benchmarks/ffn_epilogue.py", "needs triton and a CUDA GPU"),
                         ("benchmarks/attention_tma.py", "needs triton and an sm_90"),
                         ("benchmarks/attention_fa4.py", "needs a Hopper GPU (sm90)"),
                         ("benchmarks/quack_gemms.py", "needs a Hopper (sm90) or newer GPU"),
                         ("benchmarks/quack_norm_epilogue.py", "needs a Hopper (sm90) or newer GPU"),
                         ("benchmarks/stream_overlap.py", "needs a CUDA GPU"),
                         ("benchmarks/ds_batch_sum.py", "needs triton and a CUDA GPU"),
                         ("benchmarks/dq_atomics.py", "needs triton and an sm_90")):
        r = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and need in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("option, value, says", [
    ("--layers", "encoder qkv,foo", "--layers: no layer named 'foo'"),
    ("--passes", "forward,backward", "--passes: unknown pass 'backward'")])  # fmt: skip
def test_quack_gemms_refuses_layers_and_passes_it_does_not_have(option, value, says):
    r = subprocess.run([sys.executable, "benchmarks/quack_gemms.py", "--parts", "gemms", option, value],
                       cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and says in r.stderr, r.stderr[-500:]


def test_stream_overlap_runs_the_backward_gemms_that_follow_the_attention():
    """benchmarks/stream_overlap.py's GEMMs are the input and weight gradients of the qkv projection
    and of the FFN's wo and [wi_0; wi_1], in that order; an unknown group is refused."""
    from benchmarks.stream_overlap import gemm_calls, parse_args

    rows, d, f = 24, 8, 12
    outs = [call().shape for call in gemm_calls(rows, d, f, ["qkv", "ffn"], "cpu", torch.float32)]
    assert outs == [(rows, d), (3 * d, d), (rows, f), (d, f), (rows, d), (2 * f, d)]
    assert [call().shape for call in gemm_calls(rows, d, f, ["qkv"], "cpu", torch.float32)] == outs[:2]
    assert parse_args(["--gemms", "ffn"]).gemms == ["ffn"]
    with pytest.raises(SystemExit, match="--gemms: unknown GEMM group 'attn'"):
        parse_args(["--gemms", "qkv,attn"])


def test_quack_benchmarks_say_when_quack_is_missing(monkeypatch):
    """On a Hopper GPU without quack-kernels, `require_quack` stops with what to install."""
    from benchmarks.quack_gemms import require_quack

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "quack", None)  # an import of it raises ImportError
    with pytest.raises(SystemExit, match=r"some_script.py needs quack-kernels .*pip install '\.\[quack\]'"):
        require_quack("some_script.py", "quack", "quack.gemm_interface")


def _gemm_rms_standin(A, B, C=None, out=None, premult_out=None, eps=1e-6, tuned=True):
    """QuACK's gemm_rms as torch ops: D = A @ B + C into out (and premult_out), rstd of D's rows."""
    d = A @ B + C
    out.copy_(d)
    if premult_out is not None:
        premult_out.copy_(d)
    return out, torch.rsqrt(d.square().mean(-1) + eps)


def _gemm_norm_act_standin(A, B, rstd=None, activation=None, tuned=True):
    """QuACK's gemm_norm_act without an activation: (None, (A @ B) * rstd per row in A's dtype)."""
    return None, ((A @ B) * rstd[:, None]).to(A.dtype)


@pytest.mark.parametrize("low, residual, tol", [(torch.float64, torch.float64, 1e-12),
                                                (torch.float32, torch.float64, 2e-6)])  # fmt: skip
def test_quack_norm_epilogue_boundary_is_add_norm_and_linear(monkeypatch, low, residual, tol):
    """`quack_norm_epilogue.FusedBoundary` (the add in the first GEMM's epilogue, the norm's row scale
    in the next GEMM's, g folded into W; its own backward) with exact torch stand-ins for QuACK's two
    GEMMs: the outputs and all five gradients equal the plain add + RMS norm + linear's. With the GEMM
    dtype below the residual's (the fp32-residual path: h' kept wide, a copy for the next GEMM) the
    tolerance is the copy's rounding."""
    import benchmarks.quack_norm_epilogue as qn

    monkeypatch.setattr(qn, "LOW", low)
    monkeypatch.setattr(qn, "_gemm_rms", _gemm_rms_standin)
    monkeypatch.setattr(qn, "_gemm_norm_act", _gemm_norm_act_standin)
    monkeypatch.setattr(qn, "_norm_backward", qn.norm_backward)
    tensors = qn.inputs(96, 40, 32, 72, residual, "cpu")
    grads = (torch.randn(96, 32, dtype=residual), torch.randn(96, 72, dtype=low))
    errs = qn.errors(qn.fused_boundary, tensors, grads)
    assert len(errs) == 7 and max(errs) < tol, errs


@pytest.mark.parametrize("merge_cross_kv", [False, True])
def test_gemm_shapes_count_the_model_flops(merge_cross_kv):
    """benchmarks/gemm_shapes.py times every linear layer's GEMMs: three passes of its shapes must
    add up to the model's FLOPs without attention (training.model.flops, the anchors' convention),
    also with the decoder's cross k/v merged into one GEMM (one shape fewer per layer, same FLOPs)."""
    from benchmarks.gemm_shapes import linear_shapes
    from training.model import T5Config
    from training.model.flops import model_flops_per_step

    config = T5Config.from_preset("base")
    shapes = linear_shapes(config, 128, 512, 114, merge_cross_kv)
    linear = sum(3 * 2 * rows * k * n * calls for _, rows, k, n, calls in shapes)
    heads, d_kv = config.num_heads, config.d_kv  # attention scores and values, forward x 3
    attention = 3 * 2 * 2 * 128 * heads * d_kv * (12 * 512 * 512 + 12 * 114 * 114 + 12 * 114 * 512)
    assert linear + attention == model_flops_per_step(config, 128, 512, 114)
    cross = [(rows, k, n, calls) for name, rows, k, n, calls in shapes if "cross kv" in name]
    assert cross == ([(128 * 512, 768, 12 * 2 * 768, 1)] if merge_cross_kv else [(128 * 512, 768, 2 * 768, 12)])


def test_gemm_benchmarks_choose_layers_by_name_or_prefix():
    """`--layers` of gemm_shapes.py and quack_gemms.py: comma-separated names or prefixes (a name that
    holds commas is chosen by a prefix of it); an item no name starts with stops the script with the
    names."""
    from benchmarks.gemm_shapes import chosen_layers

    names = ["encoder o", "decoder self o, cross q, cross o", "decoder wo", "lm_head chunk"]
    assert chosen_layers(None, names) == chosen_layers("", names) == names
    assert chosen_layers("decoder self o, decoder wo", names) == ["decoder self o, cross q, cross o", "decoder wo"]
    assert chosen_layers("decoder", names) == names[1:3]
    with pytest.raises(SystemExit, match="--layers: no layer named 'cross q' or starting so; the layers: encoder o; "):
        chosen_layers("decoder wo,cross q", names)


def test_step_layer_operands_makes_only_the_chosen_layers():
    """The GEMM benchmarks hand their `--layers` choice to `step_layer_operands`, which then makes the
    operands of those layers alone, with the shapes it makes when it makes them all."""
    from benchmarks.gemm_shapes import step_layer_operands, step_shape_parser
    from training.model import T5Config

    config = T5Config.from_preset("tiny")
    args = step_shape_parser("").parse_args(["--batch-size", "2", "--input-length", "16", "--target-length", "8"])
    every = {name: (x.shape, w.shape, dy.shape) for name, _, x, w, dy in step_layer_operands(config, args, "cpu")}
    chosen = [*every][1::3]
    made = step_layer_operands(config, args, "cpu", layers=chosen)
    assert {name: (x.shape, w.shape, dy.shape) for name, _, x, w, dy in made} == {name: every[name] for name in chosen}
    assert 0 < len(chosen) < len(every)


def test_benchmark_comma_lists_are_checked_against_their_choices():
    from benchmarks.options import comma_choices

    assert comma_choices("enc, cross", ["enc", "dec", "cross"], "--shapes", "shape") == ["enc", "cross"]
    with pytest.raises(SystemExit, match="--shapes: unknown shape 'x'; choose among enc, dec"):
        comma_choices("enc,x", ["enc", "dec"], "--shapes", "shape")


def test_rms_norm_benchmark_counts_the_step_norms_and_their_gradients():
    """benchmarks/rms_norm.py scales one add + norm to a step by `step_rows`: its counts must be the
    model's RMS norms; its calls must hand back the pair's outputs and the gradients of h, o and w."""
    from benchmarks.rms_norm import Case, add_norm, min_bytes, step_rows
    from training.model import T5Config, T5ForConditionalGeneration
    from training.model.t5 import T5LayerNorm

    config = T5Config.from_preset("tiny", num_layers=3, num_decoder_layers=3)
    norms = sum(isinstance(m, T5LayerNorm) for m in T5ForConditionalGeneration(config).modules())
    assert sum(n for _, n in step_rows(2, 16, 8, 3)) == norms
    assert [rows for rows, _ in step_rows(2, 16, 8, 3)] == [32, 16]
    assert min_bytes(10, 8, torch.float32) == (80 * 12, 80 * 16)  # fp32 residual: 4+2+4+2, 2+4+4+4+2
    assert min_bytes(10, 8, torch.bfloat16) == (80 * 8, 80 * 10)

    case = Case(6, 8, torch.float32, "cpu")
    _, _, (y, s, dh, do, dw) = case.calls(add_norm)
    s64 = case.h.double() + case.o.double()
    rstd = s64.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
    xhat = s64 * rstd
    torch.testing.assert_close(s, s64.float())
    torch.testing.assert_close(y.double(), (xhat * case.w.double()).bfloat16().double())
    g = case.dy.double() * case.w.double()  # d(norm input) = rstd * (g - xhat * mean(g * xhat))
    ds = case.ds.double() + rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    torch.testing.assert_close(dh.double(), ds, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(do.double(), ds.bfloat16().double())
    torch.testing.assert_close(dw.double(), (case.dy.double() * xhat).sum(0), rtol=1e-5, atol=1e-5)


def test_fp8_gemm_operands_give_each_pass_product():
    """benchmarks/fp8_gemm_shapes.py times `_scaled_mm` on the FP8 operands it builds: for each of a
    linear layer's three GEMMs they must be in the layouts `_scaled_mm` takes and give the bf16
    product to FP8's precision (e4m3: 3 mantissa bits, a few % per element), or the timing would be
    of some other product."""
    from benchmarks.fp8_gemm_shapes import fp8_passes, scaled_mm

    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8")
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*shape, generator=g).to(torch.bfloat16) for shape in ((96, 48), (32, 48), (96, 32)))
    passes = fp8_passes(x, w, dy)
    assert [p.label for p in passes] == ["forward", "input grad", "weight grad"]
    expected = {"forward": x.float() @ w.float().t(), "input grad": dy.float() @ w.float(),
                "weight grad": dy.float().t() @ x.float()}  # fmt: skip
    for gemm in passes:
        torch.testing.assert_close(gemm.a.float() @ gemm.b.float(), expected[gemm.label])
        # the operands dequantized are the bf16 ones to FP8's precision, whatever _scaled_mm does
        dequantized = (gemm.a_fp8.float() * gemm.a_inv_scale) @ (gemm.b_fp8.float() * gemm.b_inv_scale)
        ref = expected[gemm.label]
        assert (dequantized - ref).norm() / ref.norm() < 0.06, gemm.label
        try:
            got = scaled_mm(gemm)
        except (RuntimeError, NotImplementedError) as e:  # a CPU build without _scaled_mm
            pytest.skip(f"torch._scaled_mm does not run here: {e}")
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert (got.float() - ref).norm() / ref.norm() < 0.06, gemm.label


def test_sni_generation_benchmark_runs_on_cpu_greedy_and_beam():
    """`training.sni.benchmark_eval` prints one JSON row per batch size, for greedy and beam search,
    and greedy with eager steps (the flag reaches `generate`, which refuses nothing on CPU)."""
    for beams, graph in ((1, "--cuda-graph"), (2, "--cuda-graph"), (1, "--no-cuda-graph")):
        r = subprocess.run([sys.executable, "-m", "training.sni.benchmark_eval", "--data", "tests/assets/sni",
                            "--preset", "tiny", "--instances", "6", "--batch-sizes", "3", "6", "--max-new-tokens",
                            "3", "--dtype", "fp32", "--num-beams", str(beams), graph],
                           cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-800:]
        rows = [json.loads(line) for line in r.stdout.splitlines()]
        assert [row["batch_size"] for row in rows] == [3, 6]
        assert all(row["num_beams"] == beams and row["instances"] == 6 and row["seconds"] > 0 for row in rows)
        assert all(row["cuda_graph"] == (graph == "--cuda-graph") for row in rows)


def test_trace_gaps_finds_idle_stretches_and_host_bound_launches(tmp_path, capsys):
    """benchmarks/trace_gaps.py on a hand-made chrome trace: a step's window runs from the first
    kernel launched inside its host range to the next step's first kernel; overlapping work merges
    into one busy stretch; a gap is host-bound only when its next kernel was launched after the GPU
    went idle."""
    from benchmarks.trace_gaps import idle_gaps, main, step_windows

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
    from benchmarks.trace_gaps import main, part_of

    assert part_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "kernel") == "GEMMs (cuBLAS)"
    assert part_of("_bwd_dkdv_kernel", "kernel") == part_of("_ds_batch_sum_kernel", "kernel") == "attention (ours)"
    assert part_of("_add_rms_norm_fwd_kernel", "kernel") == "residual add + RMS norm (ours)"  # not attention's
    assert part_of("_gated_gelu_fwd_kernel", "kernel") == "gated GELU (ours)"
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
    assert "| GEMMs (cuBLAS) | 0.30 | 57.7% |" in printed  # the kernel outside the steps is left out
    assert "| attention (ours) | 0.10 | 19.2% |" in printed and "| memsets and copies | 0.02 | 3.8% |" in printed
    assert "| **all GPU work** | **0.52** | |" in printed
    assert "| 0.10 | 2 | inductor's kernels (norms, casts, loss, optimizer, ...) | triton_poi_fused_0 |" in printed
    assert "nvjet_late" not in printed


def test_add_norm_sweep_says_which_output_differs_and_where():
    from benchmarks.add_norm_sweep import differences

    dh, dout, dw = torch.randn(6, 8), torch.randn(6, 8), torch.randn(8)
    expected = (dh, torch.empty(0), dw)  # no separate dout: skipped, as the sweep's default leaves it
    assert differences((dh.clone(), dout, dw + 1e-5), expected) == ""
    bad = dh.clone()
    bad[[1, 4], 3] += 0.5
    note = differences((bad, dout, dw), expected)
    assert note.startswith("dh max |diff| 0.5 ") and note.endswith("2 of 6 rows)")
    assert "dweight" not in note and "dout" not in note
    assert "dweight max |diff| 1 " in differences((dh, dout, dw + 1), expected)
    # A bf16 output may round to the neighbouring value (the sum's order differs), not further.
    cast = torch.tensor([[1.0, 2.0, -3.0, 100.0]], dtype=torch.bfloat16)
    one_ulp = torch.tensor([[1.0078125, 2.015625, -3.015625, 100.5]], dtype=torch.bfloat16)
    two_ulp = torch.tensor([[1.0, 2.0, -3.0, 101.0]], dtype=torch.bfloat16)
    assert differences((cast, one_ulp, dw), (cast, cast, dw)) == ""
    assert differences((cast, two_ulp, dw), (cast, cast, dw)).startswith("dout max |diff| 1 ")


def test_regional_compile_variant_keeps_loss_and_gradients(monkeypatch):
    """The benchmark's `regional` variant (each block, the final norms and the loss compiled on their
    own; inductor on CPU here) gives eager's loss and gradients. (It swaps the compiled loss into the
    model's module; `run_variant` puts the original back, here monkeypatch does.)"""
    from training import benchmark as bench
    from training.model import T5Config, T5ForConditionalGeneration, t5

    original = t5.fused_linear_cross_entropy
    monkeypatch.setattr(t5, "fused_linear_cross_entropy", original)  # put back after the test
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(T5ForConditionalGeneration(T5Config.from_preset("tiny", attention_backend="math")))
    eager, regional = models
    x, y = torch.randint(0, 100, (2, 12)), torch.randint(0, 100, (2, 5))
    try:
        bench._compile_regions(regional, {})
        assert t5.fused_linear_cross_entropy is not original
        assert all("forward" in vars(block) for block in (*regional.encoder.block, *regional.decoder.block))
        losses = []
        for model in (eager, regional):
            loss = model(input_ids=x, labels=y, return_logits=False).loss
            loss.backward()
            losses.append(loss.detach())
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, a), b in zip(eager.named_parameters(), regional.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5 * float(a.grad.abs().max()), msg=name)


def test_convergence_variants_parse():
    from benchmarks.convergence import parse_variants

    assert parse_variants("default=; quack=model.ffn_kernel=quack seed=3") == {
        "default": [], "quack": ["model.ffn_kernel=quack", "seed=3"]}
    for bad, match in (("default", "NAME=OVERRIDES"), ("a b=x=1", "NAME=OVERRIDES"), ("a=;a=x=1", "twice"),
                       ("a=model.ffn_kernel", "key=value"), (" ; ", "empty")):
        with pytest.raises(SystemExit, match=match):
            parse_variants(bad)


def test_convergence_script_on_cpu(shards, tmp_path):
    """Three variants (b and c the same) x two seeds of a 4-step schedule with evaluations: the same
    seed and variant gives the same held-out losses whichever invocation ran it, the seeds differ,
    a second invocation with the same --out runs nothing again, --table-only prints what --out
    holds, a run cut short runs again with its records kept aside, and a directory holding a run of
    another configuration stops the script before it runs or removes anything."""
    out, results = tmp_path / "conv", tmp_path / "rows.jsonl"
    base = [sys.executable, "benchmarks/convergence.py", "--data", str(shards), "--config",
            "training/configs/tiny_demo.yaml", "--steps", "4", "--warmup", "1", "--eval-every", "2",
            "--eval-samples", "16", "--log-every", "1", "--out", str(out), "data.input_length=64",
            "data.num_workers=0", "eval.batch_size=8", "optim.batch_size=4"]
    first = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.001", "--seeds", "0"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    kept = {name: (out / name).stat().st_mtime_ns for name in ("a_seed0.log", "b_seed0.log")}
    second = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.001;c=optim.base_lr=0.001", "--seeds", "0,1",
                             "--json", str(results)], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.count("done:") == 6
    rows = {(r["variant"], r["seed"]): r for r in map(json.loads, results.read_text().splitlines())}
    assert sorted(rows) == [(v, s) for v in "abc" for s in (0, 1)]
    for r in rows.values():
        assert r["eval_steps"] == [2, 4] and r["final_step"] == 4 and 0 <= r["final_eval_accuracy"] < 1
        assert r["eval_losses"][-1] == r["final_eval_loss"] and r["train_loss_end"] > 0
    # b seed 0 ran in the first invocation, c seed 0 in the second: the same run, the same figures
    assert rows[("b", 0)]["eval_losses"] == pytest.approx(rows[("c", 0)]["eval_losses"], rel=1e-5)
    assert rows[("a", 0)]["eval_losses"] != rows[("b", 0)]["eval_losses"]  # the variant's override took effect
    assert rows[("a", 0)]["eval_losses"] != rows[("a", 1)]["eval_losses"]  # so did the seed
    # the first invocation's runs were kept, not run again
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    assert sorted(p.name for p in out.glob("*.log")) == [f"{v}_seed{s}.log" for v in "abc" for s in (0, 1)]
    table = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.001;c=optim.base_lr=0.001", "--seeds", "0,1",
                            "--table-only"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stdout[-3000:] + table.stderr[-3000:]
    summary = [line for line in table.stdout.splitlines() if "final held-out loss" in line]
    assert [line.split()[0] for line in summary] == ["a", "b", "c"]
    mean_b = statistics.fmean(rows[("b", s)]["final_eval_loss"] for s in (0, 1))
    assert f"b              final held-out loss {mean_b:.4f} over 2 seed(s)" in table.stdout
    assert "gap to a +0.0000" in summary[0]
    # a variant name reused for other overrides: stopped before anything runs, nothing removed
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    clash = subprocess.run([*base, "--variants", "a=;b=optim.base_lr=0.002", "--seeds", "0"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert clash.returncode != 0 and "holds a run of another configuration (optim.base_lr: 0.001 there, 0.002 here)" \
        in clash.stderr, clash.stdout[-2000:] + clash.stderr[-2000:]
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    # a run cut short (its last evaluation missing) runs again; its records are moved aside
    metrics = out / "a_seed1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    last_eval = max(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "eval")
    metrics.write_text("".join(lines[:last_eval]))
    again = subprocess.run([*base, "--variants", "a=", "--seeds", "1"], cwd=REPO, env=_env(), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"done: a seed 1: held-out loss {rows[('a', 1)]['final_eval_loss']:.4f} at step 4" in again.stdout
    assert len(list((out / "a_seed1").glob("metrics.cut_short.*.jsonl"))) == 1


def test_ds_batch_sum_region_error_sees_every_region_and_the_band():
    """benchmarks/ds_batch_sum.py's check of the far sum: 0 for a result with each far region's row
    sum moved to one key, and not 0 when a far region's sum, or one band element, is off."""
    from benchmarks.ds_batch_sum import far_regions, region_error

    torch.manual_seed(0)
    sq, far = 12, 4
    whole = torch.randn(2, sq, sq, dtype=torch.float64)
    right, left = far_regions(sq, sq, far)
    assert right[0, far] and not right[0, far - 1] and left[far, 0] and not left[far - 1, 0]
    moved = whole.clone()
    for region, key in ((right, sq - 1), (left, 0)):
        sums = (whole * region).sum(-1)
        moved[region.expand_as(moved)] = 0
        rows = region[:, key]
        moved[:, rows, key] = sums[:, rows]
    assert not torch.equal(moved, whole)
    assert region_error(moved, whole, far) < 1e-12
    for region, key in ((right, sq - 1), (left, 0)):  # a far region's sum off
        row = int(region[:, key].nonzero()[0])
        off = moved.clone()
        off[1, row, key] += 1.0
        assert region_error(off, whole, far) > 1e-3
    off = moved.clone()
    off[0, 5, 5] += 1.0  # the diagonal: in the band
    assert region_error(off, whole, far) > 1e-3
