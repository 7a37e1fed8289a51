"""What the replicas and the router share on the wire: the OpenAI-compatible schemas and the
probe answer (``schemas``, ``probe``, ``chat``), JSON (``jsonwire``), OpenAI-style error
bodies (``errors``), small ASGI helpers (``asgi``), the OpenAPI document (``openapi``) and the
settings loader both command lines use (``settings``).

It imports neither ``replicas`` nor ``router`` (tests/wire/test_imports.py): both import it.
"""
