"""The console scripts of setup.cfg: one for every command line, and each one's --help exits 0 and
names the command as it was invoked (the console script, `python -m module`, or the script path),
with the module docstring's lines kept as written (no line continuation collapsed).

The scripts are not installed for the tests: one subprocess runs each entry point as pip's
generated wrapper does (sys.argv[0] = the script's path, then `sys.exit(main())`), and the -m and
script forms through runpy, as the interpreter runs them."""

from __future__ import annotations

import ast
import configparser
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every command line the package has; a new one needs its console script.
COMMANDS = {
    "t5ds-shard": "data_prep.shard:main",
    "t5ds-verify": "data_prep.verify:main",
    "t5ds-join": "data_prep.join:main",
    "t5ds-tokenizer": "data_prep.tokenizer:main",
    "t5ds-config": "training.config_loader:cli",
    "t5ds-pretrain": "training.pretrain:cli",
    "t5ds-launch": "training.launch:cli",
    "t5ds-finetune": "training.finetune:cli",
    "t5ds-convert-checkpoint": "training.checkpoint_universal:cli",
    "t5ds-export": "training.export:cli",
    "t5ds-evaluate-sni": "training.evaluate_sni:cli",
    "t5ds-glue": "training.glue:cli",
    "t5ds-plot": "training.plot_metrics:cli",
}

# Runs in a fresh interpreter: every help text, as {key: [exit code, text]}.
_RUNNER = r"""
import contextlib, importlib, io, json, runpy, sys

def run(call):
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            code = call()
        except SystemExit as e:
            code = e.code
    return [code or 0, out.getvalue()]

def console_script(name, target):  # what pip's wrapper does
    module, func = target.split(":")
    sys.argv = [f"/venv/bin/{name}", "--help"]
    return run(lambda: getattr(importlib.import_module(module), func)())

def dash_m(module):  # python -m module --help
    sys.argv = [module, "--help"]
    return run(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))

def script(path):  # python path/to/script.py --help
    sys.argv = [path, "--help"]
    return run(lambda: runpy.run_path(path, run_name="__main__"))

scripts, modules, paths = json.loads(sys.argv[1])
results = {name: console_script(name, target) for name, target in scripts.items()}
results.update({f"python -m {m}": dash_m(m) for m in modules})
results.update({p: script(p) for p in paths})
sys.stdout.write(json.dumps(results))
"""


def _console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict((part.strip() for part in line.split("=", 1)) for line in lines)


@pytest.fixture(scope="module")
def help_texts() -> dict[str, list]:
    request = [_console_scripts(), ["data_prep.verify", "training.export"], ["training/pretrain.py"]]
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(request)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_command_line_has_a_console_script():
    assert _console_scripts() == COMMANDS


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_exits_0_and_names_the_console_script(help_texts, name):
    code, text = help_texts[name]
    assert code == 0, text
    assert text.startswith(f"usage: {name} "), text[:200]


@pytest.mark.parametrize("invoked", ["python -m data_prep.verify", "python -m training.export", "training/pretrain.py"])
def test_help_names_the_module_or_the_script_as_invoked(help_texts, invoked):
    code, text = help_texts[invoked]
    assert code == 0 and text.startswith(f"usage: {invoked} "), text[:200]


def _docstring_source_lines(module: str) -> list[str]:
    r"""The module docstring's lines as written in the source file (before Python reads `\` escapes)."""
    path = REPO / (module.replace(".", "/") + ".py")
    src = path.read_text()
    first = ast.parse(src).body[0]
    segment = ast.get_source_segment(src, first).lstrip("rRuU")[3:-3]
    return [line.rstrip() for line in segment.splitlines() if line.strip()]


def test_docstring_descriptions_keep_their_lines_as_written(help_texts):
    """Where the module docstring is the description (RawDescriptionHelpFormatter), each of its lines
    appears in --help as written: `... \\` continuations in examples stay two lines."""
    checked = []
    for name, target in COMMANDS.items():
        lines = _docstring_source_lines(target.split(":")[0])
        text = help_texts[name][1]
        if len(lines) > 1 and lines[-1] in text:  # the whole docstring is the description
            assert [line for line in lines if line not in text] == [], name
            checked.append(name)
    assert {"t5ds-pretrain", "t5ds-finetune", "t5ds-evaluate-sni", "t5ds-convert-checkpoint"} <= set(checked)
