"""argparse value types shared by the command-line modules."""

from __future__ import annotations

import argparse


def _integer_at_least(text: str, least: int, kind: str = "an integer", note: str = "") -> int:
    """``text`` as an integer >= ``least``; else an ArgumentTypeError saying what was expected."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}{note}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: refuses 0, negatives and non-integers at parse time (argparse names the option)."""
    return _integer_at_least(text, 1)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (argparse names the option)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def tree_rows_value(text: str) -> int | str:
    """argparse type of ``--tree-rows``: ``auto`` or an integer >= 0 (argparse names the option)."""
    return text if text == "auto" else _integer_at_least(text, 0, "'auto' or an integer", " (0 = chains only)")


def slowdown_value(text: str) -> float | None:
    """argparse type of ``serve --max-slowdown``: ``off`` (None) or a finite number >= 0."""
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'off' or a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 'off' or a number >= 0, got {text}")
    return value
