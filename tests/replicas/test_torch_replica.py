"""A live replica process running the real (tiny) transformer, through the openai client."""

import contextlib

import httpx
import openai
import pytest

from tests.procs import Proc

SHARED = [256] + [(7 * i) % 250 for i in range(143)]   # 144 tokens: 9 blocks of 16
FOLLOW_UP = SHARED + [(11 * i) % 250 for i in range(20)]


@contextlib.contextmanager
def torch_replica(preset: str):
    """A replica of ``preset`` (16 tokens per block, prefill chunks of 64) and a greedy
    ``complete(ids, salt, max_tokens)`` through the openai client."""
    with Proc("replicas", "--engine", "torch", "--preset", preset, "--kv-pages", "128",
              "--tokens-per-block", "16", "--max-batched-tokens", "64") as rep:
        client = openai.OpenAI(base_url=rep.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id

        def complete(ids, salt, max_tokens):
            return client.completions.create(model=model, prompt=ids, max_tokens=max_tokens,
                                             temperature=0, extra_body={"cache_salt": salt})

        yield rep, complete


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_torch_replica_reuses_and_stays_exact(preset):
    with torch_replica(preset) as (rep, complete):
        # The first request's prefill ends on a block boundary, so even the hybrid model
        # (recurrent snapshots, a 24-token sliding window) can reuse all of it.
        complete(SHARED, "a", 1)
        probe = httpx.post(rep.url + "/probe_reuse",
                           json={"token_ids": FOLLOW_UP, "cache_salt": "a"}).json()
        reused = complete(FOLLOW_UP, "a", 8)
        fresh = complete(FOLLOW_UP, "b", 8)
        assert reused.usage.prompt_tokens_details.cached_tokens == probe["num_tokens"] == 144
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        # Greedy decoding from reused KV gives the same answer as computing it all.
        assert reused.choices[0].text == fresh.choices[0].text
        assert reused.usage.completion_tokens == fresh.usage.completion_tokens > 0


def test_hybrid_replica_resumes_where_the_last_request_ended_inside_a_block():
    """tiny-hybrid, 16 tokens per block, chunks of 64: the first request computes its 150
    prompt tokens in chunks ending at 64, 128, 150 and stops (max_tokens 1: nothing decoded
    is committed). Its history ends inside block 9, where closing keeps a snapshot; the
    next prompt extending it reuses all 150 (block boundaries alone would give 128), the
    probe says so first, and greedy decoding matches a cold run."""
    first = [256] + [(5 * i + 3) % 250 for i in range(149)]
    follow_up = first + [(13 * i) % 250 for i in range(20)]
    with torch_replica("tiny-hybrid") as (rep, complete):
        assert complete(first, "a", 1).usage.prompt_tokens_details.cached_tokens == 0
        probe = httpx.post(rep.url + "/probe_reuse",
                           json={"token_ids": follow_up, "cache_salt": "a"}).json()
        assert (probe["num_tokens"], probe["num_tokens_before_hybrid_pruning"]) == (150, 150)
        reused = complete(follow_up, "a", 8)
        fresh = complete(follow_up, "b", 8)
        assert reused.usage.prompt_tokens_details.cached_tokens == 150
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert reused.choices[0].text == fresh.choices[0].text
