"""The name a command was invoked by, for its usage text (argparse's `prog`).

    t5ds-shard --help                 usage: t5ds-shard ...
    python -m data_prep.shard --help  usage: python -m data_prep.shard ...
    python training/pretrain.py -h    usage: training/pretrain.py ...

argparse's own default is the base name of sys.argv[0], which for `python -m package.module` is
`module.py`, a command that does not exist.
"""

from __future__ import annotations

import os
import sys


def command_name() -> str:
    """`python -m <module>` when the main module was run with -m, the script's path as typed when it
    was run as a file, else the base name of the console script (or launcher) that runs it."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "t5ds"
    if argv0.endswith(".py"):
        return argv0
    return os.path.basename(argv0)
