"""Training-step benchmark of our T5 on one GPU: seconds/step, tokens/s, model TFLOP/s, MFU, peak memory.

One step = forward + backward + grad-norm clipping + optimizer step (RMS-scaled AdamW from
training.optim when available) on synthetic tokens, bf16 autocast, TF32 on, fp32 master weights.
MFU is measured against a bf16 8192^3 matmul timed in the same run. s/step is the median of
per-step CUDA-event times (each step synchronised); "wall s/step" times the same number of steps
back to back on the host clock, as a training loop runs them (compare it with the engine).
"1st step s" is the first step's time, compile included, with what AOTAutograd's cache did for
the step's graphs (hit: a process before this one compiled the same code; docs/model_speed.md, "The
compile cache").

    python -m training.benchmark                                  # base, batch 128, 512 -> 114, all fast paths
    python -m training.benchmark --attention sdpa --no-fused-ce
    python -m training.benchmark --variants "triton;sdpa;triton,nocompile;triton,bs=256"
    python -m training.benchmark --trace step.json && python benchmarks/trace_gaps.py step.json

A variant is a comma list of: an attention backend (triton|cudnn|sdpa|flex|math), compile|nocompile,
fusedce|nofusedce, bs=N, mode=MODE (torch.compile mode), dbiaskernel|dbiasatomic (the fused kernel's
bias gradient from its separate dbias kernel, or by atomic adds from the dQ kernel, instead of the
dS that the dQ kernel writes; triton_attention.DBIAS_PATH), dssumkernel|dssumfar|dssumtorch (that dS
summed over the batch by our kernel in a fixed order, by the kernel that reads only half of the
encoder's from the rows' zero sums, or by torch, which inductor fuses with the bias table's
scatter-add; triton_attention.DS_SUM), dqrecompute|dqstored|dqstoredbias (dQ
recomputed from P and dP, or computed from the dS that the dK/dV kernel stores, in every attention or
in those with a bias; triton_attention.DQ_PATH), optcompiled|opteager
(AdamWScale's update compiled or foreach kernels), bf16residual|fp32residual (T5Config.residual_dtype
"autocast" or "float32"), torchgelu (the gated GELU as torch ops for inductor to fuse instead of
training/model/triton_gated_gelu.py), torchnorm (each residual add and the RMS norm after it as torch
ops for inductor to fuse, instead of training/model/triton_add_norm.py), fartiles | fartiles=fwd+dq+dkdv | nofartiles (tiles wholly
beyond the distance where T5's bias saturates skip their bias loads, in every attention kernel, in
the ones named, or in none; triton_attention.FAR_TILES), clipinstep|clipbefore (AdamWScale clips the
gradients inside its step, as training runs at ZeRO 0 do, or torch's clip_grad_norm_ runs before the
step; training/grad_clip.py), deterministic (training/determinism.py: deterministic algorithms, as the
run config's `deterministic`), classtiles|enctiles (each attention's tiles by its kind and query
length, or the encoder's for every attention: triton_attention.tile_class and its tile tables),
biashalf|biasfp32 (the fused kernel reads T5's dense bias in fp16 or fp32 for bf16 inputs;
triton_attention.BIAS_HALF), relbias|densebias (the fused kernel takes T5's relative bias row and sums its gradient per key -
query offset in its dQ kernel, or the dense (heads, q, k) bias and returns a dense gradient per
layer; triton_attention.RELATIVE_BIAS), oneblock|nooneblock (the backward of attention with at most
128 queries, the decoder's and the cross-attention's, as one kernel per batch element and head, or
as the dK/dV and dQ kernels of longer queries; triton_attention.ONE_BLOCK_BWD), regional|wholemodel
(torch.compile each T5 block, the final norms and the loss on their own, as ZeRO 3's blocks mode does,
or the whole step as one graph as training does at ZeRO 0-2), pdl|nopdl (inductor's kernels
launched with programmatic dependent launch on Hopper or newer, as training compiles the model, or
without; training.run_setup.compile_options), quackffn|cublasffn (the gated FFN with the GELU in the
epilogues of QuACK's GEMMs, T5Config.ffn_kernel "quack", needs quack-kernels and sm90+; or cuBLAS
GEMMs and our GELU kernels), cublaslt|cublas (torch's GEMMs through cuBLASLt or cuBLAS,
torch.backends.cuda.preferred_blas_library; without either, torch's own choice, cuBLAS on CUDA),
cdtune (inductor's coordinate-descent tuning of its own kernels' launch settings,
`coordinate_descent_tuning`: a longer first compile), nobias (no relative bias in any attention: not
T5 any more, a bound on what any kernel for T5's bias and its gradient could give the step). Each
variant prints one table row, ending with the loss of the last step and the sum of every parameter
after it (two runs of the same variant are bit-identical when both are `deterministic`); --json
appends one JSON object per variant to a file.
The attention tiles come from the T5DS_ATTN_* environment variables (training/model/triton_attention.py)
for sweeps.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from training.determinism import set_deterministic
from training.grad_clip import GradClip
from training.model import T5Config, T5ForConditionalGeneration
from training.model.config import RESIDUAL_DTYPES
from training.model.flops import measure_matmul_tflops, model_flops_per_step
from training.run_setup import compile_cache_outcomes, compile_options


def build_optimizer(model: torch.nn.Module, name: str, compiled: bool = False) -> torch.optim.Optimizer:
    if name == "adamwscale":
        try:
            from training.optim import build_optimizer as build
        except ImportError:  # the optimizer package is not there: fall back, say so in the output
            name = "adamw"
        else:
            return build("adamwscale", model, lr=2e-2, weight_decay=0.0, compiled=compiled)
    return torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0, fused=True)


def parse_variant(spec: str, args: argparse.Namespace) -> dict:
    from training.model.triton_attention import (
        BIAS_HALF,
        DQ_PATH,
        DS_SUM,
        FAR_TILES,
        ONE_BLOCK_BWD,
        RELATIVE_BIAS,
    )

    variant = dict(
        attention=args.attention, compile=args.compile, fused_ce=args.fused_ce, batch_size=args.batch_size,
        mode=args.compile_mode, dbias="ds", ds_sum=DS_SUM, dq=DQ_PATH, opt_compiled=args.optimizer_compiled,
        residual_dtype=args.residual_dtype, triton_gelu=True, far_tiles=FAR_TILES, clip_in_step=True,
        deterministic=False, tiles_per_class=True, triton_add_norm=True, relative_bias=RELATIVE_BIAS,
        one_block=ONE_BLOCK_BWD, regional=False, bias_half=BIAS_HALF, pdl=True, quack_ffn=False,
        blas=None, cd_tuning=False, no_bias=False,
    )  # fmt: skip
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in ("triton", "cudnn", "sdpa", "flex", "math"):
            variant["attention"] = item
        elif item in ("compile", "nocompile"):
            variant["compile"] = item == "compile"
        elif item in ("fusedce", "nofusedce"):
            variant["fused_ce"] = item == "fusedce"
        elif item.startswith("bs="):
            variant["batch_size"] = int(item[3:])
        elif item.startswith("mode="):
            variant["mode"] = item[5:]
        elif item in ("dbiaskernel", "dbiasatomic"):
            variant["dbias"] = item[5:]
        elif item in ("dssumkernel", "dssumfar", "dssumtorch"):
            variant["ds_sum"] = item[5:]
        elif item in ("dqrecompute", "dqstored", "dqstoredbias"):
            variant["dq"] = {"dqrecompute": "recompute", "dqstored": "stored", "dqstoredbias": "stored_bias"}[item]
        elif item in ("optcompiled", "opteager"):
            variant["opt_compiled"] = item == "optcompiled"
        elif item == "torchgelu":
            variant["triton_gelu"] = False
        elif item == "torchnorm":
            variant["triton_add_norm"] = False
        elif item == "nofartiles":
            variant["far_tiles"] = ()
        elif item == "fartiles" or item.startswith("fartiles="):
            variant["far_tiles"] = _far_tile_kernels(item, spec)
        elif item in ("clipinstep", "clipbefore"):
            variant["clip_in_step"] = item == "clipinstep"
        elif item in ("bf16residual", "fp32residual"):
            variant["residual_dtype"] = "autocast" if item == "bf16residual" else "float32"
        elif item == "deterministic":
            variant["deterministic"] = True
        elif item in ("classtiles", "enctiles"):
            variant["tiles_per_class"] = item == "classtiles"
        elif item in ("relbias", "densebias"):
            variant["relative_bias"] = item == "relbias"
        elif item in ("oneblock", "nooneblock"):
            variant["one_block"] = item == "oneblock"
        elif item in ("biashalf", "biasfp32"):
            variant["bias_half"] = item == "biashalf"
        elif item in ("regional", "wholemodel"):
            variant["regional"] = item == "regional"
        elif item in ("quackffn", "cublasffn"):
            variant["quack_ffn"] = item == "quackffn"
        elif item in ("pdl", "nopdl"):
            variant["pdl"] = item == "pdl"
        elif item in ("cublaslt", "cublas"):
            variant["blas"] = item
        elif item == "cdtune":
            variant["cd_tuning"] = True
        elif item == "nobias":
            variant["no_bias"] = True
        else:
            raise SystemExit(f"unknown variant item {item!r} in {spec!r}")
    return variant


def _far_tile_kernels(item: str, spec: str) -> tuple[str, ...]:
    """`fartiles` = far tiles in every attention kernel; `fartiles=fwd+dq` = in the ones named."""
    from training.model.triton_attention import FAR_TILE_KERNELS

    if item == "fartiles":
        return FAR_TILE_KERNELS
    kernels = tuple(item.split("=", 1)[1].split("+"))
    if not set(kernels) <= set(FAR_TILE_KERNELS):  # also "fartiles=" (one empty name)
        raise SystemExit(f"{item!r} in {spec!r}: name kernels among {'+'.join(FAR_TILE_KERNELS)}")
    return kernels


def variant_label(v: dict) -> str:
    """The table row's first column: the attention backend and every kernel/optimizer/dtype choice
    that differs from the default path."""
    notes = [] if v["dbias"] == "ds" else [f"dbias {v['dbias']}"]
    notes += [f"dS summed by {v['ds_sum']}"] if v["dbias"] == "ds" and v["ds_sum"] != "kernel" else []
    notes += [] if v["dq"] == "recompute" else [f"dQ {v['dq'].replace('_', ' ')}"]
    notes += ["opt compiled"] if v["opt_compiled"] else []
    notes += ["bf16 residual"] if v["residual_dtype"] == "autocast" else []
    notes += [] if v["triton_gelu"] else ["torch GELU"]
    notes += [] if v["triton_add_norm"] else ["torch add + norm"]
    notes += [f"far tiles {'+'.join(v['far_tiles'])}" if v["far_tiles"] else "no far tiles"]
    notes += [] if v["clip_in_step"] else ["clip before step"]
    notes += ["deterministic"] if v["deterministic"] else []
    notes += [] if v["tiles_per_class"] else ["encoder tiles everywhere"]
    notes += ["relative bias"] if v["relative_bias"] else []
    notes += ["fp16 bias"] if v["bias_half"] else []
    notes += [] if v["one_block"] else ["no one-block backward"]
    notes += ["regional compile"] if v["regional"] else []
    notes += [] if v["pdl"] else ["no PDL"]
    notes += ["QuACK FFN"] if v["quack_ffn"] else []
    notes += [v["blas"]] if v["blas"] else []
    notes += ["coordinate-descent tuning"] if v["cd_tuning"] else []
    notes += ["NO relative bias (not T5)"] if v["no_bias"] else []
    return ", ".join([v["attention"], *notes])


def run_variant(variant: dict, args: argparse.Namespace, device: torch.device) -> dict:
    from training.model import t5, triton_add_norm, triton_gated_gelu
    from training.model import triton_attention as ta

    defaults = (ta.DBIAS_PATH, ta.DS_SUM, ta.DQ_PATH, ta.FAR_TILES, ta.RELATIVE_BIAS, ta.ONE_BLOCK_BWD, ta.BIAS_HALF,
                triton_gated_gelu.ENABLED, triton_add_norm.ENABLED, t5.fused_linear_cross_entropy,
                t5.T5Stack.position_bias)  # fmt: skip
    tables = ta.TILE_TABLES.values()
    default_tiles = [dict(table) for table in tables]
    ta.DBIAS_PATH, ta.DS_SUM, ta.DQ_PATH = variant["dbias"], variant["ds_sum"], variant["dq"]
    ta.FAR_TILES, ta.RELATIVE_BIAS = variant["far_tiles"], variant["relative_bias"]
    ta.ONE_BLOCK_BWD, ta.BIAS_HALF = variant["one_block"], variant["bias_half"]
    triton_gated_gelu.ENABLED = variant["triton_gelu"]
    triton_add_norm.ENABLED = variant["triton_add_norm"]
    if variant["no_bias"]:
        t5.T5Stack.position_bias = _no_position_bias
    if not variant["tiles_per_class"]:  # the encoder's tiles everywhere, as before the sixteenth session
        for table in tables:
            if "enc" in table:  # (the one-block kernel's table has the short classes only)
                table.update(dict.fromkeys(table, table["enc"]))
    # Per variant, so after the matmul ceiling's first cuBLAS call (set_deterministic asks for before):
    # cuBLAS keeps the workspace it started with, and two deterministic runs were bit-identical anyway.
    set_deterministic(variant["deterministic"])
    blas = torch.backends.cuda.preferred_blas_library()  # (no argument: returns the setting)
    torch.backends.cuda.preferred_blas_library(variant["blas"])  # (None: leaves it)
    try:
        return _run_variant(variant, args, device)
    finally:
        torch.backends.cuda.preferred_blas_library(blas)
        (ta.DBIAS_PATH, ta.DS_SUM, ta.DQ_PATH, ta.FAR_TILES, ta.RELATIVE_BIAS, ta.ONE_BLOCK_BWD, ta.BIAS_HALF,
         triton_gated_gelu.ENABLED, triton_add_norm.ENABLED, t5.fused_linear_cross_entropy,
         t5.T5Stack.position_bias) = defaults  # fmt: skip
        for table, tiles in zip(tables, default_tiles):
            table.update(tiles)
        set_deterministic(False)


def _no_position_bias(stack, q_len, k_len, q_offset, device) -> None:
    """`nobias`: T5Stack.position_bias for a model without T5's relative bias. Every attention then
    runs the kernels' no-bias path (as the cross-attention does), and the bias tables get no gradient."""
    return None


