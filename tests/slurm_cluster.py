"""A real one-node SLURM cluster for the tests: install it, start its daemons in a private temp dir,
submit jobs, poll them, stop everything, and remove what the install added.

    skip_reason()                         # None only with T5DS_TEST_SLURM=1 (the tests are opt-in)
    cluster = LocalSlurm.start()          # raises SlurmUnavailable when this machine cannot run one
    job = cluster.sbatch("slurm/pretrain.sbatch", ["--ntasks=2"], env={...})
    result = cluster.wait(job)            # JobResult(state="COMPLETED", exit_code=0, signal=0, ...)
    cluster.stop()
    remove_installed_packages()           # purge what install() added, once no other cluster runs

Where SLURM is missing, `install()` (root, apt-get) installs the Debian packages with their services
held back (a policy-rc.d that denies every start, so no system-wide munged or slurmd starts), and
records every package it added in INSTALL_RECORD; `remove_installed_packages()` purges exactly those
(their systemd units and state go with them) when no test session's cluster still runs, so the last
session to finish leaves the machine as it found it, also after a killed session.

Follows /work/shared/notes/local-slurm.md: Slurm from Debian's `slurmctld slurmd slurm-client munge`
packages, every path absolute and inside a fresh `mktemp -d`, munge auth on a private socket, the node
line from `slurmd -C`. Instead of SLURM's fixed ports 6817/6818 each cluster takes two free ports
(SlurmctldPort/SlurmdPort), so test sessions running at the same time (several people or helpers on one
machine) get separate clusters and a leftover daemon cannot clash. `stop()` must run even when a test
fails (the pytest fixture uses a finalizer); daemons of a session that was killed before its `stop()`
are stopped by the next `start()` (their owner process is gone).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged"]
SBIN = "/usr/sbin"  # where Debian installs the daemons
OPT_IN = "T5DS_TEST_SLURM"  # the SLURM tests run only where this is 1
INSTALL_RECORD = Path("/var/lib/t5ds-test-slurm/installed-packages.json")  # what install() added
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")  # Debian asks it before a package starts a service

Runner = Callable[..., subprocess.CompletedProcess]


class SlurmUnavailable(RuntimeError):
    """This machine cannot run a local SLURM (no root, no apt-get, the install failed)."""


@dataclass
class JobResult:
    """Final state of a job as `scontrol show job` reports it."""

    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ...
    exit_code: int  # the batch script's exit code (ExitCode=rc:sig)
    signal: int  # the signal that ended it, 0 if none
    restarts: int  # how often it was requeued (Restarts=)
    fields: dict[str, str]  # everything scontrol printed


def skip_reason(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the SLURM tests skip here, or None where they are asked for (T5DS_TEST_SLURM=1)."""
    if environ.get(OPT_IN, "").strip().lower() in ("1", "true", "yes"):
        return None
    return (
        f"set {OPT_IN}=1 to run the SLURM tests: they start a local slurmctld, slurmd and munged, and "
        f"where SLURM is missing install the Debian packages {' '.join(PACKAGES)} with apt-get as root "
        "(purged again when the tests end)"
    )


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path(SBIN, b).exists()]


def installed_packages(run: Runner = subprocess.run) -> set[str]:
    """The Debian packages installed now (dpkg's status "install ok installed")."""
    proc = run(["dpkg-query", "-W", "-f", "${Package}\t${Status}\n"], capture_output=True, text=True, timeout=60)
    return {
        line.split("\t")[0]
        for line in proc.stdout.splitlines()
        if line.endswith("\tinstall ok installed")
    }


@contextlib.contextmanager
def services_held_back(policy: Path = POLICY_RC_D) -> Iterator[None]:
    """While packages are installed or purged, deny every service start or stop (Debian's
    policy-rc.d, exit 101), so that the packages start no system-wide daemon. A policy-rc.d already
    in place is left as it is."""
    if policy.exists():
        yield
        return
    policy.write_text("#!/bin/sh\n# t5ds tests: no service starts while SLURM packages change\nexit 101\n")
    policy.chmod(0o755)
    try:
        yield
    finally:
        policy.unlink(missing_ok=True)


