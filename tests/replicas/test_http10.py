"""An HTTP/1.0 client of a replica, over a raw socket: a stream delimited by the close."""

import json
import socket


def _until_close(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):  # "" once the replica closes (10 s timeout)
            data += chunk
    return data


def test_an_http10_client_gets_the_stream_unframed_and_the_close(replica):
    body = json.dumps({"prompt": "hello", "max_tokens": 3, "stream": True}).encode()
    data = _until_close(replica.port, b"POST /v1/completions HTTP/1.0\r\nhost: x\r\n"
                        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(body), body))
    head, _, stream = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    events = stream.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks and all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_an_http10_client_gets_a_whole_answer_with_its_length(replica):
    body = json.dumps({"prompt": "hello", "max_tokens": 3}).encode()
    data = _until_close(replica.port, b"POST /v1/completions HTTP/1.0\r\nhost: x\r\n"
                        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(body), body))
    head, _, answer = data.partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(answer) in head.lower()
    assert json.loads(answer)["usage"]["completion_tokens"] == 3
