"""Command-line option parsing shared by the benchmark scripts."""

from __future__ import annotations

from collections.abc import Sequence


def comma_choices(text: str, allowed: Sequence[str], option: str, what: str) -> list[str]:
    """The items of a comma list such as "enc,dec", each checked against `allowed`; an unknown item
    stops the script with a message naming the option and the choices."""
    items = [item.strip() for item in text.split(",")]
    for name in items:
        if name not in allowed:
            raise SystemExit(f"{option}: unknown {what} {name!r}; choose among {', '.join(allowed)}")
    return items
