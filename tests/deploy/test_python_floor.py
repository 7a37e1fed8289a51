"""The Python floor pyproject claims (3.11) is the one `make setup` enforces."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY310 = Path("/root/.pyenv/versions/3.10.13/bin/python3")  # on this project's machines


def test_pyproject_claims_the_version_the_code_needs():
    assert 'requires-python = ">=3.11"' in (ROOT / "pyproject.toml").read_text()


def test_make_setup_refuses_an_older_python_with_what_to_do(tmp_path):
    assert PY310.exists(), "the machine's pyenv 3.10 is what this test runs make with"
    out = subprocess.run(["make", "-C", str(ROOT), "setup", f"PYTHON={PY310}",
                          f"VENV={tmp_path / 'venv'}"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    assert "is Python 3.10.13; this project needs 3.11 or newer" in out.stderr
    assert not (tmp_path / "venv").exists()
