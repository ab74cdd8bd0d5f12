"""Process-group setup and the few collectives the training loop needs.

Works the same under the `deepspeed` launcher, `torchrun`, `srun` (SLURM_* variables) and a plain
`python training/pretrain.py` (a single process, world size 1). On a machine without CUDA the
backend is gloo and the device is the CPU, which is how the tests and the README demo run.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from training.cli_errors import ExpectedError

logger = logging.getLogger(__name__)
# A CPU (gloo) process group for control flags, created in init_distributed.
_control_group = None


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int  # global rank, 0 .. world_size-1
    world_size: int  # number of data-parallel processes
    local_rank: int  # rank on this node; picks the GPU
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use_message(addr: str, port: str) -> str:
    """What to do when the rendezvous port (MASTER_PORT) is taken, e.g. by another job on the node."""
    return (f"the rendezvous port {addr}:{port} (MASTER_PORT) is in use by another process, e.g. another "
            f"job on this machine: pick a free one with `deepspeed --master_port N ...` (or `torchrun "
            f"--master_port N`, or MASTER_PORT=N for one process; the SLURM scripts take T5DS_MASTER_PORT=N), "
            f"or start through `python -m training.launch`, which picks a free port itself")


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """`auto` takes the local GPU when CUDA is present, else the CPU."""
    if requested not in ("auto", "cuda", "cpu"):
        raise ExpectedError(f"device must be auto, cuda or cpu, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ExpectedError("device=cuda but torch sees no CUDA GPU; use device=auto or device=cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def disable_deepspeed_shm_comm() -> None:
    """Keep DeepSpeed from JIT-building and starting its shared-memory CPU all-reduce.

    DeepSpeed builds it (a C++ extension: ~40-60 s on a fresh machine) whenever a process group
    starts on the CPU accelerator, but uses it only for inference all-reduce, which training never
    calls. Its /dev/shm segments are named by address and port and outlive the processes, so a later
    job on a reused port can attach to a stale one. Call before deepspeed.init_distributed.
    """
    import deepspeed.ops  # here, as in init_distributed: importing deepspeed takes seconds

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def name_cpu_accelerator(requested_device: str) -> None:
    """Where the run is on the CPU, tell DeepSpeed so (DS_ACCELERATOR=cpu, unless set) before it is
    imported: it would find no GPU, take the CPU all the same and warn about it in every process."""
    if requested_device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def init_distributed(requested_device: str = "auto") -> DistInfo:
    """Initialise torch.distributed through DeepSpeed (always, also for one process).

    Rank variables come from the launcher (RANK/WORLD_SIZE/LOCAL_RANK) or from SLURM
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID) when the job was started with `srun`.
    """
    name_cpu_accelerator(requested_device)
    import deepspeed  # heavy import: only when a job really starts

    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world_size > 1:
            raise ExpectedError("MASTER_PORT is not set for a multi-process run: launch with `python -m "
                                "training.launch`, `deepspeed` or `torchrun`, or set MASTER_ADDR and MASTER_PORT "
                                "(the SLURM scripts do)")
        os.environ["MASTER_PORT"] = str(_free_port())  # one process: any free port will do
    device = resolve_device(requested_device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # torch.distributed.nn's functions take `group=group.WORLD` as a default, evaluated when the
        # module is first imported (DeepSpeed imports it during initialize). Imported after the
        # group exists, those defaults keep the default group alive past destroy_process_group;
        # imported now, they are None.
        import torch.distributed.nn  # noqa: F401

        if backend == "gloo":
            disable_deepspeed_shm_comm()
        try:
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
        except dist.DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
            raise ExpectedError(port_in_use_message(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])) from exc
    global _control_group
    if dist.get_world_size() > 1 and _control_group is None:
        # Every rank must create a group at the same point: do it here, once.
        _control_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    """Destroy the process groups (the control group too) and free them while Python still runs.

    A gloo group that survives to the interpreter's exit can abort the process after its work is
    done ("terminate called without an active exception"; the launcher then reports a failed run):
    a worker thread that drops its last finished collective must take the GIL to free the Python
    tensor, and a thread taking the GIL during finalisation is unwound into std::terminate. So
    every reference to the groups goes here (DeepSpeed's own through deepspeed.comm, the control
    group) and the garbage collector runs, which joins their worker threads now.
    """
    global _control_group
    _control_group = None
    if dist.is_initialized():
        deepspeed_comm = sys.modules.get("deepspeed.comm")  # only where DeepSpeed is in use
        if deepspeed_comm is not None and deepspeed_comm.is_initialized():
            deepspeed_comm.destroy_process_group()  # also drops DeepSpeed's cached world group
        else:
            dist.destroy_process_group()
        deepspeed_groups = sys.modules.get("deepspeed.utils.groups")
        if getattr(deepspeed_groups, "_WORLD_GROUP", None) is not None:  # DeepSpeed versions that keep it
            deepspeed_groups._WORLD_GROUP = None
    gc.collect()  # groups held only by reference cycles (an engine, say) are freed here, not at exit


def _all_reduce(values: list[float], device: torch.device, op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)  # float64: counts stay exact
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over all ranks (float64 on the wire, so counts stay exact)."""
    return _all_reduce(values, device, dist.ReduceOp.SUM)


def all_reduce_max(value: float, device: torch.device) -> float:
    """The largest of one float over all ranks (e.g. peak GPU memory: ZeRO 3 ranks differ)."""
    return _all_reduce([value], device, dist.ReduceOp.MAX)[0]


def control_group():
    """The CPU process group for control decisions (None = the default group)."""
    return _control_group


def any_rank(flag: bool) -> bool:
    """True when `flag` is set on at least one rank (stop signals, errors).

    Runs on a CPU (gloo) group so that polling it every step never waits for the GPU.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_control_group)
    return bool(t.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
