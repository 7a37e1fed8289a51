"""Peer routers we measure against, installed in their own virtual environments.

Peers never become project dependencies: each lives in ``.peers/<name>`` (git-ignored) and
runs as a separate process.

SGLang model gateway (``sglang-router``, a Rust server inside a Python wheel)::

    with ServerProcess("replicas", "--engine", "sim") as a, \\
            ServerProcess("replicas", "--engine", "sim") as b, \\
            SGLangRouter([a.url, b.url], policy="cache_aware") as gw:
        httpx.post(gw.url + "/v1/completions",
                   json={"model": gw.model, "prompt": "Hi", "max_tokens": 4})

vLLM's router (``vllm-router``, a Rust fork of SGLang's gateway): ``VLLMRouter``, the same
interface (``vllm-router --worker-urls ... --policy cache_aware``: no ``launch``
subcommand, the same ``/readiness``; ``--version`` is not an option: the installed version
is read from the package metadata).

Facts about sglang-router 0.3.2 that shape this helper (BENCHMARKS.md, "Compatibility" and
the peer columns, has what was measured with it):

- The wheel's console scripts ``sglang-router``, ``smg`` and ``amg`` are one Python entry point
  (``sglang_router.cli:main``) that runs the Rust server in-process: one process to stop.
  SIGTERM shuts it down cleanly (exit 0); SIGINT also works but exits -2 after a Python
  KeyboardInterrupt traceback in the log.
- ``GET /health`` answers 200 as soon as the HTTP server listens, *before* any worker is
  registered (workers are registered by a background job). ``GET /readiness`` is the real
  readiness endpoint: 503 ``{"status":"not ready",...}`` until a worker is healthy, then 200
  ``{"status":"ready","healthy_workers":N,"total_workers":M}``.
- It always starts a Prometheus exporter, by default on 0.0.0.0:29000: a second gateway with
  the defaults panics ("Address already in use"), so we give it a free loopback port.
- ``/v1/completions`` requires ``model`` (422 otherwise), and the gateway's own ``/v1/models``
  says ``unknown`` (it finds no model info on our replicas), so clients must send the model
  id the replicas serve: ``.model`` is read from the first worker's ``/v1/models``.
- At INFO it logs two lines per request; the default log level here is ``warn`` so that
  the log does not tax latency measurements.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from .processes import ROOT, free_port

PEERS_DIR = ROOT / ".peers"
SGLANG_ROUTER_VERSION = "0.3.2"
VLLM_ROUTER_VERSION = "0.1.17"
SGLANG_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class PeerInstallError(RuntimeError):
    """A peer could not be installed into its virtual environment."""


def _run(cmd: list[str], timeout: float, what: str) -> str:
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        raise PeerInstallError(f"{what}: timed out after {timeout:.0f}s "
                               f"(is the package index reachable?)\n{out[-3000:]}") from None
    if done.returncode != 0:
        hint = ""
        if re.search(r"No matching distribution|Could not find a version|NewConnectionError|"
                     r"Failed to establish|Temporary failure in name resolution|"
                     r"Network is unreachable|ProxyError|SSLError", done.stdout):
            hint = ("\nhint: pip could not fetch the package: is PyPI (or your PIP_INDEX_URL)"
                    " reachable from here, and does that version exist?")
        raise PeerInstallError(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n"
                               f"{done.stdout[-3000:]}{hint}")
    return done.stdout


def ensure_sglang_router(version: str = SGLANG_ROUTER_VERSION, *,
                         venv_dir: Path | None = None, timeout: float = 900.0) -> Path:
    """Install ``sglang-router==version`` into its own virtualenv (once) and return the path
    of its ``sglang-router`` executable.

    Fast when already installed (one small file read, no subprocess). Safe against
    concurrent callers (a file lock). Raises :class:`PeerInstallError` with pip's output
    when the install fails, e.g. without network access.
    """
    return ensure_peer("sglang-router", version, "sglang-router",
                       Path(venv_dir) if venv_dir is not None else PEERS_DIR / "sglang",
                       timeout)


def ensure_vllm_router(version: str = VLLM_ROUTER_VERSION, *, venv_dir: Path | None = None,
                       timeout: float = 900.0) -> Path:
    """``ensure_sglang_router`` for ``vllm-router`` (its ``vllm-router`` executable)."""
    return ensure_peer("vllm-router", version, "vllm-router",
                       Path(venv_dir) if venv_dir is not None else PEERS_DIR / "vllm-router",
                       timeout)


def ensure_peer(package: str, version: str, executable: str, venv: Path,
                timeout: float = 900.0) -> Path:
    """Install ``package==version`` into the virtualenv ``venv`` (once, under a file lock)
    and return the path of its console script ``executable``."""
    exe = venv / "bin" / executable
    marker = venv / ".installed"
    spec = f"{package}=={version}"

    def installed() -> bool:
        try:
            return exe.is_file() and marker.read_text().strip() == spec
        except OSError:
            return False

    if installed():
        return exe
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing right now
        if installed():
            return exe
        python = venv / "bin" / "python"
        if not python.exists():
            # From a virtualenv's interpreter, venv bases the new one on the base interpreter.
            _run([sys.executable, "-m", "venv", str(venv)], timeout,
                 f"creating the virtualenv {venv}")
        marker.unlink(missing_ok=True)
        _run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
              "--no-input", spec], timeout, f"pip install {spec} into {venv}")
        if not exe.is_file():
            raise PeerInstallError(f"{spec} installed but {exe} is missing; the wheel's entry "
                                   f"points are: {sorted(p.name for p in exe.parent.iterdir())}")
        out = _run([str(python), "-c", "import importlib.metadata as m; "
                    f"print(m.version({package!r}))"], 60, f"the version of {package}")
        if out.strip() != version:
            raise PeerInstallError(f"{package} in {venv} is {out.strip()!r}, wanted {version}")
        marker.write_text(spec + "\n")
    return exe


class SGLangRouter:
    """The SGLang model gateway in front of ``worker_urls``, on a free loopback port.

    Waits until ``/readiness`` reports every worker healthy and a ``/v1/completions``
    request comes back 200 through it (``check_routing``); always stops what it started
    (SIGTERM, then SIGINT, then SIGKILL).
    """

    NAME = "sglang-router"
    SUBCOMMAND: tuple[str, ...] = ("launch",)
    LOG_LEVEL = "warn"

    @staticmethod
    def _install(version: str | None) -> Path:
        return ensure_sglang_router(version or SGLANG_ROUTER_VERSION)

    def __init__(self, worker_urls: Sequence[str], *, policy: str = "cache_aware",
                 extra_args: Sequence[str] = (), log_level: str | None = None,
                 model: str | None = None, check_routing: bool = True,
                 timeout: float = 60.0, log_dir: Path | None = None,
                 version: str | None = None, executable: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        log_level = log_level or self.LOG_LEVEL
        if not worker_urls:
            raise ValueError("SGLangRouter needs at least one worker URL")
        if policy not in SGLANG_POLICIES:
            raise ValueError(f"policy {policy!r}: choose one of {', '.join(SGLANG_POLICIES)}")
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.executable = Path(executable) if executable else self._install(version)
        self.port = free_port()
        self.prometheus_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.prometheus_port}/metrics"
        self.model = model
        self.cmd = [str(self.executable), *self.SUBCOMMAND,
                    "--worker-urls", *self.worker_urls,
                    "--policy", policy,
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(self.prometheus_port),
                    "--log-level", log_level,
                    *extra_args]
        self.log_path = (log_dir or ROOT / "artifacts") / f"{self.NAME}-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self._log.write((" ".join(self.cmd) + "\n").encode())
        self._log.flush()
        no_proxy = "127.0.0.1,localhost,::1"  # reqwest honours HTTP(S)_PROXY: keep loopback
        child_env = {**os.environ, "NO_PROXY": no_proxy, "no_proxy": no_proxy, **(env or {})}
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=child_env)
        try:
            self.wait_ready(timeout, check_routing)
        except BaseException:
            self.stop()
            raise

    # -- readiness ------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.NAME} on {self.url} exited with "
                               f"{self.proc.returncode}:\n{self.log()}")

    def _discover_model(self, client: httpx.Client) -> str:
        for url in self.worker_urls:
            try:
                data = client.get(url + "/v1/models", timeout=2.0).json()["data"]
                if data:
                    return data[0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
                continue
        return "default"

    def wait_ready(self, timeout: float, check_routing: bool = True) -> None:
        deadline = time.monotonic() + timeout
        want = len(self.worker_urls)
        last = "no answer yet"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                self._check_alive()
                try:
                    r = client.get(self.url + "/readiness")
                    last = f"/readiness {r.status_code} {r.text[:200]}"
                    if r.status_code == 200 and r.json().get("healthy_workers", 0) >= want:
                        break
                except (httpx.HTTPError, ValueError) as exc:
                    last = f"/readiness: {exc!r}"
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.NAME} on {self.url} not ready after "
                                       f"{timeout}s ({last}):\n{self.log()}")
                time.sleep(0.1)
            if self.model is None:
                self.model = self._discover_model(client)
            if not check_routing:
                return
            body = {"model": self.model, "prompt": "ping", "max_tokens": 1}
            while True:
                self._check_alive()
                try:
                    r = client.post(self.url + "/v1/completions", json=body, timeout=10.0)
                    if r.status_code == 200 and r.json().get("choices"):
                        return
                    last = f"/v1/completions {r.status_code} {r.text[:500]}"
                    if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                        raise RuntimeError(f"{self.NAME} on {self.url} does not route "
                                           f"{json.dumps(body)}: {last}\n{self.log()}")
                except (httpx.HTTPError, ValueError) as exc:
                    last = f"/v1/completions: {exc!r}"
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.NAME} on {self.url} does not route a "
                                       f"completion after {timeout}s ({last}):\n{self.log()}")
                time.sleep(0.2)

    # -- inspection and stopping ----------------------------------------------------------

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return _ANSI.sub("", self.log_path.read_text(errors="replace"))[-4000:]

    def workers(self) -> dict:
        """The gateway's view of its workers (``GET /workers``)."""
        return httpx.get(self.url + "/workers", timeout=5.0, trust_env=False).json()

    def prefix_decisions(self) -> dict[str, float]:
        """Its prefix-routing decisions so far by outcome, from its Prometheus metrics:
        ``vllm_router_prefix_routing_decisions_total`` (``prefix_hit``, ``prefix_miss``,
        ``load_imbalance``, ``missing_tokens``: no token ids for the request, so it was
        routed by load alone). Empty for a gateway without that family (SGLang's)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.metrics_url, timeout=5.0, trust_env=False).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_prefix_routing_decisions"):
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        outcome = sample.labels.get("outcome", "")
                        out[outcome] = out.get(outcome, 0.0) + sample.value
        return out

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (graceful: exit 0 in ~0.1 s when idle; SIGINT would end in a Python
        KeyboardInterrupt traceback), then SIGINT, then SIGKILL."""
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
                try:
                    self.proc.send_signal(sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout / 2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> SGLangRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class VLLMRouter(SGLangRouter):
    """vLLM's router (``vllm-router``, a Rust fork of SGLang's gateway) in front of
    ``worker_urls``: the same flags without the ``launch`` subcommand, the same
    ``/readiness``; its policies include ``cache_aware`` (the default here)."""

    NAME = "vllm-router"
    SUBCOMMAND = ()
    LOG_LEVEL = "warning"

    @staticmethod
    def _install(version: str | None) -> Path:
        return ensure_vllm_router(version or VLLM_ROUTER_VERSION)


PEER_ROUTERS = {"sglang": SGLangRouter, "vllm-router": VLLMRouter}
