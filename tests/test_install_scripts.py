"""scripts/choose_torch.py, the decision scripts/install.sh takes about torch: fed with pip's real
installation reports (tests/assets/pip_reports: `pip install --dry-run --report` of torch==2.13.0
from a local CPU wheel, and from PyPI on Linux x86_64, which is a CUDA build), variants of them,
and made-up /proc and /dev trees for the GPU detection."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "tests" / "assets" / "pip_reports"
SCRIPT = REPO / "scripts" / "choose_torch.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("choose_torch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["choose_torch"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


ct = _load_script()


def _variant(tmp_path: Path, source: str, name: str, edit) -> Path:
    report = json.loads((REPORTS / source).read_text())
    edit(report)
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


def _cpu_index_report(tmp_path: Path) -> Path:
    """What PyTorch's CPU index answers (no CUDA packages, a +cpu version, a download.pytorch.org URL)."""

    def edit(report):
        report["install"] = [i for i in report["install"] if not ct.CUDA_PACKAGE.match(i["metadata"]["name"])]
        torch = next(i for i in report["install"] if i["metadata"]["name"] == "torch")
        torch["metadata"]["version"] = "2.13.0+cpu"
        torch["download_info"]["url"] = f"{ct.CPU_INDEX}/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl"

    return _variant(tmp_path, "torch_pypi_linux_x86_64.json", "cpu_index.json", edit)


def test_a_local_cpu_wheel_is_taken_as_it_is():
    choice = ct.read_report(REPORTS / "torch_local_cpu_wheel.json")
    assert choice.local and choice.cpu_build and choice.cuda_packages == ()
    assert ct.decide(choice, gpu=False) == "take"
    assert "CPU build" in choice.describe() and "a wheel this environment provides" in choice.describe()


def test_a_cuda_build_on_a_machine_without_gpu_goes_to_the_cpu_index():
    choice = ct.read_report(REPORTS / "torch_pypi_linux_x86_64.json")
    assert not choice.local and not choice.cpu_build
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(choice.cuda_packages)
    assert ct.decide(choice, gpu=False) == "cpu-index"
    assert ct.decide(choice, gpu=True) == "take"  # the machine has a GPU: the CUDA build is wanted
    assert "CUDA build" in choice.describe() and "files.pythonhosted.org" in choice.describe()


def test_labels_and_missing_cuda_packages_decide_what_a_cpu_build_is(tmp_path):
    # PyPI's torch on macOS or Windows: no local label, no CUDA packages -> a CPU build
    def no_cuda(report):
        report["install"] = [i for i in report["install"] if not ct.CUDA_PACKAGE.match(i["metadata"]["name"])]

    plain = ct.read_report(_variant(tmp_path, "torch_pypi_linux_x86_64.json", "plain.json", no_cuda))
    assert plain.cpu_build and ct.decide(plain, gpu=False) == "take"

    # a +cu label is a CUDA build even where the report lists no CUDA packages (--no-deps)
    def cu128(report):
        no_cuda(report)
        report["install"][0]["metadata"]["version"] = "2.11.0+cu128"

    labelled = ct.read_report(_variant(tmp_path, "torch_pypi_linux_x86_64.json", "cu.json", cu128))
    assert not labelled.cpu_build and ct.decide(labelled, gpu=False) == "cpu-index"

    cpu_index = ct.read_report(_cpu_index_report(tmp_path))
    assert cpu_index.cpu_build and ct.from_cpu_index(cpu_index)
    # a CPU build offered by another source of the pip configuration is not the CPU index's answer
    assert not ct.from_cpu_index(ct.read_report(REPORTS / "torch_local_cpu_wheel.json"))
    assert not ct.from_cpu_index(labelled) and not ct.from_cpu_index(None)


def test_a_report_without_torch_installs_nothing(tmp_path):
    path = _variant(tmp_path, "torch_local_cpu_wheel.json", "none.json", lambda r: r.update(install=[]))
    assert ct.read_report(path) is None
    assert ct.decide(None, gpu=False) == "take"


def test_gpu_detection_reads_the_driver_the_device_nodes_and_nvidia_smi(tmp_path):
    proc, dev = tmp_path / "proc_gpus", tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()  # the control node alone: a driver, no GPU
    no_smi = str(tmp_path / "absent-nvidia-smi")
    assert not ct.has_nvidia_gpu(proc, dev, nvidia_smi=no_smi)
    proc.mkdir()
    assert not ct.has_nvidia_gpu(proc, dev, nvidia_smi=no_smi)  # the driver lists no GPU
    (dev / "nvidia0").touch()
    assert ct.has_nvidia_gpu(proc, dev, nvidia_smi=no_smi)
    (dev / "nvidia0").unlink()
    (proc / "0000:3b:00.0").mkdir()
    assert ct.has_nvidia_gpu(proc, dev, nvidia_smi=no_smi)

    # nvidia-smi -L, where neither /proc nor /dev shows one (some containers)
    empty = tmp_path / "empty"
    empty.mkdir()
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    assert ct.has_nvidia_gpu(empty, empty, nvidia_smi=str(smi))
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver'\nexit 9\n")
    assert not ct.has_nvidia_gpu(empty, empty, nvidia_smi=str(smi))


def test_download_size_sums_what_the_servers_report_and_says_when_it_is_a_lower_bound():
    choice = ct.read_report(REPORTS / "torch_pypi_linux_x86_64.json")
    n = len(choice.downloads)
    every = ct.download_size(choice.downloads, head=lambda url, timeout_s: 200_000_000)
    assert every == f"{n} packages, about {n * 0.2:.1f} GB to download"
    some = ct.download_size(choice.downloads, head=lambda url, timeout_s: None if "nvidia" in url else 10**9)
    assert some.startswith(f"{n} packages, at least ")
    assert ct.download_size(choice.downloads, head=lambda url, timeout_s: None) == f"{n} packages, size unknown"
    # local files are never asked for over the network
    assert ct._content_length("file:///opt/wheels/torch.whl", 1.0) is None


def test_the_command_line_prints_action_build_and_description():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "decide", str(REPORTS / "torch_local_cpu_wheel.json")],
        capture_output=True, text=True, check=True,
    ).stdout
    assert out.strip() == "take\tcpu\ttorch 2.13.0+cpu (CPU build, from a wheel this environment provides)"
    bad = subprocess.run([sys.executable, str(SCRIPT), "decide"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_cpu_index_subcommand_exit_status(tmp_path):
    ok = subprocess.run([sys.executable, str(SCRIPT), "cpu-index", str(_cpu_index_report(tmp_path))])
    assert ok.returncode == 0
    not_cpu = subprocess.run([sys.executable, str(SCRIPT), "cpu-index", str(REPORTS / "torch_pypi_linux_x86_64.json")])
    assert not_cpu.returncode == 1
