"""OpenAPI helpers shared by the replica's and the router's apps."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel


def body_schema(model: type[BaseModel]) -> dict:
    """Declare ``model`` as the JSON request body of a route that reads the raw body
    (``openapi_extra``); its nested models land in ``components`` (see ``install``)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


def install(app: FastAPI) -> None:
    """Move ``$defs`` embedded by ``body_schema`` into ``components/schemas``, so that
    every ``$ref`` in the document resolves."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for ops in doc.get("paths", {}).values():
                for op in ops.values():
                    for media in op.get("requestBody", {}).get("content", {}).values():
                        for name, sub in media.get("schema", {}).pop("$defs", {}).items():
                            schemas.setdefault(name, sub)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def not_ready_body(state: str) -> dict:
    """The 503 body of ``/ready``: an OpenAI-style error naming the state."""
    return {"error": {"message": f"not ready: {state}", "type": "server_error",
                      "param": None, "code": state.replace(" ", "_")}}
