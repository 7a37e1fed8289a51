import json

import pytest

from loadtest.workloads import Request, multi_turn, sharegpt, shared_prefix, trace_jsonl


def test_shared_prefix_is_reproducible_and_exact():
    a = shared_prefix(3, 4, system_len=100, question_len=20, output_len=7, seed=5)
    assert a == shared_prefix(3, 4, system_len=100, question_len=20, output_len=7, seed=5)
    assert a != shared_prefix(3, 4, system_len=100, question_len=20, output_len=7, seed=6)
    assert len(a) == 12
    assert sorted(r.request_id for r in a) == sorted(f"g{g}-q{q}" for g in range(3)
                                                     for q in range(4))
    assert [r.request_id for r in a] != sorted(r.request_id for r in a)  # shuffled
    for r in a:
        assert r.prompt_tokens() == 100 + 20 + 1  # 1 ASCII char = 1 token, plus BOS
        assert r.prompt.isascii() and r.max_tokens == 7 and r.messages is None
        assert r.request_id.startswith(f"g{r.group}-")
        assert r.path == "/v1/completions" and r.arrival_s is None and r.session is None
    systems = {}
    for r in a:
        systems.setdefault(r.group, set()).add(r.prompt[:100])
    assert all(len(s) == 1 for s in systems.values())  # one system prompt per group
    assert len({next(iter(s)) for s in systems.values()}) == 3  # different across groups
    assert len({r.prompt[100:] for r in a}) == 12  # distinct questions


def test_multi_turn_carries_the_history_with_exact_lengths():
    reqs = multi_turn(sessions=3, turns=4, system_len=50, user_len=10, output_len=8, seed=1)
    assert reqs == multi_turn(sessions=3, turns=4, system_len=50, user_len=10, output_len=8,
                              seed=1)
    assert len(reqs) == 12
    # turn by turn: every session's turn t before any session's turn t + 1
    assert [int(r.request_id.split("-t")[1]) for r in reqs] == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    by_session: dict[str, list[Request]] = {}
    for r in reqs:
        by_session.setdefault(r.session, []).append(r)
    assert sorted(by_session) == ["s0", "s1", "s2"]
    for session, turns in by_session.items():
        for t, r in enumerate(turns, start=1):
            assert r.request_id == f"{session}-t{t}" and r.group == int(session[1:])
            assert r.path == "/v1/chat/completions" and r.max_tokens == 8
            roles = [m["role"] for m in r.messages]
            assert roles == ["system"] + ["user", "assistant"] * (t - 1) + ["user"]
            lens = [len(m["content"]) for m in r.messages]
            assert lens == [50] + [10, 8] * (t - 1) + [10]
            # BOS + per message (<|im_start|> role \n content <|im_end|> \n) + generation prompt
            expected = 1 + sum(len(m["role"]) + len(m["content"]) + 4 for m in r.messages) + 11
            assert r.prompt_tokens() == expected
            if t > 1:
                assert r.messages[:-2] == turns[t - 2].messages


def test_request_needs_exactly_one_of_prompt_and_messages():
    with pytest.raises(ValueError, match="exactly one"):
        Request("x", 4)
    with pytest.raises(ValueError, match="exactly one"):
        Request("x", 4, prompt="a", messages=({"role": "user", "content": "b"},))
    with pytest.raises(ValueError, match="max_tokens"):
        Request("x", 0, prompt="a")


SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "hello there"},
                                  {"from": "gpt", "value": "x" * 50},
                                  {"from": "human", "value": "and more"},
                                  {"from": "gpt", "value": "y" * 3000}]},
    {"id": "b", "conversations": [{"from": "human", "value": "hi"},  # prompt too short
                                  {"from": "gpt", "value": "a long enough answer"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "starts with gpt"}]},
    {"id": "d", "conversations": [{"from": "system", "value": "be brief"},
                                  {"from": "human", "value": "héllo wörld"},
                                  {"from": "gpt", "value": "ok!!"}]},
]


def test_sharegpt_first_turn_and_history(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(SHAREGPT))
    first = {r.request_id: r for r in sharegpt(path, seed=0, max_output_tokens=1024)}
    assert sorted(first) == ["sharegpt-0", "sharegpt-3"]
    assert first["sharegpt-0"].prompt == "hello there" and first["sharegpt-0"].max_tokens == 50
    assert first["sharegpt-3"].prompt == "héllo wörld"
    assert first["sharegpt-3"].prompt_tokens() == 14  # 13 UTF-8 bytes + BOS
    assert first["sharegpt-3"].max_tokens == 4
    hist = {r.request_id: r for r in sharegpt(path, history=True, max_output_tokens=1024)}
    assert [m["content"] for m in hist["sharegpt-0"].messages] == ["hello there", "x" * 50,
                                                                     "and more"]
    assert hist["sharegpt-0"].max_tokens == 1024  # 3000-byte reply, capped
    assert [m["role"] for m in hist["sharegpt-3"].messages] == ["system", "user"]
    assert len(sharegpt(path, limit=1, seed=3)) == 1
    assert sharegpt(path, seed=3) == sharegpt(path, seed=3)


def test_trace_blocks_follow_hash_ids(tmp_path):
    rows = [
        {"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 1250, "input_length": 9, "output_length": 5, "hash_ids": [7, 9]},
        {"timestamp": 3000, "input_length": 14, "output_length": 0, "hash_ids": [7, 8]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a, b, c = trace_jsonl(path, block_size=4, seed=2)
    assert [r.prompt_tokens() for r in (a, b, c)] == [10, 9, 14]
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 0.25, 2.0]
    assert [r.max_tokens for r in (a, b, c)] == [3, 5, 1]
    assert a.prompt[:4] == b.prompt[:4] and a.prompt[4:8] != b.prompt[4:8]
    assert c.prompt.startswith(a.prompt[:8])  # same hash ids: same 8 characters
    assert len(c.prompt) == 13 and c.prompt[8:] != ""  # extended with text of its own
    assert trace_jsonl(path, block_size=4, seed=2) == [a, b, c]
    assert trace_jsonl(path, block_size=4, seed=3)[0].prompt != a.prompt
    assert [r.request_id for r in trace_jsonl(path, block_size=4, limit=2)] == ["trace-0",
                                                                                "trace-1"]


def test_forks_branch_from_each_history_past_its_first_quarter():
    from loadtest.workloads import forks

    reqs = forks(trees=3, branches=4, history_len=100, branch_len=10, output_len=5, seed=2)
    roots = {r.group: r.prompt for r in reqs if r.request_id.endswith("-root")}
    assert sorted(roots) == [0, 1, 2] and all(len(p) == 100 for p in roots.values())
    branches = [r for r in reqs if "-b" in r.request_id]
    assert len(branches) == 12 and reqs[:3] == [r for r in reqs if r.request_id.endswith("-root")]
    for r in branches:
        history = roots[r.group]
        cut = len(r.prompt) - 10
        assert 25 <= cut <= 100 and r.prompt[:cut] == history[:cut]
        assert r.max_tokens == 5 and r.session is None
    assert len({len(r.prompt) for r in branches}) > 3  # cut at different points
    assert forks(3, 4, 100, 10, 5, seed=2) == reqs  # deterministic
