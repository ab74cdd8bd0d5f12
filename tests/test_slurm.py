"""The SLURM scripts (slurm/*.sbatch) against a real one-node SLURM started by the test session.

Each job runs 2 tasks on this machine's CPUs (gloo), standing in for 2 GPUs (one node) or 2 nodes with a
GPU each (the multi-node script). The trainer is a parameter:
  "fake": tests/fake_trainer.py, same launch contract as training/pretrain.py, seconds per job;
  "real": training/pretrain.py on training/configs/tiny_demo.yaml and shards of the bundled C4 sample.
The slurm-marked tests run only with T5DS_TEST_SLURM=1 (CI leaves it unset): they start daemons and
several training jobs (~2 minutes on an idle 2-core machine), and where SLURM is missing install it
with apt-get (root needed), purging those packages again at the end (tests/slurm_cluster.py).

    T5DS_TEST_SLURM=1 python -m pytest tests/test_slurm.py -m slurm -v
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import slurm_cluster as cluster_module
from tests.slurm_cluster import (
    JobResult,
    LocalSlurm,
    SlurmUnavailable,
    install,
    remove_installed_packages,
    skip_reason,
)

REPO = Path(__file__).resolve().parents[1]

# Trainers the SLURM jobs run. "real" needs training/pretrain.py, training/configs/tiny_demo.yaml and
# data_prep/shard.py, and takes ~1 min of the file's ~2 min (idle 2-core machine): marked slow.
# To test only the script logic, `-m "not slow"` or drop "real" here.
TRAINERS = ["fake", pytest.param("real", marks=pytest.mark.slow)]

# sbatch options that turn the GPU scripts into 2-task CPU jobs on the test node (command-line options
# override the scripts' #SBATCH lines).
CPU_JOB = ["--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=60"]


# --- the cluster -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def slurm_cluster(request) -> LocalSlurm:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    # Finalizers run last-registered first: the cluster stops, then what the install added goes.
    request.addfinalizer(remove_installed_packages)
    try:
        cluster = LocalSlurm.start()
    except SlurmUnavailable as e:
        pytest.skip(f"no local SLURM on this machine: {e}")
    request.addfinalizer(cluster.stop)  # runs even when a test (or the session) fails
    return cluster


# --- the trainers ----------------------------------------------------------------------------------
@dataclass
class Trainer:
    """How the tests drive one trainer through the SLURM scripts."""

    name: str
    env: dict[str, str]  # TRAINER / CONFIG / DS_CONFIG / OVERRIDES for the job
    total_steps: int
    signal_after_step: int  # send the preemption signal once metrics.jsonl shows this step
    preempt_overrides: list[str]  # script arguments for the run that gets preempted
    fail_overrides: list[str]  # script arguments that make the training fail
    fail_exit_code: int  # the exit code the job must then report
    timeout_s: float  # per job
    extra: dict = field(default_factory=dict)


def _fake_trainer(tmp: Path) -> Trainer:
    config = tmp / "fake.yaml"
    config.write_text(
        "output_dir: runs/fake\nseed: 5\noptim:\n  total_steps: 40\ncheckpoint:\n  every_steps: 10\n"
    )
    return Trainer(
        name="fake",
        env={
            "TRAINER": f"{sys.executable} tests/fake_trainer.py",
            "CONFIG": str(config),
            "DS_CONFIG": "ds_configs/zero2.json",
            "OVERRIDES": "fake.step_seconds=0.15 logging.every_steps=1",
        },
        total_steps=40,
        signal_after_step=4,
        # It waits at step 4 until the signal arrived, so a slow signal path cannot let it finish first.
        preempt_overrides=["fake.hold_at_step=4"],
        fail_overrides=["fake.fail_at_step=3", "fake.exit_code=7"],
        fail_exit_code=7,
        timeout_s=120,
    )


def _real_trainer(tmp: Path) -> Trainer:
    needed = [
        REPO / "training" / "pretrain.py",
        REPO / "training" / "configs" / "tiny_demo.yaml",
        REPO / "data_prep" / "shard.py",
    ]
    missing = [str(p.relative_to(REPO)) for p in needed if not p.exists()]
    if missing:
        pytest.skip(f"real trainer not available yet ({', '.join(missing)} missing)")
    shards = tmp / "shards"
    # The bundled real C4 sample (1000 train + 448 validation documents), 128-token inputs.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep.shard",
            "--input",
            "assets/c4/en/c4-*.json.gz",
            "--tokenizer",
            "assets/t5/spiece.model",
            "--output",
            str(shards),
            "--input-length",
            "128",
            "--rows-per-shard",
            "512",
            "--workers",
            "2",
            "--no-progress",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    overrides = [
        f"data.dir={shards}",
        "optim.total_steps=40",
        "optim.warmup_steps=3",
        "optim.batch_size=8",
        "logging.every_steps=1",
        "eval.every_steps=0",
        "eval.max_samples=32",
        "eval.batch_size=16",
        "checkpoint.every_steps=10",
        "data.num_workers=0",
    ]
    return Trainer(
        name="real",
        env={
            "TRAINER": f"{sys.executable} training/pretrain.py",
            "CONFIG": "training/configs/tiny_demo.yaml",
            "DS_CONFIG": "ds_configs/zero2.json",
            "OVERRIDES": " ".join(overrides),
        },
        total_steps=40,
        # Signalled after step 4, it has 36 steps (>= 6 s) left for the signal to arrive.
        signal_after_step=4,
        preempt_overrides=[],
        fail_overrides=["data.dir=/nonexistent/shards"],
        fail_exit_code=2,  # an error the user can fix: one `error:` line, exit code 2
        timeout_s=400,
    )


@pytest.fixture(scope="session", params=TRAINERS)
def trainer(request, tmp_path_factory) -> Trainer:
    tmp = tmp_path_factory.mktemp(f"trainer-{request.param}")
    return _fake_trainer(tmp) if request.param == "fake" else _real_trainer(tmp)


# --- helpers ---------------------------------------------------------------------------------------
def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_eval_loss(records: list[dict]) -> float:
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals, "no eval record in metrics.jsonl"
    return evals[-1]["eval_loss"]


def train_losses(records: list[dict]) -> dict[int, float]:
    """step -> loss of the train records (a resumed run repeats no step, but keep the last if it did)."""
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@dataclass
class Job:
    result: JobResult
    run_dir: Path
    log: str

    def describe(self) -> str:
        return f"job {self.result.job_id}: {self.result.state} {self.result.exit_code}:{self.result.signal}\n{self.log}"


def submit(
    cluster: LocalSlurm,
    script: str,
    trainer: Trainer,
    tmp: Path,
    *,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    script_args: list[str] | None = None,
    while_running=None,
) -> Job:
    """sbatch `script` from the repo root as a 2-task CPU job, wait for it, return its result and log."""
    run_dir = tmp / "run"
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    job_env = {**trainer.env, "OUTPUT_DIR": str(run_dir), **(env or {})}
    job_id = cluster.sbatch(
        REPO / script,
        [*CPU_JOB, f"--output={logs}/%x-%j.out", *(args or [])],
        env=job_env,
        cwd=REPO,
        script_args=script_args,
    )
    if while_running is not None:
        while_running(job_id, run_dir)
    result = cluster.wait(job_id, timeout_s=trainer.timeout_s)
    log = "\n".join(p.read_text(errors="replace") for p in sorted(logs.glob(f"*-{job_id}.out")))
    return Job(result, run_dir, log)


def wait_for_step(cluster: LocalSlurm, job_id: str, run_dir: Path, step: int, timeout_s: float) -> None:
    """Until metrics.jsonl has a train record at >= `step` (the trainer is then inside its loop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r["kind"] == "train" and r["step"] >= step for r in read_metrics(run_dir)):
            return
        if not cluster.is_queued(job_id):
            raise AssertionError(f"job {job_id} ended before reaching step {step}: {cluster.result(job_id)}")
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not reach step {step} in {timeout_s:.0f} s")


