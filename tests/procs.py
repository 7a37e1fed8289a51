"""Test-side name for the process helper."""

from loadtest.processes import ServerProcess as Proc, free_port

__all__ = ["Proc", "free_port"]