def _run_variant(variant: dict, args: argparse.Namespace, device: torch.device) -> dict:
    if variant["quack_ffn"]:
        from training.model import quack_ffn

        quack_ffn.load()  # raises where QuACK cannot run, rather than time the default FFN under its name
    config = T5Config.from_preset(
        args.preset, attention_backend=variant["attention"], residual_dtype=variant["residual_dtype"],
        ffn_kernel="quack" if variant["quack_ffn"] else "default",
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).to(device)
    optimizer = build_optimizer(model, args.optimizer, variant["opt_compiled"])
    bs, src, tgt = variant["batch_size"], args.input_length, args.target_length
    input_ids = torch.randint(2, config.vocab_size, (bs, src), device=device)
    labels = torch.randint(2, config.vocab_size, (bs, tgt), device=device)
    labels[:, -1] = config.eos_token_id
    return_logits = not variant["fused_ce"]

    def loss_fn(ids, lab):
        return model(ids, labels=lab, return_logits=return_logits).loss

    # as training compiles the model
    options = compile_options(variant["mode"] or "default", pdl=variant["pdl"]) if variant["compile"] else None
    if options is not None and variant["cd_tuning"]:
        options["coordinate_descent_tuning"] = True
    if variant["compile"] and variant["regional"]:
        _compile_regions(model, options)
    elif variant["compile"]:
        loss_fn = torch.compile(loss_fn, fullgraph=args.fullgraph, options=options)

    # Clipping as the training loop does it at ZeRO 0: inside AdamWScale's step, or (clipbefore, or
    # an optimizer without in-step clipping) torch's foreach clip_grad_norm_ before the step.
    clip = GradClip(model.parameters(), 1.0, optimizer if variant["clip_in_step"] else None)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(input_ids, labels)
        loss.backward()
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    torch.cuda.reset_peak_memory_stats()
    counters["aot_autograd"].clear()
    t0 = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0  # compiles (or loads from the compile caches)
    compile_cache = compile_cache_outcomes()  # this variant's: the counters were cleared above
    for _ in range(args.warmup - 1):
        loss = step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    sec = statistics.median(times)
    # The same number of steps back to back, timed on the host clock with no sync between steps:
    # how a training loop sees it (host time between steps included), to compare with the engine.
    torch.cuda.synchronize()
    wall_start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    wall_sec = (time.perf_counter() - wall_start) / args.steps
    trace = variant.get("trace", "")
    if args.profile or trace:
        from torch.profiler import ProfilerActivity, profile, record_function

        # CPU activity too when a trace is asked for: benchmarks/trace_gaps.py matches each kernel to
        # its launch to tell host-bound gaps from others; each step is one `benchmark_step` range.
        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                with record_function("benchmark_step"):
                    step()
            torch.cuda.synchronize()
        if trace:
            prof.export_chrome_trace(trace)
    if args.profile:
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
        print(table, flush=True)
        if args.profile != "-":
            with open(args.profile, "a") as f:
                f.write(f"{variant}\n{table}\n")
    flops = model_flops_per_step(config, bs, src, tgt)
    result = dict(
        variant=variant, s_per_step=sec, wall_s_per_step=wall_sec, tokens_per_s=bs * (src + tgt) / sec,
        model_tflops=flops / sec / 1e12,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30, first_step_s=first_step_s,
        compile_cache=compile_cache, final_loss=float(loss.detach()),
        param_sum=float(sum(p.detach().double().sum() for p in model.parameters())),
        optimizer=type(optimizer).__name__,
    )  # fmt: skip
    return result