@pytest.fixture(scope="session")
def reference_run(slurm_cluster, trainer, tmp_path_factory) -> Job:
    """The uninterrupted single-node run, shared by the tests that compare against it."""
    return submit(
        slurm_cluster, "slurm/pretrain.sbatch", trainer, tmp_path_factory.mktemp(f"ref-{trainer.name}")
    )


# --- tests against the real SLURM ----------------------------------------------------------------------
@pytest.mark.slurm
def test_pretrain_job_completes(reference_run, trainer):
    job = reference_run
    assert (job.result.state, job.result.exit_code) == ("COMPLETED", 0), job.describe()
    assert job.result.restarts == 0
    records = read_metrics(job.run_dir)
    assert max(train_losses(records)) == trainer.total_steps, job.describe()
    assert [r["world_size"] for r in records if r.get("event") == "start"] == [2]
    assert any((job.run_dir / "checkpoints").iterdir()), "no checkpoint written"
    # The job log says where the run directory is.
    assert f"run directory: {job.run_dir}" in job.log
    assert "training finished (exit 0)" in job.log


@pytest.mark.slurm
def test_preempted_job_requeues_and_resumes(slurm_cluster, trainer, reference_run, tmp_path):
    def preempt(job_id: str, run_dir: Path) -> None:
        wait_for_step(slurm_cluster, job_id, run_dir, trainer.signal_after_step, trainer.timeout_s)
        # What `#SBATCH --signal=B:USR1@600` does before the time limit: USR1 to the batch shell only.
        slurm_cluster.scancel("--batch", "--signal=USR1", job_id)

    job = submit(
        slurm_cluster,
        "slurm/pretrain.sbatch",
        trainer,
        tmp_path,
        script_args=trainer.preempt_overrides,
        while_running=preempt,
    )
    assert (job.result.state, job.result.exit_code) == ("COMPLETED", 0), job.describe()
    assert job.result.restarts == 1, job.describe()
    assert "batch shell received SIGUSR1" in job.log
    assert "requeued job" in job.log

    records = read_metrics(job.run_dir)
    exits = [r for r in records if r.get("event") == "exit"]
    assert [e["exit_code"] for e in exits] == [75, 0], job.describe()
    stopped_at = exits[0]["step"]
    assert trainer.signal_after_step <= stopped_at < trainer.total_steps
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [stopped_at], "the requeued run did not resume from the checkpoint"
    # It finished the configured steps, with the uninterrupted run's losses from the resume point on.
    losses, reference = train_losses(records), train_losses(read_metrics(reference_run.run_dir))
    assert max(losses) == trainer.total_steps
    assert losses[trainer.total_steps] == pytest.approx(reference[trainer.total_steps], rel=1e-6)
    assert final_eval_loss(records) == pytest.approx(
        final_eval_loss(read_metrics(reference_run.run_dir)), rel=1e-6
    )


