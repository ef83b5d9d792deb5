"""argparse value types shared by the command-line modules."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: refuses 0, negatives and non-integers at parse time (argparse names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
