from pathlib import Path

import pytest
from pydantic import ValidationError

from router.settings import RouterSettings, load_settings, parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_replicas_from_flag_environment_and_file(tmp_path, monkeypatch):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("router:\n  replicas: [http://f:1]\n  probe_deadline_ms: 40\n")
    assert parse_args(["--config", str(cfg)]).replicas == ["http://f:1"]
    monkeypatch.setenv("ROUTER_REPLICAS", "http://e:1, http://e:2")
    s = parse_args(["--config", str(cfg)])
    assert (s.replicas, s.probe_deadline_ms) == (["http://e:1", "http://e:2"], 40)
    s = parse_args(["--config", str(cfg), "--replicas", "http://c:1"])
    assert s.replicas == ["http://c:1"]


def test_shipped_preset_loads():
    s = load_settings({}, str(ROOT / "config" / "router.yaml"))
    assert s.policy == "prefix" and len(s.replicas) == 2


@pytest.mark.parametrize("values, message", [
    ({"replicas": "http://a:1,http://a:1"}, "listed twice"),
    ({"replicas": "a:1"}, "must start with http"),
    ({"probe_deadline_ms": 0}, "probe_deadline_ms"),
    ({"backend": "grpc"}, "backend"),
])
def test_bad_settings(values, message):
    with pytest.raises(ValidationError, match=message):
        RouterSettings(**values)
