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


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(size, name)``: a real small filesystem (tmpfs) under tmp_path, so writes
    meet a real ENOSPC; unmounted after the test. Skips where mounting is not allowed."""
    import subprocess

    mounted = []

    def mount(size: str = "3m", name: str = "mnt"):
        mnt = tmp_path / name
        mnt.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {res.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(mount_tmpfs):
    """A real 3 MiB filesystem."""
    return mount_tmpfs("3m")
