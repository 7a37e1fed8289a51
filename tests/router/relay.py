"""A loopback TCP relay in front of a replica that keeps every request the router sends
through it, head and body, as the replica receives them (threads of its own, so that the
router and replica processes the test starts can be waited for synchronously)."""

import contextlib
import json
import socket
import socketserver
import threading


class RecordingRelay:
    """A loopback relay in front of a replica (threads of its own) that keeps each request
    passing through it, head and body, as the replica receives them."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.requests: list[tuple[bytes, bytes]] = []
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def bodies(self, path: bytes) -> list[dict]:
        return [json.loads(body) for head, body in list(self.requests)
                if head.startswith(b"POST " + path + b" ")]

    def _handler(self):
        relay = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                with socket.create_connection(("127.0.0.1", relay.upstream_port)) as up:
                    threading.Thread(target=self._answers, args=(up,), daemon=True).start()
                    while head := self._head():
                        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                       if line.lower().startswith(b"content-length:")), 0)
                        body = self.rfile.read(length)
                        relay.requests.append((head, body))
                        up.sendall(head + body)

            def _head(self) -> bytes:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = self.rfile.readline()
                    if not line:
                        return b""
                    head += line
                return head

            def _answers(self, up: socket.socket) -> None:
                with contextlib.suppress(OSError):
                    while data := up.recv(65536):
                        self.wfile.write(data)
        return Handler
