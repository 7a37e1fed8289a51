import asyncio
import json
import statistics
import subprocess
import sys

import pytest
from aiohttp import web

from loadtest import driver
from loadtest.cluster import LocalCluster
from loadtest.driver import (CANCELLED, DriverConfig, arrival_offsets, run, run_load,
                             schedule)
from loadtest.report import build_report
from loadtest.workloads import Request, multi_turn, shared_prefix

# --------------------------------------------------------------------------- arrivals


def test_constant_rate_and_gamma_arrivals():
    assert arrival_offsets(4, rate=2.0, constant=True) == [0.0, 0.5, 1.0, 1.5]
    poisson = arrival_offsets(2000, rate=10.0, burstiness=1.0, seed=1)
    assert poisson == arrival_offsets(2000, rate=10.0, burstiness=1.0, seed=1)
    assert poisson != arrival_offsets(2000, rate=10.0, burstiness=1.0, seed=2)
    assert poisson[0] == 0.0 and poisson == sorted(poisson)

    def gaps(burstiness):
        t = arrival_offsets(2000, rate=10.0, burstiness=burstiness, seed=1)
        return [b - a for a, b in zip(t, t[1:])]

    for burstiness in (0.25, 1.0, 4.0):
        assert statistics.fmean(gaps(burstiness)) == pytest.approx(0.1, rel=0.1)
    cv = {b: statistics.pstdev(gaps(b)) / statistics.fmean(gaps(b)) for b in (0.25, 1.0, 4.0)}
    assert cv[0.25] > 1.5 > cv[1.0] > 0.8 > 0.6 > cv[4.0]  # cv = 1 / sqrt(burstiness)


def test_schedule_rules():
    plain = [Request(f"r{i}", 1, prompt="x") for i in range(3)]
    timed = [Request(f"t{i}", 1, prompt="x", arrival_s=s) for i, s in enumerate((0, 1, 3))]
    assert schedule(plain, DriverConfig("u", rate=4.0, constant_rate=True)) == [0, 0.25, 0.5]
    assert schedule(plain, DriverConfig("u", concurrency=2)) == [None, None, None]
    assert schedule(timed, DriverConfig("u", time_scale=0.5)) == [0.0, 0.5, 1.5]
    assert schedule(timed, DriverConfig("u", rate=1.0, constant_rate=True)) == [0, 1, 2]
    with pytest.raises(ValueError, match="concurrency"):
        DriverConfig("u", concurrency=0)


# --------------------------------------------------------------------------- fake server


