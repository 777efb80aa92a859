"""``tiering bench``: filled in below."""

from __future__ import annotations

import argparse


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    pass
