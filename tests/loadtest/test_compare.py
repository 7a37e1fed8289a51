"""``python -m loadtest compare`` end to end on a tiny workload."""

import json
import subprocess
import sys


def test_compare_writes_json_markdown_and_plots(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "loadtest", "compare", "--groups", "3", "--prompts-per-group",
         "4", "--system-len", "256", "--question-len", "32", "--output-len", "4",
         "--replicas", "2", "--kv-pages", "64", "--policies", "prefix,round_robin",
         "--rate", "20", "--replica-args", "--sim-speedup 10", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert [r["policy"] for r in doc["rows"]] == ["prefix", "round_robin"]
    prefix, rr = doc["rows"]
    assert prefix["failed"] == rr["failed"] == 0
    assert prefix["hit_rate"] >= rr["hit_rate"]
    assert prefix["hit_rate"] <= doc["bounds"]["infinite"] + 1e-9
    runs = doc["runs"]
    assert len(runs["prefix"]["records"]) == len(runs["round_robin"]["records"]) == 12
    # Identical request sequences: same ids in the same order of scheduling.
    ids = lambda run: [r["request_id"] for r in sorted(run["records"],
                                                       key=lambda r: r["scheduled_s"])]
    assert ids(runs["prefix"]) == ids(runs["round_robin"])
    for name in ("compare.md", "hit_rate.png", "ttft_cdf.png", "replica_load.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| prefix |" in (tmp_path / "compare.md").read_text()


def test_several_routers_and_a_replica_restarted_empty(tmp_path):
    """--routers 1,2 makes a column per count, the requests spread over the routers (each
    routed some); --restart-at restarts replica 0 empty mid-run and reports the recovery."""
    out = subprocess.run(
        [sys.executable, "-m", "loadtest", "compare", "--groups", "3", "--prompts-per-group",
         "10", "--system-len", "256", "--question-len", "32", "--output-len", "4",
         "--replicas", "2", "--kv-pages", "64", "--policies", "prefix", "--routers", "1,2",
         "--restart-at", "1.0", "--window-s", "0.5", "--rate", "15", "--replica-args", "--sim-speedup 10",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert [r["policy"] for r in doc["rows"]] == ["prefix x1", "prefix x2"]
    for row in doc["rows"]:
        assert row["replicas_alive"] == 2  # the restarted one is back
        assert row["hit_rate_before_restart"] is not None
    for run in doc["runs"].values():  # only requests cut by the kill may fail
        assert run["summary"]["failed"] <= 4, run["summary"]["errors"]
    for name, run in doc["runs"].items():
        restart = run["restart"]
        assert 1.0 <= restart["at_s"] < restart["ready_s"]
        assert sum(w["prompt_tokens"] for w in restart["windows"]) == \
            run["summary"]["prompt_tokens"]
    md = (tmp_path / "compare.md").read_text()
    assert "| prefix x2 |" in md and "A replica restarted empty during the run" in md
    for name in ("restart_hit_rate.png", "routers_hit_rate.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_cache_pressure_sizes_the_pools_from_the_working_set():
    from loadtest.compare import working_set_blocks
    from loadtest.workloads import shared_prefix

    reqs = shared_prefix(groups=4, prompts_per_group=3, system_len=320, question_len=64,
                         output_len=1, seed=0)
    # each prompt: BOS + 320 + 64 tokens = 385 -> 12 full blocks of 32, the first 10 shared
    # by its group (BOS + 320 = 321 tokens: 10 full blocks), 2 of its own
    assert working_set_blocks(reqs, 32) == 4 * 10 + 12 * 2


class _Gateway:
    def __init__(self, counted):
        self.counted, self.metrics_url = counted, "http://127.0.0.1:9/metrics"

    def prefix_decisions(self):
        if isinstance(self.counted, Exception):
            raise self.counted
        return self.counted


def test_peer_prefix_decisions_are_summed_and_unreadable_metrics_only_noted(capsys):
    import httpx

    from loadtest.compare import _prefix_decisions

    gateways = [_Gateway({"prefix_hit": 3.0, "missing_tokens": 1.0}),
                _Gateway(httpx.ConnectError("refused")), _Gateway({"prefix_hit": 2.0})]
    assert _prefix_decisions("vllm-router", gateways) == {"prefix_hit": 5.0,
                                                          "missing_tokens": 1.0}
    err = capsys.readouterr().err
    assert "vllm-router's metrics at http://127.0.0.1:9/metrics could not be read" in err


def test_a_hybrid_model_cluster_with_its_bounds_and_pools_under_pressure(tmp_path):
    """--model: sim replicas of a tiny Qwen3-Next's config (3 recurrent layers : 1 attention
    layer); the forks workload; --cache-pressure sizes each pool from its working set,
    measured by replaying the workload through one sim replica that never evicts."""
    from tests.replicas.models.checkpoints import hybrid_config_dir

    model = hybrid_config_dir(tmp_path / "qwen3-next")
    out = subprocess.run(
        [sys.executable, "-m", "loadtest", "compare", "--workload", "forks", "--trees", "3",
         "--branches", "4", "--history-len", "300", "--branch-len", "20", "--output-len", "4",
         "--replicas", "2", "--model", str(model), "--cache-pressure", "2",
         "--tokens-per-block", "16", "--policies", "prefix,approx_prefix", "--rate", "20",
         "--replica-args", "--sim-speedup 10", "--out-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "compare.json").read_text())
    setup, bounds = doc["setup"], doc["bounds"]
    working = bounds["working_set_pages"]
    assert list(working) == ["full_attention", "recurrent"]
    # 3 roots of 301 tokens + 12 branches: every full block held, snapshots kept
    assert working["full_attention"] >= 3 * (301 // 16) and working["recurrent"] > 0
    pages = setup["kv_pages"]
    assert len(pages) == 2 and pages[1] == max(4, int(working["recurrent"] / (2 * 2)))
    assert "--kv-pages" in setup["replica_args"]
    assert setup["replica_args"][setup["replica_args"].index("--kv-pages") + 1] == \
        f"{pages[0]},{pages[1]}"
    assert 0 < bounds["pooled"] <= bounds["infinite"] < 1
    rows = {r["policy"]: r for r in doc["rows"]}
    assert rows["prefix"]["failed"] == rows["approx_prefix"]["failed"] == 0
    for row in rows.values():
        assert row["hit_rate"] <= bounds["infinite"] + 1e-9
        assert row["over_prediction"] is not None
    assert rows["approx_prefix"]["hit_rate_x_prefix"] is not None
    md = (tmp_path / "out" / "compare.md").read_text()
    assert "over-prediction" in md and "of qwen3-next" in md


def test_a_column_that_failed_throughout_is_reported_not_a_crash():
    from loadtest.compare import markdown, summary_row

    failed = {"summary": {"token_hit_rate": None, "completed": 0, "failed": 5,
                          "request_throughput": None, "errors": {"HTTP 502": 5},
                          "ttft_ms": {"mean": None, "p50": None, "p99": None}},
              "replica_stats": {}}
    ok = {"summary": {"token_hit_rate": 0.5, "completed": 5, "failed": 0,
                      "request_throughput": 2.0, "errors": {},
                      "ttft_ms": {"mean": 10.0, "p50": 9.0, "p99": 12.0}},
          "replica_stats": {"a": {"prefill_tokens": 10}}}
    rows = [summary_row("peer", failed, ok, ok), summary_row("round_robin", ok, ok, None)]
    assert rows[0]["hit_rate"] is None and rows[0]["errors"] == {"HTTP 502": 5}
    text = markdown(rows, {"pooled": 0.6, "infinite": 0.7}, "setup")
    assert "| peer | - | - |" in text
    assert "Column peer failed on every request: 5 x HTTP 502." in text