@pytest.mark.slurm
def test_failed_training_fails_the_job(slurm_cluster, trainer, tmp_path):
    job = submit(
        slurm_cluster, "slurm/pretrain.sbatch", trainer, tmp_path, script_args=trainer.fail_overrides
    )
    assert (job.result.state, job.result.exit_code) == ("FAILED", trainer.fail_exit_code), job.describe()
    assert job.result.restarts == 0
    assert f"training failed with exit code {trainer.fail_exit_code}" in job.log


@pytest.mark.slurm
def test_multinode_script_two_tasks(slurm_cluster, trainer, reference_run, tmp_path):
    # One node with 2 tasks stands in for 2 nodes with one GPU each: same srun, same rank variables.
    job = submit(slurm_cluster, "slurm/pretrain_multinode.sbatch", trainer, tmp_path, args=["--nodes=1"])
    assert (job.result.state, job.result.exit_code) == ("COMPLETED", 0), job.describe()
    assert f"hosts: {slurm_cluster.node} slots=2" in job.log
    records = read_metrics(job.run_dir)
    assert [r["world_size"] for r in records if r.get("event") == "start"] == [2]
    assert final_eval_loss(records) == pytest.approx(
        final_eval_loss(read_metrics(reference_run.run_dir)), rel=1e-6
    )
    if trainer.name == "fake":  # it records the launch variables every rank saw
        ranks = [json.loads(line) for line in (job.run_dir / "ranks.jsonl").read_text().splitlines()]
        assert sorted(r["env"]["RANK"] for r in ranks) == ["0", "1"]
        assert {r["env"]["WORLD_SIZE"] for r in ranks} == {"2"}
        assert sorted(r["env"]["LOCAL_RANK"] for r in ranks) == ["0", "1"]
        assert {r["env"]["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
        assert {(r["env"]["MASTER_ADDR"], r["env"]["MASTER_PORT"]) for r in ranks} == {
            (slurm_cluster.node, str(15000 + int(job.result.job_id) % 15000))
        }


@pytest.mark.slurm
def test_no_requeue_when_disabled(slurm_cluster, tmp_path):
    trainer = _fake_trainer(tmp_path)

    def stop(job_id: str, run_dir: Path) -> None:
        wait_for_step(slurm_cluster, job_id, run_dir, 3, 60)
        slurm_cluster.scancel("--signal=USR1", job_id)  # to the tasks directly, not via the batch shell

    job = submit(
        slurm_cluster,
        "slurm/pretrain.sbatch",
        trainer,
        tmp_path,
        env={"REQUEUE": "0"},
        script_args=["fake.hold_at_step=3"],
        while_running=stop,
    )
    # Checkpointed and ended with 75 for a manual resubmission.
    assert (job.result.state, job.result.exit_code, job.result.restarts) == ("FAILED", 75, 0), job.describe()
    assert "REQUEUE=0" in job.log
    assert [r["event"] for r in read_metrics(job.run_dir) if r["kind"] == "event"][-2:] == [
        "checkpoint",
        "exit",
    ]


@pytest.mark.slurm
def test_finetune_script_runs_its_trainer(slurm_cluster, tmp_path):
    trainer = _fake_trainer(tmp_path)  # training/finetune.py may not exist yet: the script is generic
    job = submit(slurm_cluster, "slurm/finetune.sbatch", trainer, tmp_path)
    assert (job.result.state, job.result.exit_code) == ("COMPLETED", 0), job.describe()
    assert "--deepspeed_config ds_configs/zero2.json" in job.log


# --- script logic without SLURM (dry run with a made-up allocation) ---------------------------------
def dry_run(script: str, env: dict[str, str], *args: str) -> str:
    base = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "t5",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "16",
        "SLURM_NTASKS_PER_NODE": "8",
        "SLURM_CPUS_PER_TASK": "12",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(REPO),
        "T5DS_DRY_RUN": "1",
    }
    proc = subprocess.run(
        ["bash", str(REPO / script), *args], env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_dry_run_builds_the_launch_command():
    out = dry_run(
        "slurm/pretrain_multinode.sbatch",
        {
            "DS_CONFIG": "ds_configs/zero3.json",
            "BUDGET_HOURS": "16",
            "OVERRIDES": "optim.base_lr=1e-2 seed=3",
        },
        "logging.wandb=offline",
    )
    assert "rendezvous gpu07:19242" in out  # first node; 15000 + 4242 % 15000
    assert "hosts: gpu07 slots=8,gpu08 slots=8" in out
    expected = (
        "srun --ntasks=16 --ntasks-per-node=8 --cpus-per-task=12 --kill-on-bad-exit=0 --wait=120 bash -c"
    )
    assert expected in out
    assert (
        "training/pretrain.py --config training/configs/t5_base_c4.yaml --deepspeed_config ds_configs/zero3.json "
        "output_dir=runs/t5_base_c4 budget.hours=16 optim.base_lr=1e-2 seed=3 logging.wandb=offline"
    ) in out
    assert f"run directory: {REPO}/runs/t5_base_c4" in out


def test_dry_run_rejects_a_missing_config():
    proc = subprocess.run(
        ["bash", str(REPO / "slurm/pretrain.sbatch")],
        env={
            "PATH": os.environ["PATH"],
            "SLURM_JOB_ID": "1",
            "SLURM_JOB_NODELIST": "n1",
            "SLURM_SUBMIT_DIR": str(REPO),
            "CONFIG": "no/such.yaml",
            "T5DS_DRY_RUN": "1",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "CONFIG=no/such.yaml not found" in proc.stdout


def test_scripts_parse():
    for script in [
        "slurm/common.sh",
        "slurm/pretrain.sbatch",
        "slurm/pretrain_multinode.sbatch",
        "slurm/finetune.sbatch",
        "slurm/shard_array.sbatch",
    ]:
        proc = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


# --- the opt-in, the install and the clean-up, without SLURM or root ---------------------------------
def test_the_slurm_tests_are_opt_in():
    reason = skip_reason({})
    assert reason is not None and "T5DS_TEST_SLURM=1" in reason and "apt-get" in reason
    assert skip_reason({"T5DS_TEST_SLURM": "0"}) == reason
    assert skip_reason({"T5DS_TEST_SLURM": "1"}) is None


class FakeDebian:
    """dpkg-query and apt-get as far as install() and remove_installed_packages() use them."""

    def __init__(self, installed: set[str], policy: Path) -> None:
        self.installed = set(installed)
        self.policy = policy
        self.commands: list[list[str]] = []

    def __call__(self, cmd, **kwargs):
        self.commands.append(cmd)
        out = ""
        if cmd[0] == "dpkg-query":
            out = "".join(f"{p}\tinstall ok installed\n" for p in sorted(self.installed)) + "gone\tdeinstall ok config-files\n"
        elif cmd[:2] in (["apt-get", "install"], ["apt-get", "purge"]):
            # every service start or stop the packages' scripts ask for is denied
            assert self.policy.read_text().rstrip().endswith("exit 101") and os.access(self.policy, os.X_OK)
            packages = [a for a in cmd[2:] if not a.startswith("-")]
            if cmd[1] == "install":
                self.installed |= {*packages, "libmunge2", "libslurm38"}  # with their dependencies
            else:
                self.installed -= set(packages)
        return subprocess.CompletedProcess(cmd, 0, out, "")


def test_install_records_what_it_added_and_the_last_session_purges_exactly_that(tmp_path, monkeypatch):
    policy, record = tmp_path / "policy-rc.d", tmp_path / "state" / "installed-packages.json"
    debian = FakeDebian({"libc6", "bash"}, policy)
    monkeypatch.setattr(cluster_module, "missing_binaries",
                        lambda: [] if "slurmd" in debian.installed else ["slurmd"])  # fmt: skip
    added = install(run=debian, record=record, policy=policy, is_root=True)
    assert added == ["libmunge2", "libslurm38", "munge", "slurm-client", "slurmctld", "slurmd"]
    assert json.loads(record.read_text()) == added
    assert not policy.exists()  # held back only while apt-get ran
    assert install(run=debian, record=record, policy=policy, is_root=True) == []  # present: nothing to do

    # another session's cluster still runs: the packages stay for it
    assert remove_installed_packages(run=debian, record=record, policy=policy, busy=lambda: True) == []
    assert record.exists() and "slurmd" in debian.installed

    debian.installed.discard("libslurm38")  # removed by hand meanwhile
    purged = remove_installed_packages(run=debian, record=record, policy=policy, busy=lambda: False)
    assert purged == ["libmunge2", "munge", "slurm-client", "slurmctld", "slurmd"]
    assert debian.commands[-1][:2] == ["apt-get", "purge"] and debian.installed == {"libc6", "bash"}
    assert not record.exists() and not record.parent.exists() and not policy.exists()
    assert remove_installed_packages(run=debian, record=record, policy=policy, busy=lambda: False) == []


def test_install_leaves_an_existing_policy_alone_and_needs_root(tmp_path, monkeypatch):
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    debian = FakeDebian(set(), policy)
    monkeypatch.setattr(cluster_module, "missing_binaries", lambda: [] if debian.installed else ["slurmd"])
    with pytest.raises(SlurmUnavailable, match="needs root"):
        install(run=debian, record=tmp_path / "r.json", policy=policy, is_root=False)
    assert debian.commands == []
    install(run=debian, record=tmp_path / "r.json", policy=policy, is_root=True)
    assert policy.read_text() == "#!/bin/sh\nexit 101\n"  # the machine's own policy stays
