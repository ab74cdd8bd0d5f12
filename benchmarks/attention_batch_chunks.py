"""The encoder attention's backward run over batch chunks, so that the stored dS stays in L2.

With T5's bias the backward of the encoder's self-attention (512 x 512) stores dS, (B, H, SQ, SK)
in bf16: 805 MB a layer at batch 128. The dK/dV kernel writes it, the dQ-from-dS kernel reads it
and the batch sum reads it again: three trips through HBM, ~0.27 ms each at the copy bandwidth.
Run over chunks of C batch elements instead, the buffer is C x 6.3 MB. The caching allocator hands
each chunk the block the previous one freed, so at C <= 4 (25 MB, half the H100's L2) the dS of a
chunk may never leave L2. The cost: C x fewer programs per launch (tails) and 4 launches per chunk.

This prints, per chunk size, the GPU ms per call of the whole backward summed over its kernels (the
profiler's device time; launch gaps excluded, as in a step where the host runs ahead) and replayed
from a CUDA graph (gaps on the GPU included, the host's launch time not), each kernel's ms, and the
largest relative difference of dQ/dK/dV (bit-identical expected) and of the bias gradient (a
different summation order) from the unchunked backward.

    python benchmarks/attention_batch_chunks.py
    python benchmarks/attention_batch_chunks.py --chunks 0,2,4,8 --iters 20
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention_backends import Case  # noqa: E402
from benchmarks.cuda_timing import kernel_table, median_cuda_ms  # noqa: E402
from training.model import triton_attention as ta  # noqa: E402


def backward_call(case: Case, chunk: int):
    """A call running the backward over chunks of `chunk` batch elements (0: all at once); returns
    (dq_src, dbias) of the whole batch."""
    mask = case.q_src.new_empty((0,), dtype=torch.uint8)
    out, lse = ta._launch_fwd(case.q_src, case.kv_src, case.bias, mask, case.causal, case.h, case.far)
    size = chunk or case.b
    starts = list(range(0, case.b, size))
    lses = [lse[:, s : s + size].contiguous() for s in starts]  # the kernels index lse (2, B, H, SQ)

    def call():
        dq_parts, dbias = [], None
        for s, lse_c in zip(starts, lses):
            e = s + size
            dq_c, _, db = ta._launch_bwd(case.q_src[s:e], case.kv_src, case.bias, mask, out[s:e], lse_c,
                                         case.dout[s:e], case.causal, case.h, case.far)  # fmt: skip
            dq_parts.append(dq_c)
            dbias = db if dbias is None else dbias.add_(db)
        return (dq_parts[0] if len(dq_parts) == 1 else torch.cat(dq_parts)), dbias

    return call


def parse_chunks(text: str, batch: int) -> list[int]:
    """--chunks: a comma list of chunk sizes, each 0 (the whole batch) or 1..batch."""
    try:
        chunks = [int(c) for c in text.split(",")]
    except ValueError:
        raise SystemExit(f"--chunks takes a comma list of integers, e.g. 0,2,4,8; got {text!r}") from None
    bad = [c for c in chunks if not 0 <= c <= batch]
    if bad:
        raise SystemExit(f"--chunks: each size must be 0 (the whole batch) or 1..{batch} (--batch-size); got {bad}")
    return chunks


def graph_ms(call, iters: int) -> float:
    """ms per replay of `call` captured in a CUDA graph (median of `iters` CUDA-event timings)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return median_cuda_ms(graph.replay, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", default="0,1,2,4,8,16", help="comma list of chunk sizes; 0 = the whole batch")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    chunks = parse_chunks(args.chunks, args.batch_size)
    if not ta.available():
        raise SystemExit("benchmarks/attention_batch_chunks.py needs triton and a CUDA GPU")
    case = Case("enc", args.batch_size, 12, 64)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | encoder self-attention backward, "
          f"batch {case.b}, {case.sq} x {case.sk}, 12 heads, d_kv 64, bf16, T5 bias")  # fmt: skip
    print("| chunk | kernels ms | graph ms | dQ/dK/dV rel. diff | dbias rel. diff |")
    print("|---|---|---|---|---|")
    ref = None
    tables = {}
    for chunk in chunks:
        call = backward_call(case, chunk)
        dq, dbias = call()
        if ref is None:
            ref = dq.float(), dbias.float()
        d_dq = ((dq.float() - ref[0]).abs().max() / ref[0].abs().max()).item()
        d_db = ((dbias.float() - ref[1]).norm() / ref[1].norm()).item()
        del dq, dbias
        table = kernel_table(call, args.iters)
        tables[chunk] = table
        print(f"| {chunk or case.b} | {sum(table.values()):.3f} | {graph_ms(call, args.iters):.3f} | "
              f"{d_dq:.1e} | {d_db:.1e} |", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    for chunk, table in tables.items():
        print(f"\n## chunk {chunk or case.b}: GPU ms per call by kernel")
        for name, ms in table.items():
            print(f"- {name[:90]}: {ms:.3f}")


if __name__ == "__main__":
    main()
