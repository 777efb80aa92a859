"""``tiering`` commands that work on a cache folder (inspect, verify, bench, ...)."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register the cache commands (filled in by the file-tier work)."""
