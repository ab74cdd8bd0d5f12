"""Checkpoints with real DeepSpeed engines on CPU (gloo): round trip, rotation, crash safety, world-size
change, content checksums (a flipped bit, a damaged rank state), a full disk, rotation around non-finite steps.

The first DeepSpeed process group on a machine JIT-builds DeepSpeed's shared-memory comm op
(about a minute on 2 cores, cached in ~/.cache/torch_extensions afterwards).
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import logging
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from training import checkpoint as checkpoint_module
from training.checkpoint import (
    CheckpointDiskFullError,
    CheckpointError,
    CheckpointManager,
)
from training.checkpoint_universal import convert_to_universal
from training.checkpoint_weights import checkpoint_state_dict, newest_checkpoint
from training.config_loader import load_run_config
from training.distributed import shutdown_distributed
from training.ds_config import resolve_ds_config
from training.run_dir import step_dirname

IN_DIM, HIDDEN, OUT_DIM = 8, 16, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_dist(rank: int, world_size: int, port: int) -> None:
    import deepspeed

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    from training.distributed import disable_deepspeed_shm_comm

    disable_deepspeed_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo")


def _engine(stage: int, world_size: int, seed: int):
    """A tiny fp32 DeepSpeed engine: Linear stack, torch AdamW, LambdaLR schedule."""
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT_DIM)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    cfg = load_run_config(
        None, [f"optim.batch_size={2 * world_size}", "optim.grad_acc=1", "precision=fp32", "device=cpu"]
    )
    ds = resolve_ds_config(f"ds_configs/zero{stage}.json", cfg, world_size)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds
    )
    return engine


def _train(engine, start: int, steps: int, rank: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(2, IN_DIM, generator=g), torch.randn(2, OUT_DIM, generator=g)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _rank_state(rank: int, step: int) -> dict:
    return {"rank": rank, "cursor": {"rows_consumed": 2 * step}, "torch_rng": torch.get_rng_state()}


@pytest.fixture(scope="module")
def dist1():
    """A world-size-1 gloo process group in this process (kept for the rest of the session)."""
    if not torch.distributed.is_initialized():
        _init_dist(0, 1, _free_port())
    assert torch.distributed.get_world_size() == 1
    yield


def _manager(tmp_path: Path, keep_last: int = 3, **kw) -> CheckpointManager:
    return CheckpointManager(tmp_path / "run", keep_last=keep_last, rank=0, world_size=1, **kw)


def test_round_trip_single_rank(dist1, tmp_path):
    engine = _engine(stage=0, world_size=1, seed=0)
    _train(engine, 0, 3, rank=0)
    manager = _manager(tmp_path)
    state = _rank_state(0, 3)
    path = manager.save(engine, 3, state)
    assert path == tmp_path / "run" / "checkpoints" / "step_00000003"
    assert (path.parent / "latest").read_text().strip() == "step_00000003"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["zero_stage"] == 0
    assert meta["files"]["rank_state_0.pt"] == (path / "rank_state_0.pt").stat().st_size
    saved_weights, saved_opt = _weights(engine), copy.deepcopy(engine.optimizer.state_dict())
    saved_lr = engine.lr_scheduler.get_last_lr()
    reference = _train(engine, 3, 2, rank=0)  # what an uninterrupted run does next

    fresh = _engine(stage=0, world_size=1, seed=123)  # different init: loading must overwrite it
    found = manager.find_resumable()
    assert found == path
    step, loaded_state = manager.load(fresh, found)
    assert step == 3
    assert loaded_state["cursor"] == state["cursor"] and torch.equal(
        loaded_state["torch_rng"], state["torch_rng"]
    )
    _assert_same_weights(_weights(fresh), saved_weights)
    opt = fresh.optimizer.state_dict()
    for pid, s in saved_opt["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(opt["state"][pid][key]), torch.as_tensor(s[key])), key
    assert fresh.lr_scheduler.get_last_lr() == saved_lr
    assert fresh.global_steps == 3
    assert _train(fresh, 3, 2, rank=0) == reference  # bit-identical continuation on CPU


def test_keep_last_rotation(dist1, tmp_path):
    engine = _engine(stage=0, world_size=1, seed=0)
    manager = _manager(tmp_path, keep_last=2)
    for step in range(1, 6):
        _train(engine, step, 1, rank=0)
        manager.save(engine, step, _rank_state(0, step))
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        "step_00000004",
        "step_00000005",
    ]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no tmp/trash left behind
    assert (root / "latest").read_text().strip() == "step_00000005"
    assert manager.find_resumable() == root / "step_00000005"


def test_partial_checkpoints_are_reported_skipped_and_kept(dist1, tmp_path, caplog):
    engine = _engine(stage=0, world_size=1, seed=0)
    manager = _manager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        _train(engine, step, 1, rank=0)
        manager.save(engine, step, _rank_state(0, step))
    root = tmp_path / "run" / "checkpoints"
    # step 3: a truncated DeepSpeed file; step 2: meta.json never written; plus a leftover tmp dir.
    model_file = root / "step_00000003" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    (root / "step_00000002" / "meta.json").unlink()
    (root / ".tmp-step_00000004").mkdir()
    (root / ".tmp-step_00000004" / "mp_rank_00_model_states.pt").write_bytes(b"partial")

    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        found = manager.find_resumable()
    assert found == root / "step_00000001"
    assert "mp_rank_00_model_states.pt has 100 bytes" in caplog.text
    assert "step_00000002" in caplog.text and "meta.json is missing" in caplog.text
    assert ".tmp-step_00000004" in caplog.text
    assert "`latest` names" not in caplog.text  # step_00000003's damage is said once, in its own warning
    # nothing was deleted
    for name in ("step_00000002", "step_00000003", ".tmp-step_00000004"):
        assert (root / name).is_dir()
    with pytest.raises(RuntimeError, match="cannot load"):
        manager.load(engine, root / "step_00000003")
    step, _ = manager.load(_engine(stage=0, world_size=1, seed=5), found)
    assert step == 1


def test_no_checkpoint_means_none(dist1, tmp_path):
    assert _manager(tmp_path).find_resumable() is None
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_00000009\n")
    assert _manager(tmp_path).find_resumable() is None


def test_crash_before_latest_still_resumes_newest(dist1, tmp_path, monkeypatch):
    engine = _engine(stage=0, world_size=1, seed=0)
    manager = _manager(tmp_path)
    manager.save(engine, 1, _rank_state(0, 1))
    _train(engine, 1, 1, rank=0)
    weights_at_2 = _weights(engine)

    real_write = checkpoint_module.write_atomic

    def crash_on_latest(path, text):
        if path.name == "latest":
            raise KeyboardInterrupt("killed between the rename and `latest`")
        real_write(path, text)

    monkeypatch.setattr(checkpoint_module, "write_atomic", crash_on_latest)
    with pytest.raises(KeyboardInterrupt):
        manager.save(engine, 2, _rank_state(0, 2))
    monkeypatch.undo()

    root = tmp_path / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000001"  # stale
    found = _manager(tmp_path).find_resumable()
    assert found == root / "step_00000002"
    fresh = _engine(stage=0, world_size=1, seed=9)
    assert _manager(tmp_path).load(fresh, found)[0] == 2
    _assert_same_weights(_weights(fresh), weights_at_2)


def test_crash_mid_save_leaves_only_tmp_and_retry_succeeds(dist1, tmp_path, monkeypatch):
    engine = _engine(stage=0, world_size=1, seed=0)
    manager = _manager(tmp_path)
    manager.save(engine, 1, _rank_state(0, 1))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing rank state")

    monkeypatch.setattr(checkpoint_module.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        manager.save(engine, 2, _rank_state(0, 2))
    monkeypatch.undo()
    root = tmp_path / "run" / "checkpoints"
    assert (root / ".tmp-step_00000002").is_dir() and not (root / "step_00000002").exists()
    assert manager.find_resumable() == root / "step_00000001"
    # Saving the same step again replaces the leftover tmp dir.
    assert manager.save(engine, 2, _rank_state(0, 2)) == root / "step_00000002"
    assert not (root / ".tmp-step_00000002").exists()
    assert manager.find_resumable() == root / "step_00000002"
    # And saving an existing step again (e.g. right after resuming) replaces it cleanly.
    assert manager.save(engine, 2, _rank_state(0, 2)) == root / "step_00000002"
    assert manager.problems(root / "step_00000002") == []


def _flip_exponent_bit(model_file: Path, tensor: torch.Tensor) -> None:
    """Flip the top exponent bit of `tensor`'s first element where its fp32 bytes lie in `model_file`
    (the file keeps its size, as a bit flipped on a disk or in a copy does)."""
    raw = bytearray(model_file.read_bytes())
    needle = tensor.detach().float().contiguous().numpy().tobytes()
    at = raw.find(needle)
    assert at >= 0 and raw.find(needle, at + 1) < 0
    raw[at + 3] ^= 0x40  # little-endian float32: byte 3 holds the sign and the top 7 exponent bits
    model_file.write_bytes(bytes(raw))


def _two_checkpoints(tmp_path, **kw) -> tuple:
    engine = _engine(stage=0, world_size=1, seed=0)
    manager = _manager(tmp_path, **kw)
    for step in (1, 2):
        _train(engine, step, 1, rank=0)
        manager.save(engine, step, _rank_state(0, step))
    return engine, tmp_path / "run" / "checkpoints"


def test_meta_records_the_sha256_of_every_file_and_the_run_config(dist1, tmp_path):
    engine = _engine(stage=0, world_size=1, seed=0)
    path = _manager(tmp_path, run_config={"seed": 7}).save(engine, 1, {**_rank_state(0, 1), "skipped_steps": 4})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["version"] == 2 and meta["run_config"] == {"seed": 7} and meta["skipped_steps"] == 4
    assert set(meta["checksums"]["files"]) == set(meta["files"]) and meta["checksums"]["algorithm"] == "sha256"
    for name, digests in meta["checksums"]["files"].items():
        assert digests == [hashlib.sha256((path / name).read_bytes()).hexdigest()]  # each < 64 MiB: one block


def test_flipped_exponent_bit_is_caught_and_the_previous_checkpoint_loads(dist1, tmp_path, caplog):
    engine, root = _two_checkpoints(tmp_path)
    weight = engine.module[0].weight
    _flip_exponent_bit(root / "step_00000002" / "mp_rank_00_model_states.pt", weight)
    flipped = checkpoint_state_dict(root / "step_00000002", verify=False)["0.weight"]
    assert abs(float(flipped.flatten()[0])) > 1e30  # what would be loaded without the checksums

    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        found = _manager(tmp_path).find_resumable()
    assert found == root / "step_00000001"
    skipped = [r.getMessage() for r in caplog.records if "skipping damaged" in r.getMessage()]
    assert len(skipped) == 1 and "step_00000002" in skipped[0] and len(caplog.records) == 1
    assert "mp_rank_00_model_states.pt: bytes 0-" in skipped[0] and "do not match the sha256" in skipped[0]
    step, _ = _manager(tmp_path).load(_engine(stage=0, world_size=1, seed=5), found)
    assert step == 1
    # export and `finetune init=` (newest_checkpoint, checkpoint_state_dict) see the same
    assert newest_checkpoint(tmp_path / "run") == found
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt: bytes"):
        checkpoint_state_dict(root / "step_00000002")
    with pytest.raises(RuntimeError, match="cannot convert .*mp_rank_00_model_states.pt: bytes"):
        convert_to_universal(tmp_path / "run", tmp_path / "universal", root / "step_00000002")
    assert not (tmp_path / "universal").exists()
    # the damaged checkpoint stays on disk; saving its step again keeps it aside under another name
    manager = _manager(tmp_path)
    assert manager.find_resumable() == found
    assert manager.save(engine, 2, _rank_state(0, 2)) == root / "step_00000002"
    assert (root / "step_00000002.damaged" / "mp_rank_00_model_states.pt").is_file()
    assert manager.verify(root / "step_00000002") == []


def test_damaged_rank_state_is_named_and_skipped_with_or_without_checksums(dist1, tmp_path, caplog):
    _, root = _two_checkpoints(tmp_path)
    rank_file = root / "step_00000002" / "rank_state_0.pt"
    raw = rank_file.read_bytes()
    assert raw.count(b"cursor") == 1  # a key of the pickled dict: damaged, it no longer decodes as UTF-8
    rank_file.write_bytes(raw.replace(b"cursor", b"\xff" * 6))
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        assert _manager(tmp_path).find_resumable() == root / "step_00000001"
    assert "rank_state_0.pt: bytes 0-" in caplog.text
    # A checkpoint of an older version (no checksums): its rank states are test-read instead.
    for step in (1, 2):
        meta_path = root / f"step_0000000{step}" / "meta.json"
        meta = json.loads(meta_path.read_text())
        del meta["checksums"]
        meta_path.write_text(json.dumps(meta))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        assert _manager(tmp_path).find_resumable() == root / "step_00000001"
    assert "rank_state_0.pt cannot be read (UnicodeDecodeError" in caplog.text
    no_checksums = [r for r in caplog.records if "records no checksums" in r.getMessage()]
    assert len(no_checksums) == 1 and "step_00000001" in no_checksums[0].getMessage()


def test_when_every_checkpoint_is_damaged_resuming_is_refused(dist1, tmp_path):
    _, root = _two_checkpoints(tmp_path)
    for step in (1, 2):
        model_file = root / f"step_0000000{step}" / "mp_rank_00_model_states.pt"
        _flip_exponent_bit(model_file, checkpoint_state_dict(model_file.parent, verify=False)["2.bias"])
    with pytest.raises(CheckpointError, match="no intact checkpoint under .*step_00000001, step_00000002 are damaged"):
        _manager(tmp_path).find_resumable()
    assert (root / "step_00000001").is_dir() and (root / "step_00000002").is_dir()


def test_rotation_keeps_the_newest_checkpoint_written_before_nonfinite_updates(dist1, tmp_path, caplog):
    engine = _engine(stage=0, world_size=1, seed=0)
    manager = _manager(tmp_path, keep_last=2)
    skipped_by_step = {1: 0, 2: 0, 3: 3, 4: 3, 5: 3, 6: 3}  # updates 3-5 were skipped (non-finite)
    with caplog.at_level(logging.INFO, logger="training.checkpoint"):
        for step, skipped in skipped_by_step.items():
            _train(engine, step, 1, rank=0)
            manager.save(engine, step, {**_rank_state(0, step), "skipped_steps": skipped})
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000005", "step_00000006"]
    assert "keeping step_00000002 beyond checkpoint.keep_last=2" in caplog.text


def test_disk_full_names_the_space_needed_removes_the_partial_checkpoint_and_keeps_the_rest(
        dist1, tmp_path, monkeypatch):
    engine = _engine(stage=0, world_size=1, seed=0)
    manager = _manager(tmp_path)
    first = manager.save(engine, 1, _rank_state(0, 1))
    root = first.parent
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    size = sum(json.loads((first / "meta.json").read_text())["files"].values())

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", no_space)
    with pytest.raises(CheckpointDiskFullError) as info:
        manager.save(engine, 2, _rank_state(0, 2))
    message = str(info.value)
    assert "\n" not in message and str(root) in message and "checkpoint step_00000002" in message
    assert f"needs about {size / 1e9:.2f} GB (the size of step_00000001)" in message
    assert "resumes from step_00000001" in message
    assert not (root / ".tmp-step_00000002").exists() and not (root / "step_00000002").exists()
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    assert (root / "latest").read_text().strip() == "step_00000001"

    # torch's zip writer keeps no errno: its error counts as a full disk when less than the size is free
    def writer_failed(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint_module.torch, "save", writer_failed)
    usage = checkpoint_module.shutil.disk_usage(root)
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage._replace(free=100))
    fresh = _manager(tmp_path / "other")
    with pytest.raises(CheckpointDiskFullError, match="the size of the model and optimizer state.*starts from step 0"):
        fresh.save(engine, 1, _rank_state(0, 1))
    monkeypatch.setattr(checkpoint_module.shutil, "disk_usage", lambda path: usage._replace(free=10**15))
    with pytest.raises(RuntimeError, match="unexpected pos") as info:  # with space free it is another failure
        fresh.save(engine, 1, _rank_state(0, 1))
    assert not isinstance(info.value, CheckpointDiskFullError)


def _two_rank_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    _init_dist(rank, world_size, port)
    for stage in (0, 1):
        run_dir = Path(out_dir) / f"zero{stage}"
        engine = _engine(stage=stage, world_size=world_size, seed=0)
        _train(engine, 0, 3, rank=rank)
        manager = CheckpointManager(run_dir, keep_last=2, rank=rank, world_size=world_size)
        path = manager.save(engine, 3, _rank_state(rank, 3))
        if rank == 0:
            torch.save(_weights(engine), run_dir / "weights_at_3.pt")
        reference = _train(engine, 3, 2, rank=rank)

        # Round trip on 2 ranks: each rank gets its own rank state back.
        fresh = _engine(stage=stage, world_size=world_size, seed=77)
        found = manager.find_resumable()
        assert found == path, (found, path)
        step, state = manager.load(fresh, found)
        assert step == 3 and state["rank"] == rank
        assert _train(fresh, 3, 2, rank=rank) == reference

        # A damaged file of rank 1's: the ranks share the hashing and both skip the checkpoint.
        damaged = manager.save(fresh, 5, _rank_state(rank, 5))
        if rank == 0:
            name = "zero_pp_rank_1_mp_rank_00_optim_states.pt" if stage else "rank_state_1.pt"
            raw = bytearray((damaged / name).read_bytes())
            raw[len(raw) // 2] ^= 0x01
            (damaged / name).write_bytes(bytes(raw))
        torch.distributed.barrier()
        again = CheckpointManager(run_dir, keep_last=2, rank=rank, world_size=world_size)
        assert again.find_resumable() == path
        assert set(again.damaged) == {damaged.name}
    shutdown_distributed()


@pytest.fixture(scope="module")
def two_rank_checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_two_rank_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return out


def test_two_rank_save_and_round_trip(two_rank_checkpoints):
    for stage in (0, 1):
        path = two_rank_checkpoints / f"zero{stage}" / "checkpoints" / step_dirname(3)
        meta = json.loads((path / "meta.json").read_text())
        assert meta["world_size"] == 2 and meta["zero_stage"] == stage
        assert {"rank_state_0.pt", "rank_state_1.pt"} <= set(meta["files"])
        if stage == 1:
            assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} <= set(meta["files"])
        # the two ranks hashed a share each; together they recorded every file's sha256
        for name, digests in meta["checksums"]["files"].items():
            assert digests == [hashlib.sha256((path / name).read_bytes()).hexdigest()], name


def test_resume_two_rank_zero0_checkpoint_on_one_rank(dist1, two_rank_checkpoints, caplog):
    run_dir = two_rank_checkpoints / "zero0"
    manager = CheckpointManager(run_dir, keep_last=2, rank=0, world_size=1)
    engine = _engine(stage=0, world_size=1, seed=31)
    step, state = manager.load(engine, manager.find_resumable())
    assert step == 3 and state["rank"] == 0
    _assert_same_weights(_weights(engine), torch.load(run_dir / "weights_at_3.pt"))
    assert engine.optimizer.state_dict()["state"]  # Adam moments came back too
    # A rank that did not exist in the writing run gets rank 0's state (the data cursor is global).
    extra = CheckpointManager(run_dir, keep_last=2, rank=2, world_size=3)
    with caplog.at_level(logging.WARNING, logger="training.checkpoint"):
        _, state = extra.load(_engine(stage=0, world_size=1, seed=32), manager.find_resumable())
    assert state["rank"] == 0 and "takes rank 0's" in caplog.text


def test_zero1_world_size_change_is_a_clear_error(dist1, two_rank_checkpoints):
    manager = CheckpointManager(two_rank_checkpoints / "zero1", keep_last=2, rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="training.checkpoint_universal"):
        manager.load(_engine(stage=1, world_size=1, seed=0), manager.find_resumable())


@pytest.mark.parametrize("stage", [0, 1])
def test_torch_autocast_mode_keeps_fp32_weights(dist1, monkeypatch, stage):
    """The shipped bf16 mechanism: fp32 parameters, bf16 compute; at ZeRO-0 the client optimizer
    holds the model's own tensors (per-tensor optimizers keep their meaning), at ZeRO-1 a flat partition."""
    import deepspeed
    import deepspeed.runtime.torch_autocast as ds_autocast

    # DeepSpeed records autocast in module globals; restore them so later engines are unaffected.
    monkeypatch.setattr(ds_autocast, "TORCH_AUTOCAST_INITIALIZED", ds_autocast.TORCH_AUTOCAST_INITIALIZED)
    monkeypatch.setattr(ds_autocast, "TORCH_AUTOCAST_DTYPE", ds_autocast.TORCH_AUTOCAST_DTYPE)
    cfg = load_run_config(None, ["optim.batch_size=2", "precision=bf16"])
    ds = resolve_ds_config(f"ds_configs/zero{stage}.json", cfg, 1, device_type="cuda")  # as on a GPU
    assert ds["torch_autocast"]["enabled"] is True and ds["bf16"]["enabled"] is False
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(IN_DIM, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT_DIM)
    )
    own = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    out = engine(torch.randn(2, IN_DIM))
    assert out.dtype == torch.bfloat16  # bf16 compute
    engine.backward(out.float().pow(2).mean())
    engine.step()
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())  # fp32 weights
    held = [p for g in optimizer.param_groups for p in g["params"]]
    if stage == 0:
        assert len(held) == len(own) and all(a is b for a, b in zip(held, own))
    else:
        assert len(held) == 1 and held[0].dim() == 1 and held[0].numel() == sum(p.numel() for p in own)
