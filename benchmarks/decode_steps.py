"""Where a decoding step's time goes: milliseconds per step, graphed or eager, and the kernels.

A randomly initialised model never emits EOS, so every call decodes all `--max-new-tokens` steps
(greedy, or with `--num-beams K` beam search over batch x K rows).
For each (batch, prompt length): the wall time per step of one `generate` call replayed as a CUDA
graph (the default) and, with `--eager`, with eager steps; then the profiler's device time of that
graphed call per step, in all and for its `--top` kernels (the encoder and the first, eager step
included, as in evaluation).

    python benchmarks/decode_steps.py                                  # base, bf16, 128 x 512 and 32 x 512
    python benchmarks/decode_steps.py --shapes 128x1024 --eager --top 20
    python benchmarks/decode_steps.py --shapes 32x512 --num-beams 4 --eager
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.model import T5Config, T5ForConditionalGeneration  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """"128x512,32x512" -> [(128, 512), (32, 512)] (batch x prompt length)."""
    shapes = []
    for item in text.split(","):
        batch, _, length = item.strip().partition("x")
        if not (batch.isdigit() and length.isdigit()) or int(batch) < 1 or int(length) < 1:
            raise SystemExit(f"--shapes: {item!r} is not BATCHxLENGTH with positive integers (e.g. 128x512)")
        shapes.append((int(batch), int(length)))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--shapes", default="128x512,32x512", help="comma list of BATCHxPROMPT_LENGTH")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-beams", type=int, default=1, help="1 = greedy; k > 1 = beam search")
    parser.add_argument("--eager", action="store_true", help="also time eager steps (cuda_graph=False)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per shape")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes)
    if args.num_beams < 1:
        raise SystemExit(f"--num-beams must be >= 1 (1 = greedy), got {args.num_beams}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_steps.py needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    config = T5Config.from_preset(args.preset)
    model = T5ForConditionalGeneration(config).cuda().to(torch.bfloat16).eval()
    steps = args.max_new_tokens
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | {args.preset}, bf16 weights, "
          f"{steps} steps per call, {args.num_beams} beam(s)")  # fmt: skip
    for batch, length in shapes:
        ids = torch.randint(2, config.vocab_size, (batch, length), device="cuda")
        mask = torch.ones_like(ids)
        kwargs = dict(attention_mask=mask, max_new_tokens=steps, num_beams=args.num_beams)
        for graph in (True, False) if args.eager else (True,):
            model.generate(ids, cuda_graph=graph, **kwargs)  # compiles kernels
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, cuda_graph=graph, **kwargs)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / steps * 1e3
            print(f"batch {batch} x prompt {length}, {'CUDA graph' if graph else 'eager steps'}: {ms:.2f} ms/step")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.generate(ids, **kwargs)
            torch.cuda.synchronize()
        kernels = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in kernels) / steps / 1e3
        print(f"  GPU time {total:.2f} ms/step (graphed); the largest kernels, ms/step and launches/step:")
        for e in kernels[: args.top]:
            print(f"  {e.self_device_time_total / steps / 1e3:7.3f} {e.count / steps:6.1f}  {e.key[:100]}")


if __name__ == "__main__":
    main()
