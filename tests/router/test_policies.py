"""Policies as pure objects: exact choices for exact inputs."""

import hashlib
import os
import subprocess
import sys
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

from text import ByteTokenizer
from router.policies import (POLICIES, Candidate, RouteRequest, block_keys,
                             chain_keys, make_policy, text_keys)
from router.policies.keys import remember, shared_units
from wire.probe import LoadSnapshot


def req(rid="r", n=256, tokens=None, session=None, tpb=32, lazy=False):
    """lazy: keys from their source on first use, as the router builds requests."""
    tokens = tokens if tokens is not None else list(range(n))
    if lazy:
        wire = np.array(tokens, dtype="<u4").tobytes()
        return RouteRequest(rid, len(tokens), unit_tokens=tpb, session_key=session,
                            keys_from=(wire, 4 * tpb, ""))
    return RouteRequest(rid, len(tokens), block_keys(tokens, tpb), tpb, session)


def cands(*specs):
    """specs: (name, reuse, queued, rate, in_flight)"""
    return [Candidate(name, reuse, reuse, LoadSnapshot(queued_prefill_tokens=q,
                                                       prefill_tokens_per_s=rate), inflight)
            for name, reuse, q, rate, inflight in specs]


def test_registry_and_unknown_names():
    assert set(POLICIES) == {"prefix", "approx_prefix", "round_robin", "random",
                             "least_loaded", "power_of_two", "session"}
    with pytest.raises(ValueError, match="unknown policy 'best'; choose one of prefix"):
        make_policy("best")


def test_prefix_trades_reuse_against_queued_work():
    p = make_policy("prefix", seed=0)
    # a: 200 of 256 cached but 1000 tokens queued; b: nothing cached, idle. Same rate.
    # score = (queued + uncached) / rate + uncached / rate
    d = p.choose(req(), cands(("a", 200, 1000, 1000.0, 0), ("b", 0, 0, 1000.0, 0)))
    assert d.chosen == "b"
    assert [c.score for c in d.candidates] == [pytest.approx(1.112), pytest.approx(0.512)]
    d = p.choose(req(), cands(("a", 200, 100, 1000.0, 0), ("b", 0, 0, 1000.0, 0)))
    assert d.chosen == "a" and d.ranked() == ["a", "b"]
    assert d.reason == ("lowest expected TTFT (est. TTFT 156.0 ms: reuse 200, queued 100 "
                        "of 256 tokens)")


def test_prefix_uses_each_replicas_own_rate_and_missing_probes():
    p = make_policy("prefix", seed=0)
    # "fast" did not answer its probe (reuse None: nothing known cached) but computes 256
    # tokens at 100k/s; "slow" has half of them cached but computes at 100/s.
    d = p.choose(req(), cands(("slow", 128, 0, 100.0, 0), ("fast", None, 0, 100000.0, 0)))
    assert d.chosen == "fast"
    assert {c.name: c.score for c in d.candidates} == {"slow": pytest.approx(2.56),
                                                       "fast": pytest.approx(0.00512)}
    # A replica that never reported a rate is assumed to prefill 10k tokens/s.
    d = p.choose(req(), [Candidate("new", 0)])
    assert d.candidates[0].score == pytest.approx(2 * 256 / 10_000)


