"""Package boundaries: the router (and the shared text/ and wire/ packages) import nothing
from replicas/, so the front door never depends on the replica package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(package: str) -> dict[str, set[str]]:
    """file -> the top-level packages its absolute imports name."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize("package", ["router", "text", "wire"])
def test_imports_nothing_from_replicas(package):
    files = imported_packages(package)
    assert files  # the walk found the package's modules
    assert {f: names for f, names in files.items() if "replicas" in names} == {}
