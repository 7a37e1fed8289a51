"""Every family behind the router, driven by the official ``openai`` client.

One replica process per family (``python -m replicas --engine torch --model DIR``, each a
tiny random checkpoint with a Llama-3-style tokenizer and chat template), one router in
front of them all (``--replicas``; the client's ``model`` picks the family). For each
family a two-turn chat: each answer is transformers' greedy ``generate`` over the rendered
conversation, decoded; the second turn's ``cached_tokens`` is exactly what the replica's
``/probe_reuse`` said for the same messages just before; ``x-replica`` names the family's
replica.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import transformers

from tests.procs import Proc
from tests.replicas import hf_checkpoints
from tests.replicas.models.checkpoints import FAMILY_VARIANTS, save_checkpoint

N_NEW = 12


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """{variant: (replica, checkpoint directory, transformers model, tokenizer)} and the
    router in front of every replica."""
    saved, procs = {}, []
    try:
        for variant in FAMILY_VARIANTS:
            directory = tmp_path_factory.mktemp("live") / variant
            # the vocabulary is padded past the tokenizer's 400 ids, as real ones often are
            hf = save_checkpoint(variant, directory, changes={"vocab_size": 512})
            hf_checkpoints.llama3(directory)
            replica = Proc("replicas", "--engine", "torch", "--model", str(directory),
                           "--device", "cpu", "--kv-pages", "64", "--tokens-per-block", "16",
                           "--log-level", "warning")
            procs.append(replica)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
            saved[variant] = (replica, directory, hf, tokenizer)
        router = Proc("router", "--replicas", ",".join(r.url for r in procs),
                      "--log-level", "warning", "--probe-deadline-ms", "2000",
                      "--tokens-per-block", "16")
        procs.append(router)
        yield router, saved
    finally:
        for proc in procs:
            proc.stop()


def expected_answer(hf, tokenizer, directory, messages) -> str:
    eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                        return_dict=False)
    ids = torch.tensor([ids])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=N_NEW, eos_token_id=eos)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("variant", FAMILY_VARIANTS)
def test_a_two_turn_chat_through_the_router(families, variant):
    router, saved = families
    replica, directory, hf, tokenizer = saved[variant]
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 4},
                {"role": "user", "content": "The quick brown fox jumps over the lazy dog?"}]
    for turn in range(2):
        probe = httpx.post(replica.url + "/probe_reuse", json={"messages": messages},
                           timeout=30).json()
        raw = client.chat.completions.with_raw_response.create(
            model=directory.name, messages=messages, max_tokens=N_NEW, temperature=0)
        answer = raw.parse()
        assert raw.headers["x-replica"] == replica.url
        text = answer.choices[0].message.content
        assert text == expected_answer(hf, tokenizer, directory, messages), f"turn {turn}"
        assert answer.usage.prompt_tokens == probe["num_prompt_tokens"]
        assert answer.usage.prompt_tokens_details.cached_tokens == probe["num_tokens"]
        if turn == 1:  # the first turn's prompt was computed: the attention layers match it
            assert probe["num_tokens_before_hybrid_pruning"] > 0
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": "Hello, how are you today?"}]
