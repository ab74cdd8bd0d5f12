r"""Time SNI generation (the costly part of `evaluate_sni`) for a model size on this machine.

    python benchmarks/sni_generation.py --data /path/to/sni --preset base \
        --instances 1024 --batch-sizes 32 64 128 [--checkpoint HF_DIR] [--dtype bf16] [--num-beams 4]
        [--no-cuda-graph]

Without --checkpoint the model is randomly initialised: it never emits EOS, so every batch runs the
full 128 decoding steps (an upper bound; a fine-tuned model answers in ~9 tokens on average and a
batch stops when all its rows have). Prints one JSON line per batch size with instances/s.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.evaluate_sni import load_model_for_eval  # noqa: E402
from training.model import T5Config, T5ForConditionalGeneration  # noqa: E402
from training.sni.encoding import SNITokenizer  # noqa: E402
from training.sni.evaluate import build_eval_set, generate_predictions  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--preset", default="base")
    p.add_argument("--checkpoint", default=None, help="HF directory (default: random init of --preset)")
    p.add_argument("--instances", type=int, default=1024, help="random sample of test instances")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-beams", type=int, default=1, help="1 = greedy; k > 1 = beam search")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="decoding replays its step as a CUDA graph (--no-cuda-graph: eager steps)")  # fmt: skip
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tokenizer = SNITokenizer()
    eval_set = build_eval_set(args.data, tokenizer)
    examples = random.Random(0).sample(eval_set.examples, min(args.instances, len(eval_set.examples)))
    if args.checkpoint:
        model = load_model_for_eval(args.checkpoint, device=device, dtype=dtype)
    else:
        torch.manual_seed(0)
        model = (
            T5ForConditionalGeneration(T5Config.from_preset(args.preset))
            .to(device=device, dtype=dtype)
            .eval()
        )
    if not args.cuda_graph:  # generate_predictions passes HF's arguments only
        model.generate = functools.partial(model.generate, cuda_graph=False)
    # Warm-up: one untimed pass over the same instances, so that the kernels every prompt length
    # needs (the encoder's attention compiles per tile-alignment case) are built before timing.
    generate_predictions(
        model,
        examples,
        tokenizer,
        args.batch_sizes[0],
        max_new_tokens=args.max_new_tokens,
        device=device,
        num_beams=args.num_beams,
    )
    for batch_size in args.batch_sizes:
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.time()
        generate_predictions(
            model,
            examples,
            tokenizer,
            batch_size,
            max_new_tokens=args.max_new_tokens,
            device=device,
            num_beams=args.num_beams,
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.time() - start
        row = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "preset": args.preset if not args.checkpoint else args.checkpoint,
            "dtype": args.dtype,
            "instances": len(examples),
            "batch_size": batch_size,
            "max_new_tokens": args.max_new_tokens,
            "num_beams": args.num_beams,
            "cuda_graph": args.cuda_graph,
            "seconds": round(seconds, 2),
            "instances_per_s": round(len(examples) / seconds, 1),
            "full_test_set_minutes": round(len(eval_set.examples) / (len(examples) / seconds) / 60, 2),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device.type == "cuda"
            else None,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
