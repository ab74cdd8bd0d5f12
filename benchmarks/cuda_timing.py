"""GPU time of one call for the benchmark scripts and tools/: the profiler's device time of the
kernels the call runs."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_ms(fn, iters: int) -> float:
    """GPU time of one call in ms: the device time of every kernel (and copy) that `iters` calls ran,
    from torch's profiler, divided by iters. Idle gaps while the host launches do not count: at these
    sizes a lone call is launch-bound, while in a training step the host runs ahead of the GPU."""
    return sum(kernel_table(fn, iters).values())


def kernel_table(fn, iters: int) -> dict[str, float]:
    """`kernel_ms` by kernel: {kernel name: its GPU ms per call}, largest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {e.key: e.self_device_time_total / iters / 1e3 for e in prof.key_averages()}
    return dict(sorted(((k, v) for k, v in times.items() if v > 0), key=lambda kv: -kv[1]))
