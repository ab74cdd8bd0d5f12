"""Which torch build scripts/install.sh installs, decided from what pip says it would install.

Standard library only: it runs in the fresh .venv before anything is installed.

    python scripts/choose_torch.py decide REPORT.json   one line: ACTION<TAB>BUILD<TAB>what pip would install
    python scripts/choose_torch.py size REPORT.json     one line: "N packages, about X GB to download"
    python scripts/choose_torch.py cpu-index REPORT.json  exit 0 when the report installs a CPU build from
                                                        PyTorch's CPU wheel index (1 otherwise)

REPORT.json is pip's installation report (`pip install --dry-run --report REPORT.json torch==X`).
ACTION is `take` (install what pip chose: a CPU build, a wheel this environment provides, or a CUDA
build on a machine with an NVIDIA GPU) or `cpu-index` (pip chose a CUDA build and this machine has
no NVIDIA GPU: ask PyTorch's CPU wheel index instead). BUILD is `cpu` or `cuda`, the kind of build
pip chose (a CPU build's few small dependencies can wait for the project's own install; a CUDA
build's large ones are better downloaded with torch, with their progress shown).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Packages a CUDA build of torch pulls in (nvidia-cublas, nvidia-cudnn-cu13, cuda-toolkit, cuda-bindings...).
CUDA_PACKAGE = re.compile(r"^(nvidia|cuda)[-_]", re.IGNORECASE)


@dataclass(frozen=True)
class TorchChoice:
    """What pip would install for a torch requirement."""

    version: str  # e.g. 2.13.0, 2.13.0+cpu, 2.11.0+cu128
    url: str  # where the torch wheel comes from (file:// for a wheel this environment provides)
    cuda_packages: tuple[str, ...]  # CUDA libraries pip would install along with it
    downloads: tuple[str, ...]  # URLs of every package pip would install

    @property
    def local(self) -> bool:
        return self.url.startswith("file:")

    @property
    def cpu_build(self) -> bool:
        label = self.version.partition("+")[2]
        if label:
            return label == "cpu" or label.startswith("cpu.")
        return not self.cuda_packages

    def describe(self) -> str:
        kind = "CPU build" if self.cpu_build else f"CUDA build with {len(self.cuda_packages)} CUDA packages"
        where = "a wheel this environment provides" if self.local else self.url.split("/")[2]
        return f"torch {self.version} ({kind}, from {where})"


def read_report(path: str | Path) -> TorchChoice | None:
    """The torch that pip's report would install; None when the report installs no torch."""
    report = json.loads(Path(path).read_text())
    items = report.get("install", [])
    for item in items:
        meta = item["metadata"]
        if meta["name"].lower() == "torch":
            return TorchChoice(
                version=meta["version"],
                url=item["download_info"]["url"],
                cuda_packages=tuple(i["metadata"]["name"] for i in items if CUDA_PACKAGE.match(i["metadata"]["name"])),
                downloads=tuple(i["download_info"]["url"] for i in items),
            )
    return None


def has_nvidia_gpu(
    proc_gpus: str | Path = "/proc/driver/nvidia/gpus", dev: str | Path = "/dev", nvidia_smi: str | None = None
) -> bool:
    """Whether this machine has an NVIDIA GPU, without torch: the driver's list of GPUs, a GPU's
    device node (/dev/nvidia0; /dev/nvidiactl alone is no GPU), or `nvidia-smi -L`."""
    proc_gpus, dev = Path(proc_gpus), Path(dev)
    if proc_gpus.is_dir() and any(proc_gpus.iterdir()):
        return True
    if dev.is_dir() and any(re.fullmatch(r"nvidia\d+", p.name) for p in dev.iterdir()):
        return True
    smi = nvidia_smi or shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            return False
        return any(line.startswith("GPU ") for line in out.splitlines())
    return False


def from_cpu_index(choice: TorchChoice | None) -> bool:
    """Whether pip, asked with `--index-url CPU_INDEX`, took a CPU build from there (and not a build
    that an extra index or find-links of the pip configuration offered)."""
    return choice is not None and choice.url.startswith(CPU_INDEX + "/") and choice.cpu_build


def decide(choice: TorchChoice | None, gpu: bool) -> str:
    """`take` or `cpu-index` (see the module docstring)."""
    if choice is None or choice.local or choice.cpu_build or gpu:
        return "take"
    return "cpu-index"


def _content_length(url: str, timeout_s: float) -> int | None:
    if not url.startswith(("http://", "https://")):
        return None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s) as r:
            return int(r.headers["Content-Length"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def download_size(urls: tuple[str, ...], timeout_s: float = 5.0, head=_content_length) -> str:
    """The line "N packages, about X GB to download", from the servers' Content-Length (HEAD requests in
    parallel); packages whose size is unknown make it "at least"."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        sizes = list(pool.map(lambda u: head(u, timeout_s), urls))
    known = [s for s in sizes if s is not None]
    if not known:
        return f"{len(urls)} packages, size unknown"
    total_gb = sum(known) / 1e9
    about = "about" if len(known) == len(sizes) else "at least"
    return f"{len(urls)} packages, {about} {total_gb:.1f} GB to download"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] not in ("decide", "size", "cpu-index"):
        print(f"usage: {Path(sys.argv[0]).name} decide|size|cpu-index REPORT.json", file=sys.stderr)
        return 2
    choice = read_report(argv[1])
    if argv[0] == "cpu-index":
        return 0 if from_cpu_index(choice) else 1
    if argv[0] == "size":
        print(download_size(choice.downloads) if choice else "nothing to download")
        return 0
    gpu = has_nvidia_gpu()
    action = decide(choice, gpu)
    what = choice.describe() if choice else "torch is already satisfied"
    if action == "take" and choice is not None and not choice.cpu_build and not choice.local:
        what += "; this machine has an NVIDIA GPU"
    build = "cpu" if choice is None or choice.cpu_build else "cuda"
    print(f"{action}\t{build}\t{what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
