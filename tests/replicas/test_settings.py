from pathlib import Path

import pytest
from pydantic import ValidationError

from replicas.settings import ReplicaSettings, load_settings, parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_flags_beat_environment_beat_file(tmp_path, monkeypatch):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("replica:\n  kv_pages: 100\n  max_num_seqs: 7\n  tokens_per_block: 8\n")
    monkeypatch.setenv("REPLICA_KV_PAGES", "200")
    monkeypatch.setenv("REPLICA_MAX_NUM_SEQS", "9")
    s = parse_args(["--config", str(cfg), "--max-num-seqs", "3"])
    assert (s.kv_pages, s.max_num_seqs, s.tokens_per_block) == (200, 3, 8)


def test_boolean_flags_and_environment(monkeypatch):
    assert parse_args(["--no-enable-partial-reuse"]).enable_partial_reuse is False
    monkeypatch.setenv("REPLICA_ENABLE_PARTIAL_REUSE", "false")
    assert parse_args([]).enable_partial_reuse is False


@pytest.mark.parametrize("name", ["replica-sim.yaml", "replica-torch.yaml",
                                  "replica-hybrid.yaml"])
def test_shipped_presets_load(name):
    s = load_settings({}, str(ROOT / "config" / name))
    assert s.engine in ("sim", "torch")


@pytest.mark.parametrize("argv, field", [
    (["--kv-pages", "0"], "kv_pages"),
    (["--engine", "tpu"], "engine"),
    (["--port", "70000"], "port"),
])
def test_bad_settings_name_the_field(argv, field):
    with pytest.raises(ValidationError, match=field):
        parse_args(argv)


def test_unknown_yaml_key_is_refused(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("replica:\n  kv_pagez: 3\n")
    with pytest.raises(ValidationError, match="kv_pagez"):
        load_settings({}, str(cfg))


def test_defaults():
    s = ReplicaSettings()
    assert (s.host, s.port, s.engine, s.kv_pages, s.tokens_per_block) == \
        ("127.0.0.1", 9001, "sim", None, 32)


@pytest.mark.parametrize("argv, message", [
    (["--engine", "sim", "--dtype", "bfloat16"], "--dtype applies to a checkpoint"),
    (["--engine", "torch", "--dtype", "bfloat16"], "--dtype applies to a checkpoint"),
])
def test_checkpoint_flags_are_refused_where_they_mean_nothing(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_served_model_name_names_the_model():
    assert parse_args(["--served-model-name", "alpha"]).served_model_name == "alpha"
