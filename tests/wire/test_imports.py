"""``wire`` imports neither side of the wire: the replica and the router both import it."""

import subprocess
import sys

MODULES = ["wire", "wire.asgi", "wire.chat", "wire.errors", "wire.jsonwire", "wire.openapi",
           "wire.probe", "wire.schemas", "wire.settings", "wire.tracing"]


def test_wire_imports_neither_replicas_nor_router():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES) +
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('replicas', 'router', 'kvcache', 'loadtest', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_the_probe_answer_is_the_documented_schema():
    """The dataclasses the replica writes and the router reads are the OpenAPI schema."""
    from replicas.app import create_app
    from replicas.settings import ReplicaSettings
    from wire.probe import WIRE_FIELDS

    doc = create_app(ReplicaSettings()).app.openapi()
    schemas = doc["components"]["schemas"]
    assert tuple(schemas["ProbeAnswer"]["properties"]) == WIRE_FIELDS["ProbeAnswer"]
    assert tuple(schemas["LoadSnapshot"]["properties"]) == WIRE_FIELDS["LoadSnapshot"]
    ok = doc["paths"]["/probe_reuse"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ProbeAnswer"}
