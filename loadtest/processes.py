"""Start servers (replicas, routers) as real processes on free loopback ports.

Used by the tests, the benchmarks and ``loadtest compare``. ``ServerProcess`` waits until
the server answers its readiness path and always stops what it started (SIGCONT first, so a
stopped process can exit; then SIGINT twice; then SIGKILL).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


_ADDRESS_IN_USE = "address already in use"  # errno 98's text, in the server's log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server process: ``python -m <module> --host 127.0.0.1 --port <free> ...``."""

    # A port from free_port() is free when drawn, not when the server binds it: another
    # process can take it in between. A server that exits on that gets a new port.
    PORT_ATTEMPTS = 3

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None,
                 ready_path: str = "/ready", timeout: float = 60.0,
                 log_dir: Path | None = None, port: int | None = None) -> None:
        for attempt in range(1, self.PORT_ATTEMPTS + 1):
            self._start(module, args, env, log_dir, port or free_port())
            try:
                self.wait_ready(ready_path, timeout)
                return
            except BaseException as exc:
                self.stop()
                taken = isinstance(exc, RuntimeError) and _ADDRESS_IN_USE in self.log()
                if port is not None or not taken or attempt == self.PORT_ATTEMPTS:
                    raise

    def _start(self, module: str, args, env, log_dir: Path | None, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = (log_dir or ROOT / "artifacts") / f"{module}-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(self.port),
               *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url}{path} not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
                self.proc.send_signal(sig)  # the second SIGINT skips a graceful drain
                try:
                    self.proc.wait(timeout / 2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
