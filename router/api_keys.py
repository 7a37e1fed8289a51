"""The ``--api-keys FILE``: API keys, the tenants they belong to, and each tenant's limits.

    tenants:
      acme:
        keys: ["sha256:<64 hex digits: the SHA-256 of the key>", "a-plain-key"]
        limits: {requests_per_minute: 600, prompt_tokens_per_minute: 2000000,
                 concurrent_requests: 32}
    default: reject        # or a tenant's name, or {limits: {...}}: unknown and missing keys

A bad file is a start-up error (``ValueError``) naming the file, the entry and the field.
Keys are kept only as their SHA-256 (a plain key in the file is hashed when loaded).
``config/api-keys.example.yaml`` is an example; ``router/tenants.py`` enforces the limits.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, Optional, Union

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag,
                      ValidationError, field_validator, model_validator)

REJECT = "reject"
INLINE_DEFAULT = "default"  # the name of the tenant an inline ``default: {limits: ...}`` makes
_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,63}")


def key_hash(key: str) -> str:
    """The hex SHA-256 of an API key: what the router keeps and looks keys up by."""
    return hashlib.sha256(key.encode()).hexdigest()


def _name(name: str) -> str:
    # names show up in metric labels, /stats and the dashboard: keep them plain
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a tenant name: 1-64 letters, digits and _.:@-, "
                         "starting with a letter or digit")
    return name


def _hashed(key: str) -> str:
    """A key as the file gives it (``sha256:<hex>`` or the key itself) -> its hex SHA-256."""
    if key.startswith("sha256:"):
        m = _HASHED.fullmatch(key)
        if m is None:
            raise ValueError("starts with sha256: but is not followed by exactly 64 hex "
                             "digits (the key's SHA-256)")
        return m.group(1).lower()
    if not key or any(c.isspace() for c in key):
        raise ValueError("empty or holds whitespace, which `Authorization: Bearer KEY` "
                         "cannot carry")
    return key_hash(key)


TenantName = Annotated[str, AfterValidator(_name)]
KeyHash = Annotated[str, AfterValidator(_hashed)]


class Limits(BaseModel):
    """A tenant's limits, shared by all its keys; an absent limit is no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: Optional[int] = Field(default=None, ge=1)
    prompt_tokens_per_minute: Optional[int] = Field(default=None, ge=1)
    concurrent_requests: Optional[int] = Field(default=None, ge=1)


class TenantEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # each "sha256:<hex>" or the key itself; held as hex SHA-256 once loaded
    keys: list[KeyHash] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)


class InlineDefault(BaseModel):
    """``default: {limits: {...}}``: unknown and missing keys share one tenant of their own
    (named ``default``), with these limits."""

    model_config = ConfigDict(extra="forbid")

    limits: Limits


class ApiKeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[TenantName, TenantEntry]
    # "reject", a tenant's name, or an inline tenant without keys
    default: Annotated[
        Union[Annotated[str, Tag("name")], Annotated[InlineDefault, Tag("inline")]],
        Discriminator(lambda v: "name" if isinstance(v, str) else "inline")] = REJECT

    @field_validator("default", mode="before")
    @classmethod
    def _default_shape(cls, v):
        if not isinstance(v, (str, dict, InlineDefault)):
            raise ValueError(f"must be {REJECT!r}, a tenant's name, or {{limits: {{...}}}}; "
                             f"got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ApiKeysFile:
        if isinstance(self.default, InlineDefault) and INLINE_DEFAULT in self.tenants:
            raise ValueError(f"default: an inline default makes a tenant named "
                             f"{INLINE_DEFAULT!r}, and tenants already has one: write "
                             f"`default: {INLINE_DEFAULT}` or rename that tenant")
        if isinstance(self.default, str) and self.default != REJECT \
                and self.default not in self.tenants:
            raise ValueError(f"default: {self.default!r} is neither {REJECT!r} nor a tenant "
                             f"of this file ({', '.join(sorted(self.tenants)) or 'none'})")
        owner: dict[str, str] = {}
        for name, entry in self.tenants.items():
            for i, digest in enumerate(entry.keys):
                where = f"tenants.{name}.keys[{i}]"
                if digest in owner:  # never the key itself in a message: a prefix of its hash
                    raise ValueError(f"{where}: the key sha256:{digest[:12]}... is already "
                                     f"{owner[digest]}; a key belongs to one tenant, once")
                owner[digest] = where
            if not entry.keys and name != self.default:
                raise ValueError(f"tenants.{name}: no keys, and it is not the default: no "
                                 "request can reach it")
        return self


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a mapping key given twice (a tenant listed twice would otherwise
    silently lose its first entry)."""


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"{key!r} is given twice in one mapping", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_api_keys(path: str) -> ApiKeysFile:
    """The file, validated; ``ValueError`` naming the file, the entry and the field."""
    where = f"--api-keys {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: cannot read it: {exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping with `tenants:` (and `default:`), "
                         f"got {type(data).__name__}")
    try:
        return ApiKeysFile.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{where}: " + "; ".join(_problem(e) for e in exc.errors())) from None


def _problem(error: dict) -> str:
    """``tenants.acme.keys[1]: message``."""
    loc = ""
    for part in error["loc"]:
        if part in ("inline", "name"):  # which side of ``default``'s union
            continue
        if part == "[key]":  # the mapping's key itself (a tenant's name) is wrong
            loc += " (the name)"
        elif isinstance(part, int):
            loc += f"[{part}]"
        else:
            loc += f".{part}" if loc else str(part)
    message = error["msg"].removeprefix("Value error, ")
    return f"{loc}: {message}" if loc else message
