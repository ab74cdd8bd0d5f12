"""The loop's small collectives, and shutting the process groups down, on 2 gloo ranks in this machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.test_checkpoint import _free_port, _init_dist


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    from training.distributed import all_reduce_max, all_reduce_sum, shutdown_distributed

    _init_dist(rank, world_size, port)
    cpu = torch.device("cpu")
    result = {"sum": all_reduce_sum([rank + 0.5, 2.0**40 + rank], cpu), "max": all_reduce_max(10.0 - 3 * rank, cpu)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_distributed()


def test_sum_and_max_agree_on_every_rank(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sum"] == [2.0, 2.0**41 + 1]  # float64 on the wire: the +1 survives
        assert got["max"] == 10.0


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # every native thread of this process


def _names():
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def _train_one_step(world_size: int) -> None:
    """What a run leaves behind: a DeepSpeed engine (its world group; DeepSpeed imports
    torch.distributed.nn once the group exists) and finished collectives on Python tensors."""
    import deepspeed

    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2})
    engine.backward(engine(torch.randn(2, 4)).square().sum())
    engine.step()


def _shutdown_worker(rank: int, world_size: int, port: int, out: str) -> None:
    from training.distributed import all_reduce_sum, init_distributed, shutdown_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    before = _threads()
    init_distributed("cpu")
    _train_one_step(world_size)
    total = all_reduce_sum([1.0], torch.device("cpu"))
    during = _threads()
    shutdown_distributed()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"before": before, "during": during, "after": _threads(),
                                                         "sum": total, "threads": _names()}))


def test_shutdown_frees_the_gloo_threads_before_exit(tmp_path):
    """A gloo group alive at interpreter exit can abort the process after a finished run (the
    flaky "exit -6" of a 2-rank run): shutdown_distributed must leave no gloo thread behind."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("counts threads through /proc (Linux)")
    torch.multiprocessing.spawn(_shutdown_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sum"] == [2.0]
        assert got["during"] > got["before"]  # the groups' worker and transport threads were running
        assert got["after"] == got["before"], got
