"""The probe client against a real replica process and against misbehaving servers."""

import asyncio
import json

import pytest

from router.probe_client import ProbeClient, _parse_head
from tests.procs import Proc


def test_keep_alive_probes_against_a_replica():
    with Proc("replicas", "--engine", "sim", "--log-level", "warning") as rep:
        async def run():
            client = ProbeClient()
            answers = []
            for i in range(20):
                status, body = await client.post(rep.url, "/probe_reuse",
                                                 json.dumps({"prompt": f"p{i}"}).encode())
                answers.append((status, json.loads(body)["num_prompt_tokens"]))
            idle = sum(len(v) for v in client._idle.values())
            bad = await client.post(rep.url, "/probe_reuse", b"{}")
            client.close()
            return answers, idle, bad
        answers, idle, bad = asyncio.run(run())
    assert answers == [(200, 3)] * 10 + [(200, 4)] * 10
    assert idle == 1  # one connection, reused
    assert bad[0] == 400 and json.loads(bad[1])["error"]["type"] == "invalid_request_error"


def test_a_cancelled_probe_closes_its_connection():
    async def run():
        async def slow(reader, writer):
            await reader.read(100)
            await asyncio.sleep(5)
        server = await asyncio.start_server(slow, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = ProbeClient()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await client.post(f"http://127.0.0.1:{port}", "/probe_reuse", b"{}")
        idle = sum(len(v) for v in client._idle.values())
        server.close()
        return idle
    assert asyncio.run(run()) == 0


@pytest.mark.parametrize("head, message", [
    (b"SSH-2.0-x", "not an HTTP/1.x response"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked", "chunked"),
    (b"HTTP/1.1 200 OK\r\nx: y", "without Content-Length"),
])
def test_bad_answers_are_errors(head, message):
    with pytest.raises(ValueError, match=message):
        _parse_head(head)
    assert _parse_head(b"HTTP/1.1 503 X\r\nContent-Length: 7\r\nConnection: close") == \
        (503, 7, False)
