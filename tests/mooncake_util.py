"""A real ``mooncake_master`` for tests: started on free localhost ports, killed at teardown.

The master runs with its own HTTP metadata server (no etcd). ``kill()`` is a SIGKILL (a crashed
master: nothing is flushed, every stored value is lost with it), ``stop()``/``cont()`` freeze
and thaw it (a master that stops answering without closing its sockets), ``restart()`` starts a
fresh one on the same ports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def master_binary() -> Path | None:
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return path if path.is_file() else None


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class MooncakeMaster:
    def __init__(self, log_dir: Path, extra: tuple[str, ...] = ()) -> None:
        binary = master_binary()
        assert binary is not None, "mooncake-transfer-engine is not installed"
        self.binary = binary
        self.rpc_port, self.http_port, self.admin_port = free_ports(3)
        self.log_path = log_dir / f"mooncake_master_{self.rpc_port}.log"
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def admin(self) -> str:
        return f"127.0.0.1:{self.admin_port}"

    def tier_config(self, **more: object) -> dict[str, object]:
        return {"master": self.master, "metadata": self.metadata, "protocol": "tcp",
                "segment": "64MiB", "local_buffer": "16MiB", "admin": self.admin, **more}

    def start(self) -> MooncakeMaster:
        args = [str(self.binary), "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={self.http_port}",
                "--http_metadata_server_host=127.0.0.1", f"--rpc_port={self.rpc_port}",
                "--rpc_address=127.0.0.1", f"--metrics_port={self.admin_port}",
                "--metrics_host=127.0.0.1", "--client_ttl=3", *self.extra]
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}; see "
                                   f"{self.log_path}")
            try:
                with urllib.request.urlopen(f"http://{self.admin}/metrics/summary", timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"mooncake_master did not start in 30s; see {self.log_path}")

    def kill(self) -> None:
        """kill -9: the master and everything it knew are gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> MooncakeMaster:
        self.kill()
        return self.start()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
        self.kill()
