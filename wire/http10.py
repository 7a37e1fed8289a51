"""HTTP/1.0 clients of uvicorn's httptools protocol: answers of unknown length (streams)
delimited by the connection's close instead of chunked. Used by the router's front door
(``router/http_server.py``) and the replica's protocol (``replicas/coalesce.py``), each from
its ``on_headers_complete`` for an HTTP/1.0 request."""

from __future__ import annotations


def close_delimited(cycle) -> None:
    """An answer of unknown length goes to an HTTP/1.0 client delimited by the connection's
    close, which HTTP/1.0 reads, instead of uvicorn's chunked encoding, which it does not
    (RFC 9112, 6.1: no Transfer-Encoding in a response to an HTTP/1.0 request). uvicorn
    already closes every HTTP/1.0 connection after its answer; each body message is let
    through as if its own length had been announced."""
    send, unframed = cycle.send, False

    async def send_unframed(message: dict) -> None:
        nonlocal unframed
        if message["type"] == "http.response.start":
            unframed = not any(name.lower() == b"content-length"
                               for name, _ in message.get("headers", ()))
            if unframed:
                cycle.chunked_encoding = False
        elif unframed and message["type"] == "http.response.body":
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = send_unframed  # run_asgi hands the app cycle.send when it starts
