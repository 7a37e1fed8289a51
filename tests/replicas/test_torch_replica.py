"""A live replica process running the real (tiny) transformer, through the openai client."""

import httpx
import openai
import pytest

from tests.procs import Proc


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_torch_replica_reuses_and_stays_exact(preset):
    with Proc("replicas", "--engine", "torch", "--preset", preset, "--kv-pages", "128",
              "--tokens-per-block", "16", "--max-batched-tokens", "64") as rep:
        client = openai.OpenAI(base_url=rep.url + "/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "Answer briefly. " * 6},
                    {"role": "user", "content": "What is reuse?"}]
        first = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                               temperature=0)
        probe = httpx.post(rep.url + "/probe_reuse", json={"messages": messages}).json()
        second = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == probe["num_tokens"] > 0
        assert probe["num_tokens"] <= probe["num_tokens_before_hybrid_pruning"]
        # Greedy decoding from reused KV gives the same answer as computing it all.
        assert second.choices[0].message.content == first.choices[0].message.content
        assert second.usage.completion_tokens == first.usage.completion_tokens
        assert second.choices[0].finish_reason == first.choices[0].finish_reason
