"""The loop's small collectives, on 2 gloo ranks in this machine."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.test_checkpoint import _free_port, _init_dist


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    from training.distributed import all_reduce_max, all_reduce_sum

    _init_dist(rank, world_size, port)
    cpu = torch.device("cpu")
    result = {"sum": all_reduce_sum([rank + 0.5, 2.0**40 + rank], cpu), "max": all_reduce_max(10.0 - 3 * rank, cpu)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_sum_and_max_agree_on_every_rank(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sum"] == [2.0, 2.0**41 + 1]  # float64 on the wire: the +1 survives
        assert got["max"] == 10.0
