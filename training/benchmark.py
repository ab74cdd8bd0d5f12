"""Training-step benchmark of our T5 on one GPU: seconds/step, tokens/s, model TFLOP/s, MFU, peak memory.

One step = forward + backward + grad-norm clipping + optimizer step (RMS-scaled AdamW from
training.optim when available) on synthetic tokens, bf16 autocast, TF32 on, fp32 master weights.
MFU is measured against a bf16 8192^3 matmul timed in the same run. s/step is the median of
per-step CUDA-event times (each step synchronised); "wall s/step" times the same number of steps
back to back on the host clock, as a training loop runs them (compare it with the engine).
"1st step s" is the first step's time, compile included, with what AOTAutograd's cache did for
the step's graphs (hit: a process before this one compiled the same code).

    python -m training.benchmark                                  # base, batch 128, 512 -> 114, all fast paths
    python -m training.benchmark --attention sdpa --no-fused-ce
    python -m training.benchmark --variants "triton;sdpa;triton,nocompile;triton,bs=256"
    python -m training.benchmark --trace step.json && python tools/trace_gaps.py step.json

A variant is a comma list of: an attention backend (triton|sdpa|math), compile|nocompile,
fusedce|nofusedce, bs=N, mode=MODE (torch.compile mode), optfused|opteager (AdamWScale's update as one
Triton kernel or torch's foreach kernels, as the run config's optim.compile), clipinstep|clipbefore
(AdamWScale clips the gradients inside its step, as training runs at ZeRO 0 do, or torch's
clip_grad_norm_ runs before the step; training/grad_clip.py), bf16residual|fp32residual
(T5Config.residual_dtype "autocast" or "float32"), quackffn|cublasffn (T5Config.ffn_kernel "quack":
the gated FFN's GELU in the epilogues of QuACK's GEMMs, needs quack-kernels and sm90+; or "default":
cuBLAS GEMMs and our GELU kernels), deterministic (training/determinism.py, as the run config's
`deterministic`), regional|wholemodel (torch.compile each T5 block, the final norms and the loss on
their own, as training does with `model.compile_scope=blocks`, or the whole step as one graph, the
default), objective=ul2|prefix_lm (one batch of that objective, training/data/objectives.py, from
random raw tokens at --input-length: its padded targets and attention mask; tokens/s and FLOPs count
the real lengths), vocab=N (rows of the embedding and head: 32128 T5's, 250112 mT5's),
bias=auto|dense|row (T5Config.attention_bias_layout), ckpt=none|block|selective
(T5Config.activation_checkpointing), hf (transformers' T5ForConditionalGeneration of the same config
in place of ours: the model nanoT5 trains; its own attention and loss, gradient checkpointing for any
ckpt= but none). Each variant prints one table row, ending with the loss of the last step and the sum
of every parameter after it (two runs of the same variant are bit-identical when both are
`deterministic`); --json appends one JSON object per variant to a file.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch._dynamo.utils import counters

from training.compile_settings import compile_cache_outcomes, compile_model, compile_options
from training.config import DataConfig
from training.data.objectives import build_objective
from training.determinism import set_deterministic
from training.grad_clip import GradClip
from training.model import T5Config, T5ForConditionalGeneration, quack_ffn
from training.model.config import RESIDUAL_DTYPES
from training.model.flops import measure_matmul_tflops, model_flops_per_step, samples_flops_per_step

ATTENTION_BACKENDS = ("triton", "sdpa", "math")


def build_optimizer(model: torch.nn.Module, name: str, fused: bool = False) -> torch.optim.Optimizer:
    if name == "adamwscale":
        try:
            from training.optim import build_optimizer as build
        except ImportError:  # the optimizer package is not there: fall back, say so in the output
            name = "adamw"
        else:
            return build("adamwscale", model, lr=2e-2, weight_decay=0.0, fused=fused)
    return torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0, fused=True)


# Items that set one field to one of two values: item -> (field, value)
_SWITCHES = {
    "compile": ("compile", True), "nocompile": ("compile", False),
    "fusedce": ("fused_ce", True), "nofusedce": ("fused_ce", False),
    "optfused": ("opt_fused", True), "opteager": ("opt_fused", False),
    "clipinstep": ("clip_in_step", True), "clipbefore": ("clip_in_step", False),
    "bf16residual": ("residual_dtype", "autocast"), "fp32residual": ("residual_dtype", "float32"),
    "quackffn": ("quack_ffn", True), "cublasffn": ("quack_ffn", False),
    "deterministic": ("deterministic", True),
    "regional": ("regional", True), "wholemodel": ("regional", False),
    "hf": ("hf", True),
}  # fmt: skip
_SETTINGS = {"bs": ("batch_size", int), "mode": ("mode", str), "objective": ("objective", str),  # name=value
             "vocab": ("vocab_size", int), "bias": ("bias_layout", str), "ckpt": ("checkpointing", str)}  # fmt: skip


def parse_variant(spec: str, args: argparse.Namespace) -> dict:
    """The variant `spec` (see the module docstring) on top of the command line's settings."""
    variant = dict(
        attention=args.attention, compile=args.compile, fused_ce=args.fused_ce, batch_size=args.batch_size,
        mode=args.compile_mode, opt_fused=args.optimizer_fused, residual_dtype=args.residual_dtype,
        clip_in_step=True, deterministic=False, regional=False, quack_ffn=False, objective="span_corruption",
        vocab_size=T5Config.vocab_size, bias_layout=T5Config.attention_bias_layout, checkpointing="none", hf=False,
    )  # fmt: skip
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, value = item.partition("=")
        if item in ATTENTION_BACKENDS:
            variant["attention"] = item
        elif item in _SWITCHES:
            field, value = _SWITCHES[item]
            variant[field] = value
        elif value and name in _SETTINGS:
            field, kind = _SETTINGS[name]
            variant[field] = kind(value)
        else:
            raise SystemExit(f"unknown variant item {item!r} in {spec!r}")
    variant["fused_ce"] = variant["fused_ce"] and not variant["hf"]  # transformers' T5 has its own loss
    return variant


