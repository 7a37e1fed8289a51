"""Workloads: lists of ``Request`` built from a seed, a dataset or a trace.

Every generator is deterministic: the same arguments (and seed) give the same requests, in
the same order. Generated text is ASCII (lowercase letters and spaces), so under the replicas'
byte-level tokenizer one character is exactly one token; a completion prompt of ``n``
characters is ``n + 1`` prompt tokens (the BOS). Chat requests add the chat template's tokens
(``text/byte_level.py``; ``Request.prompt_tokens`` counts them)::

    tokens = 1 (BOS) + sum(len(role) + len(content) + 4 for each message) + 11
             # per message: <|im_start|> role \\n content <|im_end|> \\n
             # generation prompt: <|im_start|> "assistant\\n"

Requests of one ``session`` form a chain: the driver sends them in list order, each one only
after the previous one of the same session finished (see ``loadtest/driver.py``).

Where a model's reuse rules matter (sliding windows, recurrent layers; ``loadtest compare
--model DIR``), three workloads tell the policies apart:

- ``shared-prefix`` with ``--system-len`` longer than the model's windows: every window
  page of the shared system prompt stays needed only at its end point; a router-side tree
  that remembers the whole prompt cannot tell which pages the replica kept;
- ``multi-turn`` with long sessions: each turn resumes where the last one ended (a
  recurrent snapshot at its history's end, or at its prompt's last block boundary), and
  the placeholder answers differ from what the replica generated, so reuse stops at the
  previous prompt: a tree that counted the answer over-predicts;
- ``forks``: continuations cut from a shared history anywhere: attention layers can
  reuse up to the cut, recurrent layers only up to the last snapshot before it.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from text import ByteTokenizer, ChatMessage

_ALPHABET = "abcdefghijklmnopqrstuvwxyz     "  # ~1 space in 6 characters: word-like text
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}


@dataclass(frozen=True)
class Request:
    """One request of a workload.

    Exactly one of ``prompt`` (sent to ``/v1/completions``) and ``messages`` (a tuple of
    ``{"role", "content"}`` dicts, sent to ``/v1/chat/completions``) is set.
    ``arrival_s`` is the offset from the start of the run at which the request arrives, for
    workloads that carry their own arrival times (traces); ``None`` lets the driver pace it.
    ``session`` chains requests (turns of a conversation); ``group`` labels requests that
    share a prefix by construction (shared-prefix groups, sessions), for reports.
    """

    request_id: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    arrival_s: float | None = None
    session: str | None = None
    group: int | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"request {self.request_id}: set exactly one of prompt and "
                             "messages")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, "
                             f"got {self.max_tokens}")

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def prompt_tokens(self) -> int:
        """Prompt tokens under the replicas' default (byte-level) tokenizer and template."""
        tok = ByteTokenizer()
        if self.prompt is not None:
            return len(tok.encode(self.prompt))
        return len(tok.render_chat([ChatMessage(m["role"], m["content"])
                                    for m in self.messages]))

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.messages is not None:
            d["messages"] = [dict(m) for m in self.messages]
        return d


def random_text(rng: random.Random, n: int) -> str:
    """``n`` ASCII characters (lowercase letters and spaces): exactly ``n`` byte tokens."""
    return "".join(rng.choices(_ALPHABET, k=n))


def shared_prefix(groups: int, prompts_per_group: int, system_len: int, question_len: int,
                  output_len: int, seed: int = 0) -> list[Request]:
    """SGLang bench_serving's "generated-shared-prefix" dataset, with exact lengths.

    Each group has a random system prompt of ``system_len`` characters; each of its
    ``prompts_per_group`` prompts is that system prompt followed directly by a random
    question of ``question_len`` characters, so a prompt is ``system_len + question_len + 1``
    tokens (BOS) and the prompts of a group share their first ``system_len + 1`` tokens.
    ``max_tokens`` is ``output_len``. The order is shuffled (seeded); ``group`` is the group
    index and ``request_id`` is ``g{group}-q{index}``.
    """
    _check_positive(groups=groups, prompts_per_group=prompts_per_group, output_len=output_len)
    _check_non_negative(system_len=system_len, question_len=question_len)
    rng = random.Random(seed)
    requests = []
    for g in range(groups):
        system = random_text(rng, system_len)
        for q in range(prompts_per_group):
            requests.append(Request(f"g{g}-q{q}", output_len,
                                    prompt=system + random_text(rng, question_len), group=g))
    rng.shuffle(requests)
    return requests


