"""Shared by the deployment tests: the files, the CLI flags, and running a compose command
as a local process."""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
LOGS = ROOT / "artifacts" / "deploy-tests"

# What every image is called: prefix-router-<Dockerfile target>.
IMAGE_PREFIX = "prefix-router-"


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # safe_load resolves the `<<:` merge keys


@functools.cache
def cli_flags(module: str) -> frozenset[str]:
    """Every ``--flag`` that ``python -m <module> --help`` lists (``--no-x`` included)."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return frozenset(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", out.stdout))


def flags_of(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` / ``--flag=value`` / bare ``--flag`` pairs of an argument list."""
    flags: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        arg = str(argv[i])
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if eq:
                flags[name] = value
            elif i + 1 < len(argv) and not str(argv[i + 1]).startswith("--"):
                flags[name] = str(argv[i + 1])
                i += 1
            else:
                flags[name] = None
        i += 1
    return flags


def module_of(argv: list[str]) -> str:
    """``router`` or ``replicas`` for ``python -m router ...``."""
    argv = [str(a) for a in argv]
    assert argv[:2] == ["python", "-m"] and len(argv) > 2, f"not `python -m MODULE`: {argv}"
    return argv[2]


def image_repo(image: str) -> str:
    """``registry/name:tag`` -> ``registry/name`` (a registry port is not a tag)."""
    last = image.rsplit("/", 1)[-1]
    return image[: len(image) - len(last)] + last.split(":", 1)[0].split("@", 1)[0]


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions as (INSTRUCTION, rest), continuation lines joined."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)\s*$", rest, re.IGNORECASE)
            current = stages.setdefault(m.group(1) if m else f"stage{len(stages)}", [])
        if current is not None:
            current.append((word, rest.strip()))
    return stages


def service_environment(service: dict) -> dict[str, str]:
    """A compose service's environment as the container sees it: a key without a value is
    taken from this environment when set there, and left out otherwise."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    out = {}
    for key, value in env.items():
        if value is None:
            if key in os.environ:
                out[key] = os.environ[key]
        else:
            out[key] = str(value)
    return out


class LocalProcess:
    """One compose service's command, run here as a process with its output in a log file;
    stopped as ``loadtest.processes.ServerProcess`` stops servers (SIGCONT, SIGINT twice,
    then SIGKILL)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.argv = argv
        self.log_path = LOGS / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **env})

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_healthy(self, check: list[str], url: str, timeout: float) -> None:
        """compose's `service_healthy`: wait until ``url`` answers 200 (polled here, which
        is cheaper than a Python process per try), then the healthcheck command must pass."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: {url} not ready after {timeout}s:\n"
                                   f"{self.log()}")
            time.sleep(0.1)
        out = subprocess.run(check, cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{self.name}: {shlex.join(check)} failed: {out.stderr}"

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            for sig in (signal.SIGINT, signal.SIGINT, signal.SIGKILL):
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout / 2)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()
