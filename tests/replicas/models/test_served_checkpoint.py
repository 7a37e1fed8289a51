"""A replica serving a checkpoint directory end to end (``--engine torch --model DIR``,
in-process through the ASGI app): the served id is the directory's name, the card describes
the architecture, and greedy text is transformers' ``generate`` decoded by its tokenizer,
cold and with the prompt reused."""

from __future__ import annotations

import json
import random

import torch
from fastapi.testclient import TestClient

from replicas.app import create_app
from replicas.settings import ReplicaSettings
from tests.replicas import hf_checkpoints
from tests.replicas.models.checkpoints import save_checkpoint


def test_a_replica_serves_the_checkpoint_as_transformers_computes_it(tmp_path):
    import transformers

    directory = tmp_path / "tiny-llama"
    # the model's vocabulary is padded past the tokenizer's 400 ids, as real ones often are
    hf = save_checkpoint("llama", directory, changes={"vocab_size": 512})
    hf_checkpoints.llama3(directory)  # tokenizer.json, tokenizer_config.json, generation_config
    eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    rng = random.Random(0)
    prompt = [rng.randrange(5, 400) for _ in range(40)]
    ids = torch.tensor([prompt])
    expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=16, eos_token_id=eos)[0, len(prompt):].tolist()
    text = transformers.AutoTokenizer.from_pretrained(str(directory)).decode(
        expected, skip_special_tokens=True)
    settings = ReplicaSettings(engine="torch", model=str(directory), device="cpu",
                               kv_pages=64, tokens_per_block=16)
    with TestClient(create_app(settings)) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["id"] == "tiny-llama"
        assert (card["engine"]["architecture"], card["engine"]["vocab_size"]) == (
            "LlamaForCausalLM", 512)
        answers = [client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0}).json() for _ in range(2)]
    assert [a["choices"][0]["text"] for a in answers] == [text, text]
    assert [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers] == [0, 39]
    assert answers[0]["usage"]["completion_tokens"] == len(expected)
