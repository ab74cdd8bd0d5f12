"""Where the GPU sits idle inside a training step, and where its time goes: reads the torch.profiler
chrome trace that the step benchmark writes.

    python -m training.benchmark --trace step.json      # profiles 3 steps, writes their trace
    python tools/trace_gaps.py step.json                # the idle gaps
    python tools/trace_gaps.py step.json --parts        # and the GPU time by part of the step

The benchmark marks each profiled step with a `benchmark_step` range on the host; a step's window
on the GPU runs from the first kernel launched inside its range to the first of the next step's
(the whole trace when there are no ranges). A gap is a stretch with no kernel, copy or memset
running. It is "host-bound" when the kernel after it was launched (its cudaLaunchKernel, matched by
correlation id) after the previous kernel had ended: the GPU ran out of queued work. Prints the step
time, busy and idle time per step, the idle time by cause, and the largest gaps with the kernels on
either side. `--parts` also prints the GPU time per step of each part of the step (GEMMs,
attention, ...: `PARTS`, by kernel name) and its largest kernels.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # cudaLaunchKernel; Triton's cuLaunchKernel
STEP_ANNOTATION = "benchmark_step"
# The parts of a T5 step by kernel name: the first part with a name fragment that the kernel's name
# contains takes it (our Triton kernels by their function names; inductor's are named triton_*).
PARTS = (  # (the norm's and the GELU's kernels before attention's: their names end in _fwd_kernel too)
    ("GEMMs (cuBLAS, QuACK)", ("nvjet", "gemm", "xmma", "cutlass", "splitKreduce")),
    ("residual add + RMS norm (ours)", ("_add_rms_norm",)),
    ("gated GELU (ours)", ("_gated_gelu",)),
    ("attention (ours)", ("_fwd_kernel", "_bwd_", "_delta_kernel", "_ds_batch_sum", "_far_region_sums")),
    ("torch's foreach / multi-tensor kernels", ("multi_tensor", "foreach")),
    ("inductor's kernels (norms, casts, loss, optimizer, ...)", ("triton_",)),
)


@dataclass(frozen=True)
class Gap:
    start_us: float
    length_us: float
    before: str  # the kernel that ended last before the gap
    after: str  # the kernel that starts the next busy stretch
    host_bound: bool  # that kernel was launched only after the GPU went idle


def _events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _correlation(e: dict):
    return e.get("args", {}).get("correlation")


def _launch_times(events: list[dict]) -> dict:
    """{correlation id: µs when the host launched that GPU work}."""
    return {_correlation(e): float(e["ts"]) for e in events
            if e.get("cat") in LAUNCH_CATEGORIES and _correlation(e) is not None}  # fmt: skip


def step_windows(trace: dict) -> list[tuple[float, float]]:
    """(start, end) µs of each step on the GPU's timeline: from the first kernel launched inside the
    step's `benchmark_step` range on the host to the first kernel of the next step (the last step
    ends with its last kernel), so the idle time between steps counts too. The profiler's own GPU
    copy of the range is not used: it covers only part of a step's kernels."""
    events = _events(trace)
    ranges = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name") == STEP_ANNOTATION)  # fmt: skip
    launches = _launch_times(events)
    work = {_correlation(e): (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
            if e.get("cat") in GPU_CATEGORIES and _correlation(e) is not None}  # fmt: skip
    steps = []
    for lo, hi in ranges:
        spans = [work[c] for c, ts in launches.items() if lo <= ts <= hi and c in work]
        if spans:
            steps.append((min(a for a, _ in spans), max(b for _, b in spans)))
    return [(a, steps[i + 1][0] if i + 1 < len(steps) else b) for i, (a, b) in enumerate(steps)]


def idle_gaps(trace: dict, window: tuple[float, float], min_us: float = 0.0) -> tuple[float, list[Gap]]:
    """Busy µs and the idle gaps of at least `min_us` between GPU work inside `window`. Work
    overlapping the window's edges is clipped to it; the window's own edges are not gaps (a step
    starts at its first kernel)."""
    lo, hi = window
    events = _events(trace)
    launches = _launch_times(events)
    work = sorted(((max(float(e["ts"]), lo), min(float(e["ts"]) + float(e["dur"]), hi), e) for e in events
                   if e.get("cat") in GPU_CATEGORIES and float(e["ts"]) < hi and float(e["ts"]) + float(e["dur"]) > lo),
                  key=lambda t: t[:2])  # fmt: skip
    busy, gaps = 0.0, []
    end, last = None, None  # the busy stretch so far ends at `end`, with kernel `last`
    for start, stop, e in work:
        if end is not None and start > end:  # idle from `end` to `start`
            if start - end >= min_us:
                launched = launches.get(_correlation(e))
                host_bound = launched is not None and launched > end
                gaps.append(Gap(end, start - end, last["name"], e["name"], host_bound))
            end = None
        if end is None:
            busy += stop - start
            end, last = stop, e
        elif stop > end:
            busy += stop - end
            end, last = stop, e
    return busy, gaps


def summarize(trace: dict, top: int = 15, min_us: float = 5.0) -> str:
    windows = step_windows(trace)
    if not windows:
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in _events(trace)
                 if e.get("cat") in GPU_CATEGORIES]  # fmt: skip
        if not spans:
            raise SystemExit("no GPU kernels in this trace: was it recorded with ProfilerActivity.CUDA?")
        windows = [(min(s for s, _ in spans), max(t for _, t in spans))]
    lines = [f"| step | ms | busy ms | idle ms | host-bound idle ms | gaps >= {min_us:g} µs |", "|---|---|---|---|---|---|"]
    every: list[Gap] = []
    for i, w in enumerate(windows):
        busy, gaps = idle_gaps(trace, w)
        idle = (w[1] - w[0]) - busy
        host = sum(g.length_us for g in gaps if g.host_bound)
        big = [g for g in gaps if g.length_us >= min_us]
        every += big
        lines.append(f"| {i} | {(w[1] - w[0]) / 1e3:.2f} | {busy / 1e3:.2f} | {idle / 1e3:.2f} | "
                     f"{host / 1e3:.2f} | {len(big)} |")  # fmt: skip
    lines += ["", f"Largest gaps (of {len(every)} >= {min_us:g} µs in all steps):",
              "| µs | host-bound | last kernel before | first kernel after |", "|---|---|---|---|"]  # fmt: skip
    for g in sorted(every, key=lambda g: -g.length_us)[:top]:
        lines.append(f"| {g.length_us:.1f} | {'yes' if g.host_bound else 'no'} | {g.before[:70]} | {g.after[:70]} |")
    return "\n".join(lines)


