"""Faults under load (bench/faults.py runs the same scenarios for BENCHMARKS.md): the claims
hold exactly, for every request, in every scenario.

- No request is lost before anything of its answer reached the client: the router retried
  it elsewhere (a failure before the first content event is retryable).
- Every request that failed is a stream that had begun on the faulty replica (and ended
  with an error event and ``data: [DONE]``, or was cut: ``loadtest/checked.py`` counts a
  stream without ``[DONE]`` as failed); the faulty replica's answers are the only ones
  that may break.
- The fault struck while requests were open on the victim (else the test proves nothing):
  for a fault from the start, the router chose the victim (or probed it, for slow probes).
- The router takes back a replica that returns, and never one that is gone.
"""

import pytest

from bench.faults import SCENARIOS, run_scenario


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fault_under_load(name):
    sc = SCENARIOS[name]
    s = run_scenario(sc)["summary"]
    assert s["lost_before_start"] == 0, s
    assert s["failed_not_a_started_stream_on_victim"] == 0, s
    assert s["ok"] > 0 and s["streams"] > 0, s
    if sc.act is not None:
        assert s["in_flight_on_victim_at_fault"] > 0, s
    elif name == "slow_probes":
        assert s["victim_probe_failures"] > 0, s
    else:
        assert s["chosen_during_fault"] > 0, s
    if name in ("http500", "slow_probes"):
        assert s["failed"] == 0, s  # nothing streamed from the victim before failing
    if sc.comes_back is True:
        assert s["took_back_after_s"] is not None, s
    elif sc.comes_back is False:
        assert s["took_back_after_s"] is None, s