def multi_turn(sessions: int, turns: int, system_len: int, user_len: int, output_len: int,
               seed: int = 0) -> list[Request]:
    """Chat sessions whose every turn resends the whole conversation so far.

    Session ``s`` has its own random system prompt (``system_len`` characters); turn ``t``
    (1-based) sends ``[system, user_1, assistant_1, ..., assistant_{t-1}, user_t]``, with user
    messages of ``user_len`` characters and ``max_tokens = output_len``. The assistant
    messages are fixed placeholders of ``output_len`` characters, not the answers the server
    gave: answers are not known when the workload is built, and fixed text keeps the workload
    (and its token counts) reproducible. So turn ``t + 1`` can reuse turn ``t``'s prompt from
    the cache (up to and including its generation prompt) but not its generated tokens.

    Requests are ordered turn by turn (all sessions' turn 1 in a seeded order, then turn 2,
    ...); ``session`` is ``s{s}``, ``group`` is ``s``, ``request_id`` is ``s{s}-t{t}``. The
    driver sends a turn only after the session's previous turn finished.
    """
    _check_positive(sessions=sessions, turns=turns, output_len=output_len)
    _check_non_negative(system_len=system_len, user_len=user_len)
    rng = random.Random(seed)
    histories = []
    for s in range(sessions):
        histories.append([{"role": "system", "content": random_text(rng, system_len)}])
    requests = []
    order = list(range(sessions))
    for t in range(1, turns + 1):
        rng.shuffle(order)
        for s in order:
            history = histories[s]
            if t > 1:
                history.append({"role": "assistant", "content": random_text(rng, output_len)})
            history.append({"role": "user", "content": random_text(rng, user_len)})
            requests.append(Request(f"s{s}-t{t}", output_len,
                                    messages=tuple(dict(m) for m in history),
                                    session=f"s{s}", group=s))
    return requests


