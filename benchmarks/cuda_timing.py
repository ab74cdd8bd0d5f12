"""Timing of one GPU call for the benchmark scripts: the median of per-call CUDA-event times."""

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