def variant_label(v: dict) -> str:
    """The table row's first column: the attention backend and every kernel/optimizer/dtype choice
    that differs from the default path."""
    notes = [] if v["opt_fused"] else ["opt foreach"]
    notes += ["bf16 residual"] if v["residual_dtype"] == "autocast" else []
    notes += [] if v["clip_in_step"] else ["clip before step"]
    notes += ["deterministic"] if v["deterministic"] else []
    notes += ["regional compile"] if v["regional"] else []
    notes += ["QuACK FFN"] if v["quack_ffn"] else []
    notes += [v["objective"]] if v["objective"] != "span_corruption" else []
    notes += [f"vocab {v['vocab_size']}"] if v["vocab_size"] != T5Config.vocab_size else []
    notes += [f"{v['bias_layout']} bias"] if v["bias_layout"] != T5Config.attention_bias_layout else []
    notes += [f"checkpointing {v['checkpointing']}"] if v["checkpointing"] != "none" else []
    return ", ".join(["transformers T5" if v["hf"] else v["attention"], *notes])


def run_variant(variant: dict, args: argparse.Namespace, device: torch.device) -> dict:
    """One variant's figures."""
    # Per variant, so after the matmul ceiling's first cuBLAS call (set_deterministic asks for before):
    # cuBLAS keeps the workspace it started with, and two deterministic runs are bit-identical anyway.
    set_deterministic(variant["deterministic"])
    try:
        return _run_variant(variant, args, device)
    finally:
        set_deterministic(False)


def _run_variant(variant: dict, args: argparse.Namespace, device: torch.device) -> dict:
    if variant["quack_ffn"]:
        quack_ffn.load()  # raises where QuACK cannot run, rather than time the default FFN under its name
    config = T5Config.from_preset(args.preset, attention_backend=variant["attention"], residual_dtype=variant[
        "residual_dtype"], ffn_kernel="quack" if variant["quack_ffn"] else "default", vocab_size=variant["vocab_size"],
        attention_bias_layout=variant["bias_layout"], activation_checkpointing=variant["checkpointing"])
    torch.manual_seed(0)
    model = hf_model(config) if variant["hf"] else T5ForConditionalGeneration(config)
    model = model.to(device)
    optimizer = build_optimizer(model, args.optimizer, variant["opt_fused"])
    bs, src, tgt = variant["batch_size"], args.input_length, args.target_length
    input_ids = torch.randint(2, config.vocab_size, (bs, src), device=device)
    labels = torch.randint(2, config.vocab_size, (bs, tgt), device=device)
    labels[:, -1] = config.eos_token_id
    mask, flops = None, model_flops_per_step(config, bs, src, tgt)
    if variant["objective"] != "span_corruption":
        batch = {k: torch.from_numpy(v).to(device) for k, v in objective_batch(variant["objective"], bs, src).items()}
        input_ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        flops = samples_flops_per_step(config, mask.sum(1).cpu(), (labels != -100).sum(1).cpu())
    tokens = int((labels != -100).sum()) + (bs * src if mask is None else int(mask.sum()))
    return_logits = not variant["fused_ce"]

    def loss_fn(ids, lab):
        if variant["hf"]:
            return model(input_ids=ids, labels=lab, attention_mask=mask).loss
        return model(ids, labels=lab, attention_mask=mask, return_logits=return_logits).loss

    # as training compiles the model
    options = compile_options(variant["mode"] or "default") if variant["compile"] else None
    if variant["compile"] and variant["regional"]:
        compile_model(model, "blocks", variant["mode"] or "default")
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

        # CPU activity too when a trace is asked for: tools/trace_gaps.py matches each kernel to
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
    return dict(
        variant=variant, s_per_step=sec, wall_s_per_step=wall_sec, tokens_per_s=tokens / sec,
        model_tflops=flops / sec / 1e12,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30, first_step_s=first_step_s,
        compile_cache=compile_cache, final_loss=float(loss.detach()),
        param_sum=float(sum(p.detach().double().sum() for p in model.parameters())),
        optimizer=type(optimizer).__name__,
    )  # fmt: skip