def forks(trees: int, branches: int, history_len: int, branch_len: int, output_len: int,
          seed: int = 0) -> list[Request]:
    """Continuations branching from a shared history at arbitrary points: regenerations,
    agents retrying a step, tree search.

    Tree ``t`` has a random history of ``history_len`` characters, sent first on its own
    (``t{t}-root``); then each of its ``branches`` cuts that history at a point drawn
    uniformly past its first quarter (some branches share nearly all of it, some a quarter)
    and appends ``branch_len`` new characters (``t{t}-b{b}``). A branch point falls
    anywhere, mostly inside a block: the attention layers can reuse up to it, recurrent
    layers only up to the last snapshot before it (a block boundary where a prefill stopped, or a branch point an earlier
    branch left). Completions (``prompt``), ``max_tokens = output_len``, ``group`` is the
    tree. All roots come first (in a seeded order), then every branch, shuffled across
    trees; a branch is no session (branches of one tree arrive concurrently, as an agent's
    retries or a search's expansions do).
    """
    _check_positive(trees=trees, branches=branches, history_len=history_len,
                    output_len=output_len)
    _check_non_negative(branch_len=branch_len)
    rng = random.Random(seed)
    histories = [random_text(rng, history_len) for _ in range(trees)]
    roots = [Request(f"t{t}-root", output_len, prompt=histories[t], group=t)
             for t in range(trees)]
    rng.shuffle(roots)
    branched = []
    for t, history in enumerate(histories):
        for b in range(branches):
            cut = rng.randint(history_len // 4, history_len)
            branched.append(Request(f"t{t}-b{b}", output_len,
                                    prompt=history[:cut] + random_text(rng, branch_len),
                                    group=t))
    rng.shuffle(branched)
    return roots + branched


def sharegpt(path: str | Path, limit: int | None = None, seed: int = 0,
             max_output_tokens: int = 1024, max_prompt_tokens: int = 4096,
             history: bool = False) -> list[Request]:
    """Requests from a ShareGPT-format JSON file.

    The file is a list of ``{"conversations": [{"from": "human"|"gpt"|..., "value": str}]}``
    (``id`` and other keys ignored). Without ``history``: the first human turn is the prompt
    (``/v1/completions``) and the gpt reply after it sets ``max_tokens`` (its UTF-8 byte
    length, our token count, capped at ``max_output_tokens``). With ``history``: the
    conversation up to its last human turn that has a reply is sent as chat ``messages``,
    and that reply sets ``max_tokens``. Conversations without such a pair, with a prompt or
    reply under 4 tokens, or a prompt over ``max_prompt_tokens`` are skipped (as
    bench_serving does). The kept ones are shuffled (seeded) and the first ``limit`` taken;
    ``request_id`` is ``sharegpt-{index in the file}``.
    """
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of {{'conversations': [...]}}")
    requests = []
    for i, entry in enumerate(data):
        turns = _sharegpt_turns(entry)
        pair = _history_pair(turns) if history else _first_pair(turns)
        if pair is None:
            continue
        messages, reply = pair
        output = len(reply.encode())
        if output < 4:
            continue
        max_tokens = min(output, max_output_tokens)
        if history:
            req = Request(f"sharegpt-{i}", max_tokens, messages=tuple(messages))
        else:
            req = Request(f"sharegpt-{i}", max_tokens, prompt=messages[0]["content"])
        if 4 <= req.prompt_tokens() <= max_prompt_tokens:
            requests.append(req)
    random.Random(seed).shuffle(requests)
    return requests[:limit] if limit is not None else requests


def trace_jsonl(path: str | Path, block_size: int = 512, limit: int | None = None,
                seed: int = 0) -> list[Request]:
    """Requests from a Mooncake-style JSONL trace.

    Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
    [...]}``. Hash id ``h`` stands for one block of ``block_size`` tokens whose text depends
    only on ``(seed, h)``, so requests whose hash ids agree on a prefix share exactly that
    text. The prompt is the blocks' text in order, cut or extended (with text unique to the
    line) to ``n - 1`` characters: ``n`` tokens with the BOS. ``max_tokens`` is ``m`` (at
    least 1); ``arrival_s`` is the timestamp minus the first line's, in seconds.
    ``request_id`` is ``trace-{line index}``; blank lines are skipped.
    """
    _check_positive(block_size=block_size)
    blocks: dict[int, str] = {}
    requests = []
    t0 = None
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        if limit is not None and len(requests) >= limit:
            break
        row = json.loads(line)
        t0 = row["timestamp"] if t0 is None else t0
        n = max(1, int(row["input_length"]))
        text = "".join(_block_text(blocks, h, block_size, seed) for h in row.get("hash_ids", []))
        if len(text) < n - 1:
            text += random_text(random.Random(f"{seed}:line:{i}"), n - 1 - len(text))
        requests.append(Request(f"trace-{i}", max(1, int(row["output_length"])),
                                prompt=text[: n - 1],
                                arrival_s=(row["timestamp"] - t0) / 1000.0))
    return requests


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload flags of ``python -m loadtest run`` (and of commands that reuse them)."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", required=True,
                   choices=["shared-prefix", "multi-turn", "forks", "sharegpt", "trace"])
    g.add_argument("--dataset", help="sharegpt: JSON file; trace: JSONL file")
    g.add_argument("--groups", type=int, default=16, help="shared-prefix: groups (16)")
    g.add_argument("--prompts-per-group", type=int, default=16,
                   help="shared-prefix: prompts per group (16)")
    g.add_argument("--system-len", type=int, default=1024,
                   help="shared-prefix, multi-turn: system prompt characters = tokens (1024)")
    g.add_argument("--question-len", type=int, default=128,
                   help="shared-prefix: question characters = tokens (128)")
    g.add_argument("--sessions", type=int, default=16, help="multi-turn: sessions (16)")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session (4)")
    g.add_argument("--user-len", type=int, default=128,
                   help="multi-turn: user message characters (128)")
    g.add_argument("--output-len", type=int, default=64,
                   help="shared-prefix, multi-turn: max_tokens per request (64)")
    g.add_argument("--trees", type=int, default=16, help="forks: shared histories (16)")
    g.add_argument("--branches", type=int, default=8, help="forks: branches per history (8)")
    g.add_argument("--history-len", type=int, default=2048,
                   help="forks: history characters = tokens (2048)")
    g.add_argument("--branch-len", type=int, default=64,
                   help="forks: new characters per branch (64)")
    g.add_argument("--limit", type=int, default=None, help="sharegpt, trace: at most N requests")
    g.add_argument("--max-output-len", type=int, default=1024,
                   help="sharegpt: cap on max_tokens (1024)")
    g.add_argument("--sharegpt-history", action="store_true",
                   help="sharegpt: send the conversation as chat messages")
    g.add_argument("--block-size", type=int, default=512,
                   help="trace: tokens per hash id (512, as in Mooncake traces)")


