"""One-line errors at every entry point (training/cli_errors.py) and the entry points that use it."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from training.cli_errors import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    ExpectedError,
    ReportedByAnotherRank,
    expected_errors,
    run_main,
)
from training.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def _fails_with(exc: BaseException):
    def main(argv):
        raise exc

    return main


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def test_an_expected_error_is_one_line_and_exit_code_2(capsys, monkeypatch):
    monkeypatch.delenv("T5DS_DEBUG", raising=False)
    assert run_main(_fails_with(ConfigError("optim.base_lr=-1 must be > 0; set a positive value"))) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == "error: optim.base_lr=-1 must be > 0; set a positive value\n"


def test_debug_switch_adds_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("T5DS_DEBUG", "1")
    assert run_main(_fails_with(ExpectedError("run directory in use"))) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.endswith("error: run directory in use\n")


def test_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.delenv("T5DS_DEBUG", raising=False)
    with pytest.raises(KeyError):
        run_main(_fails_with(KeyError("not an expected error")))


def test_os_errors_name_the_path_and_a_full_disk_says_what_to_do(capsys, tmp_path):
    missing = tmp_path / "nope.yaml"

    def read(argv):
        return len(open(missing).read())

    assert run_main(read) == EXIT_USAGE
    assert capsys.readouterr().err == f"error: {missing}: No such file or directory\n"
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "metrics.jsonl"))
    assert run_main(_fails_with(full)) == EXIT_USAGE
    (line,) = _error_lines(capsys.readouterr().err)
    assert str(tmp_path / "metrics.jsonl") in line and "free space" in line


def test_another_ranks_error_exits_2_without_a_line(capsys, monkeypatch):
    monkeypatch.delenv("T5DS_DEBUG", raising=False)
    assert run_main(_fails_with(ReportedByAnotherRank("rank 0 failed"))) == EXIT_USAGE
    assert capsys.readouterr().err == ""


def test_ctrl_c_exits_130_without_a_traceback(capsys, monkeypatch):
    monkeypatch.delenv("T5DS_DEBUG", raising=False)
    assert run_main(_fails_with(KeyboardInterrupt())) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "interrupted\n"


def test_expected_errors_marks_a_libraries_validation_errors_as_the_users():
    with pytest.raises(ExpectedError, match=r"^data.dir: split 'train' holds no rows$"):
        with expected_errors("data.dir", ValueError):
            raise ValueError("split 'train' holds no rows")
    with pytest.raises(TypeError):  # other types pass through
        with expected_errors("data.dir", ValueError):
            raise TypeError("a bug")


def _run(args: list[str], cwd: Path = REPO, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    full_env.pop("T5DS_DEBUG", None)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=300)


def test_config_loader_cli_reports_a_bad_key_in_one_line():
    proc = _run(["-m", "training.config_loader", "training/configs/tiny_demo.yaml", "optim.base_lrr=1"])
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert "optim.base_lrr" in line


@pytest.mark.parametrize("args, says", [
    (["-m", "training.export", "{missing}", "{tmp}/hf"], "{missing} is not a run directory"),
    (["-m", "training.checkpoint_universal", "{missing}", "{tmp}/new"], "no complete checkpoint under"),
    (["-m", "training.plot_metrics", "{missing}", "--out", "{tmp}/x.png"], "{missing}/metrics.jsonl not found"),
    (["-m", "training.evaluate_sni", "{missing}", "--data", "{tmp}", "--out", "{tmp}/eval"], "--data {tmp}"),
])
def test_entry_points_report_a_missing_path_in_one_line(tmp_path, args, says):
    if "plot_metrics" in args:
        pytest.importorskip("matplotlib")
    names = {"missing": str(tmp_path / "no_such_run"), "tmp": str(tmp_path)}
    proc = _run([a.format(**names) for a in args])
    assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert says.format(**names) in line


def test_a_rendezvous_port_in_use_says_how_to_choose_another():
    """Rank 0 cannot open the rendezvous on MASTER_PORT (another job holds it): one line naming the
    port and the variables and options that pick another."""
    code = ("import sys\nfrom training.cli_errors import run_main\nfrom training.distributed import init_distributed\n"
            "sys.exit(run_main(lambda argv: init_distributed('cpu')))")
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = _run(["-c", code], RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port))
    assert proc.returncode == EXIT_USAGE and "Traceback" not in proc.stderr
    (line,) = _error_lines(proc.stderr)
    assert f"127.0.0.1:{port} (MASTER_PORT) is in use" in line and "--master_port" in line