def test_prefix_ties_break_at_random_but_reproducibly():
    picks = Counter(make_policy("prefix", seed=s).choose(
        req(), cands(("a", 0, 0, 1e3, 0), ("b", 0, 0, 1e3, 0), ("c", 0, 0, 1e3, 0))).chosen
        for s in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60
    first = make_policy("prefix", seed=7).choose(req(), cands(("a", 0, 0, 1e3, 0),
                                                              ("b", 0, 0, 1e3, 0))).chosen
    again = make_policy("prefix", seed=7).choose(req(), cands(("a", 0, 0, 1e3, 0),
                                                              ("b", 0, 0, 1e3, 0))).chosen
    assert first == again


def test_prefix_near_ties_go_where_the_attention_layers_hold_the_prefix():
    """A hybrid model's fork: no replica has a snapshot inside the 256-token prompt (reuse 0
    everywhere: a tie), but b's attention layers hold 200 tokens of it, c's 100 (pruned):
    b wins, every time (its prefill leaves a snapshot at the branch point for the next
    fork), instead of the draw. Less than a block (32) held beyond the snapshots does not
    count; with no pruned prefix anywhere the draw stays."""
    def cand(name, reuse, before):
        return Candidate(name, reuse, before, LoadSnapshot(prefill_tokens_per_s=1e3), 0)

    for seed in range(20):
        p = make_policy("prefix", seed=seed)
        d = p.choose(req(), [cand("a", 0, 0), cand("b", 0, 200), cand("c", 0, 100)])
        assert d.chosen == "b"
    picks = {make_policy("prefix", seed=s).choose(
        req(), [cand("a", 0, 0), cand("b", 0, 31)]).chosen for s in range(40)}
    assert picks == {"a", "b"}
    # not a near tie: a clearly better score still wins over a held, pruned prefix
    d = make_policy("prefix", seed=0).choose(req(), [cand("a", 224, 224), cand("b", 0, 200)])
    assert d.chosen == "a"


@pytest.mark.parametrize("lazy", [False, True])
def test_prefix_burst_of_a_new_prefix_follows_the_first_request(lazy):
    """Nothing cached anywhere yet: the first request goes anywhere; the next ones see the
    prefill this router sent there and follow it, until that queue is about two prefixes
    (1 + new_work_weight) longer than elsewhere; then they spill to a second replica."""
    p = make_policy("prefix", seed=1)
    shared = list(range(1024))
    queued = {"a": 0, "b": 0, "c": 0, "d": 0}
    chosen = []
    for i in range(40):
        r = req(f"r{i}", tokens=shared + [5000 + i] * 32, lazy=lazy)
        cs = [Candidate(n, 0, 0, LoadSnapshot(prefill_tokens_per_s=1e4), 0, queued[n])
              for n in queued]
        d = p.choose(r, cs)
        uncached = r.num_tokens - next(c for c in cs if c.name == d.chosen).pending_reuse
        queued[d.chosen] += uncached  # routed, not yet queued on the replica
        p.on_routed(r, d.chosen)
        chosen.append(d.chosen)
    first = chosen[0]
    # Follower k adds 32 tokens: it stays while its score, (1056 + 32 (k - 1) + 2 * 32) /
    # rate, is more than 5% (the near-tie window) below an idle replica's 2 * 1056 / rate.
    assert chosen[:27] == [first] * 27
    assert len(set(chosen)) == 2 and chosen[-1] != first
    p.on_prefill_done(req("r0", tokens=shared + [5000] * 32), first)
    assert p.pending_requests() == 39


def test_prefix_keys_are_computed_only_to_compare_with_an_unfinished_prefill():
    p = make_policy("prefix", seed=1)
    two = [Candidate(n, 0, 0, LoadSnapshot(prefill_tokens_per_s=1e3)) for n in ("a", "b")]
    r1 = req("r1", n=320, lazy=True)
    wire = r1.keys_from[0]
    p.on_routed(r1, p.choose(r1, two).chosen)
    p.on_prefill_done(r1, "a")
    p.on_prefill_done(r1, "b")
    assert r1.keys_from is not None and r1.keys == ()  # alone: never needed
    r2, r3 = req("r2", n=320, lazy=True), req("r3", n=320, lazy=True)
    p.on_routed(r2, "a")
    d = p.choose(r3, [Candidate(n, 0, 0, LoadSnapshot(prefill_tokens_per_s=1e3)) for n in "ab"])
    assert d.chosen == "a" and d.candidates[0].pending_reuse == 319
    assert r2.keys_from is None and r3.keys_from is None  # compared: both computed
    assert r2.prefix_keys() == chain_keys(wire, 4 * 32) == block_keys(list(range(320)), 32)
    assert p._pending["a"] == Counter(r2.keys)


def test_prefix_pending_counts_follow_counted_and_uncounted_requests():
    p = make_policy("prefix", seed=1)
    def a():
        return [Candidate("a", 0, 0, LoadSnapshot(prefill_tokens_per_s=1e3))]
    long_, short = req("long", n=320, lazy=True), req("short", n=128, lazy=True)
    p.on_routed(long_, "a")
    p.on_routed(short, "a")
    p.choose(req("probe", n=320, lazy=True), a())  # counts both
    assert p._pending["a"] == Counter(long_.keys) + Counter(short.keys)
    late = req("late", n=64, lazy=True)
    p.on_routed(late, "a")  # not counted yet
    p.on_prefill_done(long_, "a")
    assert p._pending["a"] == Counter(short.keys) and late.keys_from is not None
    p.on_prefill_done(late, "a")  # never counted: nothing to take away
    assert p._pending["a"] == Counter(short.keys)
    p.on_prefill_done(short, "a")
    assert p._pending["a"] == Counter() and p.pending_requests() == 0
    assert p.choose(req("next", n=320, lazy=True), a()).candidates[0].pending_reuse == 0


def test_prefix_request_id_reused_while_unfinished_replaces_the_first():
    """Request ids come from clients (x-request-id): a second request under an id still
    in flight replaces the first in the pending record instead of leaking it."""
    p = make_policy("prefix", seed=1)
    first, second = req("same", n=320), req("same", n=64)
    p.on_routed(first, "a")
    p.choose(req("x", n=320), [Candidate("a", 0, 0, LoadSnapshot(prefill_tokens_per_s=1e3))])
    p.on_routed(second, "b")
    assert p.pending_requests() == 1 and p._pending["a"] == Counter()
    p.on_prefill_done(second, "b")
    assert p.pending_requests() == 0
    c = [Candidate(n, 0, 0, LoadSnapshot(prefill_tokens_per_s=1e3)) for n in "ab"]
    p.choose(req("y", n=320), c)
    assert [x.pending_reuse for x in c] == [0, 0]


def test_prefix_pending_reuse_is_dropped_when_done_or_forgotten():
    p = make_policy("prefix", seed=1)
    r = req("x", n=320)
    p.on_routed(r, "a")
    c = [Candidate("a", 0, 0, LoadSnapshot(prefill_tokens_per_s=1e3)),
         Candidate("b", 0, 0, LoadSnapshot(prefill_tokens_per_s=1e3))]
    assert p.choose(req("y", n=320), c).chosen == "a"
    assert c[0].pending_reuse == 319  # capped: the last token is always computed
    p.on_prefill_done(r, "a")
    assert p.pending_requests() == 0
    p.on_routed(r, "a")
    p.forget("a")
    assert p.pending_requests() == 0


def test_bounded_fan_out_probes_replicas_with_affinity_first():
    """Up to k - 1 of the k probes go to the replicas sent the longest shared prefix, longest
    first; the rest (at least one) are drawn at random from the others."""
    p = make_policy("prefix", seed=2)
    replicas = [f"r{i}" for i in range(10)]
    base = list(range(512))  # 16 blocks of 32
    p.probe_targets(req("first", n=64), replicas, 3)  # bounded fan-out starts the record
    for rid, tokens, replica in (("whole", base, "r7"),
                                 ("half", base[:256] + [9000] * 256, "r3"),
                                 ("quarter", base[:128] + [9001] * 384, "r5"),
                                 ("other", [9002] * 512, "r1")):
        p.on_routed(req(rid, tokens=tokens), replica)
        p.on_prefill_done(req(rid, tokens=tokens), replica)
    new = req("new", tokens=base + [7] * 32)

    def draws(k):
        return [p.probe_targets(new, replicas, k) for _ in range(60)]
    for k, affinity in ((1, ["r7"]), (2, ["r7"]), (3, ["r7", "r3"]), (4, ["r7", "r3", "r5"]),
                        (5, ["r7", "r3", "r5"])):  # r1 shares nothing: no affinity slot
        got = draws(k)
        assert all(len(t) == len(set(t)) == k and t[:len(affinity)] == affinity for t in got)
        drawn = {r for t in got for r in t[len(affinity):]}
        if k > 1:  # the random part: varied, never an affinity replica
            assert drawn.isdisjoint(affinity) and len(drawn) >= 4, (k, drawn)
    # a prefix sent nowhere: every probe at random
    fresh = [p.probe_targets(req("fresh", tokens=[9003] * 512), replicas, 3) for _ in range(60)]
    assert len({t[0] for t in fresh}) >= 4
    assert p.probe_targets(new, replicas, 10) == p.probe_targets(new, replicas, 20) == replicas


def test_round_robin_cycles_in_name_order_from_a_start_of_its_own():
    cs = cands(("b", 0, 0, 1, 0), ("a", 0, 0, 1, 0), ("c", 0, 0, 1, 0))
    firsts = set()
    for seed in range(12):
        p = make_policy("round_robin", seed=seed)
        picks = [p.choose(req(), cs).chosen for _ in range(7)]
        start = "abc".index(picks[0])
        assert picks == [("a", "b", "c")[(start + i) % 3] for i in range(7)]
        again = make_policy("round_robin", seed=seed)
        assert again.choose(req(), cs).chosen == picks[0]  # seeded: reproducible
        firsts.add(picks[0])
    # routers with seeds of their own (or none) do not all start at the first replica
    assert firsts == {"a", "b", "c"}


def test_least_loaded_and_power_of_two():
    cs = cands(("a", 0, 0, 1, 5), ("b", 0, 0, 1, 1), ("c", 0, 0, 1, 3))
    assert make_policy("least_loaded", seed=0).choose(req(), cs).chosen == "b"
    p2 = make_policy("power_of_two", seed=0)
    picks = Counter(p2.choose(req(), cands(("a", 0, 0, 1, 5), ("b", 0, 0, 1, 1),
                                            ("c", 0, 0, 1, 3))).chosen for _ in range(300))
    assert picks["a"] == 0  # the busiest never wins a pair
    assert picks["b"] > picks["c"] > 0


def test_session_affinity_is_stable_and_moves_little():
    p = make_policy("session")
    names = [f"r{i}" for i in range(5)]
    mk = lambda ns: [Candidate(n) for n in ns]
    homes = {k: p.choose(req(session=k), mk(names)).chosen for k in map(str, range(200))}
    assert homes == {k: p.choose(req(session=k), mk(names)).chosen for k in homes}
    without = {k: p.choose(req(session=k), mk(names[:-1])).chosen for k in homes}
    moved = [k for k in homes if homes[k] != without[k]]
    assert all(homes[k] == "r4" for k in moved)  # only the removed replica's sessions move
    assert p.choose(req(session=None), mk(names)).reason == "no session key: round robin"
    # a `user` field may carry an unpaired surrogate (JSON can escape one): still a home
    odd = p.choose(req(session="a\ud800"), mk(names)).chosen
    assert odd in names and odd == p.choose(req(session="a\ud800"), mk(names)).chosen


def test_approx_prefix_follows_what_it_sent_unless_load_is_out_of_balance():
    p = make_policy("approx_prefix", seed=0, balance_abs=4, balance_rel=1.5)
    long = req("1", n=640)
    p.on_routed(long, "b")
    assert p.choose(req("2", n=640), cands(("a", None, 0, 1, 0), ("b", None, 0, 1, 2))
                    ).chosen == "b"
    d = p.choose(req("3", n=640), cands(("a", None, 0, 1, 0), ("b", None, 0, 1, 9)))
    assert d.chosen == "a" and d.reason.startswith("load out of balance")
    d = p.choose(req("4", tokens=[7] * 640), cands(("a", None, 0, 1, 1), ("b", None, 0, 1, 0)))
    assert d.chosen == "b" and d.reason.startswith("no prefix sent before")


def test_eviction_of_what_was_sent_shortens_an_old_prefix_from_its_end():
    """A replica's record of prefix keys is capped; evicting drops an old prompt's last
    blocks first (its head still matches a later request sharing it), as the replica's own
    cache does."""
    old, new = req("old", n=320), req("new", tokens=[7] * 320)  # 10 blocks each
    seen = OrderedDict()
    remember(seen, old.keys, cap=20)
    remember(seen, new.keys, cap=15)  # 5 of the old prompt's 10 keys must go
    assert shared_units(old.keys, seen) == 5 and shared_units(new.keys, seen) == 10
    # both policies that remember where prefixes went
    approx = make_policy("approx_prefix", seed=0, max_keys_per_replica=15)
    approx.on_routed(old, "a")
    approx.on_routed(new, "a")
    d = approx.choose(req("again", n=320), cands(("a", None, 0, 1, 0), ("b", None, 0, 1, 0)))
    assert d.chosen == "a" and "5/10 blocks" in d.reason
    prefix = make_policy("prefix", seed=0, max_keys_per_replica=15)
    assert len(prefix.probe_targets(old, ["a", "b", "c"], 2)) == 2  # starts tracking keys
    prefix.on_routed(old, "a")
    prefix.on_routed(new, "a")
    # the old prompt's first 5 keys are still on "a": its affinity slot, every time
    again = req("again", n=320)
    assert all(prefix.probe_targets(again, ["a", "b", "c"], 2)[0] == "a" for _ in range(20))


def test_keys_chain_over_scope_and_prefix():
    a, b = list(range(96)), list(range(64)) + [0] * 32
    ka, kb = block_keys(a, 32), block_keys(b, 32)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert block_keys(a, 32, "tenant-a")[0] != ka[0]
    assert len(block_keys(list(range(95)), 32)) == 2
    assert text_keys("x" * 130, 64)[:2] == text_keys("x" * 128 + "yy", 64)[:2]


def test_a_cold_replica_wins_new_prefixes_over_a_shared_preamble():
    """Busy replicas reuse a short preamble every prompt shares (26 tokens here); that must
    not keep an idle, empty replica from ever getting a new prefix."""
    p = make_policy("prefix", seed=0)
    for i, name in enumerate(("a", "b", "c")):  # each has done a good deal of work already
        warm = req(f"warm-{name}", tokens=[10_000 * (i + 1) + t for t in range(1088)])
        p.on_routed(warm, name)
        p.on_prefill_done(warm, name)
    cs = [Candidate("a", 26, 26, LoadSnapshot(prefill_tokens_per_s=2e4)),
          Candidate("b", 26, 26, LoadSnapshot(prefill_tokens_per_s=2e4)),
          Candidate("cold", 0, 0, LoadSnapshot(prefill_tokens_per_s=2e4)),
          Candidate("c", 26, 26, LoadSnapshot(prefill_tokens_per_s=2e4))]
    assert p.choose(req("new", n=1088), cs).chosen == "cold"


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200),
       st.lists(st.integers(0, 2**32 - 1), max_size=200),
       st.sampled_from([1, 3, 16, 32]), st.sampled_from(["", "tenant-a"]))