def use_reference_workload(parser: argparse.ArgumentParser) -> None:
    """Make the project's reference workload the default (BENCHMARKS.md): shared prefix,
    32 groups x 16 prompts, 2048-token system prompts, 128-token questions, 32 output
    tokens; ``--workload`` becomes optional."""
    parser.set_defaults(workload="shared-prefix", groups=32, prompts_per_group=16,
                        system_len=2048, question_len=128, output_len=32)
    for action in parser._actions:
        if action.dest == "workload":
            action.required = False


def workload_from_args(args: argparse.Namespace) -> tuple[list[Request], dict]:
    """The requests and a JSON-able description (name and parameters) for the report."""
    name = args.workload
    if name == "shared-prefix":
        params = dict(groups=args.groups, prompts_per_group=args.prompts_per_group,
                      system_len=args.system_len, question_len=args.question_len,
                      output_len=args.output_len, seed=args.seed)
        return shared_prefix(**params), {"name": name, **params}
    if name == "multi-turn":
        params = dict(sessions=args.sessions, turns=args.turns, system_len=args.system_len,
                      user_len=args.user_len, output_len=args.output_len, seed=args.seed)
        return multi_turn(**params), {"name": name, **params}
    if name == "forks":
        params = dict(trees=args.trees, branches=args.branches, history_len=args.history_len,
                      branch_len=args.branch_len, output_len=args.output_len, seed=args.seed)
        return forks(**params), {"name": name, **params}
    if not args.dataset:
        raise ValueError(f"--workload {name} needs --dataset PATH")
    if name == "sharegpt":
        params = dict(path=args.dataset, limit=args.limit, seed=args.seed,
                      max_output_tokens=args.max_output_len, history=args.sharegpt_history)
        return sharegpt(**params), {"name": name, **params}
    params = dict(path=args.dataset, block_size=args.block_size, limit=args.limit,
                  seed=args.seed)
    return trace_jsonl(**params), {"name": name, **params}


# --------------------------------------------------------------------------- helpers

def _sharegpt_turns(entry) -> list[dict]:
    conversation = entry.get("conversations") if isinstance(entry, dict) else None
    turns = []
    for turn in conversation or []:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        if role is None or not isinstance(turn.get("value"), str):
            return []  # unknown speaker or content: skip the whole conversation
        turns.append({"role": role, "content": turn["value"]})
    return turns


def _first_pair(turns: Sequence[dict]) -> tuple[list[dict], str] | None:
    start = 1 if turns and turns[0]["role"] == "system" else 0
    if len(turns) < start + 2:
        return None
    if turns[start]["role"] != "user" or turns[start + 1]["role"] != "assistant":
        return None
    return [turns[start]], turns[start + 1]["content"]


def _history_pair(turns: Sequence[dict]) -> tuple[list[dict], str] | None:
    for k in range(len(turns) - 1, 0, -1):
        if turns[k]["role"] == "assistant" and turns[k - 1]["role"] == "user":
            return [dict(t) for t in turns[:k]], turns[k]["content"]
    return None


def _block_text(cache: dict[int, str], hash_id: int, block_size: int, seed: int) -> str:
    if hash_id not in cache:
        cache[hash_id] = random_text(random.Random(f"{seed}:block:{hash_id}"), block_size)
    return cache[hash_id]


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def _check_non_negative(**values: int) -> None:
    for name, v in values.items():
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
