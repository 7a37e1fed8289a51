"""loadtest.processes.ServerProcess: a drawn port that another process takes before the
server binds it costs a restart on a new port, not the test."""

import socket

import httpx
import pytest

from loadtest import processes
from loadtest.processes import ServerProcess, free_port


def test_a_port_taken_before_the_server_binds_it_is_drawn_again(monkeypatch, tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        draws = iter([taken, free_port()])
        monkeypatch.setattr(processes, "free_port", lambda: next(draws))
        with ServerProcess("replicas", "--engine", "sim", log_dir=tmp_path) as rep:
            assert rep.port != taken
            assert httpx.get(rep.url + "/ready").status_code == 200
        logs = sorted(p.name for p in tmp_path.iterdir())
        assert logs == sorted([f"replicas-{taken}.log", f"replicas-{rep.port}.log"])
        assert "address already in use" in (tmp_path / f"replicas-{taken}.log").read_text()


def test_a_port_asked_for_is_never_swapped(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(RuntimeError, match="address already in use"):
            ServerProcess("replicas", "--engine", "sim", port=taken, log_dir=tmp_path)