def test_keys_agree_exactly_on_shared_block_prefixes(a, b, tpb, scope):
    """Key j of two prompts is equal exactly when their first j + 1 blocks are, whatever the
    block size (the vectorised hash reads 1-, 4- or 8-byte words)."""
    b = a[: len(b)] + b[len(a):] if len(b) % 2 else b  # often share a prefix
    ka, kb = block_keys(a, tpb, scope), block_keys(b, tpb, scope)
    assert len(ka) == len(a) // tpb and len(kb) == len(b) // tpb
    for j in range(min(len(ka), len(kb))):
        assert (ka[j] == kb[j]) == (a[: (j + 1) * tpb] == b[: (j + 1) * tpb])
    if ka:
        assert block_keys(a, tpb, scope + "/other")[0] != ka[0]


def test_chain_keys_of_wire_bytes_equal_block_keys():
    tokens = list(range(1000))
    wire = ByteTokenizer().encode_le32("x" * 999)
    assert chain_keys(wire, 4 * 32) == block_keys([256] + [120] * 999, 32)
    assert block_keys(tokens, 32)[:3] == block_keys(tokens[:96], 32)


_MASK = (1 << 64) - 1


def reference_chain_keys(data: bytes, step: int, scope: str = "") -> tuple[int, ...]:
    """``chain_keys`` as its docstring defines it, one unit and one word at a time: each
    unit's words (1, 4 or 8 bytes, little-endian) mixed, times the splitmix64 multiplier of
    their position (forced odd), summed and mixed into ``h_j``; ``K_j = K_(j-1) * P + h_j``
    from the scope's seed (its 8-byte blake2b digest, little-endian, forced odd); each
    ``K_j`` through the finaliser."""
    size = 8 if step % 8 == 0 else 4 if step % 4 == 0 else 1
    multipliers, x = [], 0x243F6A8885A308D3
    for _ in range(step // size):
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        z = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        multipliers.append((z ^ (z >> 31)) | 1)
    seed = int.from_bytes(hashlib.blake2b(scope.encode(), digest_size=8).digest(), "little")
    key, keys = seed | 1, []
    for j in range(len(data) // step):
        unit = data[j * step:(j + 1) * step]
        words = [int.from_bytes(unit[i:i + size], "little") for i in range(0, step, size)]
        h = sum((w ^ (w >> 29)) * m for w, m in zip(words, multipliers)) & _MASK
        h ^= h >> 33
        h = h * 0xFF51AFD7ED558CCD & _MASK
        h ^= h >> 29
        key = (key * 0x9E3779B97F4A7C15 + h) & _MASK
        k = key ^ (key >> 33)
        k = k * 0xC4CEB9FE1A85EC53 & _MASK
        keys.append(k ^ (k >> 33))
    return tuple(keys)


@pytest.mark.parametrize("step", [5, 12, 16, 128])  # 1-, 4- and 8-byte words
@pytest.mark.parametrize("scope", ["", "tenant-a"])
def test_chain_keys_follow_their_definition(step, scope):
    data = bytes(range(256)) * 4 + b"tail"
    keys = chain_keys(data, step, scope)
    assert len(keys) == len(data) // step
    assert keys == reference_chain_keys(data, step, scope)


def test_chain_keys_differ_from_the_first_unit_that_differs():
    data = bytes(range(250))
    keys = chain_keys(data, 5)  # 50 units of 5 bytes
    changed = chain_keys(data[:17] + bytes([data[17] ^ 1]) + data[18:], 5)  # in unit 3
    assert changed[:3] == keys[:3]
    assert all(a != b for a, b in zip(changed[3:], keys[3:]))
    # two bytes of unit 3 swapped: each word's position counts, not just its value
    swapped = chain_keys(data[:15] + data[16:17] + data[15:16] + data[17:], 5)
    assert swapped[:3] == keys[:3] and swapped[3] != keys[3]
    assert chain_keys(data[:100], 5) == keys[:20]  # a prefix's keys begin the longer's
    assert chain_keys(data, 5, "tenant-a")[0] != keys[0]


@pytest.mark.parametrize("scope", ["", "tenant-a"])
def test_runs_of_zero_blocks_get_a_different_key_at_every_depth(scope):
    """A block of zero ids hashes to 0; the chain's odd start still moves at every block,
    so a prompt of 1 zero block and one of 3 share exactly their first key (a start of 0,
    as ``hash("")`` is, gave key 0 at every depth: 3 shared blocks with a 1-block prompt)."""
    keys = block_keys([0] * 32 * 64, 32, scope)
    assert len(set(keys)) == 64
    seen = OrderedDict.fromkeys(block_keys([0] * 32, 32, scope))
    assert shared_units(block_keys([0] * 96, 32, scope), seen) == 1


def test_keys_are_the_same_in_every_process():
    """``hash()`` of a str is salted per process; keys are not, so a simulation's sets of
    keys (and their order) repeat from run to run."""
    code = ("from router.policies import block_keys; "
            "print(block_keys(list(range(96)), 32, 'tenant-a'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, cwd=Path(__file__).parents[2],
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert outs == {f"{block_keys(list(range(96)), 32, 'tenant-a')}\n"}
