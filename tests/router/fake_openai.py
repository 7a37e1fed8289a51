"""A minimal third-party OpenAI-compatible server that records what it receives.

``python -m tests.router.fake_openai --host 127.0.0.1 --port P`` (for --backend openai tests).
"""

import argparse
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

app = FastAPI()
captured: list[dict] = []
seen: list[str] = []  # "METHOD /path" of every request, in order


@app.middleware("http")
async def record(request: Request, call_next):
    seen.append(f"{request.method} {request.url.path}")
    return await call_next(request)


@app.get("/health")
async def health():
    return {"ok": True}


@app.get("/v1/models")
async def models():
    return {"object": "list", "data": [{"id": "third-party", "object": "model"}]}


@app.get("/captured")
async def get_captured():
    return captured


@app.get("/seen")
async def get_seen():
    return seen


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    captured.append({"headers": dict(request.headers), "body": body})
    answer = {"id": "cmpl-x", "object": "text_completion", "created": 0,
              "model": "third-party",
              "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    if not body.get("stream"):
        return JSONResponse(answer)

    async def events():
        chunk = dict(answer, choices=[{"index": 0, "text": "ok", "finish_reason": None}])
        yield f"data: {json.dumps(chunk)}\n\n"
        yield f"data: {json.dumps(answer)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args()
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