def _compile_regions(model: torch.nn.Module, options: dict) -> None:
    """Regional compilation (variant `regional`): each T5 block compiled on its own, as ZeRO 3's
    `model.zero3_compile=blocks` does (the blocks of a stack share their graphs), the final norms and
    the fused cross-entropy too; the embeddings and the bias lookup stay eager. Fewer, smaller graphs
    to compile than the whole model's, and no fusion across their borders. The blocks take the default
    mode's options without PDL (as under ZeRO 3), the loss `options` (so `pdl|nopdl` reaches only the
    loss here)."""
    import training.model.t5 as t5
    from training.zero3_compile import _compiled_block_forward

    norm = torch.compile(t5.rms_norm)
    for stack in (model.encoder, model.decoder):
        stack.final_layer_norm.norm_fn = norm
        for block in stack.block:
            block.forward = _compiled_block_forward(block, "inductor")
    # the model looks the loss up in its module's namespace on each call (this process only)
    t5.fused_linear_cross_entropy = torch.compile(t5.fused_linear_cross_entropy, fullgraph=True, options=options)


def _cache_outcome(result: dict) -> str:
    """' (hit)', ' (miss, bypass)', ...: what AOTAutograd's cache did for the first step's compile."""
    return f" ({', '.join(result['compile_cache'])})" if result["compile_cache"] else ""


