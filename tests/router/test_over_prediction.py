"""Over-prediction, measured: what a policy expected the chosen replica to reuse against the
``cached_tokens`` it reported, in the decision log, ``/stats`` and the metrics.

One sim replica of a hybrid model (the config of a tiny Qwen3-Next: 3 recurrent layers, 1
attention layer; 16 tokens a block). A 100-character prompt (101 tokens) leaves snapshots
only where its prefill stopped (its last block boundary, 96) and its end; a second prompt
sharing its first 70 tokens matches 4 blocks (64 tokens) in a router-side tree, and the
attention layers could reuse 70, but no snapshot lies inside: the replica reuses 0.
``approx_prefix`` expected 64 (over-predicted 64); ``prefix`` asked the replica (0, exact).
"""

from __future__ import annotations

import httpx
import pytest
from bench._common import metric_sum
from tests.replicas.models.checkpoints import hybrid_config_dir
from tests.router.cluster import cluster

TEXT = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3


@pytest.fixture(scope="module")
def hybrid_config(tmp_path_factory):
    return hybrid_config_dir(tmp_path_factory.mktemp("qwen3-next-config"))


@pytest.mark.parametrize("policy, expected, over", [("approx_prefix", 64, 64),
                                                    ("prefix", 0, 0)])
def test_expected_reuse_against_what_the_replica_reused(hybrid_config, policy, expected, over):
    first, second = TEXT[:100], TEXT[:69] + "x" * 31
    with cluster(1, replica_args=("--model", str(hybrid_config), "--tokens-per-block", "16"),
                 router_args=("--policy", policy, "--tokens-per-block", "16")) as (router, _):
        answers = [httpx.post(router.url + "/v1/completions", timeout=30, json={
            "prompt": prompt, "max_tokens": 2, "temperature": 0}).json()
            for prompt in (first, second)]
        stats = httpx.get(router.url + "/stats").json()
        metrics = httpx.get(router.url + "/metrics").text
    assert [a["usage"]["prompt_tokens"] for a in answers] == [101, 101]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 0]
    latest = stats["decisions"][0]
    assert (latest["expected_reuse"], latest["cached_tokens"]) == (expected, 0)
    (replica,) = stats["replicas"]
    assert (replica["expected_tokens"], replica["over_predicted_tokens"]) == (expected, over)
    assert metric_sum(metrics, "router_expected_reused_tokens_total") == expected
    assert metric_sum(metrics, "router_over_predicted_tokens_total") == over