def _apt(args: list[str], run: Runner, timeout_s: float) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = run(["apt-get", *args], env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise SlurmUnavailable(f"`apt-get {' '.join(args)}` failed ({proc.returncode}): {proc.stderr[-2000:]}")


def install(
    timeout_s: float = 600,
    run: Runner = subprocess.run,
    record: Path = INSTALL_RECORD,
    policy: Path = POLICY_RC_D,
    is_root: bool | None = None,
) -> list[str]:
    """apt-get install the SLURM packages unless they are present, services held back; returns the
    packages it added (also added to `record`); SlurmUnavailable when it cannot."""
    if not missing_binaries():
        return []
    if not (os.geteuid() == 0 if is_root is None else is_root):
        raise SlurmUnavailable(
            f"SLURM is not installed ({', '.join(missing_binaries())} missing) and installing "
            "it needs root: run `apt-get install slurmctld slurmd slurm-client munge` as root"
        )
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable("SLURM is not installed and this machine has no apt-get to install it")
    before = installed_packages(run)
    added: list[str] = []
    try:
        with services_held_back(policy):
            _apt(["update", "-qq"], run, timeout_s)
            _apt(["install", "-y", "-qq", "--no-install-recommends", *PACKAGES], run, timeout_s)
    finally:  # a half-finished install is recorded too, so that it is removed
        added = sorted(installed_packages(run) - before)
        if added:
            known = json.loads(record.read_text()) if record.exists() else []
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(sorted(set(known) | set(added))) + "\n")
    if missing_binaries():
        raise SlurmUnavailable(f"installed {PACKAGES} but {missing_binaries()} are still missing")
    return added


