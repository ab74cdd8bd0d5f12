"""Launch-setting sweep of the residual add + RMS norm backward kernel (training/model/triton_add_norm.py).

One backward of the pair at T5 base's width (768) as the model runs it: the gradient of y in bf16,
the residual's gradient and h' in the residual dtype, a bf16 sublayer output (so the kernel also
writes the cast gradient). For every combination of rows per loop step, programs per SM, warps and
software-pipelining stages, checks the outputs against the default setting's and prints the GPU time
per call (the profiler's device time, averaged over `--iters` calls), best first; a setting whose
results differ (`differences`: beyond 1e-3, or beyond one unit in the last place for a bf16
output), or that fails to compile, is listed as such, with which output differs and by how much.
The default is the module's setting for the residual dtype (`triton_add_norm.backward_setting`).

    python benchmarks/add_norm_sweep.py                                   # encoder rows, fp32 residual
    python benchmarks/add_norm_sweep.py --rows 14592 --residual bf16 --top 5
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cuda_timing import kernel_ms  # noqa: E402
from training.model import triton_add_norm as tn  # noqa: E402

# (rows per loop step, programs per SM, warps, stages) settings swept: 64
SETTINGS = tuple(itertools.product((1, 2, 4, 8), (2, 4, 8, 16), (4, 8), (1, 2)))
RESIDUALS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def backward_inputs(rows: int, d_model: int, residual: torch.dtype, device: str = "cuda") -> tuple:
    """(dy, dres, h_new, weight, rstd) of one pair, h_new and rstd from the forward kernel."""
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, d_model, device=device, generator=gen).to(residual)
    out = torch.randn(rows, d_model, device=device, generator=gen).to(torch.bfloat16)
    weight = 1 + 0.1 * torch.randn(d_model, device=device, generator=gen)
    h_new, _, rstd = tn._launch_fwd(h, out, weight, 1e-6, torch.bfloat16)
    dy = torch.randn(rows, d_model, device=device, generator=gen).to(torch.bfloat16)
    dres = torch.randn(rows, d_model, device=device, generator=gen).to(residual)
    return dy, dres, h_new, weight, rstd


def differences(got: tuple, expected: tuple) -> str:
    """'' when each of (dh, dout, dweight) equals the expected one within 1e-3 absolute plus a
    relative 1e-3 (fp32) or one unit in the last place (an fp16 or bf16 output), else for each that
    does not: its largest absolute difference, the expected value's largest magnitude and how many
    rows differ.

    Settings sum each row in another order (more warps split a row more ways), so the fp32 results
    differ in their last bits, and a cast output then rounds an element now and then to the
    neighbouring bf16 value: the 1-row, 8-warp settings did that in 22 of 65536 rows of dout
    (nineteenth session), which is no error."""
    notes = []
    for name, a, b in zip(("dh", "dout", "dweight"), got, expected):
        rtol = torch.finfo(b.dtype).eps if b.dtype in (torch.float16, torch.bfloat16) else 1e-3
        if not b.numel() or torch.allclose(a.float(), b.float(), rtol=rtol, atol=1e-3):
            continue
        diff = (a.float() - b.float()).abs()
        rows = int((diff > 1e-3 + rtol * b.float().abs()).reshape(-1, b.shape[-1]).any(-1).sum())
        notes.append(
            f"{name} max |diff| {diff.max():.3g} (max |expected| {b.float().abs().max():.3g}, "
            f"{rows} of {diff.numel() // b.shape[-1]} rows)"
        )
    return "; ".join(notes)


def sweep(inputs: tuple, time_ms, settings=SETTINGS) -> tuple[list, list]:
    """([(ms, setting)] of the settings whose results equal the default setting's, [(setting, why)]
    of the others). time_ms(fn) times one call of fn; the module's BWD_* defaults are restored."""
    default = (tn.BWD_ROWS, tn.BWD_PROGRAMS_PER_SM, tn.BWD_WARPS, tn.BWD_STAGES, tn.BWD_STAGES_HALF)
    expected = tn._launch_bwd(*inputs, torch.bfloat16)
    timed, failed = [], []
    try:
        for setting in settings:  # the stages for either residual dtype
            tn.BWD_ROWS, tn.BWD_PROGRAMS_PER_SM, tn.BWD_WARPS, tn.BWD_STAGES = setting
            tn.BWD_STAGES_HALF = tn.BWD_STAGES
            try:
                got = tn._launch_bwd(*inputs, torch.bfloat16)
                differ = differences(got, expected)
                if differ:
                    failed.append((setting, "results differ from the default setting's: " + differ))
                    continue
                timed.append((time_ms(lambda: tn._launch_bwd(*inputs, torch.bfloat16)), setting))
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is a row too
                failed.append((setting, f"{type(e).__name__}: {str(e)[:100]}"))
    finally:
        tn.BWD_ROWS, tn.BWD_PROGRAMS_PER_SM, tn.BWD_WARPS, tn.BWD_STAGES, tn.BWD_STAGES_HALF = default
    return timed, failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=128 * 512, help="rows of one call (batch x sequence)")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--residual", default="fp32", choices=list(RESIDUALS))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=10, help="how many of the fastest settings to print")
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and tn._OP is not None):
        raise SystemExit("benchmarks/add_norm_sweep.py needs triton and a CUDA GPU")
    inputs = backward_inputs(args.rows, args.d_model, RESIDUALS[args.residual])
    default = tn.backward_setting(RESIDUALS[args.residual])
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | rows {args.rows}, d_model "
          f"{args.d_model}, {args.residual} residual | default (rows, programs/SM, warps, stages) {default}")  # fmt: skip
    timed, failed = sweep(inputs, lambda fn: kernel_ms(fn, args.iters))
    print("| ms | rows per step | programs per SM | warps | stages | |")
    print("|---|---|---|---|---|---|")
    for ms, setting in sorted(timed)[: args.top]:
        note = "default" if setting == default else ""
        print(f"| {ms:.4f} | " + " | ".join(map(str, setting)) + f" | {note} |")
    for ms, setting in timed:
        if setting == default:
            print(f"default {default}: {ms:.4f} ms ({ms / min(timed)[0] - 1:+.1%} against the best)")
    for setting, why in failed:
        print(f"failed {setting}: {why}")


if __name__ == "__main__":
    main()
