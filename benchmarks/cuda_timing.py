"""Timing of one GPU call for the benchmark scripts: the median of per-call CUDA-event times, or the
profiler's device time of the kernels a call runs."""

from __future__ import annotations

import statistics

import torch


def median_cuda_ms(fn, iters: int, warmup: int = 2) -> float:
    """Milliseconds per call of `fn`: `warmup` untimed calls, then the median of `iters` calls, each
    between two CUDA events and waited for (so the host's launch time is not what is measured)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn, iters: int) -> float:
    """GPU time of one call in ms: the device time of every kernel (and copy) that `iters` calls ran,
    from torch's profiler, divided by iters. Idle gaps while the host launches do not count: at these
    sizes a lone call is launch-bound, while in a training step the host runs ahead of the GPU."""
    return sum(kernel_table(fn, iters).values())


def kernel_table(fn, iters: int) -> dict[str, float]:
    """`kernel_ms` by kernel: {kernel name: its GPU ms per call}, largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.self_device_time_total / iters / 1e3 for e in prof.key_averages()}
    return dict(sorted(((k, v) for k, v in times.items() if v > 0), key=lambda kv: -kv[1]))
