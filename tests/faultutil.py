"""Helpers of the fault suite (tests/test_faults_*.py): CLI runs in their own process, the
one-line rule for tool errors, seeded damage."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``tiering ARGS`` in its own process: a crash (SIGBUS, SIGSEGV) cannot hide in pytest's."""
    return subprocess.run([sys.executable, "-m", "tiering.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def assert_tool_ok(proc: subprocess.CompletedProcess, allowed=(0, 1, 2)) -> None:
    """Every tool ends with an exit code it documents and at most one line on stderr."""
    err = proc.stderr.strip()
    assert proc.returncode in allowed, (proc.args, proc.returncode, err[-2000:])
    assert "Traceback" not in err, (proc.args, err[-2000:])
    assert len(err.splitlines()) <= 1, (proc.args, err[-2000:])
    if proc.returncode != 0:  # verify reports what it found on stdout, errors go to stderr
        assert err or proc.stdout.strip(), (proc.args, "failed without saying why")
