"""Settings from flags, the environment and a YAML file, for the replica and the router:
command-line flags > ``<PREFIX>_*`` environment > YAML file (its section) > defaults."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic_settings import BaseSettings


def merge_settings(cls: type[BaseSettings], section: str, cli: dict[str, Any],
                   config_file: str | None) -> Any:
    """``cls`` from, in order of precedence: flags given on the command line, the
    environment (``cls``'s prefix), the YAML file (its ``section:`` mapping, or the whole
    file), the defaults. Shared by the replica's and the router's settings."""
    prefix = cls.model_config.get("env_prefix", "")
    config_file = config_file or os.environ.get(f"{prefix}CONFIG")
    from_file: dict[str, Any] = {}
    if config_file:
        data = yaml.safe_load(Path(config_file).read_text()) or {}
        data = data.get(section, data)
        if not isinstance(data, dict):
            raise ValueError(f"{config_file}: expected a mapping of {section} settings")
        from_file = {k.replace("-", "_"): v for k, v in data.items()
                     if f"{prefix}{k.replace('-', '_').upper()}" not in os.environ}
    return cls(**{**from_file, **{k: v for k, v in cli.items() if v is not None}})


def settings_from_argv(cls: type[BaseSettings], section: str, prog: str, description: str,
                       argv: list[str] | None) -> Any:
    """A flag per field of ``cls`` (``--kv-pages``; booleans get ``--no-...``), plus
    ``--config FILE``; then ``merge_settings``."""
    prefix = cls.model_config.get("env_prefix", "")
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help="YAML file of settings (see config/)")
    for name, field in cls.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                                default=None)
        else:
            parser.add_argument(flag, dest=name, default=None,
                                help=f"(env {prefix}{name.upper()})")
    args = vars(parser.parse_args(argv))
    config = args.pop("config")
    return merge_settings(cls, section, args, config)