class Fake:
    """An in-process OpenAI-style server on loopback with scripted answers."""

    def __init__(self, turn_delay_s: float = 0.0) -> None:
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.turn_delay_s = turn_delay_s
        self.finished: set[tuple[str, int]] = set()
        self.out_of_order: list[tuple[str, int]] = []
        self.in_flight = self.most_in_flight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def chat(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        session = request.headers.get("x-session-id")
        turn = sum(m["role"] == "user" for m in body["messages"])
        if turn > 1 and (session, turn - 1) not in self.finished:
            self.out_of_order.append((session, turn))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        resp = await self._open(request)
        await self._send(resp, {"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                     "content": ""}}]})
        await asyncio.sleep(self.turn_delay_s)
        for text in ("ab", "c"):
            await self._send(resp, {"choices": [{"index": 0, "delta": {"content": text}}]})
            await asyncio.sleep(0.05)
        await self._send(resp, {"choices": [], "usage": {
            "prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
            "prompt_tokens_details": {"cached_tokens": 16}}})
        await resp.write(b"data: [DONE]\n\n")
        self.finished.add((session, turn))
        self.in_flight -= 1
        return resp

    async def completions(self, request):
        body = await request.json()
        prompt = body["prompt"]
        if prompt == "bad":
            return web.json_response({"error": {"message": "prompt is bad", "type": "x",
                                                "param": None, "code": None}}, status=400)
        resp = await self._open(request)
        if prompt == "hang":  # answers nothing more until the client goes away
            await asyncio.Event().wait()
        await self._send(resp, {"choices": [{"index": 0, "text": "hello"}]})
        if prompt == "event":
            await self._send(resp, {"error": {"message": "engine failed"}})
            await resp.write(b"data: [DONE]\n\n")
        return resp  # "cut": no [DONE]

    @staticmethod
    async def _open(request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream",
                                           "x-replica": "http://fake:1"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _send(resp, payload) -> None:
        await resp.write(f"data: {json.dumps(payload)}\n\n".encode())


RUN_LIMIT_S = 60.0  # a run that has not ended by then never will: fail instead of hanging


def drive(fake: Fake, requests, **config):
    async def main():
        runner = web.AppRunner(fake.app(), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            load = run_load(requests, DriverConfig(f"http://127.0.0.1:{port}", **config))
            return await asyncio.wait_for(load, RUN_LIMIT_S)
        except TimeoutError:
            raise AssertionError(f"the run did not end within {RUN_LIMIT_S:.0f} s") from None
        finally:
            await runner.cleanup()
    return asyncio.run(main())


class ScriptedClock:
    """Stands in for the driver's ``time``: ``perf_counter()`` returns ``readings`` in
    order, so the recorded times are exact and a busy machine cannot stretch them."""

    def __init__(self, *readings: float) -> None:
        self.readings = list(readings)

    def perf_counter(self) -> float:
        assert self.readings, "the driver read its clock more often than the test expects"
        return self.readings.pop(0)


def test_stream_is_timed_and_usage_kept(monkeypatch):
    # The clock is read when the run starts, when the request is sent, at each chunk with
    # text ("ab", "c"; not the role-only first chunk), when the answer ends, when the run
    # ends. Binary fractions, so the differences are exact.
    clock = ScriptedClock(0.0, 1.0, 1.5, 1.75, 2.0, 4.0)
    monkeypatch.setattr(driver, "time", clock)
    req = Request("c1", 7, messages=({"role": "user", "content": "hi"},), session="s")
    result = drive(Fake(), [req], concurrency=1)
    assert result.model == "fake-model" and result.replicas is None
    [r] = result.records
    assert (r.ok, r.status, r.error, r.replica) == (True, 200, None, "http://fake:1")
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (40, 16, 3)
    assert (r.start_s, r.ttft_s, r.itl_s, r.e2e_s) == (1.0, 0.5, [0.25], 1.0)
    assert result.duration_s == 4.0 and clock.readings == []


def test_request_body_and_session_header():
    fake = Fake()
    req = Request("c1", 7, messages=({"role": "user", "content": "hi"},), session="s9")
    drive(fake, [req], concurrency=1, ignore_eos=False, model="given")
    assert fake.bodies == [{"model": "given", "max_tokens": 7, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": "hi"}]}]
    assert fake.headers[0]["x-session-id"] == "s9"


def test_failures_are_recorded():
    reqs = [Request(p, 4, prompt=p) for p in ("bad", "event", "cut")]
    result = drive(Fake(), reqs, concurrency=3)
    got = {r.request_id: (r.ok, r.status, r.error) for r in result.records}
    assert got == {"bad": (False, 400, "HTTP 400: prompt is bad"),
                   "event": (False, 200, "engine failed"),
                   "cut": (False, 200, "stream ended without data: [DONE]")}
    assert build_report(result)["summary"]["errors"] == {
        "HTTP 400: prompt is bad": 1, "engine failed": 1,
        "stream ended without data: [DONE]": 1}


def test_max_seconds_cancels_what_is_in_flight():
    # The server never finishes these answers: only max_seconds can end the run (drive
    # fails the test if nothing has ended it after a minute).
    reqs = [Request(f"hang{i}", 4, prompt="hang") for i in range(2)]
    result = drive(Fake(), reqs, concurrency=1, max_seconds=0.3)
    assert result.stopped_early and result.not_sent == 1
    [r] = result.records
    assert (r.request_id, r.ok, r.error) == ("hang0", False, CANCELLED)


@pytest.mark.parametrize("config,side_by_side", [({"rate": 1000.0}, 3), ({"concurrency": 2}, 2),
                                                ({}, 3)])
def test_a_session_turn_waits_for_the_previous_one(config, side_by_side):
    fake = Fake(turn_delay_s=0.03)
    reqs = multi_turn(sessions=3, turns=3, system_len=20, user_len=5, output_len=3, seed=0)
    result = drive(fake, reqs, **config)
    assert fake.out_of_order == [] and len(fake.finished) == 9
    by_id = {r.request_id: r for r in result.records}
    for s in range(3):
        for t in (2, 3):
            prev, cur = by_id[f"s{s}-t{t - 1}"], by_id[f"s{s}-t{t}"]
            assert cur.start_s >= prev.start_s + prev.e2e_s
    # sessions run side by side (as many at once as the config allows), not 9 turns in a
    # row; counted by the server, not by the wall clock, which a busy machine stretches
    # (at most `side_by_side` at once is also what makes 9 turns take >= 9 / side_by_side
    # rounds)
    assert fake.most_in_flight == side_by_side and fake.in_flight == 0


# --------------------------------------------------------------------------- live cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(2, "prefix", ("--engine", "sim", "--sim-speedup", "20",
                                    "--log-level", "warning"),
                      ("--log-level", "warning"),
                      log_dir=tmp_path_factory.mktemp("logs")) as c:
        yield c


def test_shared_prefix_through_the_router(cluster):
    reqs = shared_prefix(3, 4, system_len=256, question_len=32, output_len=6, seed=4)
    result = run(reqs, DriverConfig(cluster.router.url, concurrency=2, seed=4))
    urls = sorted(r.url for r in cluster.replicas)
    assert sorted(result.replicas) == urls
    assert len(result.records) == 12 and all(r.ok for r in result.records)
    want = {r.request_id: r.prompt_tokens() for r in reqs}
    for r in result.records:
        assert r.replica in urls and r.status == 200
        assert r.prompt_tokens == want[r.request_id] == 289
        assert r.completion_tokens == 6 and 0 <= r.cached_tokens < r.prompt_tokens
        assert r.ttft_s is not None and r.ttft_s <= r.e2e_s
    s = build_report(result)["summary"]
    assert s["completed"] == 12 and s["token_hit_rate"] > 0
    assert s["cached_tokens"] == sum(r.cached_tokens for r in result.records)


def test_multi_turn_through_the_router(cluster):
    reqs = multi_turn(sessions=3, turns=3, system_len=64, user_len=16, output_len=4, seed=2)
    result = run(reqs, DriverConfig(cluster.router.url, rate=500.0, seed=2))
    by_id = {r.request_id: r for r in result.records}
    assert all(r.ok for r in result.records) and len(by_id) == 9
    for req in reqs:
        assert by_id[req.request_id].prompt_tokens == req.prompt_tokens()
    for s in range(3):
        for t in (2, 3):
            prev, cur = by_id[f"s{s}-t{t - 1}"], by_id[f"s{s}-t{t}"]
            assert cur.start_s >= prev.start_s + prev.e2e_s


def test_one_replica_directly_has_no_x_replica(cluster):
    reqs = shared_prefix(1, 3, system_len=64, question_len=8, output_len=2, seed=0)
    result = run(reqs, DriverConfig(cluster.replicas[0].url, concurrency=1))
    assert result.replicas is None and all(r.ok and r.replica is None for r in result.records)
    doc = build_report(result)
    assert list(doc["replicas"]) == ["unattributed"]
    assert doc["summary"]["load_imbalance"] is None
    # one after the other, sharing BOS + 64 characters: the 2nd and 3rd reuse them
    assert [r.cached_tokens >= 65 for r in result.records] == [False, True, True]
    assert doc["summary"]["token_hit_rate"] > 0


def test_run_command_writes_json(cluster, tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "run", "--url", cluster.router.url,
         "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3",
         "--system-len", "128", "--question-len", "16", "--output-len", "4",
         "--rate", "100", "--burstiness", "0.5", "--seed", "7", "--out", str(out)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "loadtest.run/1" and doc["url"] == cluster.router.url
    assert doc["workload"] == {"name": "shared-prefix", "groups": 2, "prompts_per_group": 3,
                               "system_len": 128, "question_len": 16, "output_len": 4,
                               "seed": 7}
    assert doc["driver"]["rate"] == 100.0 and doc["driver"]["burstiness"] == 0.5
    assert doc["summary"]["completed"] == 6 and len(doc["records"]) == 6
    assert sorted(doc["replicas"]) == sorted(r.url for r in cluster.replicas)
    assert "completed 6  failed 0" in proc.stdout
    assert "6/6 [" in proc.stderr  # the progress line


def test_run_command_rejects_an_unpaced_workload(cluster):
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "run", "--url", cluster.router.url,
         "--workload", "multi-turn"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "give --rate and/or --concurrency" in proc.stderr
