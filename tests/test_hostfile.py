"""slurm/hostfile.py: SLURM node lists -> host names -> DeepSpeed hostfile lines (no SLURM needed)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HOSTFILE_PY = Path(__file__).resolve().parents[1] / "slurm" / "hostfile.py"
# slurm/ is a directory of job scripts, not a package: load the module from its file.
_spec = importlib.util.spec_from_file_location("t5ds_slurm_hostfile", HOSTFILE_PY)
hostfile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hostfile)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu01", ["gpu01"]),
        ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("node-[001-002]-ib", ["node-001-ib", "node-002-ib"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding: width of the lower bound
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept across the digit change
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu[01-02],cpu[1,3],login", ["gpu01", "gpu02", "cpu1", "cpu3", "login"]),
        ("x[5]", ["x5"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert hostfile.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "bad", ["", "gpu[01-03", "gpu01-03]", "gpu[a-b]", "gpu[03-01]", "gpu[1-]", "a,,b", "g[[1-2]]"]
)
def test_expand_nodelist_rejects_malformed_lists(bad):
    with pytest.raises(ValueError):
        hostfile.expand_nodelist(bad)


def test_expand_counts():
    assert hostfile.expand_counts("8(x2),4") == [8, 8, 4]
    assert hostfile.expand_counts("2") == [2]
    with pytest.raises(ValueError, match="N\\(xK\\)"):
        hostfile.expand_counts("8(2)")


def test_hostfile_lines_with_slots():
    hosts = hostfile.expand_nodelist("gpu[01-03,07]")
    assert hostfile.hostfile_lines(hosts, 8) == [
        "gpu01 slots=8",
        "gpu02 slots=8",
        "gpu03 slots=8",
        "gpu07 slots=8",
    ]
    assert hostfile.hostfile_lines(["a", "b"], [8, 4]) == ["a slots=8", "b slots=4"]
    with pytest.raises(ValueError):
        hostfile.hostfile_lines(["a", "b"], [8])


def test_slots_per_node_from_the_job_environment():
    assert hostfile.slots_per_node(2, slots=4, env={"SLURM_GPUS_ON_NODE": "8"}) == [4, 4]
    assert hostfile.slots_per_node(2, env={"SLURM_GPUS_ON_NODE": "8", "SLURM_TASKS_PER_NODE": "2(x2)"}) == [
        8,
        8,
    ]
    assert hostfile.slots_per_node(3, env={"SLURM_GPUS_ON_NODE": "0", "SLURM_TASKS_PER_NODE": "4(x2),2"}) == [
        4,
        4,
        2,
    ]
    assert hostfile.slots_per_node(2, env={}) == [1, 1]
    with pytest.raises(ValueError):
        hostfile.slots_per_node(1, slots=0, env={})


def test_cli_writes_a_hostfile(tmp_path):
    out = tmp_path / "hostfile"
    proc = subprocess.run(
        [
            sys.executable,
            str(HOSTFILE_PY),
            "--no-scontrol",
            "--nodelist",
            "gpu[01-03,07]",
            "--slots",
            "8",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().splitlines() == [
        "gpu01 slots=8",
        "gpu02 slots=8",
        "gpu03 slots=8",
        "gpu07 slots=8",
    ]

    first = subprocess.run(
        [sys.executable, str(HOSTFILE_PY), "--no-scontrol", "--first", "--nodelist", "a[1-2],b3"],
        capture_output=True,
        text=True,
    )
    assert first.stdout.strip() == "a1"

    bad = subprocess.run(
        [sys.executable, str(HOSTFILE_PY), "--no-scontrol", "--nodelist", "gpu[01-"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unclosed '['" in bad.stderr


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's scontrol is not installed")
def test_matches_scontrol_show_hostnames(tmp_path):
    # `scontrol show hostnames` needs no running cluster, only a readable slurm.conf.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1\nPartitionName=p Nodes=n1\n")
    for nodelist in ["gpu[01-03,07]", "a[1-2],b3", "n[8-11]", "n[098-101]", "rack[1-2]-n[1-2]"]:
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            env={"SLURM_CONF": str(conf)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, proc.stderr
        assert hostfile.expand_nodelist(nodelist) == proc.stdout.split()
