"""Shared pytest options: ``--long`` runs the fault suite's long mode (>=100 trials per kind)."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="fault suite (tests/test_faults_*.py): at least 100 trials per kind; "
                     "TIERING_FAULT_TRIALS=N sets the count directly")


@pytest.fixture
def trials(request: pytest.FixtureRequest):
    """``trials(default)``: how many trials a fault kind runs (bounded by default)."""
    def count(default: int) -> int:
        env = os.environ.get("TIERING_FAULT_TRIALS")
        if env:
            return max(1, int(env))
        return max(100, default) if request.config.getoption("--long") else default
    return count