def part_of(name: str, category: str) -> str:
    """The PARTS entry a kernel (or copy, memset) belongs to; "other" where none matches."""
    if category != "kernel":
        return "memsets and copies"
    return next((part for part, fragments in PARTS if any(f in name for f in fragments)), "other")


def parts(trace: dict, top: int = 12) -> str:
    """GPU ms per step by part of the step, and the largest kernels (ms per step, calls per step), from
    the kernels that start inside the step windows (the whole trace without them)."""
    windows = step_windows(trace) or [(float("-inf"), float("inf"))]
    events = [e for e in _events(trace) if e.get("cat") in GPU_CATEGORIES]
    inside = [e for e in events if any(a <= float(e["ts"]) < b for a, b in windows)]
    if not inside:
        raise SystemExit("no GPU kernels in this trace: was it recorded with ProfilerActivity.CUDA?")
    steps = len(windows)
    by_part: dict[str, float] = {}
    by_kernel: dict[str, list] = {}  # name -> [µs, calls, part]
    for e in inside:
        part = part_of(e["name"], e["cat"])
        by_part[part] = by_part.get(part, 0.0) + float(e["dur"])
        entry = by_kernel.setdefault(e["name"], [0.0, 0, part])
        entry[0] += float(e["dur"])
        entry[1] += 1
    total = sum(by_part.values())
    lines = ["| part | ms per step | share |", "|---|---|---|"]
    for part, us in sorted(by_part.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {part} | {us / steps / 1e3:.2f} | {us / total:.1%} |")
    lines += [f"| **all GPU work** | **{total / steps / 1e3:.2f}** | |", "",
              f"Largest kernels ({top}):", "| ms per step | calls per step | part | kernel |", "|---|---|---|---|"]
    for name, (us, calls, part) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {us / steps / 1e3:.2f} | {calls / steps:g} | {part} | {name[:90]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="chrome trace JSON from torch.profiler (export_chrome_trace)")
    parser.add_argument("--top", type=int, default=15, help="how many of the largest gaps (and kernels) to list")
    parser.add_argument("--min-us", type=float, default=5.0, help="shortest gap listed or counted (µs)")
    parser.add_argument("--parts", action="store_true", help="also the GPU time per step by part of the step")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        raise SystemExit(f"{args.trace}: no such file; write one with `python -m training.benchmark --trace FILE`")
    trace = json.loads(args.trace.read_text())
    print(summarize(trace, args.top, args.min_us))
    if args.parts:
        print()
        print(parts(trace, args.top))


if __name__ == "__main__":
    main()
