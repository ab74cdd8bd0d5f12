"""One-line errors for every command-line entry point.

An error the user can fix (a bad config, a missing path, a run directory in use, a port taken, a full
disk) ends a command with ONE line on stderr, `error: <what is wrong and what to do>`, and exit code
2; a traceback would only bury that line. `run_main` gives every entry point this behaviour:

    if __name__ == "__main__":
        sys.exit(run_main(main))

Expected errors are `ExpectedError` (and its subclasses, e.g. training.config.ConfigError), a missing
file or a permission problem the OS reports, and a full disk. Anything else is a bug and keeps its
traceback (exit code 1). `T5DS_DEBUG=1` prints the traceback of expected errors too.

In a run of several processes each rank runs `run_main`; an error that every rank meets at start-up
is printed by one of them only: the others raise `ReportedByAnotherRank`, which exits 2 silently
(training/run_setup.py decides which rank reports).

This module imports nothing heavy: `--help` and argument errors of every command stay instant.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Callable, Iterator

DEBUG_ENV = "T5DS_DEBUG"
# Exit code of a command stopped by an error the user can fix (as data_prep, argparse and most
# Unix tools use it).
EXIT_USAGE = 2
# 128 + SIGINT, what a shell reports for a command ended by Ctrl-C.
EXIT_INTERRUPTED = 130


class ExpectedError(Exception):
    """An error the user can fix; the message says what is wrong and what to do."""


class ReportedByAnotherRank(ExpectedError):
    """This rank stops because of an error that another rank of the run reports (exit 2, no line)."""


def debug_enabled() -> bool:
    """Whether T5DS_DEBUG asks for tracebacks of expected errors too (any value but '', 0, false, no)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def expected_message(exc: BaseException) -> str | None:
    """The one-line message of an expected error, or None for an error that deserves a traceback."""
    if isinstance(exc, ExpectedError):
        return str(exc)
    if _disk_full(exc):
        where = f" writing {exc.filename}" if exc.filename else ""
        return (f"no space left on the device{where} ({exc.strerror}): free space there and run the command "
                "again; files written before stay as they were")
    if isinstance(exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError,
                        FileExistsError)):
        if exc.filename and exc.strerror:  # raised by the OS: name the path and the reason
            return f"{exc.filename}: {exc.strerror}"
        return str(exc)  # raised by our code with its own message
    return None


@contextlib.contextmanager
def expected_errors(what: str, *types: type[BaseException]) -> Iterator[None]:
    """Turn `types` raised inside the block into an ExpectedError "<what>: <message>" (just the
    message when `what` is empty).

    For the call sites where a library's validation errors (often ValueError) are the user's input
    problem, e.g. `with expected_errors(f"data.dir={path}", ValueError, FileNotFoundError):`.
    """
    try:
        yield
    except ExpectedError:
        raise
    except types as exc:
        raise ExpectedError(f"{what}: {exc}" if what else str(exc)) from exc


def report(exc: BaseException) -> int:
    """Print an expected error's line (or, with T5DS_DEBUG, its traceback and line) and return the
    exit code; re-raise anything else."""
    message = expected_message(exc)
    if message is None:
        raise exc
    if isinstance(exc, ReportedByAnotherRank):
        if debug_enabled():
            traceback.print_exception(exc, file=sys.stderr)
        return EXIT_USAGE
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run an entry point's `main(argv)` and return its exit code; expected errors become one
    `error:` line and exit code 2, Ctrl-C exit code 130 without a traceback."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        if debug_enabled():
            traceback.print_exc()
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 (report re-raises what it does not handle)
        return report(exc)
