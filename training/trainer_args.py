"""The command line of the training entry points (training/pretrain.py, training/finetune.py).

Light (argparse, YAML, the config dataclasses): the entry points parse their arguments and load the
run config with it before they import torch, DeepSpeed and the model (seconds), so `--help`, a
mistyped option and a bad run config are answered at once (`preflight`).
"""

from __future__ import annotations

import argparse
import os
import sys

from data_prep.invocation import command_name
from training.cli_errors import ExpectedError, ReportedByAnotherRank, report
from training.config_loader import load_run_config

# The entry points' default run configs (found from any working directory: config_loader.shipped_path).
PRETRAIN_CONFIG = "training/configs/t5_base_c4.yaml"
FINETUNE_CONFIG = "training/configs/sni.yaml"

EPILOG = """\
exit codes: 0 done; 75 stopped by a signal (SIGTERM, SIGUSR1, SIGINT) or by the end of its launcher,
after a checkpoint: start the same command again to resume; 2 an error the message explains
(T5DS_DEBUG=1 adds its traceback); 3 too many non-finite steps in a row."""


def trainer_parser(doc: str, default_config: str) -> argparse.ArgumentParser:
    """`--config` YAML, `--deepspeed_config` (default: the config's ds_config), `--local_rank` (set by
    the deepspeed launcher), then `key=value` overrides."""
    parser = argparse.ArgumentParser(prog=command_name(), description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    parser.add_argument("--config", default=default_config,
                        help=f"run config (YAML; default {default_config}, found from any directory)")
    parser.add_argument("--deepspeed_config", default=None,
                        help="DeepSpeed config; switch ZeRO stage by switching this file "
                             "(default: the run config's ds_config)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    parser.add_argument("overrides", nargs="*", help="run-config overrides, e.g. optim.base_lr=1e-2")
    return parser


def parse_trainer_args(argv: list[str] | None, *, doc: str, default_config: str) -> argparse.Namespace:
    """The parsed command line; overrides may come before, between and after the options."""
    return trainer_parser(doc, default_config).parse_intermixed_args(argv)


def launcher_rank() -> int:
    """This process's rank as its launcher set it (before any process group exists); 0 without one."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def load_trainer_config(args: argparse.Namespace, root: type):
    """The run config of a parsed command line. Every rank meets the same config error: rank 0
    reports it, the others stop silently (ReportedByAnotherRank)."""
    try:
        return load_run_config(args.config, args.overrides, root=root)
    except ExpectedError as exc:
        if launcher_rank() != 0:
            raise ReportedByAnotherRank(str(exc)) from exc
        raise


def preflight(argv: list[str], *, doc: str, default_config: str, root: type) -> None:
    """Parse the command line and load the run config; on `--help` or an error, exit here (with the
    error's one line and code 2)."""
    try:
        load_trainer_config(parse_trainer_args(argv, doc=doc, default_config=default_config), root)
    except ExpectedError as exc:
        sys.exit(report(exc))
