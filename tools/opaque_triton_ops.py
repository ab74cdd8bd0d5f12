"""Experiment: the cold first step with the model's Triton ops kept opaque through AOTAutograd and
inductor, their kernels compiled ahead in worker processes.

torch.compile decomposes each `torch.library.triton_op` into its kernel launches: AOTAutograd traces
the launcher and works out which tensors each launch writes (training/model/triton_access_cache.py),
and inductor compiles and launches the kernels itself. With `torch._functorch.config.
decompose_custom_triton_ops = False` (the switch torch.export sets) each op stays one call in the graph
and its launcher runs when the compiled graph runs: less to trace and to compile, but each kernel
specialization then compiles at its first launch, in the main process, one after another (T5 base's 21
take 19.4 s on 2 CPU cores). With `--precompile N`, N worker processes compile each specialization into
Triton's cache as soon as Dynamo's or AOTAutograd's fake run of an op meets its launch (tensors by
dtype, 16-byte aligned as the caching allocator's are), so that the first launch loads it.

On the GPU machine, the arguments after `--` going to `python -m training.benchmark` (each cold run
with empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR):

    python tools/opaque_triton_ops.py --precompile 8 -- --compile-times   # opaque, compiled ahead
    python tools/opaque_triton_ops.py -- --compile-times                  # opaque, at the first launch
    python -m training.benchmark --compile-times                          # decomposed, the default

On a CPU: AOTAutograd's trace of one step as tools/triton_access_trace.py makes it (Triton targeting
sm_90, nothing run), the kernels compiled ahead for sm_90:

    python tools/opaque_triton_ops.py --trace base --precompile 2

Prints the specializations compiled ahead, when the last was ready, and (on the GPU) how many of the
model's kernels the first launches found in Triton's cache.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import multiprocessing
import runpy
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

from training.cli_errors import ExpectedError, run_main

_PACKAGE = "training."
_KERNEL_MODULES = ("training.model.triton_attention_kernels", "training.model.triton_add_norm",
                   "training.model.triton_gated_gelu", "training.model.triton_bias_grad")  # fmt: skip


class _TargetDriver:
    """Triton's active driver in a worker: the parent's GPU target, no GPU touched."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _import_kernels() -> None:  # each worker, as it starts
    for module in _KERNEL_MODULES:
        importlib.import_module(module)


def _compile(module: str, name: str, args: dict[str, Any], target: Any) -> float:
    """In a worker: compile kernel `module.name` for `target` with `args` (a tensor as ("tensor",
    dtype)) into Triton's cache; its seconds."""
    import triton
    from triton.runtime.jit import MockTensor

    triton.runtime.driver.set_active(_TargetDriver(target))
    kernel = getattr(importlib.import_module(module), name)
    args = {k: MockTensor(v[1]) if isinstance(v, tuple) and v[:1] == ("tensor",) else v for k, v in args.items()}
    start = time.perf_counter()
    kernel.warmup(grid=(1,), **args)
    return time.perf_counter() - start


def launch_spec(kernel: Any, constant_args: dict[str, Any], kwargs: dict[str, Any]) -> tuple | None:
    """(module, name, arguments) of a traced launch of one of this package's kernels: tensors as
    ("tensor", dtype), the launch options torch wraps the kernel in (an Autotuner of one Config)
    added; None for another package's kernel or a symbolic size."""
    from triton.runtime.autotuner import Autotuner

    args = dict(constant_args)
    if isinstance(kernel, Autotuner):
        args.update(kernel.configs[0].all_kwargs())
        kernel = kernel.fn
    if not getattr(kernel, "fn", None) or not kernel.fn.__module__.startswith(_PACKAGE):
        return None
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            args[name] = ("tensor", value.dtype)
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return None
        else:
            args[name] = value
    return kernel.fn.__module__, kernel.fn.__name__, args


def specialization(kernel: Any, args: dict[str, Any]) -> str:
    """What Triton compiles a launch of `kernel` with `args` for: an integer that is not a constexpr
    by whether it is 1, a multiple of 16 and fits 32 bits (Triton's specialization), anything else
    by its value. Two launches alike here share one binary."""
    constexprs = {param.name for param in getattr(kernel, "params", ()) if param.is_constexpr}
    return repr(sorted(
        (name, (value == 1, value % 16 == 0, -(2**31) <= value < 2**31)
         if type(value) is int and name not in constexprs else value)
        for name, value in args.items()))  # fmt: skip