def _time_cuda(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def attention_microbenchmark(
    batch_size: int, seq: int, heads: int = 12, d_kv: int = 64, iters: int = 20
) -> None:
    """Time one encoder self-attention (bias + its gradient) per backend and bias path, from a packed
    (batch, seq, 3 * heads * d_kv) projection output as the model runs it (a path "ds+stored": dQ
    from the dS that the dK/dV kernel stores). The "T5 bias" cases use
    a bias made from T5's buckets (32, up to distance 128), with and without far tiles."""
    from training.model import triton_attention as ta
    from training.model.attention import (
        bias_saturation_distance,
        dense_bias,
        packed_attention,
        relative_position_bucket,
    )

    device = torch.device("cuda")
    qkv = torch.randn(
        batch_size, seq, 3 * heads * d_kv, device=device, dtype=torch.bfloat16, requires_grad=True
    )
    dense = torch.randn(heads, seq, seq, device=device, requires_grad=True)
    buckets = relative_position_bucket(torch.arange(-(seq - 1), seq, device=device), True)
    t5_bias = dense_bias(torch.randn(32, heads, device=device)[buckets].t(), seq, seq).requires_grad_()
    far = bias_saturation_distance(True)
    dout = torch.randn(batch_size, seq, heads * d_kv, device=device, dtype=torch.bfloat16)
    flops = 4 * batch_size * heads * seq * seq * d_kv  # forward QK^T + PV; backward is 2.5x (recomputes QK^T)
    defaults = ta.DBIAS_PATH, ta.DQ_PATH, ta.FAR_TILES
    fwd_far = ta.FAR_TILES
    cases = [  # (name, backend, bias, bias-gradient path of the triton kernels, far distance, far-tile kernels)
        ("triton, T5 bias, no far tiles", "triton", t5_bias, "ds", far, ()),
        ("triton, T5 bias, default far tiles, dQ from the stored dS", "triton", t5_bias, "ds+stored", far,
         fwd_far),
        ("triton, no bias, dQ from the stored dS", "triton", None, "ds+stored", 0, ()),
        *[(f"triton, T5 bias, far tiles (from distance {far}) in {'+'.join(kernels)}", "triton", t5_bias,
           "ds", far, kernels) for kernels in [("fwd",), ("dq",), ("dkdv",), ta.FAR_TILE_KERNELS]],
        ("triton, no bias", "triton", None, "ds", 0, ()),
        ("triton, random dense bias, dbias from dS (default)", "triton", dense, "ds", 0, ()),
        ("triton, random dense bias, dbias kernel", "triton", dense, "kernel", 0, ()),
        ("triton, random dense bias, dbias by atomic adds", "triton", dense, "atomic", 0, ()),
        ("sdpa, random dense bf16 bias", "sdpa", dense, "ds", 0, ()),
        ("cudnn (training/model/cudnn_attention.py), T5 bias in bf16", "cudnn", t5_bias, "ds", far, fwd_far),
        ("cudnn, no bias", "cudnn", None, "ds", 0, ()),
    ]  # fmt: skip
    for name, backend, bias, path, bias_far, far_tiles in cases:
        ta.DBIAS_PATH, ta.DQ_PATH = (path.split("+") + ["recompute"])[:2]
        ta.FAR_TILES = far_tiles
        try:
            with torch.no_grad():
                fwd = _time_cuda(
                    lambda b=backend, x=bias, f=bias_far: packed_attention(
                        qkv, None, heads, x, None, False, b, bias_far=f
                    ),
                    iters,
                )
            total = _time_cuda(
                lambda b=backend, x=bias, f=bias_far: torch.autograd.backward(
                    packed_attention(qkv, None, heads, x, None, False, b, bias_far=f), dout
                ),
                iters,
            )
            bwd = total - fwd
            print(f"# {name} b{batch_size} s{seq}: fwd {fwd * 1e3:.2f} ms ({flops / fwd / 1e12:.0f} TFLOP/s), "
                  f"bwd {bwd * 1e3:.2f} ms ({2.5 * flops / bwd / 1e12:.0f} TFLOP/s)", flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001
            print(f"# {name}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            ta.DBIAS_PATH, ta.DQ_PATH, ta.FAR_TILES = defaults


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--attention", default="triton", choices=["triton", "cudnn", "sdpa", "flex", "math"])
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--compile-mode", default="", help="torch.compile mode, e.g. max-autotune-no-cudagraphs"
    )
    parser.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                        help="fail on a graph break instead of silently splitting the step")  # fmt: skip
    parser.add_argument("--fused-ce", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--optimizer", default="adamwscale", choices=["adamwscale", "adamw"])
    parser.add_argument("--residual-dtype", default="float32", choices=RESIDUAL_DTYPES,
                        help="T5Config.residual_dtype (autocast: bf16 hidden states between blocks)")  # fmt: skip
    parser.add_argument("--optimizer-compiled", action=argparse.BooleanOptionalAction, default=True,
                        help="AdamWScale(compiled=True), as the run config's optim.compile")  # fmt: skip
    parser.add_argument("--steps", type=int, default=15, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default="", help="';'-separated variant specs (see module doc)")
    parser.add_argument(
        "--profile", default="", help="profile 3 steps; print the kernel table (and append to FILE)"
    )
    parser.add_argument("--trace", default="",
                        help="profile 3 steps and write their chrome trace to FILE (FILE.<i>.json with several variants); "
                             "benchmarks/trace_gaps.py reads it")  # fmt: skip
    parser.add_argument(
        "--attention-micro", action="store_true", help="also time the attention kernels alone"
    )
    parser.add_argument("--json", default="", help="append one JSON line per variant to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("training.benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    ceiling = measure_matmul_tflops(device)
    print(
        f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 8192^3 matmul {ceiling:.0f} TFLOP/s"
    )
    print(f"# T5 {args.preset}, inputs {args.input_length}, targets {args.target_length}, bf16 autocast, "
          f"{args.optimizer} + clip, median of {args.steps} after {args.warmup} warm-up")  # fmt: skip
    if args.attention_micro:
        attention_microbenchmark(args.batch_size, args.input_length)
    print(
        "| attention | compile | fused CE | batch | s/step | tokens/s | model TFLOP/s | MFU | peak GiB | 1st step s "
        "| wall s/step | last loss | parameter sum |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    specs = args.variants.split(";") if args.variants else [""]
    for i, spec in enumerate(specs):
        variant = parse_variant(spec, args)
        if args.trace:  # one trace per variant: FILE, or FILE's stem numbered by variant
            path = Path(args.trace)
            variant["trace"] = str(path if len(specs) == 1 else path.with_name(f"{path.stem}.{i}{path.suffix}"))
        try:
            r = run_variant(variant, args, device)
        except torch.cuda.OutOfMemoryError:
            r = dict(
                variant=variant, error="out of memory", peak_gib=torch.cuda.max_memory_allocated() / 2**30
            )
        except Exception as e:  # noqa: BLE001 - a failing variant must not hide the others
            r = dict(variant=variant, error=f"{type(e).__name__}: {str(e)[:300]}")
        v = variant
        compiled = ("yes " + v["mode"]).strip() if v["compile"] else "no"
        head = f"| {variant_label(v)} | {compiled} | "
        head += f"{'yes' if v['fused_ce'] else 'no'} | {v['batch_size']} |"
        if "error" in r:
            print(f"{head} {r['error']} | | | | {r.get('peak_gib', 0):.1f} | | | | |", flush=True)
        else:
            r["mfu"] = r["model_tflops"] / ceiling
            print(f"{head} {r['s_per_step']:.4f} | {r['tokens_per_s'] / 1e3:.0f}k | {r['model_tflops']:.0f} | "
                  f"{r['mfu']:.1%} | {r['peak_gib']:.1f} | {r['first_step_s']:.0f}{_cache_outcome(r)} | {r['wall_s_per_step']:.4f} | "
                  f"{r['final_loss']:.9g} | {r['param_sum']!r} |",
                  flush=True)  # fmt: skip
        r["matmul_ceiling_tflops"] = ceiling
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
