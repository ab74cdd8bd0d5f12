"""How long AOTAutograd takes to trace a T5 step through the model's Triton kernels, and how much of
it goes to torch's analysis of which tensors each kernel writes (training/model/
triton_access_cache.py). Runs on a CPU, no GPU needed:

    python tools/triton_access_trace.py --preset base             # with the analysis memoised
    python tools/triton_access_trace.py --preset base --no-cache  # torch's own, per launch

The Triton path is taken on CPU tensors, and Triton is told it compiles for an H100 (sm_90), so that
torch analyses the kernels as it does on the GPU; nothing runs, the trace stops after AOTAutograd's
joint graph (before partitioning and inductor). Prints the trace's seconds, the analysis's calls and
seconds, and the traced Triton launches.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

import torch
from torch.func import functional_call

from training.model import attention, triton_access_cache, triton_add_norm, triton_gated_gelu
from training.model import t5 as t5_module
from training.model.config import T5Config
from training.model.t5 import T5ForConditionalGeneration


class _H100Target:
    """A stand-in for Triton's active driver: the target that torch's analysis compiles for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0


class _Stop(Exception):
    pass


@contextlib.contextmanager
def triton_path_on_cpu() -> Iterator[None]:
    """Route attention, the residual add + norm and the gated GELU to their Triton ops for CPU
    tensors, with Triton targeting sm_90; everything restored on exit."""
    import triton

    saved = [(attention, "resolve_backend"), (triton_add_norm, "kernel_applies"),
             (triton_gated_gelu, "kernel_applies"), (t5_module, "add_norm_kernel_applies")]  # fmt: skip
    saved = [(module, name, getattr(module, name)) for module, name in saved]
    attention.resolve_backend = lambda backend, device: "triton"
    for module, name, _ in saved[1:]:
        setattr(module, name, lambda h: True)
    driver = triton.runtime.driver
    active = driver._active  # None until first asked for: a CPU machine has no driver to make
    driver.set_active(_H100Target())
    try:
        yield
    finally:
        driver._active = active
        for module, name, value in saved:
            setattr(module, name, value)


def trace_step(preset: str, batch: int, inputs: int, targets: int, cache: bool) -> dict:
    """AOTAutograd's trace of one training step (bf16 autocast, the loss's gradient w.r.t. every
    weight) of T5 `preset` with the Triton path: seconds, the analysis's calls and seconds, and the
    tensors each Triton launch in the joint forward-backward graph writes (`tensors_to_clone`)."""
    import torch._higher_order_ops.triton_kernel_wrap as kernel_wrap
    from torch._functorch.aot_autograd import aot_function

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config.from_preset(preset))
    params = dict(model.named_parameters())
    ids = torch.randint(0, 1000, (batch, inputs))
    labels = torch.randint(0, 1000, (batch, targets))
    graphs, spent = [], {"calls": 0, "seconds": 0.0}

    def loss(params, ids, labels):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return functional_call(model, params, (ids,), {"labels": labels, "return_logits": False}).loss

    def keep(joint_graph, joint_inputs, **kwargs):  # the joint graph: stop before partitioning it
        graphs.append(joint_graph)
        raise _Stop

    triton_access_cache.uninstall()
    name = triton_access_cache.analysis_name()
    if name is None:
        raise SystemExit(f"torch {torch.__version__} has neither identify_accessed_tensors nor identify_mutated_tensors to measure")
    analysis = getattr(kernel_wrap, name)

    def counted(kernel, kwargs, tma_descriptor_metadata):
        start = time.perf_counter()
        try:
            return analysis(kernel, kwargs, tma_descriptor_metadata)
        finally:
            spent["calls"] += 1
            spent["seconds"] += time.perf_counter() - start

    setattr(kernel_wrap, name, counted)
    if cache:
        triton_access_cache.install()
    start = time.perf_counter()
    try:
        with triton_path_on_cpu(), contextlib.suppress(_Stop):
            aot_function(loss, fw_compiler=None, partition_fn=keep)(params, ids, labels)
    finally:
        triton_access_cache.uninstall()
        setattr(kernel_wrap, name, analysis)
    seconds = time.perf_counter() - start
    writes = [
        (str(node.kwargs["kernel_idx"]), tuple(node.kwargs["tensors_to_clone"]))
        for graph in graphs
        for node in graph.graph.nodes
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional
    ]
    return {"seconds": seconds, "analysis_calls": spent["calls"], "analysis_seconds": spent["seconds"],
            "launches": len(writes), "writes": writes}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base", help="a T5Config preset (tiny, small, base, ...)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--targets", type=int, default=114)
    parser.add_argument("--no-cache", action="store_true", help="torch's own analysis, once per launch and stage")
    args = parser.parse_args(argv)
    result = trace_step(args.preset, args.batch, args.inputs, args.targets, cache=not args.no_cache)
    print(f"T5 {args.preset}, {'torch' if args.no_cache else 'memoised'} analysis: trace "
          f"{result['seconds']:.1f} s, analysis {result['analysis_seconds']:.1f} s in "
          f"{result['analysis_calls']} calls, {result['launches']} Triton launches")  # fmt: skip


if __name__ == "__main__":
    main()
