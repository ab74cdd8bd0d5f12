"""Our fused attention's outputs and gradients, saved for a bit-for-bit comparison across checkouts.

Runs the model's attention path (`packed_attention`, triton backend, eager, bf16) on fixed random
inputs at T5's three attentions and two longer ones (batch 16): the encoder's 512 x 512 with a bias,
the decoder's 114 x 114 and 300 x 300 (causal, bias) and the cross-attention's 114 x 512 and
200 x 512. Saves out, dq_src, dkv_src and the bias gradient of each to FILE; with `--against OLD`
(a file saved by another checkout, e.g. before a kernel change), prints per shape whether each
tensor is bit-identical to OLD's and exits 1 if any is not. Needs triton and a CUDA GPU.

    (cd /path/to/old/checkout && python benchmarks/attention_outputs.py /tmp/old.pt)
    python benchmarks/attention_outputs.py /tmp/new.pt --against /tmp/old.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_backends import Case, run_model_path  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402

CASES = [("enc", None), ("dec", None), ("cross", None), ("dec", (300, 300)), ("cross", (200, 512))]
NAMES = ("out", "dq_src", "dkv_src", "dbias")


def outputs(batch: int = 16, seed: int = 1) -> dict[str, list]:
    """{case: [out, dq_src, dkv_src, dbias]} on the CPU (None where the attention has no such tensor)."""
    results = {}
    for shape, lengths in CASES:
        case = Case(shape, batch, 12, 64, seed=seed, lengths=lengths)
        _, _, tensors = run_model_path(case, "triton", compiled=False)
        results[f"{shape} {case.sq}x{case.sk}"] = [t.cpu() if t is not None else None for t in tensors]
    return results


def _identical(a: torch.Tensor | None, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return isinstance(b, torch.Tensor) and torch.equal(a, b)


def differing(new: dict, old: dict) -> dict[str, list[str]]:
    """{case: names of the tensors not bit-identical} for every case of `new` (a case OLD lacks: all)."""
    missing = [torch.empty(0)] * len(NAMES)
    return {
        key: [name for name, a, b in zip(NAMES, tensors, old.get(key, missing)) if not _identical(a, b)]
        for key, tensors in new.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("file", type=Path, help="where to save this checkout's outputs")
    parser.add_argument("--against", type=Path, help="outputs saved by another checkout, to compare with")
    args = parser.parse_args()
    if args.against is not None and not args.against.is_file():
        raise SystemExit(f"--against {args.against}: no such file; save one first from the other checkout")
    if not ta.available():
        raise SystemExit("benchmarks/attention_outputs.py needs triton and a CUDA GPU")
    new = outputs()
    torch.save(new, args.file)
    print(f"saved {len(new)} cases to {args.file}")
    if args.against is None:
        return
    diff = differing(new, torch.load(args.against))
    for key, names in diff.items():
        print(f"{key}: {'bit-identical' if not names else 'DIFFERENT: ' + ', '.join(names)}")
    if any(diff.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