def clusters_running() -> bool:
    """Whether a LocalSlurm of some test session (this one included) still runs on this machine."""
    for root in Path(tempfile.gettempdir()).glob("t5ds-slurm-*"):
        try:
            owner = int((root / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            continue
        if _alive(owner) and (root / "slurm.conf").exists():
            return True
    return False


def remove_installed_packages(
    run: Runner = subprocess.run,
    record: Path = INSTALL_RECORD,
    policy: Path = POLICY_RC_D,
    timeout_s: float = 600,
    busy: Callable[[], bool] = clusters_running,
) -> list[str]:
    """Purge the packages `install` recorded (their units, configuration and state go with them),
    unless a cluster still runs: the session that stops last removes them. Returns what it purged."""
    if not record.exists() or busy():
        return []
    packages = json.loads(record.read_text())
    present = sorted(set(packages) & installed_packages(run))
    if present:
        with services_held_back(policy):
            _apt(["purge", "-y", "-qq", *present], run, timeout_s)
    record.unlink()
    with contextlib.suppress(OSError):
        record.parent.rmdir()
    return present


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports that are free now (held open together so that they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("0.0.0.0", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (daemons whose parent never reaps them linger as zombies)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _run(
    cmd: list[str], env: dict[str, str], check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
    return proc


def _parse_scontrol(text: str) -> dict[str, str]:
    """`Key=Value Key2=Value2 ...` lines into a dict (values without spaces, as scontrol prints them)."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


def stop_stale_clusters() -> None:
    """Stop the daemons of earlier LocalSlurm runs that never reached stop() (a killed test session).

    Only clusters of this module are touched (pid files in a `t5ds-slurm-*` temp dir), and only when the
    process that started them is gone: a cluster of a test session still running is left alone.
    """
    for root in Path(tempfile.gettempdir()).glob("t5ds-slurm-*"):
        try:
            owner = int((root / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            continue  # no owner recorded (being created right now, or not ours)
        if _alive(owner):
            continue
        pids = []
        for pid_file in (root / "run").glob("*.pid"):
            try:
                pids.append(int(pid_file.read_text().strip()))
            except (OSError, ValueError):
                pass
        if (root / "slurm.conf").exists() and any(_alive(pid) for pid in pids):
            LocalSlurm(root).stop()


class LocalSlurm:
    """A running slurmctld + slurmd (+ munged) pair with one node and one partition `debug`."""

    def __init__(self, root: Path):
        self.root = root  # private dir: state/ spool/ log/ run/ munge/ slurm.conf
        self.conf = root / "slurm.conf"
        # The daemons live in /usr/sbin, which `missing_binaries` accepts but a user's PATH often lacks
        # (env -i, non-login shells): put it on the PATH the cluster's commands run with.
        path = os.environ.get("PATH", "")
        if SBIN not in path.split(os.pathsep):
            path = os.pathsep.join(filter(None, (path, SBIN)))
        self.env = {**os.environ, "PATH": path, "SLURM_CONF": str(self.conf)}
        self.node = socket.gethostname().split(".")[0]
        self.ports = self._read_ports()  # (slurmctld, slurmd), from slurm.conf once written

    # --- lifecycle ------------------------------------------------------------------------------
    @classmethod
    def start(cls, startup_timeout_s: float = 60) -> LocalSlurm:
        install()
        stop_stale_clusters()
        root = Path(tempfile.mkdtemp(prefix="t5ds-slurm-"))
        root.chmod(0o755)  # munged refuses a socket dir that others cannot traverse
        (root / "owner.pid").write_text(str(os.getpid()))
        cluster = cls(root)
        try:
            cluster._write_config()
            cluster._start_daemons(startup_timeout_s)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _read_ports(self) -> tuple[int, ...]:
        if not self.conf.exists():
            return ()
        text = self.conf.read_text()
        return tuple(
            int(re.search(rf"^{k}=(\d+)", text, re.M).group(1)) for k in ("SlurmctldPort", "SlurmdPort")
        )

    def _write_config(self) -> None:
        r = self.root
        self.ports = tuple(_free_ports(2))
        for sub in ("state", "spool", "log", "run", "munge"):
            (r / sub).mkdir(mode=0o755)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        # The node line as slurmd measures it; without it RealMemory is 1 MB and any --mem fails.
        node_line = _run(["slurmd", "-C"], self.env).stdout.splitlines()[0]
        node_line = re.sub(r"^NodeName=\S+", f"NodeName={self.node}", node_line)
        # Job ids from a random start: the job scripts derive MASTER_PORT from the job id, and two test
        # sessions' clusters on one machine must not hand the same port to their first jobs.
        first_job_id = random.randrange(1000, 14000, 100)
        self.conf.write_text(f"""\
ClusterName=t5ds-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={self.ports[0]}
SlurmdPort={self.ports[1]}
FirstJobId={first_job_id}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket.2
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/slurmd-%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
MinJobAge=300
SchedulerParameters=sched_interval=1
{node_line} NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _start_daemons(self, timeout_s: float) -> None:
        r = self.root
        _run(
            [
                "munged",
                f"--key-file={r}/munge/munge.key",
                f"--socket={r}/munge/munge.socket.2",
                f"--pid-file={r}/run/munged.pid",
                f"--seed-file={r}/munge/munged.seed",
                f"--log-file={r}/log/munged.log",
            ],
            self.env,
        )
        _run(["slurmctld", "-f", str(self.conf)], self.env)
        _run(["slurmd", "-f", str(self.conf)], self.env)
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = _run(["sinfo", "-h", "-o", "%T"], self.env, check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.25)
        raise RuntimeError(
            f"the local SLURM node did not become idle in {timeout_s:.0f} s (state {state!r}); "
            f"logs in {r}/log"
        )

    def stop(self) -> None:
        """Shut the daemons down and remove the private dir; safe to call twice or after a failed start."""
        if self.conf.exists():
            _run(["scontrol", "shutdown"], self.env, check=False, timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(_port_in_use(p) for p in self.ports):
                time.sleep(0.2)
        # Whatever is still up (shutdown failed, or munged, which scontrol does not stop): by pid file.
        pids = []
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / "run" / f"{name}.pid"
            try:
                pid = int(pid_file.read_text().strip())
                if _alive(pid):
                    os.kill(pid, signal.SIGTERM)
                    pids.append(pid)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10  # munged writes its seed file on the way out: let it finish
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)

    # --- jobs ----------------------------------------------------------------------------------
    def sbatch(
        self,
        script: str | Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        script_args: list[str] | None = None,
    ) -> str:
        """Submit `script` (options in `args` override its #SBATCH lines); returns the job id."""
        cmd = ["sbatch", "--parsable", *(args or []), str(script), *(script_args or [])]
        proc = (
            _run(cmd, {**self.env, **(env or {})}, timeout=30)
            if cwd is None
            else subprocess.run(
                cmd,
                env={**self.env, **(env or {})},
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        )
        return proc.stdout.strip().split(";")[0]

    def show_job(self, job_id: str) -> dict[str, str]:
        proc = _run(["scontrol", "-o", "show", "job", job_id], self.env, check=False)
        return _parse_scontrol(proc.stdout) if proc.returncode == 0 else {}

    def is_queued(self, job_id: str) -> bool:
        """Pending, running, completing or requeued (squeue still lists it)."""
        return bool(_run(["squeue", "-h", "-j", job_id], self.env, check=False).stdout.strip())

    def wait(
        self,
        job_id: str,
        timeout_s: float = 300,
        poll_s: float = 0.5,
        release_held: bool = True,
        release_after_s: float = 2.0,
    ) -> JobResult:
        """Poll squeue every `poll_s` until the job left the queue, then read its final state.

        `release_held`: a requeued job waits ~120 s for its EligibleTime; move its start to now (what
        a cluster's scheduler would do when the node is free) so that tests do not idle. Not at once:
        slurmd refuses to launch a job whose new credential dates from the same second as the kill of
        its previous run ("Job credential revoked", the job then FAILS with exit code 1), which is what
        the hold protects against; `release_after_s` of pending is enough.
        """
        deadline = time.monotonic() + timeout_s
        held_since = None
        while self.is_queued(job_id):
            if time.monotonic() > deadline:
                fields = self.show_job(job_id)
                _run(["scancel", job_id], self.env, check=False)
                raise TimeoutError(
                    f"job {job_id} still {fields.get('JobState')} after {timeout_s:.0f} s "
                    f"(reason {fields.get('Reason')}); cancelled it"
                )
            if release_held:
                fields = self.show_job(job_id)
                if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
                    held_since = held_since or time.monotonic()
                    if time.monotonic() - held_since >= release_after_s:
                        self.scontrol("update", f"JobId={job_id}", "StartTime=now", check=False)
                else:
                    held_since = None
            time.sleep(poll_s)
        return self.result(job_id)

    def result(self, job_id: str) -> JobResult:
        fields = self.show_job(job_id)
        if not fields:
            raise RuntimeError(f"scontrol no longer knows job {job_id} (MinJobAge passed?)")
        rc, _, sig = fields.get("ExitCode", "0:0").partition(":")
        return JobResult(
            job_id=job_id,
            state=fields.get("JobState", "?"),
            exit_code=int(rc),
            signal=int(sig or 0),
            restarts=int(fields.get("Restarts", "0")),
            fields=fields,
        )

    def wait_running(self, job_id: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.show_job(job_id).get("JobState") != "RUNNING":
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} did not start in {timeout_s:.0f} s: {self.show_job(job_id)}"
                )
            time.sleep(0.25)

    def scancel(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["scancel", *args], self.env, check=check)

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(["scontrol", *args], self.env, check=check)

    def log_tail(self, n_chars: int = 4000) -> str:
        """The daemons' logs, for failure messages."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-n_chars:]}")
        return "\n".join(parts)