class Precompiler:
    """Compiles each kernel specialization that a fake run launches, once, in `workers` processes
    (0: only records them). `install` hooks torch's launch of a Triton kernel in a traced graph."""

    def __init__(self, workers: int) -> None:
        self.start = time.perf_counter()
        self.specs: dict[str, tuple] = {}
        self.futures: list[Future] = []
        self.ready: list[float] = []
        self.pool = None
        if workers:
            context = multiprocessing.get_context("spawn")  # the parent may hold a CUDA context
            self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_import_kernels)
            for _ in range(workers):  # start them now: they import torch while Dynamo traces
                self.pool.submit(int)

    def launched(self, kernel_idx: int, constant_args_idx: int, kwargs: dict[str, Any]) -> None:
        import triton
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        if not any(isinstance(v, torch.Tensor) and type(v) is not torch.Tensor for v in kwargs.values()):
            return  # a launch with real tensors, not a traced one (a FakeTensor, a FunctionalTensor)
        spec = launch_spec(kernel_side_table.get_kernel(kernel_idx),
                           kernel_side_table.get_constant_args(constant_args_idx), kwargs)  # fmt: skip
        if spec is None:
            return
        module, name, args = spec
        key = f"{module}.{name}{specialization(getattr(importlib.import_module(module), name), args)}"
        if key in self.specs:
            return
        self.specs[key] = spec
        if self.pool is not None:
            future = self.pool.submit(_compile, *spec, triton.runtime.driver.active.get_current_target())
            future.add_done_callback(lambda f: self.ready.append(time.perf_counter() - self.start))
            self.futures.append(future)

    @contextlib.contextmanager
    def install(self) -> Iterator[None]:
        from torch._higher_order_ops.triton_kernel_wrap import TritonKernelWrapperMutation

        call = TritonKernelWrapperMutation.__call__

        def hooked(hop, kernel_idx, constant_args_idx, grid, tma_descriptor_metadata, kwargs):
            self.launched(kernel_idx, constant_args_idx, kwargs)
            return call(hop, kernel_idx=kernel_idx, constant_args_idx=constant_args_idx, grid=grid,
                        tma_descriptor_metadata=tma_descriptor_metadata, kwargs=kwargs)  # fmt: skip

        TritonKernelWrapperMutation.__call__ = hooked
        try:
            yield
        finally:
            TritonKernelWrapperMutation.__call__ = call

    def finish(self) -> dict:
        """Waits for the compiles: specializations met, compiled, seconds of compiling, when the
        last was ready (seconds since this object was made), and the first error."""
        errors = [f.exception() for f in self.futures if f.exception() is not None]
        seconds = sum(f.result() for f in self.futures if f.exception() is None)
        if self.pool is not None:
            self.pool.shutdown()
        return {"met": len(self.specs), "compiled": len(self.futures) - len(errors), "compile_s": seconds,
                "ready_s": max(self.ready, default=0.0), "error": repr(errors[0]) if errors else ""}  # fmt: skip


@contextlib.contextmanager
def opaque_triton_ops(opaque: bool = True) -> Iterator[None]:
    """The model's triton_ops kept as calls in the graph (True) or decomposed (False, torch's default)."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(decompose_custom_triton_ops=not opaque):
        yield


class _FirstLaunches:
    """Triton's compile listener in this process: how many of this package's kernels the first
    launches loaded from Triton's cache (hits) or compiled (misses)."""

    def __init__(self) -> None:
        self.hits = self.misses = 0

    def __call__(self, *, src, cache_hit: bool, **_: Any) -> None:
        fn = getattr(getattr(src, "fn", None), "fn", None)
        if fn is not None and fn.__module__.startswith(_PACKAGE):
            if cache_hit:
                self.hits += 1
            else:
                self.misses += 1


def trace(preset: str, workers: int, opaque: bool = True, batch: int = 4, inputs: int = 512,
          targets: int = 114) -> dict:  # fmt: skip
    """On a CPU: AOTAutograd's trace of one step of T5 `preset` (tools/triton_access_trace.py), the
    ops opaque or decomposed, each kernel specialization it launches compiled for sm_90 by `workers`
    processes: `Precompiler.finish`'s figures, the trace's seconds, its graph's Triton launches and the
    specializations met ({specialization key: launch_spec})."""
    from tools.triton_access_trace import trace_step

    precompiler = Precompiler(workers)
    with precompiler.install(), opaque_triton_ops(opaque):
        traced = trace_step(preset, batch, inputs, targets, cache=True)
    result = precompiler.finish()
    result.update(trace_s=traced["seconds"], launches=traced["launches"], specs=precompiler.specs)
    return result


def _precompiled(result: dict, workers: int) -> str:
    met = f"{result['met']} kernel specializations met"
    if not workers:
        return met
    error = f" (the first error: {result['error']})" if result["error"] else ""
    return (f"{met}, {result['compiled']} compiled ahead in {workers} workers ({result['compile_s']:.1f} s of "
            f"compiling), the last ready {result['ready_s']:.1f} s after the start{error}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    benchmark_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precompile", type=int, default=0, metavar="N", help="worker processes (0: none)")
    parser.add_argument("--trace", metavar="PRESET", help="on a CPU: trace one step of this T5 preset")
    args = parser.parse_args(own)
    if args.precompile < 0:
        raise ExpectedError(f"--precompile {args.precompile}: give a number of worker processes, 0 or more")
    if args.trace:
        r = trace(args.trace, args.precompile)
        print(f"T5 {args.trace}, opaque ops: trace {r['trace_s']:.1f} s, {r['launches']} Triton launches in the graph; "
              + _precompiled(r, args.precompile))  # fmt: skip
        return 0
    from triton import knobs

    first_launches = _FirstLaunches()
    if hasattr(knobs.compilation, "listener"):  # Triton >= 3.4
        knobs.compilation.listener = first_launches
    precompiler = Precompiler(args.precompile)
    sys.argv = ["training.benchmark", *benchmark_args]
    with precompiler.install(), opaque_triton_ops():
        runpy.run_module("training.benchmark", run_name="__main__")
    print(f"opaque ops: {_precompiled(precompiler.finish(), args.precompile)}; the model's kernels at their first "
          f"launch: {first_launches.hits} from Triton's cache, {first_launches.misses} compiled")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
