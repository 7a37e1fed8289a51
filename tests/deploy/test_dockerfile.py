"""Dockerfile and .dockerignore, without Docker: the targets exist, the router image gets no
torch (and the router runs without it), the dependency list follows pyproject.toml, and the
build context lets through everything the Dockerfile copies."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
import tomllib

from .common import DOCKERIGNORE, ROOT, cli_flags, dockerfile_stages, flags_of


def pyproject_dependencies() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    assert block, "no dependencies = [...] in pyproject.toml"
    return re.findall(r'^\s*"([^"]+)"', block.group(1), re.MULTILINE)


def pip_install_args(stage: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of each `pip install` command in a stage's RUN lines."""
    commands = []
    for word, rest in stage:
        if word == "RUN":
            lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(lexer)
            for i in range(len(words) - 1):
                if words[i:i + 2] == ["pip", "install"]:
                    end = next((j for j in range(i + 2, len(words))
                                if words[j] in ("&&", "||", ";", "|")), len(words))
                    commands.append(words[i + 2:end])
    return commands


def pip_installs(stage: list[tuple[str, str]]) -> list[str]:
    """The requirements (not options, not wheel files) a stage's `pip install`s name."""
    reqs = []
    for args in pip_install_args(stage):
        skip = False
        for a in args:
            if skip:
                skip = False
            elif a in ("--index-url", "-i", "--extra-index-url", "-c", "-r"):
                skip = True
            elif not a.startswith("-"):
                reqs.append(a)
    return reqs


def test_targets_and_commands():
    stages = dockerfile_stages()
    assert {"router", "replica"} <= set(stages)
    for target, module, port in (("router", "router", "8000"), ("replica", "replicas", "9001")):
        cmd = [w for w, _ in stages[target]].count("CMD")
        assert cmd == 1, f"{target}: one CMD"
        argv = json.loads(next(r for w, r in stages[target] if w == "CMD"))  # exec form
        assert argv[:3] == ["python", "-m", module]
        flags = flags_of(argv[3:])
        assert set(flags) <= cli_flags(module), set(flags) - cli_flags(module)
        assert flags["--host"] == "0.0.0.0" and flags["--port"] == port
        assert ("EXPOSE", port) in stages[target]
        # numeric, so Kubernetes runAsNonRoot can verify it (deploy/k8s runs as 10001)
        assert ("USER", "10001:10001") in stages[target], f"{target} must not run as root"


def test_router_image_installs_no_torch():
    stages = dockerfile_stages()
    assert stages["router"][0] == ("FROM", "base AS router")  # base: no torch either
    for name in ("base", "router"):
        for req in pip_installs(stages[name]):
            assert not re.match(r"torch\b", req), f"{name} installs {req}"
    assert pip_installs(stages["router"]) == ["/wheels/*.whl"]
    assert all("--no-deps" in args for args in pip_install_args(stages["router"]))
    wheel = " ".join(rest for word, rest in stages["wheel"] if word == "RUN")
    assert "pip wheel --no-deps" in wheel
    replica = pip_installs(stages["replica"])
    assert any(r.startswith("torch==") for r in replica)
    assert any("--index-url" in args for args in pip_install_args(stages["replica"]))


def test_base_dependencies_are_pyprojects_less_torch_plus_the_otel_extra():
    deps = pyproject_dependencies()
    assert any(d.startswith("torch") for d in deps)
    otel = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["otel"]
    assert otel and all(d.startswith("opentelemetry-") for d in otel)
    assert sorted(pip_installs(dockerfile_stages()["base"])) == sorted(
        [d for d in deps if not re.match(r"torch\b", d)] + otel)


def test_the_wheel_stage_copies_every_package_the_project_ships():
    """A package left out of the build context would build a wheel without it, and the
    images would fail to import (wire/ once was)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    packages = sorted({pattern.removesuffix("*") for pattern in find})
    assert packages and all((ROOT / name).is_dir() for name in packages)
    copied = {rest.split()[0] for word, rest in dockerfile_stages()["wheel"] if word == "COPY"}
    # (test_dockerignore_lets_through_what_is_copied: the context has what is copied)
    assert {f"{name}/" for name in packages} <= copied, sorted(packages)


def test_router_never_imports_torch():
    # statically: no module of router/ or wire/ (or what it imports from replicas/) names
    # torch
    imported = {"replicas." + m for m in re.findall(
        r"from replicas\.([\w.]+) import", "".join(p.read_text() for p in
                                                    (ROOT / "router").rglob("*.py")))}
    files = list((ROOT / "router").rglob("*.py")) + list((ROOT / "wire").rglob("*.py"))
    for m in imported:  # a module, or a package (all of it)
        path = ROOT / m.replace(".", "/")
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    for path in files:
        assert not re.search(r"^\s*(import|from)\s+torch\b", path.read_text(), re.MULTILINE), \
            path
    # and at run time: every router module imports with torch unimportable
    modules = sorted({".".join(p.relative_to(ROOT).with_suffix("").parts)
                      for p in (ROOT / "router").rglob("*.py")} - {"router.__init__"})
    code = ("import importlib, sys; sys.modules['torch'] = None\n"
            f"for m in {modules!r}: importlib.import_module(m.removesuffix('.__init__'))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "router", "--help"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "torch" not in out.stderr


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches decides (``!`` lets a path through);
    a pattern matching a parent folder matches what is in it."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p.rsplit("/", 1)[-1], pat[3:]) for p in prefixes)
        else:
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_lets_through_what_is_copied():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    sources = []
    for stage in dockerfile_stages().values():
        for word, rest in stage:
            if word == "COPY" and "--from" not in rest:
                sources += rest.split()[:-1]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        files = [src] if (ROOT / src).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / src).rglob("*.py")]
        for f in files:
            assert not _ignored(f, patterns), f"{f} is excluded by .dockerignore"
    for kept_out in (".venv/bin/python", ".git/HEAD", "artifacts/x.log", "tests/procs.py",
                     "router/__pycache__/app.cpython-311.pyc"):
        assert _ignored(kept_out, patterns), kept_out
