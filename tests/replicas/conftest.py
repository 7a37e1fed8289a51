import pytest

from tests.procs import Proc


@pytest.fixture(scope="module")
def replica():
    """A sim replica fast enough for tests, small enough to run out of pages."""
    with Proc("replicas", "--engine", "sim", "--kv-pages", "64", "--tokens-per-block", "16",
              "--max-model-len", "1024", "--max-body-bytes", "65536",
              "--sim-speedup", "4") as proc:
        yield proc
