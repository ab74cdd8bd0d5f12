"""torch's analysis of which tensors a t5ds Triton kernel reads and writes, done once per kernel
specialization instead of once per launch and stage.

torch.compile keeps the model's Triton kernels in its graph (`torch.library.triton_op`). To know
which arguments a launch writes, torch compiles the kernel to Triton IR and walks it
(`identify_accessed_tensors`; `identify_mutated_tensors` before torch 2.13, with the same arguments;
10-100 ms a kernel), for every launch in the graph, and again at each stage that needs it
(functionalization while AOTAutograd traces, inductor's lowering). T5 base's step launches ~300 of
them, of about 20 distinct specializations. Measured: AOTAutograd's trace of T5 base's step with the
Triton path (`tools/triton_access_trace.py`, 2 CPU cores, torch 2.13) spends 11.3-12.2 of its
21.5-23.0 s in 420 such analyses; with this cache 0.7-0.8 s in 21, and the trace takes 11.2-13.0 s.
On one H100 (torch 2.11) the cold first step of T5 base takes 46-49 s instead of 71-76 s
(docs/performance.md).

The answer depends only on the kernel and on what torch hands Triton to specialise it: a traced
tensor (a FakeTensor, or inductor's TensorBox) only by its dtype (torch replaces it by an empty
tensor of that dtype), a symbolic size not at all, every other argument by its value. `install`
memoises the analysis under exactly that key, for this package's kernels only; a launch with a real
tensor (whose address's alignment specialises the kernel), a TMA descriptor or an unhashable argument
is analysed as torch does. Each caller gets its own copy of the answer. Where torch lacks the function
or its signature differs, `install` changes nothing.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch

_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")  # torch >= 2.13, older
_PARAMETERS = ["kernel", "kwargs", "tma_descriptor_metadata"]
_PACKAGE = "training."


def _jit_function(kernel: Any) -> Any:
    """The JITFunction a launch runs: the kernel itself, or the one inside the Autotuner torch wraps
    each launch given num_warps or num_stages in (a new one per launch, with a single Config). None
    for any other wrapper."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, Autotuner):
        kernel = kernel.fn
    return kernel if isinstance(kernel, JITFunction) else None


def analysis_key(kernel: Any, kwargs: dict[str, Any], tma_descriptor_metadata: Any) -> tuple | None:
    """What the analysis of launching `kernel` with `kwargs` depends on, or None where it is not
    memoised (another package's kernel, a TMA descriptor, a real tensor, an unhashable value)."""
    jit = _jit_function(kernel)
    if jit is None or tma_descriptor_metadata or not jit.fn.__module__.startswith(_PACKAGE):
        return None
    from torch._inductor.ir import TensorBox
    from torch._subclasses.fake_tensor import FakeTensor

    parts: list[Any] = [jit]
    if kernel is not jit:  # torch adds the first config's values to the arguments
        parts.append(tuple(tuple(sorted(config.all_kwargs().items())) for config in kernel.configs))
    for name, value in sorted(kwargs.items()):
        if isinstance(value, (FakeTensor, TensorBox)):
            parts.append((name, "tensor", value.dtype))
        elif isinstance(value, torch.Tensor):
            return None
        elif isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) or _is_sympy(value):
            parts.append((name, "symbolic"))
        else:
            parts.append((name, type(value), value))  # the type: True, 1 and 1.0 hash alike
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:  # an unhashable argument or config setting
        return None
    return key


def _is_sympy(value: Any) -> bool:
    return type(value).__module__.startswith("sympy")


def _memoised(analysis: Callable) -> Callable:
    answers: dict[tuple, Any] = {}

    def memoised(kernel, kwargs, tma_descriptor_metadata):
        key = analysis_key(kernel, kwargs, tma_descriptor_metadata)
        if key is None:
            return analysis(kernel, kwargs, tma_descriptor_metadata)
        if key not in answers:
            answers[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
        return copy.deepcopy(answers[key])

    memoised.__wrapped__ = analysis
    memoised.__doc__ = analysis.__doc__
    memoised.answers = answers
    return memoised


def analysis_name() -> str | None:
    """The name of this torch's analysis in torch._higher_order_ops.triton_kernel_wrap, or None."""
    module = importlib.import_module("torch._higher_order_ops.triton_kernel_wrap")
    return next((name for name in _ANALYSES if hasattr(module, name)), None)


def install() -> bool:
    """Memoise torch's Triton access analysis for this package's kernels (idempotent). True where it
    is in place; False where this torch has no such function or another signature."""
    module = importlib.import_module("torch._higher_order_ops.triton_kernel_wrap")
    name = analysis_name()
    if name is None:
        return False
    analysis = getattr(module, name)
    if hasattr(analysis, "answers"):
        return True
    if list(inspect.signature(analysis).parameters) != _PARAMETERS:
        return False
    setattr(module, name, _memoised(analysis))
    return True


def uninstall() -> None:
    """Restore torch's own analysis (tests)."""
    module = importlib.import_module("torch._higher_order_ops.triton_kernel_wrap")
    name = analysis_name()
    analysis = getattr(module, name) if name else None
    if analysis is not None and hasattr(analysis, "answers"):
        setattr(module, name, analysis.__wrapped__)