def hf_model(config: T5Config) -> torch.nn.Module:
    """transformers' T5ForConditionalGeneration of `config` (variant `hf`), with gradient checkpointing
    per block where `config.activation_checkpointing` asks for any. The head is its own parameter, as
    T5 v1.1's is (transformers 5 ties it to the embedding whatever the config says)."""
    import transformers

    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**config.to_hf_config()))
    if not config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "scale_decoder_outputs"):
            model.config.scale_decoder_outputs = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    if config.activation_checkpointing != "none":
        model.gradient_checkpointing_enable()
    return model


def objective_batch(name: str, batch_size: int, input_length: int) -> dict:
    """One batch of the pre-training objective `name` from random raw tokens (T5 vocabulary)."""
    data = DataConfig(objective=name, input_length=input_length, tokenizer="assets/t5/spiece.model")
    objective = build_objective(data)
    rows = np.random.default_rng(0).integers(2, 32000, (batch_size, objective.row_length))
    return objective.make(rows, np.arange(batch_size), seed=0, stream=0)


def _cache_outcome(result: dict) -> str:
    """' (hit)', ' (miss, bypass)', ...: what AOTAutograd's cache did for the first step's compile."""
    return f" ({', '.join(result['compile_cache'])})" if result["compile_cache"] else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--attention", default="triton", choices=ATTENTION_BACKENDS)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--compile-mode", default="", help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    parser.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                        help="fail on a graph break instead of silently splitting the step")  # fmt: skip
    parser.add_argument("--fused-ce", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--optimizer", default="adamwscale", choices=["adamwscale", "adamw"])
    parser.add_argument("--residual-dtype", default="float32", choices=RESIDUAL_DTYPES,
                        help="T5Config.residual_dtype (autocast: bf16 hidden states between blocks)")  # fmt: skip
    parser.add_argument("--optimizer-fused", action=argparse.BooleanOptionalAction, default=True,
                        help="AdamWScale(fused=True), as the run config's optim.compile")  # fmt: skip
    parser.add_argument("--steps", type=int, default=15, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default="", help="';'-separated variant specs (see module doc)")
    parser.add_argument("--profile", default="", help="profile 3 steps; print the kernel table (and append to FILE)")
    parser.add_argument("--trace", default="",
                        help="profile 3 steps and write their chrome trace to FILE (FILE.<i>.json with several variants); "
                             "tools/trace_gaps.py reads it")  # fmt: skip
    parser.add_argument("--json", default="", help="append one JSON line per variant to this file")
    parser.add_argument("--compile-times", action="store_true",
                        help="print torch.compile's time per phase (dynamo, AOTAutograd, inductor) after each variant")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("training.benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    ceiling = measure_matmul_tflops(device)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 8192^3 matmul {ceiling:.0f} TFLOP/s")
    print(f"# T5 {args.preset}, inputs {args.input_length}, targets {args.target_length}, bf16 autocast, "
          f"{args.optimizer} + clip, median of {args.steps} after {args.warmup} warm-up")  # fmt: skip
    print("| attention | compile | fused CE | batch | s/step | tokens/s | model TFLOP/s | MFU | peak GiB | 1st step s "
          "| wall s/step | last loss | parameter sum |")
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
            r = dict(variant=variant, error="out of memory", peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        except Exception as e:  # noqa: BLE001 - a failing variant must not hide the others
            r = dict(variant=variant, error=f"{type(e).__name__}: {str(e)[:300]}")
        v = variant
        compiled = ("yes " + v["mode"]).strip() if v["compile"] else "no"
        head = f"| {variant_label(v)} | {compiled} | {'yes' if v['fused_ce'] else 'no'} | {v['batch_size']} |"
        if "error" in r:
            print(f"{head} {r['error']} | | | | {r.get('peak_gib', 0):.1f} | | | | |", flush=True)
        else:
            r["mfu"] = r["model_tflops"] / ceiling
            print(f"{head} {r['s_per_step']:.4f} | {r['tokens_per_s'] / 1e3:.0f}k | {r['model_tflops']:.0f} | "
                  f"{r['mfu']:.1%} | {r['peak_gib']:.1f} | {r['first_step_s']:.0f}{_cache_outcome(r)} | {r['wall_s_per_step']:.4f} | "
                  f"{r['final_loss']:.9g} | {r['param_sum']!r} |",
                  flush=True)  # fmt: skip
        if args.compile_times and v["compile"]:  # where the first step's compile went, before the reset below
            print(torch._dynamo.utils.compile_times(repr="str", aggregate=True), flush=True)
        r["matmul_ceiling_tflops"] = ceiling
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
