"""Time one optimizer step on a T5 v1.1-shaped set of tensors.

    python benchmarks/optimizer_step.py --size small --steps 5 [--device cpu|cuda]

Variants: adamwscale on the model's tensors (foreach path, and `fused=True`: one Triton kernel;
both clip in the step), adamwscale on one flat buffer with a bound layout (the ZeRO path, one rank), torch AdamW
(fused on CUDA, foreach), and the nanoT5 per-tensor loop.
Prints the median seconds per step of each, the first step's seconds (state allocated, kernels
built) and, on CUDA, how many times one step makes the host
wait for the GPU (`torch.cuda.set_sync_debug_mode`; adamwscale's should be 0: a step that waits lets
the GPU idle while the host queues the next forward).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.optim import AdamWScale, FlatLayout  # noqa: E402
from training.optim.zero_layout import segments_for_partition  # noqa: E402

SIZES = {"tiny": (64, 128, 2, 4, 16), "small": (512, 1024, 8, 6, 64), "base": (768, 2048, 12, 12, 64)}


def t5_shapes(size: str, vocab: int = 32128) -> list[tuple[int, ...]]:
    d, ff, layers, heads, kv = SIZES[size]
    inner = heads * kv
    shapes = [(vocab, d), (vocab, d)]  # shared embedding, untied lm_head
    attn = [(inner, d), (inner, d), (inner, d), (d, inner)]
    ffn = [(ff, d), (ff, d), (d, ff)]
    for _ in range(layers):  # encoder block
        shapes += attn + ffn + [(d,), (d,)]
    for _ in range(layers):  # decoder block
        shapes += attn + attn + ffn + [(d,), (d,), (d,)]
    shapes += [(32, heads), (32, heads), (d,), (d,)]  # relative bias tables, final norms
    return shapes


def nanot5_step(params, states, lr=1e-2, betas=(0.9, 0.999), eps=1e-6):
    for p, st in zip(params, states):
        st["step"] += 1
        st["m"].mul_(betas[0]).add_(p.grad, alpha=1 - betas[0])
        st["v"].mul_(betas[1]).addcmul_(p.grad, p.grad, value=1 - betas[1])
        denom = st["v"].sqrt().add_(eps)
        size = lr * math.sqrt(1 - betas[1] ** st["step"]) / (1 - betas[0] ** st["step"])
        size = size * max(1e-3, p.norm(2) / p.numel() ** 0.5)
        p.addcdiv_(st["m"], denom, value=-size)


def timed(fn, steps: int, device: torch.device) -> tuple[float, float]:
    """(the first call's seconds: state allocated, anything compiled; the median of the next `steps`)."""
    times = []
    for _ in range(steps + 1):  # the first call allocates state: not timed
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def host_syncs(fn, device: torch.device) -> int | None:
    """How many times one call of `fn` waits for the GPU (None off CUDA). Call after a warm-up."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # torch also warns, once per process, that the debug mode is a prototype: not a wait
    return sum("synchroniz" in str(w.message) and "prototype" not in str(w.message) for w in caught)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    shapes = t5_shapes(args.size)
    n = sum(math.prod(s) for s in shapes)
    print(
        f"{args.size}: {len(shapes)} tensors, {n / 1e6:.1f} M params, device {device}, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}"
    )

    def make():
        ps = [torch.nn.Parameter(torch.randn(s, device=device) * 0.05) for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        return ps

    results, syncs = {}, {}

    def measure(name: str, step) -> None:  # the first, untimed step allocates state (and compiles)
        results[name], syncs[name] = timed(step, args.steps, device), host_syncs(step, device)

    for name, fused in [("adamwscale (tensors, foreach)", False), ("adamwscale (tensors, fused)", True)]:
        if fused and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            continue  # the Triton kernel: CUDA, or the CPU through Triton's interpreter
        measure(name, AdamWScale(make(), lr=1e-2, max_grad_norm=1.0, fused=fused).step)

    ps = make()
    flat = torch.cat([p.detach().reshape(-1) for p in ps]).requires_grad_()
    flat.grad = torch.cat([p.grad.reshape(-1) for p in ps])
    spans, off = [], 0
    for j, p in enumerate(ps):
        spans.append((j, off, p.numel()))
        off += p.numel()
    del ps
    lengths, index = segments_for_partition(spans, 0, off)
    opt = AdamWScale([flat], lr=1e-2)
    opt.bind_flat_layouts(
        [FlatLayout(lengths, index, [s[2] for s in spans], [str(j) for j, _, _ in spans], flat_param=flat)]
    )
    measure("adamwscale (flat + layout, ZeRO path)", opt.step)
    del opt, flat

    if device.type == "cuda":  # torch's single-kernel AdamW: the floor for this much state traffic
        measure("torch AdamW fused", torch.optim.AdamW(make(), lr=1e-2, fused=True).step)
    ps = make()
    measure("torch AdamW foreach", torch.optim.AdamW(ps, lr=1e-2, foreach=True).step)
    states = [dict(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p)) for p in ps]
    measure("nanoT5 per-tensor loop", lambda: nanot5_step(ps, states))

    for name, (first, sec) in results.items():
        waits = "" if syncs[name] is None else f"   host waits/step {syncs[name]}"
        print(f"{name:40s} {sec * 1e3:9.1f} ms/step   first {first:6.2f} s{waits}")


if __name__ == "__main__":
    with torch.no_grad():
        main()
